"""Sample media from a family in-process, for a person to look at (ODE + guidance).

    python -m adapters.sample --adapter tiny_t2i --prompt "a red circle at the top left on a \
black background" --prompt "..." --num-samples 4 --out grid.png
    python -m adapters.sample --adapter sd3 --weights /ckpt/sd3.5-medium --prompt "..." --out a.png

`generate` runs the graph's own denoising step (`diffusion.step.denoise_step`), per-row seeded
initial noise (`diffusion.noise.initial_noise`) and the family's guidance decision, so a seed
gives the same media here as in the rollout graph's ODE path. The graph is the production
path (batched, stochastic, versioned); this is the small offline one (evaluation, reports).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch
from PIL import Image, ImageDraw
from torch import nn

from adapters.family import ModelFamily
from adapters.registry import get_family
from contract import MediaRole, Representation, SamplerKind, SamplingSpec
from diffusion.noise import initial_noise
from diffusion.step import FrozenLatents, Guidance, denoise_step, doubles_rows


@dataclass
class LocalModels:
    """Every component of a family in one process (an offline sampler needs all of them)."""

    transformers: dict[str, nn.Module]
    encoders: dict[str, nn.Module]
    media: dict[str, nn.Module]
    decoders: dict[str, dict[str, nn.Module]]      # latent name -> its decoder components

    @classmethod
    def load(cls, family: ModelFamily, dtype="float32", device="cpu") -> "LocalModels":
        return cls(family.load_transformers(dtype, device), family.load_encoders(dtype, device),
                   family.load_media_encoders(dtype, device),
                   {latent: family.load_decoder(latent, dtype, device)
                    for latent in family.spec.decoders})


@torch.no_grad()
def generate(family: ModelFamily, models: LocalModels, prompts: Sequence[str],
             seeds: Sequence[int], num_steps: int = 20, guidance_scale: float = 3.0,
             media: Mapping[MediaRole, torch.Tensor] | None = None,
             negative_prompts: Sequence[str | None] | None = None,
             **size: int) -> dict[str, torch.Tensor]:
    """One row per (prompt, seed). media: role -> uint8 condition media shared by the rows.
    size: height / width / num_frames over the family's defaults. Returns every artifact the
    family declares: latents (B, ...) and decoded media (B, ...)."""
    if len(prompts) != len(seeds):
        raise ValueError(f"need one seed per prompt: {len(prompts)} prompts, {len(seeds)} seeds")
    spec = family.spec
    sampling = SamplingSpec(sampler=SamplerKind.ODE, num_steps=num_steps, noise_level=0.0,
                            guidance_scale=guidance_scale, seeds=tuple(seeds),
                            **{**spec.sampling_defaults, **size})
    rows, shape = len(seeds), family.codec.state_shape(sampling)
    bundles = family.conditioner.tokenize(list(prompts), negative_prompts)
    cond = family.conditioner.encode(models.encoders, bundles)
    uncond = None
    if doubles_rows(spec.guidance, guidance_scale):
        uncond = family.conditioner.encode(
            models.encoders, [family.conditioner.unconditional(b) for b in bundles])
    guidance = Guidance.of(spec.guidance, [guidance_scale] * rows, uncond)
    mc = family.codec.encode_media(models.media, sampling, dict(media or {}))
    frozen = None if mc.frozen is None else FrozenLatents(
        mc.frozen.mask.expand(rows, *shape), mc.frozen.values.expand(rows, *shape))
    inputs = {k: v.expand(rows, *v.shape[1:]) for k, v in mc.inputs.items()}
    sigmas = family.sigmas(sampling)
    x = initial_noise(seeds, shape)                                                 # (B, *S)
    if frozen is not None:
        x = frozen.apply(x)
    for i in range(num_steps):
        sigma, sigma_next = sigmas[i].expand(rows), sigmas[i + 1].expand(rows)
        x = denoise_step(family.denoiser, models.transformers, x, sigma, sigma_next, cond,
                         guidance, SamplerKind.ODE, 0.0, media=inputs,
                         frozen=frozen).prev_sample
    out = dict(family.codec.split_state(x, sampling))
    for artifact in family.io_spec.artifacts:
        if artifact.representation == Representation.DECODED:
            out[artifact.name] = family.codec.decode(artifact.source,
                                                     models.decoders[artifact.source],
                                                     out[artifact.source], sampling)
    return out


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
    parser.add_argument("--adapter", default="tiny_t2i", help="family name or 'auto'")
    parser.add_argument("--weights", default=None, help="local checkpoint (default: shipped)")
    parser.add_argument("--prompt", action="append", required=True)
    parser.add_argument("--num-samples", type=int, default=4, help="images per prompt")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    family = get_family(args.adapter, args.weights)
    models = LocalModels.load(family)
    prompts = [p for p in args.prompt for _ in range(args.num_samples)]
    seeds = [args.seed + i for i in range(len(prompts))]
    out = generate(family, models, prompts, seeds, args.steps, args.guidance)
    images = next(out[a.name] for a in family.io_spec.artifacts
                  if a.representation == Representation.DECODED and a.layout.value == "CHW")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, rows=len(args.prompt), labels=args.prompt).save(args.out)
    return args.out


if __name__ == "__main__":
    print(main())
