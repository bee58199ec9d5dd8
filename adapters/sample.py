"""Draw images from an adapter for a person to look at (ODE Euler + classifier-free guidance).

    python -m adapters.sample --adapter tiny_t2i --prompt "a red circle at the top left on a \
black background" --prompt "..." --num-samples 4 --out grid.png

The loop uses the project's diffusion math (schedule, time convention, CFG, Euler step); the
rollout engine is the production path, this is the small offline one (also used for evaluation
in scripts/pretrain_t2i.py).
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import torch
from PIL import Image, ImageDraw

from adapters.base import Components, DiffusionAdapter, TextCondition
from adapters.registry import get_adapter
from contract import SamplingSpec, SamplerKind
from diffusion.conventions import predict_velocity
from diffusion.guidance import cfg_velocity
from diffusion.samplers import ode_step
from diffusion.schedule import flow_match_sigmas


@torch.no_grad()
def sample_latents(adapter: DiffusionAdapter, components: Components, prompts: Sequence[str],
                   seeds: Sequence[int], num_steps: int = 20,
                   guidance_scale: float = 3.0) -> torch.Tensor:
    """One latent per (prompt, seed) row: (B, *S) fp32, B = len(prompts) = len(seeds)."""
    sampling = SamplingSpec(sampler=SamplerKind.ODE, num_steps=num_steps,
                            guidance_scale=guidance_scale, seeds=tuple(seeds))
    shape = adapter.state_shape(sampling)
    x = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(int(s)))
                     for s in seeds])                                              # (B, *S)
    cond = adapter.encode(components.text_encoder, adapter.tokenize(list(prompts)))
    null = adapter.encode(components.text_encoder, adapter.tokenize([""] * len(prompts)))
    both = TextCondition(torch.cat([null.hidden, cond.hidden]), torch.cat([null.mask, cond.mask]),
                         torch.cat([null.pooled, cond.pooled]))
    sigmas = flow_match_sigmas(num_steps, adapter.schedule_shift)                 # (T + 1,)

    def model_fn(state: torch.Tensor, model_time: torch.Tensor) -> torch.Tensor:
        return adapter.model_forward(components.transformer, state, model_time, both)

    for i in range(num_steps):
        sigma = sigmas[i].expand(2 * x.shape[0])                                  # (2B,)
        v = predict_velocity(model_fn, torch.cat([x, x]), sigma, adapter.time_convention,
                             adapter.model_time_scale)                            # (2B, *S)
        v_uncond, v_cond = v.chunk(2)
        v = cfg_velocity(v_uncond, v_cond, guidance_scale)
        x = ode_step(x, v, sigmas[i].expand(x.shape[0]), sigmas[i + 1].expand(x.shape[0])).prev_sample
    return x


def sample_images(adapter: DiffusionAdapter, components: Components, prompts: Sequence[str],
                  seeds: Sequence[int], num_steps: int = 20,
                  guidance_scale: float = 3.0) -> torch.Tensor:
    """uint8 (B, 3, H, W) images of an image adapter (its first declared latent)."""
    latent_name = adapter.io_spec.latent_needed(adapter.io_spec.defaults)[0]
    latents = sample_latents(adapter, components, prompts, seeds, num_steps, guidance_scale)
    return adapter.decode(components.decoders, latent_name, latents)


def image_grid(images: torch.Tensor, rows: int, labels: Sequence[str] = (),
               scale: int = 4) -> Image.Image:
    """uint8 (R*C, 3, H, W) -> a PIL grid with R rows, each optionally labelled above."""
    n, _, h, w = images.shape
    cols = n // rows
    label_h = 12 if labels else 0
    grid = Image.new("RGB", (cols * w * scale, rows * (h * scale + label_h)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for r in range(rows):
        top = r * (h * scale + label_h)
        if labels:
            draw.text((2, top), labels[r], fill=(0, 0, 0))
        for c in range(cols):
            tile = Image.fromarray(images[r * cols + c].permute(1, 2, 0).numpy())
            grid.paste(tile.resize((w * scale, h * scale), Image.NEAREST),
                       (c * w * scale, top + label_h))
    return grid


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapter", default="tiny_t2i")
    parser.add_argument("--weights", default=None, help="local weights dir (default: shipped)")
    parser.add_argument("--prompt", action="append", required=True)
    parser.add_argument("--num-samples", type=int, default=4, help="images per prompt")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    adapter = get_adapter(args.adapter)
    components = adapter.load(args.weights)
    prompts = [p for p in args.prompt for _ in range(args.num_samples)]
    seeds = [args.seed + i for i in range(len(prompts))]
    images = sample_images(adapter, components, prompts, seeds, args.steps, args.guidance)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, rows=len(args.prompt), labels=args.prompt).save(args.out)
    return args.out


if __name__ == "__main__":
    print(main())
