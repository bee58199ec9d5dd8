"""The run gallery: held-out samples at step 0 next to the latest evaluation.

Images: gallery.png, row 1 = step 0, row 2 = now (same prompts and seeds). Clips: one MP4 (video
+ audio) per prompt for step 0 and for now, plus a frame-strip PNG. Writers are the adapters'
(adapters/sample.py `image_grid`, adapters/sample_clip.py `write_mp4` / `frame_grid`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from adapters.base import DiffusionAdapter
from contract import Modality, Representation, RolloutOutput


def _decoded(outputs: Sequence[RolloutOutput], modality: Modality) -> torch.Tensor | None:
    parts = [a.data for o in outputs for a in o.artifacts.values()
             if a.spec.representation == Representation.DECODED and a.spec.modality == modality]
    return torch.cat(parts) if parts else None


def record(run_dir: Path, adapter: DiffusionAdapter, step: int,
           outputs: Sequence[RolloutOutput]) -> Path:
    root = run_dir / "gallery"
    root.mkdir(parents=True, exist_ok=True)
    video, image = _decoded(outputs, Modality.VIDEO), _decoded(outputs, Modality.IMAGE)
    tag = "step0" if step == 0 else "now"
    if video is not None:
        return _clips(root, tag, step, outputs, video, _decoded(outputs, Modality.AUDIO))
    if image is None:
        raise ValueError("evaluation outputs carry no decoded image or video to show")
    torch.save(image, root / f"{tag}.pt")
    first = torch.load(root / "step0.pt") if (root / "step0.pt").exists() else image
    from adapters.sample import image_grid
    grid = image_grid(torch.cat([first, image]), rows=2, labels=["step 0", f"step {step}"])
    grid.save(root / "gallery.png")
    return root / "gallery.png"


def _clips(root: Path, tag: str, step: int, outputs, video: torch.Tensor,
           audio: torch.Tensor | None) -> Path:
    from PIL import Image
    from adapters.sample_clip import frame_grid, write_mp4
    spec = next(a.spec for o in outputs for a in o.artifacts.values()
                if a.spec.modality == Modality.VIDEO and
                a.spec.representation == Representation.DECODED)
    aspec = next((a.spec for o in outputs for a in o.artifacts.values()
                  if a.spec.modality == Modality.AUDIO and
                  a.spec.representation == Representation.DECODED), None)
    group = len(outputs[0].seeds)
    for i in range(len(outputs)):
        row = i * group
        if audio is not None and aspec is not None:
            write_mp4(root / f"{tag}_prompt{i}.mp4", video[row].numpy(), spec.fps or 8.0,
                      audio[row].numpy(), aspec.sample_rate or 16000)
    Image.fromarray(frame_grid(video[::group].numpy())).save(root / f"{tag}_frames.png")
    (root / f"{tag}.txt").write_text(f"step {step}\n")
    return root
