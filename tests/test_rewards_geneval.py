"""GenEval: its rules against excerpts of the benchmark's own code on constructed detections, and
the scorer end to end on tiny random-weight detectors saved and loaded back through transformers'
Auto classes (Mask2FormerForUniversalSegmentation, GenEval's detector, with the masked crops;
DetrForObjectDetection) and a tiny CLIP for colour.

Reference: djghosh13/geneval, evaluation/evaluate_images.py, commit
af4902f24d3ca90ebbb446dd9891a59e0f82725f (`compute_iou`, `relative_position`, `evaluate`, the
per-class selection in `evaluate_image`): the excerpts below are that code with its globals
passed in."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from contract import ArtifactSpec, MediaArtifact, UnscorableInputError
from rewards.base import ScoreRequest
from rewards.geneval import (COLORS, GenEvalMetadata, compute_iou, evaluate, relative_position,
                             select_objects)
from rewards.registry import ScorerSpec, build_scorer

torch.set_num_threads(1)
IMAGE = ArtifactSpec("image", "image", "decoded", "CHW", source="image_latent")
CLASSES = ("person", "dog", "cat", "car")


# ---- excerpts of GenEval's evaluate_images.py --------------------------------------------------
def ref_compute_iou(box_a, box_b):
    area_fn = lambda box: max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)  # noqa: E731
    i_area = area_fn([max(box_a[0], box_b[0]), max(box_a[1], box_b[1]),
                      min(box_a[2], box_b[2]), min(box_a[3], box_b[3])])
    u_area = area_fn(box_a) + area_fn(box_b) - i_area
    return i_area / u_area if u_area else 0


def ref_relative_position(obj_a, obj_b, POSITION_THRESHOLD):  # noqa: N803
    boxes = np.array([obj_a[0], obj_b[0]])[:, :4].reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised_offset = np.maximum(np.abs(offset) - POSITION_THRESHOLD * (dim_a + dim_b), 0) * \
        np.sign(offset)
    if np.all(np.abs(revised_offset) < 1e-3):
        return set()
    dx, dy = revised_offset / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5: relations.add("left of")  # noqa: E701
    if dx > 0.5: relations.add("right of")  # noqa: E701
    if dy < -0.5: relations.add("above")  # noqa: E701
    if dy > 0.5: relations.add("below")  # noqa: E701
    return relations


def ref_select(bbox, classnames, confidence_threshold, MAX_OBJECTS, NMS_THRESHOLD):  # noqa: N803
    detected = {}
    for index, classname in enumerate(classnames):
        ordering = np.argsort(bbox[index][:, 4])[::-1]
        ordering = ordering[bbox[index][ordering, 4] > confidence_threshold]
        ordering = ordering[:MAX_OBJECTS].tolist()
        detected[classname] = []
        while ordering:
            max_obj = ordering.pop(0)
            detected[classname].append((bbox[index][max_obj], None))
            ordering = [obj for obj in ordering if NMS_THRESHOLD == 1 or
                        ref_compute_iou(bbox[index][max_obj], bbox[index][obj]) < NMS_THRESHOLD]
        if not detected[classname]:
            del detected[classname]
    return detected


def _boxes(g, n):
    xy = g.uniform(0, 40, (n, 2))
    wh = g.uniform(1, 20, (n, 2))
    return np.concatenate([xy, xy + wh, g.uniform(0, 1, (n, 1))], 1)


def test_iou_position_and_selection_equal_genevals_code():
    g = np.random.default_rng(0)
    a, b = _boxes(g, 200), _boxes(g, 200)
    for x, y in zip(a, b):
        assert compute_iou(x, y) == pytest.approx(ref_compute_iou(x, y), rel=1e-12)
        for t in (0.0, 0.1, 0.3):
            assert relative_position(x, y, t) == ref_relative_position((x,), (y,), t)
    labels = g.integers(0, len(CLASSES), 60)
    boxes = _boxes(g, 60)
    per_class = [boxes[labels == c] for c in range(len(CLASSES))]
    for threshold, max_objects, nms in ((0.3, 16, 1.0), (0.5, 3, 0.3), (0.0, 16, 0.5)):
        ours = select_objects(boxes, labels, CLASSES, threshold, max_objects, nms)
        ref = ref_select(per_class, CLASSES, threshold, max_objects, nms)
        assert ours.keys() == ref.keys()
        for cls in ref:
            np.testing.assert_array_equal(np.stack(ours[cls]), np.stack([o for o, _ in ref[cls]]))


def _meta(tag, include, exclude=(), prompt="p"):
    return GenEvalMetadata.model_validate({"tag": tag, "prompt": prompt, "include": include,
                                           "exclude": list(exclude)})


def test_rules_on_constructed_detections():
    """Each clause kind passing and failing, with the outcome GenEval's rules give by hand."""
    dog_left, dog_right = np.array([0, 10, 10, 20, .9]), np.array([30, 10, 40, 20, .8])
    cat_mid = np.array([15, 10, 25, 20, .95])
    objects = {"dog": [dog_left, dog_right], "cat": [cat_mid]}
    red = lambda found, cls: ["red"] * len(found)                      # noqa: E731
    first_blue = lambda found, cls: ["blue"] + ["red"] * (len(found) - 1)   # noqa: E731
    cases = [
        (_meta("counting", [{"class": "dog", "count": 2}]), red, True, 1.0),
        (_meta("counting", [{"class": "dog", "count": 3}]), red, False, 0.0),
        (_meta("colors", [{"class": "dog", "count": 2, "color": "red"}]), red, True, 1.0),
        (_meta("colors", [{"class": "dog", "count": 2, "color": "red"}]), first_blue, False, 0.),
        (_meta("position", [{"class": "cat", "count": 1},
                            {"class": "dog", "count": 1, "position": ["left of", 0]}]),
         red, True, 1.0),       # the most confident dog (left) is left of the cat
        (_meta("position", [{"class": "cat", "count": 1},
                            {"class": "dog", "count": 2, "position": ["left of", 0]}]),
         red, False, 0.5),      # the second dog is right of it
        (_meta("position", [{"class": "person", "count": 1},
                            {"class": "dog", "count": 1, "position": ["above", 0]}]),
         red, False, 0.0),      # no target
        (_meta("single_object", [{"class": "cat", "count": 1}], [{"class": "dog", "count": 2}]),
         red, False, 0.5),
        (_meta("single_object", [{"class": "cat", "count": 1}], [{"class": "dog", "count": 3}]),
         red, True, 1.0),
    ]
    for meta, colors_of, correct, share in cases:
        got, got_share, reasons = evaluate(objects, meta, colors_of, 0.1)
        assert (got, got_share) == (correct, share), (meta, reasons)
        assert bool(reasons) == (not correct)


@pytest.fixture(scope="module", params=["instance_segmentation", "object_detection"])
def scorer(request, tmp_path_factory):
    from testing import preference_snapshots as ps
    from testing.detector_snapshots import write_tiny_detr, write_tiny_mask2former
    root = tmp_path_factory.mktemp("geneval")
    write = write_tiny_mask2former if request.param == "instance_segmentation" else \
        write_tiny_detr
    return build_scorer(ScorerSpec(kind="geneval", params={
        "detector_dir": write(root / "detector", CLASSES), "detector": request.param,
        "clip_dir": ps.write_hf_clip_dir(root / "clip"), "threshold": 0.0}))


def test_scorer_end_to_end_on_a_tiny_detector(scorer):
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (2, 3, 40, 48), generator=g, dtype=torch.uint8)
    prompts = ("a photo of a red dog", "a photo of two cats")
    metas = ({"tag": "colors", "prompt": prompts[0], "seed": 3,
              "include": [{"class": "dog", "count": 1, "color": "red"}]},
             {"tag": "counting", "prompt": prompts[1], "include": [{"class": "cat", "count": 2}],
              "exclude": [{"class": "cat", "count": 3}]})
    out = scorer.score(ScoreRequest({"image": MediaArtifact(IMAGE, images)}, prompts, metas))
    # the same outcome from the detector's raw detections through the rules
    for i, ((boxes, labels, masks), meta) in enumerate(zip(scorer.detect(images), metas)):
        assert boxes.shape[1] == 6 and boxes.shape[0] == labels.shape[0] > 0
        assert set(labels.tolist()) <= set(range(len(CLASSES)))
        if masks is not None:            # Mask2Former: each box is its mask's (mmdet mask2bbox)
            assert masks.shape == (boxes.shape[0], 40, 48)
            for box, mask in zip(boxes, masks):
                ys, xs = np.nonzero(mask)
                if xs.size:
                    assert box[:4].tolist() == [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
        parsed = GenEvalMetadata.model_validate(meta)
        threshold = 0.9 if parsed.tag == "counting" else 0.0
        objects = select_objects(boxes, labels, CLASSES, threshold, 16, 1.0)
        correct, share, _ = evaluate(objects, parsed, lambda f, c, im=images[i], mk=masks:
                                     scorer.colors(im, f, c, mk), 0.1)
        assert out.scores["correct"][i] == float(correct)
        assert out.scores["clauses"][i] == pytest.approx(share)
    colors = scorer.colors(images[0], [np.array([2.4, 3.6, 20.5, 30, 1.0, 0])], "dog")
    assert len(colors) == 1 and colors[0] in COLORS
    assert scorer.color_classifier("dog").shape[1] == len(COLORS)


@pytest.mark.parametrize("meta, field", [
    ({"tag": "counting", "prompt": "another prompt", "include": [{"class": "dog", "count": 1}]},
     "metadata[0].prompt"),
    ({"tag": "counting", "prompt": "a dog", "include": [{"class": "zebra", "count": 1}]},
     "metadata[0].include[0].class"),
    ({"tag": "colors", "prompt": "a dog", "include": [{"class": "dog", "count": 1,
                                                       "color": "teal"}]},
     "metadata[0].include[0]"),
    ({"tag": "position", "prompt": "a dog", "include": [
        {"class": "dog", "count": 1, "position": ["left of", 0]}]}, "metadata[0]"),
    ({"prompt": "a dog", "include": [{"class": "dog", "count": 1}]}, "metadata[0].tag"),
])
def test_metadata_that_does_not_match_its_prompt_is_the_clients_error(scorer, meta, field):
    images = torch.zeros(1, 3, 32, 32, dtype=torch.uint8)
    with pytest.raises(UnscorableInputError) as e:
        scorer.score(ScoreRequest({"image": MediaArtifact(IMAGE, images)}, ("a dog",), (meta,)))
    assert e.value.field == field and e.value.http_status == 422


def test_masked_crop_shows_the_background_outside_the_mask(scorer, monkeypatch):
    """GenEval's ImageCrops: the image composited onto the grey background through the mask,
    then cropped to the box. A white image whose mask covers its left half: the crop CLIP reads
    is white on the left and #999 on the right."""
    from rewards import geneval
    image = torch.full((3, 8, 8), 255, dtype=torch.uint8)
    mask = np.zeros((1, 8, 8), dtype=bool)
    mask[0, :, :4] = True
    crops, real = [], geneval.images_to_pixels

    def recorded(processor, images, device, dtype):
        crops.append(images.clone())
        return real(processor, images, device, dtype)
    monkeypatch.setattr(geneval, "images_to_pixels", recorded)
    scorer.colors(image, [np.array([0, 0, 8, 6, 1.0, 0])], "dog", mask)
    [crop] = crops
    assert crop.shape == (1, 3, 6, 8)
    assert (crop[0, :, :, :4] == 255).all() and (crop[0, :, :, 4:] == 0x99).all()
