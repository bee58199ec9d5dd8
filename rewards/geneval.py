"""GenEval (Ghosh et al. 2023; djghosh13/geneval `evaluation/evaluate_images.py`): an object
detector, CLIP for colour and fixed counting / position rules over the benchmark's prompt
metadata, as flow_grpo and DiffusionNFT train on it.

Per sample, its prompt's GenEval metadata (the record of `*_metadata.jsonl`, which the prompt
files put into each request's metadata):
    {"tag": "counting" | "colors" | "position" | ..., "prompt": <the prompt>,
     "include": [{"class": c, "count": k, "color"?: colour, "position"?: [relation, index]}],
     "exclude"?: [{"class": c, "count": k}]}
Detection (transformers' own classes from a local checkpoint whose `id2label` holds the classes
the metadata names): `instance_segmentation` (default; GenEval's detector is Mask2Former) loads
`AutoModelForUniversalSegmentation` (Mask2FormerForUniversalSegmentation), each instance's box
from its mask as mmdet's mask2bbox; `object_detection` loads `AutoModelForObjectDetection` (DETR
and its kin), boxes only. Per class, the detections above `threshold` (`counting_threshold` for
the tag "counting"), most confident first, at most `max_objects`, greedy NMS at `max_overlap`
(1 = none). Then GenEval's `evaluate`: an include clause needs `count` objects of its class, the
`count` most confident ones of the `color` (CLIP zero-shot over GenEval's ten colours with its
three templates, on the box crop of the image composited onto `background` through the
instance's mask where the detector gives one) and each in `relation` to every object of the
clause `index` names (centres offset by `position_threshold` times the two boxes' sizes); an
exclude clause fails with `count` or more.
Scores: "correct" (1 / 0, the benchmark's) and "clauses" (share of clauses met).
Metadata that is not GenEval's, names another prompt, or names a class the detector lacks is the
client's UnscorableInputError naming `metadata[i].<field>`.
"""
from __future__ import annotations

from enum import Enum
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from contract import Modality, ScorerOutput, UnscorableInputError
from rewards.base import ScoreRequest
from rewards.embedding import ok_output, pooled_features
from rewards.hf_clip import (check_snapshot, images_to_pixels, load_clip_processor,
                             load_pretrained, torch_dtype)
from rewards.media import require_decoded, require_prompt_per_sample

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
COLOR_TEMPLATES = ("a photo of a {c} {cls}", "a photo of a {c}-colored {cls}",
                   "a photo of a {c} object")


class DetectorKind(str, Enum):
    INSTANCE_SEGMENTATION = "instance_segmentation"   # Mask2Former: boxes from masks
    OBJECT_DETECTION = "object_detection"             # DETR-like: boxes only


class Relation(str, Enum):
    LEFT_OF = "left of"
    RIGHT_OF = "right of"
    ABOVE = "above"
    BELOW = "below"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Exclude(_Strict):
    cls: str = Field(alias="class", min_length=1)
    count: int = Field(ge=1)


class Include(Exclude):
    color: str | None = None
    position: tuple[Relation, int] | None = None

    @model_validator(mode="after")
    def _check_color(self) -> "Include":
        if self.color is not None and self.color not in COLORS:
            raise ValueError(f"color {self.color!r} is not one of GenEval's {list(COLORS)}")
        return self


class GenEvalMetadata(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)   # the graph adds seed, conditions

    tag: str = Field(min_length=1)
    prompt: str
    include: tuple[Include, ...] = Field(min_length=1)
    exclude: tuple[Exclude, ...] = ()

    @model_validator(mode="after")
    def _check_positions(self) -> "GenEvalMetadata":
        for k, req in enumerate(self.include):
            if req.position is not None and not 0 <= req.position[1] < k:
                raise ValueError(f"include[{k}].position names clause {req.position[1]}, not an "
                                 f"earlier one (0..{k - 1})")
        return self


def parse_metadata(meta: Mapping[str, Any], prompt: str, classes: Sequence[str], scorer: str,
                   index: int) -> GenEvalMetadata:
    """One sample's GenEval metadata, checked against its prompt and the detector's classes."""
    field = f"metadata[{index}]"
    try:
        parsed = GenEvalMetadata.model_validate(dict(meta))
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in first["loc"])
        raise UnscorableInputError(f"scorer {scorer!r}: not GenEval metadata: {first['msg']}",
                                   field=field + loc,
                                   expected="GenEval metadata", actual=first.get("input")
                                   if not isinstance(first.get("input"), (dict, list)) else
                                   type(first.get("input")).__name__) from None
    if parsed.prompt.strip() != prompt.strip():
        raise UnscorableInputError(f"scorer {scorer!r}: the GenEval metadata is another prompt's",
                                   field=f"{field}.prompt", expected=prompt,
                                   actual=parsed.prompt)
    known = set(classes)
    for key, clauses in (("include", parsed.include), ("exclude", parsed.exclude)):
        for k, req in enumerate(clauses):
            if req.cls not in known:
                raise UnscorableInputError(f"scorer {scorer!r}: the detector has no class "
                                           f"{req.cls!r}", field=f"{field}.{key}[{k}].class",
                                           expected="a class of the detector's id2label",
                                           actual=req.cls)
    return parsed


# ---- GenEval's rules (evaluation/evaluate_images.py), on boxes (x0, y0, x1, y1, score) --------
def compute_iou(box_a: np.ndarray, box_b: np.ndarray) -> float:
    def area(b):
        return max(b[2] - b[0] + 1, 0) * max(b[3] - b[1] + 1, 0)
    inter = area([max(box_a[0], box_b[0]), max(box_a[1], box_b[1]),
                  min(box_a[2], box_b[2]), min(box_a[3], box_b[3])])
    union = area(box_a) + area(box_b) - inter
    return inter / union if union else 0.0


def relative_position(box_a: np.ndarray, box_b: np.ndarray, threshold: float) -> set[str]:
    """Relations of A to B: centre offset shrunk by `threshold` x the summed box sizes, then
    the unit direction's components past 0.5."""
    boxes = np.array([box_a[:4], box_b[:4]], dtype=np.float64).reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - threshold * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    out = set()
    if dx < -0.5:
        out.add(Relation.LEFT_OF.value)
    if dx > 0.5:
        out.add(Relation.RIGHT_OF.value)
    if dy < -0.5:
        out.add(Relation.ABOVE.value)
    if dy > 0.5:
        out.add(Relation.BELOW.value)
    return out


def select_objects(boxes: np.ndarray, labels: np.ndarray, classes: Sequence[str],
                   threshold: float, max_objects: int, max_overlap: float
                   ) -> dict[str, list[np.ndarray]]:
    """Detections (N, >= 5) [x0, y0, x1, y1, score, ...] with class indices (N,) -> class ->
    kept rows, most confident first."""
    out: dict[str, list[np.ndarray]] = {}
    for c, name in enumerate(classes):
        mine = boxes[labels == c]
        order = np.argsort(mine[:, 4], kind="stable")[::-1]
        order = order[mine[order, 4] > threshold][:max_objects].tolist()
        kept = []
        while order:
            best = order.pop(0)
            kept.append(mine[best])
            order = [o for o in order if max_overlap == 1
                     or compute_iou(mine[best], mine[o]) < max_overlap]
        if kept:
            out[name] = kept
    return out


def mask_to_box(mask: np.ndarray) -> list[float]:
    """(H, W) bool -> [x0, y0, x1, y1], exclusive ends (mmdet's mask2bbox); an empty mask is
    [0, 0, 0, 0]."""
    cols, rows = np.flatnonzero(mask.any(0)), np.flatnonzero(mask.any(1))
    if cols.size == 0:
        return [0.0, 0.0, 0.0, 0.0]
    return [float(cols[0]), float(rows[0]), float(cols[-1] + 1), float(rows[-1] + 1)]


def _rows(boxes: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """(N, 4) boxes + (N,) scores -> (N, 6) [x0, y0, x1, y1, score, index]."""
    n = scores.shape[0]
    return np.concatenate([boxes.reshape(n, 4), scores.reshape(n, 1),
                           np.arange(n, dtype=np.float64).reshape(n, 1)], 1).astype(np.float64)


def _crop_box(box: np.ndarray) -> tuple[int, int, int, int]:
    """PIL's integer crop box of a float box (its round), at least one pixel wide and high."""
    x0, y0, x1, y1 = (int(round(float(v))) for v in box[:4])
    return x0, y0, max(x1, x0 + 1), max(y1, y0 + 1)


ColorFn = Callable[[list[np.ndarray], str], list[str]]   # (boxes, class) -> colour per box


def evaluate(objects: Mapping[str, list[np.ndarray]], metadata: GenEvalMetadata,
             colors_of: ColorFn, position_threshold: float) -> tuple[bool, float, str]:
    """GenEval's `evaluate`: (correct, share of clauses met, reasons)."""
    correct, met, reasons = True, 0, []
    matched: list[list[np.ndarray] | None] = []
    for req in metadata.include:
        ok = True
        found = list(objects.get(req.cls, []))[:req.count]
        if len(found) < req.count:
            ok = False
            reasons.append(f"expected {req.cls}>={req.count}, found {len(found)}")
        else:
            if req.color is not None:
                colors = colors_of(found, req.cls)
                if colors.count(req.color) < req.count:
                    ok = False
                    reasons.append(f"expected {req.color} {req.cls}>={req.count}, found "
                                   f"{colors.count(req.color)} {req.color}")
            if req.position is not None and ok:
                relation, target = req.position
                if matched[target] is None:
                    ok = False
                    reasons.append(f"no target for {req.cls} to be {relation.value}")
                else:
                    for obj in found:
                        for other in matched[target]:
                            rels = relative_position(obj, other, position_threshold)
                            if relation.value not in rels:
                                ok = False
                                reasons.append(f"expected {req.cls} {relation.value} target, "
                                               f"found {' and '.join(sorted(rels))} target")
                                break
                        if not ok:
                            break
        matched.append(found if ok else None)
        correct &= ok
        met += ok
    for req in metadata.exclude:
        if len(objects.get(req.cls, [])) >= req.count:
            correct = False
            reasons.append(f"expected {req.cls}<{req.count}, found {len(objects[req.cls])}")
        else:
            met += 1
    return correct, met / (len(metadata.include) + len(metadata.exclude)), "\n".join(reasons)


class GenEvalScorerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    name: str = "geneval"
    detector_dir: str = Field(description="local transformers detector checkpoint (config.json "
                              "with id2label, weights, preprocessor_config.json)")
    detector: DetectorKind = DetectorKind.INSTANCE_SEGMENTATION
    background: str = Field("#999", description="what a masked crop shows outside its mask "
                            "(GenEval's bgcolor)")
    clip_dir: str = Field(description="local transformers CLIPModel snapshot (colour)")
    clip_processor_dir: str | None = Field(None, description="CLIPProcessor dir; None = clip_dir")
    artifact: str = "image"
    threshold: float = Field(0.3, ge=0, lt=1)
    counting_threshold: float = Field(0.9, ge=0, lt=1)
    max_objects: int = Field(16, ge=1, le=256)
    max_overlap: float = Field(1.0, gt=0, le=1, description="NMS IoU; 1 = no NMS")
    position_threshold: float = Field(0.1, ge=0)
    device: str = "cpu"
    dtype: str = "float32"

    @field_validator("background")
    @classmethod
    def _check_background(cls, value: str) -> str:
        from PIL import ImageColor
        ImageColor.getrgb(value)          # ValueError for a colour PIL cannot read
        return value


class GenEvalScorer:
    primary = "correct"

    def __init__(self, config: GenEvalScorerConfig):
        from transformers import (AutoImageProcessor, AutoModelForObjectDetection,
                                  AutoModelForUniversalSegmentation, CLIPModel)
        self.config = config
        self.name = config.name
        self.required_artifacts = (config.artifact,)
        self._dtype = torch_dtype(config.dtype, f"{self.name}.dtype")
        det_path = check_snapshot(config.detector_dir, f"{self.name}.detector_dir",
                                  ("config.json", "preprocessor_config.json"))
        cls = (AutoModelForUniversalSegmentation
               if config.detector is DetectorKind.INSTANCE_SEGMENTATION
               else AutoModelForObjectDetection)
        self._detector = load_pretrained(cls, det_path,
                                         f"{self.name}.detector_dir", self._dtype
                                         ).to(config.device).eval().requires_grad_(False)
        self._det_processor = AutoImageProcessor.from_pretrained(str(det_path),
                                                                 local_files_only=True)
        id2label = self._detector.config.id2label
        self.classes = tuple(id2label[i] for i in range(len(id2label)))
        clip_path = check_snapshot(config.clip_dir, f"{self.name}.clip_dir")
        self._clip = load_pretrained(CLIPModel, clip_path, f"{self.name}.clip_dir", self._dtype
                                     ).to(config.device).eval().requires_grad_(False)
        self._clip_processor = load_clip_processor(config.clip_processor_dir or config.clip_dir,
                                                   f"{self.name}.clip_processor_dir")
        self._color_classifiers: dict[str, torch.Tensor] = {}

    # ---- models ---------------------------------------------------------------------------
    @torch.inference_mode()
    def detect(self, images: torch.Tensor
               ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
        """(B, 3, H, W) uint8 -> per image (boxes (N, 6) [x0, y0, x1, y1, score, index],
        labels (N,), masks (N, H, W) bool or None) of every detection (threshold 0: the rules
        threshold per tag); `index` is the row of the detection's mask."""
        arrays = list(np.ascontiguousarray(images.cpu().numpy().transpose(0, 2, 3, 1)))
        inputs = self._det_processor(images=arrays, return_tensors="pt")
        inputs = {k: v.to(self.config.device, self._dtype if v.is_floating_point() else v.dtype)
                  for k, v in inputs.items()}
        outputs = self._detector(**inputs)
        sizes = [tuple(images.shape[-2:])] * images.shape[0]
        if self.config.detector is DetectorKind.OBJECT_DETECTION:
            results = self._det_processor.post_process_object_detection(
                outputs, threshold=0.0, target_sizes=sizes)
            return [(_rows(r["boxes"].float().cpu().numpy(), r["scores"].float().cpu().numpy()),
                     r["labels"].cpu().numpy(), None) for r in results]
        results = self._det_processor.post_process_instance_segmentation(
            outputs, threshold=0.0, target_sizes=sizes, return_binary_maps=True)
        out = []
        for r, size in zip(results, sizes):
            infos = r["segments_info"]
            masks = (np.zeros((0, *size), dtype=bool) if r["segmentation"] is None or not infos
                     else r["segmentation"].cpu().numpy().astype(bool))
            boxes = np.array([mask_to_box(m) for m in masks], dtype=np.float64).reshape(-1, 4)
            scores = np.array([i["score"] for i in infos], dtype=np.float64)
            out.append((_rows(boxes, scores), np.array([i["label_id"] for i in infos],
                                                       dtype=np.int64), masks))
        return out

    def color_classifier(self, cls: str) -> torch.Tensor:
        """(D, 10): per colour the normalised mean of its three templates' normalised text
        embeddings (clip_benchmark's zero_shot_classifier, as GenEval builds it)."""
        if cls not in self._color_classifiers:
            tok = self._clip_processor.tokenizer
            columns = []
            for color in COLORS:
                texts = [t.format(c=color, cls=cls) for t in COLOR_TEMPLATES]
                ids = tok(texts, padding=True, truncation=True, max_length=77,
                          return_tensors="pt").to(self.config.device)
                with torch.inference_mode():
                    emb = pooled_features(self._clip.get_text_features(
                        input_ids=ids["input_ids"], attention_mask=ids["attention_mask"]))
                emb = torch.nn.functional.normalize(emb.float(), dim=-1).mean(0)
                columns.append(emb / emb.norm())
            self._color_classifiers[cls] = torch.stack(columns, 1)
        return self._color_classifiers[cls]

    @torch.inference_mode()
    def colors(self, image: torch.Tensor, boxes: list[np.ndarray], cls: str,
               masks: np.ndarray | None = None) -> list[str]:
        """GenEval's colour of each detection: CLIP zero-shot on PIL's crop of its box, the
        image composited onto the background through its mask first when there are masks."""
        from PIL import Image
        pil = Image.fromarray(np.ascontiguousarray(image.cpu().numpy().transpose(1, 2, 0)))
        blank = Image.new("RGB", pil.size, color=self.config.background)
        crops = []
        for box in boxes:
            shown = pil if masks is None else Image.composite(
                pil, blank, Image.fromarray(masks[int(box[5])]))
            crops.append(torch.from_numpy(np.asarray(shown.crop(_crop_box(box))).copy()
                                          ).permute(2, 0, 1))
        feats = []
        for crop in crops:
            pixels = images_to_pixels(self._clip_processor, crop[None], self.config.device,
                                      self._dtype)
            feats.append(pooled_features(self._clip.get_image_features(pixel_values=pixels)))
        feats = torch.nn.functional.normalize(torch.cat(feats).float(), dim=-1)
        logits = feats @ self.color_classifier(cls)
        return [COLORS[i] for i in logits.argmax(1).tolist()]

    # ---- scoring --------------------------------------------------------------------------
    def score(self, request: ScoreRequest) -> ScorerOutput:
        cfg = self.config
        art = require_decoded(request.artifacts, cfg.artifact, Modality.IMAGE, self.name)
        require_prompt_per_sample(request.prompts, art.batch_size, self.name)
        if len(request.metadata) != art.batch_size:
            raise UnscorableInputError(f"scorer {self.name!r} needs each sample's GenEval "
                                       "metadata", field="metadata", expected=art.batch_size,
                                       actual=len(request.metadata))
        metas = [parse_metadata(m, p, self.classes, self.name, i)
                 for i, (m, p) in enumerate(zip(request.metadata, request.prompts))]
        correct, clauses = [], []
        for image, meta, (boxes, labels, masks) in zip(art.data, metas, self.detect(art.data)):
            threshold = cfg.counting_threshold if meta.tag == "counting" else cfg.threshold
            objects = select_objects(boxes, labels, self.classes, threshold, cfg.max_objects,
                                     cfg.max_overlap)
            ok, share, _ = evaluate(objects, meta, lambda found, cls, im=image, mk=masks:
                                    self.colors(im, found, cls, mk), cfg.position_threshold)
            correct.append(float(ok))
            clauses.append(share)
        return ok_output(self.name, {"correct": torch.tensor(correct),
                                     "clauses": torch.tensor(clauses)})
