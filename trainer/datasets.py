"""Prompt files in the formats users train from, and a seeded, resumable epoch order over them.

    records = load_prompt_file("prompts/train.jsonl")            # list[PromptRecord]
    data = PromptDataset(records, seed=0)
    batch = data.take(4)                                         # next 4 in this epoch's order
    state = data.state(); data.load_state(state)                 # saved with checkpoints

Formats (DatasetFormat; AUTO picks by suffix):
  .txt      one prompt a line; blank lines are not prompts (flow_grpo's pickscore / ocr files).
  .jsonl    one JSON object a line: "prompt" (required), "negative_prompt", "metadata" (object,
            handed to the scorers, e.g. {"ocr_text": "OPEN"}), condition media paths "image",
            "first_frame", "last_frame", "reference" (images) and "video" (relative paths are
            relative to the file). Other keys are refused.
  .parquet  the same fields as columns ("metadata" a struct/map column or a JSON string).
  geneval   GenEval's metadata jsonl (`{"tag", "include": [{"class", "count"}], "prompt", ...}`):
            the whole record is the prompt's metadata, as the GenEval scorer reads it. AUTO
            chooses it for a .jsonl whose first record has "tag" and "include".
Edits (task `edit`, e.g. Qwen-Image-Edit, FLUX.1 Kontext): one .jsonl record per edit,
            {"prompt": instruction, "image": source image path, "negative_prompt": ...,
             "metadata": {"source_caption": ...}} (the clip_directional scorer reads the
            caption; the ingress hands every scorer the source under "image"); a multi-image
            edit adds "image_2", "image_3". A run checks at start-up that every record carries
            exactly its task's media (`check_task_media`).
Every bad input is a DatasetError naming `<file>:<line>`: a missing file, a file without prompts,
a line that is not JSON or has no prompt, a condition path that does not open as an image/video.
Media are checked (opened, headers verified, the first video frame decoded) at load; their
pixels are read per request. Condition paths stay under the prompt file's folder (after `..` and
symlinks); images are PNG / JPEG / WebP in 8-bit RGB, videos .mp4 / .m4v / .mov / .webm / .mkv
read by that demuxer in 8-bit; files, pixels and frames are bounded (MAX_* below).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from contract import DatasetError, MediaInput, MediaRole, Modality, RolloutError
from contract.request import check_metadata


class DatasetFormat(str, Enum):
    AUTO = "auto"
    TXT = "txt"
    JSONL = "jsonl"
    PARQUET = "parquet"
    GENEVAL = "geneval"


# jsonl / parquet key -> (modality, role) of a condition media path
MEDIA_KEYS: dict[str, tuple[Modality, MediaRole]] = {
    "image": (Modality.IMAGE, MediaRole.IMAGE),
    "image_2": (Modality.IMAGE, MediaRole.IMAGE_2),          # a multi-image edit's 2nd source
    "image_3": (Modality.IMAGE, MediaRole.IMAGE_3),          # ... and its 3rd
    "first_frame": (Modality.IMAGE, MediaRole.FIRST_FRAME),
    "last_frame": (Modality.IMAGE, MediaRole.LAST_FRAME),
    "reference": (Modality.IMAGE, MediaRole.REFERENCE),
    "video": (Modality.VIDEO, MediaRole.REFERENCE),
}
RECORD_KEYS = ("prompt", "negative_prompt", "metadata", *MEDIA_KEYS)
_SUFFIX = {".txt": DatasetFormat.TXT, ".jsonl": DatasetFormat.JSONL,
           ".parquet": DatasetFormat.PARQUET}


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a file. source: `<file>:<line>` (parquet: the 1-based row)."""

    text: str
    source: str
    negative: str | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)
    media: Mapping[str, Path] = field(default_factory=dict)     # MEDIA_KEYS key -> path

    def media_inputs(self) -> tuple[MediaInput, ...] | None:
        """The condition media, decoded (uint8 CHW images, TCHW video); None without media."""
        if not self.media:
            return None
        out = []
        for key, path in self.media.items():
            modality, role = MEDIA_KEYS[key]
            data = (_read_image(path, self.source) if modality is Modality.IMAGE
                    else _read_video(path, self.source))
            out.append(MediaInput(modality, role, data))
        return tuple(out)


# ---- media ------------------------------------------------------------------------------------
# Declared formats only: images by Pillow's PNG / JPEG / WebP decoders, videos by the FFmpeg demuxer
# their suffix names, reading the opened file object (never a URL, protocol or playlist that a
# demuxer picked from the content could reach). 8-bit RGB images and 8-bit video only: nothing is
# converted silently (16-bit, palette, alpha, grayscale are refused, naming the mode).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
VIDEO_DEMUXERS = {".mp4": "mp4", ".m4v": "mp4", ".mov": "mov", ".webm": "webm",
                  ".mkv": "matroska"}
MAX_MEDIA_BYTES = 256 << 20            # one condition file
MAX_IMAGE_PIXELS = 4096 * 4096         # one image or video frame
MAX_VIDEO_FRAMES = 1024
MAX_VIDEO_PIXELS = 256 << 20           # all frames of one video (768 MiB as RGB)


def _media_error(kind: str, exc: BaseException, source: str, path: Path) -> DatasetError:
    if isinstance(exc, DatasetError):
        return exc
    return DatasetError(f"condition {kind} does not load ({type(exc).__name__}: {exc})",
                        field=source, expected=f"a readable {kind} file", actual=str(path))


def _check_size(path: Path, source: str) -> None:
    size = path.stat().st_size
    if size > MAX_MEDIA_BYTES:
        raise DatasetError("condition media file is too large", field=source,
                           expected=f"<= {MAX_MEDIA_BYTES} bytes", actual=size)


def _open_image(path: Path, source: str):
    from PIL import Image
    _check_size(path, source)
    img = Image.open(path, formats=IMAGE_FORMATS)               # header only
    if img.mode != "RGB":
        img.close()
        raise DatasetError("condition image must be 8-bit RGB (it is not converted)",
                           field=source, expected="RGB", actual=f"{img.mode} ({path})")
    if img.width * img.height > MAX_IMAGE_PIXELS:
        img.close()
        raise DatasetError("condition image has too many pixels", field=source,
                           expected=f"<= {MAX_IMAGE_PIXELS}", actual=img.width * img.height)
    return img


def _check_image(path: Path, source: str) -> None:
    try:
        with _open_image(path, source) as img:
            img.verify()
    except Exception as exc:  # noqa: BLE001 - PIL raises many types for a bad file
        raise _media_error("image", exc, source, path) from None


def _read_image(path: Path, source: str) -> torch.Tensor:
    try:
        with _open_image(path, source) as img:
            array = np.asarray(img)
    except Exception as exc:  # noqa: BLE001
        raise _media_error("image", exc, source, path) from None
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()       # (3, H, W) uint8


def _video_frames(path: Path, source: str, first_only: bool):
    """Decoded rgb24 frames of the file's first video stream, within the frame / pixel bounds."""
    import av
    demuxer = VIDEO_DEMUXERS.get(path.suffix.lower())
    if demuxer is None:
        raise DatasetError("condition video does not load: its suffix names no declared "
                           "format", field=source,
                           expected=sorted(VIDEO_DEMUXERS), actual=path.suffix or str(path))
    _check_size(path, source)
    with open(path, "rb") as file, av.open(file, format=demuxer) as container:
        if not container.streams.video:
            raise DatasetError("condition video has no video stream", field=source,
                               actual=str(path))
        stream = container.streams.video[0]
        pixels = stream.codec_context.width * stream.codec_context.height
        if pixels > MAX_IMAGE_PIXELS:
            raise DatasetError("condition video frames have too many pixels", field=source,
                               expected=f"<= {MAX_IMAGE_PIXELS}", actual=pixels)
        if stream.frames > MAX_VIDEO_FRAMES:
            raise DatasetError("condition video has too many frames", field=source,
                               expected=f"<= {MAX_VIDEO_FRAMES}", actual=stream.frames)
        frames, total = [], 0
        for frame in container.decode(stream):
            fmt = frame.format
            if fmt.has_palette or any(c.bits > 8 for c in fmt.components):
                raise DatasetError("condition video must be 8-bit (it is not converted)",
                                   field=source, expected="8 bits per component",
                                   actual=fmt.name)
            total += frame.width * frame.height
            if len(frames) >= MAX_VIDEO_FRAMES or total > MAX_VIDEO_PIXELS:
                raise DatasetError("condition video decodes to more than its bound",
                                   field=source, expected=f"<= {MAX_VIDEO_FRAMES} frames and "
                                   f"{MAX_VIDEO_PIXELS} pixels", actual=f"> {len(frames)} frames")
            frames.append(frame.to_ndarray(format="rgb24"))
            if first_only:
                break
    return frames


def _check_video(path: Path, source: str) -> None:
    try:
        frames = _video_frames(path, source, first_only=True)     # the first frame decodes
    except Exception as exc:  # noqa: BLE001 - PyAV raises its own error tree
        raise _media_error("video", exc, source, path) from None
    if not frames:
        raise DatasetError("condition video has no frames", field=source, actual=str(path))


def _read_video(path: Path, source: str) -> torch.Tensor:
    try:
        frames = _video_frames(path, source, first_only=False)
    except Exception as exc:  # noqa: BLE001
        raise _media_error("video", exc, source, path) from None
    if not frames:
        raise DatasetError("condition video has no frames", field=source, actual=str(path))
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()  # (T, 3, H, W)


def _confined(value: str, base: Path, source: str) -> Path:
    """`value` (relative to the prompt file's folder, or absolute) resolved, symlinks included;
    a path outside that folder is refused."""
    root = base.resolve()
    path = (Path(value) if Path(value).is_absolute() else root / value).resolve()
    if not path.is_relative_to(root):
        raise DatasetError("condition media path leaves the prompt file's folder", field=source,
                           expected=f"a file under {root}", actual=value)
    return path


# ---- records ----------------------------------------------------------------------------------
def _record(raw: Mapping[str, Any], source: str, base: Path, geneval: bool) -> PromptRecord:
    if not isinstance(raw, Mapping):
        raise DatasetError("a record must be a JSON object", field=source, expected="object",
                           actual=type(raw).__name__)
    prompt = raw.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError("record has no prompt", field=source,
                           expected='"prompt": a non-empty string', actual=prompt)
    if geneval:
        include = raw.get("include")
        if not isinstance(raw.get("tag"), str) or not isinstance(include, list) or not all(
                isinstance(o, Mapping) and isinstance(o.get("class"), str) for o in include):
            raise DatasetError("GenEval record needs 'tag' and 'include': [{'class', 'count'}]",
                               field=source, expected="GenEval metadata", actual=dict(raw))
        return PromptRecord(prompt.strip(), source, metadata=_checked_metadata(raw, source))
    unknown = sorted(set(raw) - set(RECORD_KEYS))
    if unknown:
        raise DatasetError(f"unknown keys {unknown} (put extra fields under 'metadata'; GenEval "
                           "files take format 'geneval')", field=source,
                           expected=list(RECORD_KEYS), actual=unknown)
    negative = raw.get("negative_prompt")
    if negative is not None and not isinstance(negative, str):
        raise DatasetError("negative_prompt must be a string", field=source, actual=negative)
    metadata = raw.get("metadata") or {}
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except (ValueError, RecursionError):
            raise DatasetError("metadata string is not JSON", field=source,
                               actual=metadata) from None
    if not isinstance(metadata, Mapping):
        raise DatasetError("metadata must be an object", field=source,
                           actual=type(metadata).__name__)
    media = {}
    for key, (modality, _) in MEDIA_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise DatasetError(f"'{key}' must be a path string", field=source, actual=value)
        path = _confined(value, base, source)
        (_check_image if modality is Modality.IMAGE else _check_video)(path, source)
        media[key] = path
    return PromptRecord(prompt.strip(), source, negative, _checked_metadata(metadata, source),
                        media)


def _checked_metadata(metadata: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The record's metadata under the request rule (contract check_metadata: strict numbers,
    bounded strings, entries and depth), refused here naming the line, not later per request."""
    try:
        check_metadata(metadata)
    except RolloutError as exc:
        raise DatasetError(f"metadata: {exc.message}", field=f"{source} {exc.field}",
                           expected=exc.expected, actual=exc.actual) from None
    return dict(metadata)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise DatasetError("prompt file is not UTF-8 text", field=f"{path}:{line}",
                           actual=f"byte {exc.start}") from None


def _jsonl_rows(path: Path) -> list[tuple[int, Any]]:
    rows = []
    for line_no, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append((line_no, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise DatasetError(f"line is not JSON ({exc.msg})", field=f"{path}:{line_no}",
                               actual=line[:80]) from None
        except (ValueError, RecursionError) as exc:  # a number too long, nesting too deep
            raise DatasetError(f"line is not readable JSON ({type(exc).__name__})",
                               field=f"{path}:{line_no}", actual=line[:80]) from None
    return rows


def _parquet_rows(path: Path) -> list[tuple[int, Any]]:
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow's errors vary by failure
        raise DatasetError(f"not a readable parquet file ({type(exc).__name__})",
                           field=str(path), actual=str(exc)[:200]) from None
    unknown = sorted(set(table.column_names) - set(RECORD_KEYS))
    if unknown or "prompt" not in table.column_names:
        raise DatasetError("parquet columns must include 'prompt' and only known fields",
                           field=str(path), expected=list(RECORD_KEYS),
                           actual=table.column_names)
    rows = []
    for i, row in enumerate(table.to_pylist(), start=1):
        clean = {k: v for k, v in row.items() if v is not None}
        if isinstance(clean.get("metadata"), list):      # a map column arrives as pairs
            try:
                clean["metadata"] = dict(clean["metadata"])
            except (TypeError, ValueError):
                raise DatasetError("metadata column is neither a struct, a map nor JSON",
                                   field=f"{path}:{i}", actual=str(clean["metadata"])[:80]
                                   ) from None
        rows.append((i, clean))
    return rows


def resolve_format(path: Path, fmt: DatasetFormat) -> DatasetFormat:
    fmt = DatasetFormat(fmt)
    if fmt is not DatasetFormat.AUTO:
        return fmt
    found = _SUFFIX.get(path.suffix.lower())
    if found is None:
        raise DatasetError("cannot tell the prompt file's format from its suffix",
                           field=str(path), expected=sorted(_SUFFIX), actual=path.suffix)
    if found is DatasetFormat.JSONL:
        for line in _read_text(path).splitlines():
            if line.strip():
                try:
                    first = json.loads(line)
                except (ValueError, RecursionError):
                    break               # reported with its line by the JSONL reader
                if isinstance(first, Mapping) and "tag" in first and "include" in first:
                    return DatasetFormat.GENEVAL
                break
    return found


def load_prompt_file(path: str | Path, fmt: DatasetFormat = DatasetFormat.AUTO
                     ) -> list[PromptRecord]:
    """All prompts of one file, in file order (see the module docstring for the formats)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError("prompt file not found", field=str(path), expected="an existing file",
                           actual=str(path))
    fmt = resolve_format(path, fmt)
    base = path.parent
    if fmt is DatasetFormat.TXT:
        records = [PromptRecord(line.strip(), f"{path}:{n}")
                   for n, line in enumerate(_read_text(path).splitlines(), 1)
                   if line.strip()]
    else:
        rows = _parquet_rows(path) if fmt is DatasetFormat.PARQUET else _jsonl_rows(path)
        records = [_record(raw, f"{path}:{n}", base, fmt is DatasetFormat.GENEVAL)
                   for n, raw in rows]
    if not records:
        raise DatasetError("prompt file holds no prompts", field=str(path),
                           expected=">= 1 prompt", actual=0)
    return records


def check_task_media(records: Sequence[PromptRecord], roles: Sequence[MediaRole],
                     task: str, optional: Sequence[MediaRole] = ()) -> None:
    """Every record carries exactly the condition media of its run's task, as the family's
    request check takes them: its `roles` (an edit: the source image, key "image"), then a
    prefix of its `optional` ones (a multi-image edit: "image_2", "image_3"); checked from the
    paths before any pixel is read, else a DatasetError naming `<file>:<line> <key>`."""
    wanted, optional = set(roles), list(optional)
    for record in records:
        have = {MEDIA_KEYS[key][1]: key for key in record.media}
        for role in sorted(wanted - set(have), key=lambda r: r.value):
            keys = [k for k, (_, r) in MEDIA_KEYS.items() if r is role]
            raise DatasetError(f"a {task} record needs its {role.value} condition media",
                               field=f"{record.source} {'/'.join(keys) or role.value}",
                               expected=f"a path under '{'/'.join(keys)}'", actual=None)
        for role in sorted(set(have) - wanted - set(optional), key=lambda r: r.value):
            raise DatasetError(f"task {task} takes no {role.value} condition media",
                               field=f"{record.source} {have[role]}",
                               expected=sorted(r.value for r in wanted | set(optional)),
                               actual=str(record.media[have[role]]))
        taken = [r for r in optional if r in have]
        if taken != optional[:len(taken)]:
            gap = next(r for r in optional if r not in have)      # a later one is there
            raise DatasetError(f"task {task} takes its further media in order "
                               f"{[r.value for r in optional]}", field=f"{record.source} "
                               f"{[k for k, (_, r) in MEDIA_KEYS.items() if r is gap][0]}",
                               expected="a path (the ones after it need it)", actual=None)


# ---- epoch order ----------------------------------------------------------------------------
class PromptDataset:
    """Records in a seeded order that is reshuffled every epoch; the position is resumable.

    Epoch e visits every record once, in `order(e)` (a permutation seeded by (seed, e); file
    order when shuffle is off). `take(n)` continues across epoch boundaries.
    """

    def __init__(self, records: Sequence[PromptRecord], seed: int = 0, shuffle: bool = True):
        if not records:
            raise DatasetError("a dataset needs at least one prompt", field="records", actual=0)
        self.records = list(records)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self.order(0)

    def __len__(self) -> int:
        return len(self.records)

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.records), generator=gen).tolist()

    def take(self, n: int) -> list[tuple[int, PromptRecord]]:
        """The next n (index, record) pairs of the epoch order."""
        out = []
        for _ in range(n):
            if self.position == len(self.records):
                self.epoch += 1
                self.position = 0
                self._order = self.order(self.epoch)
            index = self._order[self.position]
            out.append((index, self.records[index]))
            self.position += 1
        return out

    @property
    def progress(self) -> float:
        """Epochs completed, fractional (epoch + position / len)."""
        return self.epoch + self.position / len(self.records)

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "size": len(self.records),
                "seed": self.seed, "shuffle": int(self.shuffle)}

    def load_state(self, state: Mapping[str, int]) -> None:
        if int(state["size"]) != len(self.records):
            raise DatasetError("the prompt file changed since the checkpoint (record count)",
                               field="data.train", expected=int(state["size"]),
                               actual=len(self.records))
        self.seed, self.shuffle = int(state["seed"]), bool(state["shuffle"])
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self.order(self.epoch)
