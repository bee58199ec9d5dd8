"""Sample clips from a video+audio adapter and write them as MP4 (H.264 + AAC) with PyAV.

`generate_clips` is a plain deterministic (ODE) sampling loop for local inspection, evaluation and
pretraining reports; the rollout engine does the real, batched, stochastic sampling. Time
conversion goes through `diffusion.conventions.predict_velocity` (the one place), FL2VA conditions
through the adapter's `encode_media` / `apply_conditions` before every step and at the end.

    python -m adapters.sample_clip --prompt "a red square bouncing left and right with low beeps" \
        --out /tmp/clip.mp4 [--grid /tmp/clip.png]
"""
from __future__ import annotations

import argparse
import fractions
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from adapters.base import Components, DiffusionAdapter
from contract import MediaRole, SamplingSpec
from diffusion.conventions import predict_velocity
from diffusion.guidance import cfg_velocity
from diffusion.samplers import ode_step
from diffusion.schedule import flow_match_sigmas


@torch.no_grad()
def generate_clips(adapter: DiffusionAdapter, components: Components, prompts: Sequence[str],
                   seeds: Sequence[int], num_steps: int = 20, guidance_scale: float = 3.0,
                   media: Mapping[MediaRole, torch.Tensor] | None = None,
                   num_frames: int = 8, size: int = 32) -> dict[str, torch.Tensor]:
    """One row per (prompt, seed) pair. media: role -> uint8 (B, 3, H, W) condition frames.
    Returns the latent artifacts and the decoded ones: video (B,T,3,H,W) u8, audio (B,C,N) f32."""
    if len(prompts) != len(seeds):
        raise ValueError(f"need one seed per prompt: {len(prompts)} prompts, {len(seeds)} seeds")
    sampling = SamplingSpec(seeds=tuple(seeds), num_steps=num_steps, num_frames=num_frames,
                            height=size, width=size, guidance_scale=guidance_scale)
    shape = adapter.state_shape(sampling)
    cond = adapter.encode(components.text_encoder, adapter.tokenize(prompts))
    null = adapter.encode(components.text_encoder, [adapter.null_prompt()] * len(prompts))
    cond_latents = adapter.encode_media(components, sampling, media or {})
    x = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(int(s)))
                     for s in seeds])                                             # (B, *S)
    sigmas = flow_match_sigmas(num_steps, adapter.schedule_shift)
    net = components.transformer
    for i in range(num_steps):
        x = adapter.apply_conditions(x, cond_latents)
        sigma = sigmas[i].expand(x.shape[0])

        def velocity(c):
            return predict_velocity(
                lambda s, t: adapter.model_forward(net, s, t, c, cond_latents), x, sigma,
                adapter.time_convention, adapter.model_time_scale)

        v = velocity(cond)
        if guidance_scale != 1.0:
            v = cfg_velocity(velocity(null), v, guidance_scale)
        x = ode_step(x, v, sigma, sigmas[i + 1].expand(x.shape[0])).prev_sample
    x = adapter.apply_conditions(x, cond_latents)
    latents = adapter.split_state(x, sampling)
    out = dict(latents)
    for spec in adapter.io_spec.artifacts:
        if spec.source is not None:
            out[spec.name] = adapter.decode(components.decoders, spec.source, latents[spec.source])
    return out


def write_mp4(path: str | Path, video: np.ndarray, fps: float, audio: np.ndarray,
              sample_rate: int) -> None:
    """video (T, 3, H, W) uint8 (H, W even); audio (C, N) float in [-1, 1] -> H.264 + AAC MP4."""
    import av  # PyAV bundles FFmpeg

    frames = np.ascontiguousarray(video.transpose(0, 2, 3, 1))                    # (T, H, W, 3)
    with av.open(str(path), mode="w") as container:
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
    from adapters.tiny_t2va import TinyT2VAAdapter

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", action="append", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=3.0)
    p.add_argument("--weights", default=None, help="weights directory (default: shipped)")
    p.add_argument("--out", required=True, help="MP4 path; several prompts get _<i> suffixes")
    p.add_argument("--grid", default=None, help="optional PNG frame grid of all clips")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    adapter = TinyT2VAAdapter()
    components = adapter.load(args.weights)
    seeds = [args.seed + i for i in range(len(args.prompt))]
    out = generate_clips(adapter, components, args.prompt, seeds, args.steps, args.guidance)
    video, audio = out["video"].numpy(), out["audio"].numpy()
    fps, sr = adapter.io_spec["video"].fps, adapter.io_spec["audio"].sample_rate
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
