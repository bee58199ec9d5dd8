"""Clips from a video+audio family as MP4 (H.264 + AAC) with PyAV, and frame grids.

    python -m adapters.sample_clip --prompt "a red square bouncing left and right with low beeps" \
        --out /tmp/clip.mp4 [--grid /tmp/clip.png]

Sampling is `adapters.sample.generate` (the graph's denoising step, ODE); this module writes it.
"""
from __future__ import annotations

import argparse
import fractions
from pathlib import Path
from typing import BinaryIO, Sequence

import numpy as np
import torch


def write_mp4(path: str | Path | BinaryIO, video: np.ndarray, fps: float, audio: np.ndarray,
              sample_rate: int) -> None:
    """video (T, 3, H, W) uint8 (H, W even); audio (C, N) float in [-1, 1] -> H.264 + AAC MP4
    at `path` (a file path or a seekable binary file object)."""
    import av  # PyAV bundles FFmpeg

    frames = np.ascontiguousarray(video.transpose(0, 2, 3, 1))                    # (T, H, W, 3)
    target = path if hasattr(path, "write") else str(path)
    with av.open(target, mode="w", format="mp4") as container:
        vs = container.add_stream("libx264", rate=fractions.Fraction(fps).limit_denominator(1000))
        vs.width, vs.height, vs.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        vs.options = {"crf": "18", "preset": "veryfast"}
        layout = "stereo" if audio.shape[0] == 2 else "mono"
        a = container.add_stream("aac", rate=sample_rate, layout=layout)
        for f in frames:
            for packet in vs.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in vs.encode():
            container.mux(packet)
        af = av.AudioFrame.from_ndarray(np.ascontiguousarray(audio.astype(np.float32)),
                                        format="fltp", layout=layout)
        af.sample_rate, af.pts, af.time_base = sample_rate, 0, fractions.Fraction(1, sample_rate)
        for packet in a.encode(af):
            container.mux(packet)
        for packet in a.encode():
            container.mux(packet)


def frame_grid(videos: np.ndarray, scale: int = 4) -> np.ndarray:
    """(B, T, 3, H, W) uint8 -> (B*H*scale, T*W*scale, 3) image: one row per clip."""
    b, t, _, h, w = videos.shape
    grid = videos.transpose(0, 3, 1, 4, 2).reshape(b * h, t * w, 3)
    return grid.repeat(scale, 0).repeat(scale, 1)


def main(argv: Sequence[str] | None = None) -> None:
    from adapters.registry import get_family
    from adapters.sample import LocalModels, generate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adapter", default="tiny_t2va")
    p.add_argument("--prompt", action="append", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=3.0)
    p.add_argument("--weights", default=None, help="checkpoint directory (default: shipped)")
    p.add_argument("--out", required=True, help="MP4 path; several prompts get _<i> suffixes")
    p.add_argument("--grid", default=None, help="optional PNG frame grid of all clips")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    family = get_family(args.adapter, args.weights)
    seeds = [args.seed + i for i in range(len(args.prompt))]
    out = generate(family, LocalModels.load(family), args.prompt, seeds, args.steps,
                   args.guidance)
    video, audio = out["video"].numpy(), out["audio"].numpy()
    fps, sr = family.io_spec["video"].fps, family.io_spec["audio"].sample_rate
    for i in range(len(args.prompt)):
        path = Path(args.out) if len(args.prompt) == 1 else \
            Path(args.out).with_name(f"{Path(args.out).stem}_{i}.mp4")
        write_mp4(path, video[i], fps, audio[i], sr)
        print(f"wrote {path}: {args.prompt[i]!r}")
    if args.grid:
        import matplotlib.pyplot as plt
        plt.imsave(args.grid, frame_grid(video))
        print(f"wrote {args.grid}")


if __name__ == "__main__":
    main()
