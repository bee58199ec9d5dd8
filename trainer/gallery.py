"""The run gallery: held-out samples at step 0 next to the latest evaluation.

Images: gallery.png, row 1 = step 0, row 2 = now (same prompts and seeds). Clips: one MP4 (video
+ audio) per prompt for step 0 and for now, plus a frame-strip PNG. Writers are the adapters'
(adapters/sample.py `image_grid`, adapters/sample_clip.py `write_mp4` / `frame_grid`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from adapters.family import ModelFamily
from contract import Modality, Representation, RolloutOutput
from trainer.reporting import scorer_summary


def _decoded(outputs: Sequence[RolloutOutput], modality: Modality) -> torch.Tensor | None:
    parts = [a.data for o in outputs for a in o.artifacts.values()
             if a.spec.representation == Representation.DECODED and a.spec.modality == modality]
    return torch.cat(parts) if parts else None


def record(run_dir: Path, adapter: ModelFamily, step: int,
           outputs: Sequence[RolloutOutput], prompts: Sequence[str] | None = None) -> Path:
    """Write the gallery for evaluation `step`; prompts: the texts of the outputs' prompts."""
    root = run_dir / "gallery"
    root.mkdir(parents=True, exist_ok=True)
    video, image = _decoded(outputs, Modality.VIDEO), _decoded(outputs, Modality.IMAGE)
    tag = "step0" if step == 0 else "now"
    captions = sample_captions(outputs)
    if video is not None:
        path = _clips(root, tag, step, outputs, video, _decoded(outputs, Modality.AUDIO))
        (root / f"{tag}_rewards.txt").write_text("".join(
            f"{p}: {c}\n" for p, c in zip(_row_prompts(outputs, prompts), captions)) + "".join(
            f"group {i}: {s}\n" for i, s in enumerate(group_summaries(outputs))))
        return path
    if image is None:
        raise ValueError("evaluation outputs carry no decoded image or video to show")
    torch.save({"images": image, "captions": captions}, root / f"{tag}.pt")
    first = torch.load(root / "step0.pt") if (root / "step0.pt").exists() else \
        {"images": image, "captions": captions}
    if isinstance(first, torch.Tensor):               # a run folder from before captions
        first = {"images": first, "captions": [""] * first.shape[0]}
    texts = [f"{p}  [{s}]" if s else p for p, s in
             zip(prompts or [f"prompt {i}" for i in range(len(outputs))], group_summaries(outputs))]
    grid = captioned_grid(texts, len(outputs[0].seeds), (first["images"], first["captions"]),
                          (image, captions), step)
    grid.save(root / "gallery.png")
    return root / "gallery.png"


def sample_captions(outputs: Sequence[RolloutOutput]) -> list[str]:
    """Per sample: the total reward and each scorer's value ('total 0.81 | attr 0.81')."""
    out = []
    for o in outputs:
        if o.rewards is None:
            out.extend("no reward" for _ in o.seeds)
            continue
        for i, total in enumerate(o.rewards.total):
            parts = [f"total {total:.3f}"]
            for name, vals in o.rewards.values.items():
                parts.append(f"{name} " + ("missing" if vals[i] is None else f"{vals[i]:.3f}"))
            out.append(" | ".join(parts))
    return out


def group_summaries(outputs: Sequence[RolloutOutput]) -> list[str]:
    """Per prompt group: each scorer's mean+-std over the group (trainer/reporting.py), so a
    scorer rising while another falls shows beside the samples."""
    return [scorer_summary(o.rewards.values) if o.rewards is not None else "" for o in outputs]


def _row_prompts(outputs, prompts):
    prompts = list(prompts or [f"prompt {i}" for i in range(len(outputs))])
    return [p for p, o in zip(prompts, outputs) for _ in o.seeds]


def captioned_grid(prompts: Sequence[str], group: int, before: tuple[torch.Tensor, list[str]],
                   after: tuple[torch.Tensor, list[str]], step: int, cell: int = 128):
    """One row per prompt (its text above): the `group` samples at step 0, then the same
    prompts and seeds now, each captioned with its rewards. images: uint8 (P*G, 3, H, W)."""
    import textwrap

    from PIL import Image, ImageDraw
    images_0, caps_0 = before
    images_1, caps_1 = after
    h, w = images_1.shape[2:]
    scale = max(1, cell // max(h, w))
    cw, ch = w * scale, h * scale
    pad, line = 6, 12
    cap_lines = max(len(textwrap.wrap(c, max(8, cw // 6)) or [""]) for c in caps_0 + caps_1)
    cols = 2 * group
    width = cols * (cw + pad) + pad + pad
    prompt_lines = [textwrap.wrap(p, max(16, width // 6 - 2)) or [""] for p in prompts]
    row_h = [len(pl) * line + ch + cap_lines * line + 2 * pad for pl in prompt_lines]
    grid = Image.new("RGB", (width, line + pad + sum(row_h)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    half = group * (cw + pad)
    draw.text((pad, 2), "step 0", fill=(0, 0, 0))
    draw.text((pad + half + pad, 2), f"step {step}", fill=(0, 0, 0))
    draw.line([(half + pad + pad // 2, 0), (half + pad + pad // 2, grid.height)],
              fill=(160, 160, 160))
    top = line + pad
    for r, lines in enumerate(prompt_lines):
        for k, text in enumerate(lines):
            draw.text((pad, top + k * line), text, fill=(0, 0, 128))
        y = top + len(lines) * line
        for c in range(cols):
            images, caps = (images_0, caps_0) if c < group else (images_1, caps_1)
            i = r * group + c % group
            x = pad + c * (cw + pad) + (pad if c >= group else 0)
            tile = Image.fromarray(images[i].permute(1, 2, 0).numpy())
            grid.paste(tile.resize((cw, ch), Image.NEAREST), (x, y))
            for k, text in enumerate(textwrap.wrap(caps[i], max(8, cw // 6))):
                draw.text((x, y + ch + 2 + k * line), text, fill=(0, 0, 0))
        top += row_h[r]
    return grid


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
