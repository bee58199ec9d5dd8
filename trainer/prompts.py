"""Prompts, rollout requests and probe data for the trainer (synthetic, verifiable sources).

Training prompts come from the train split (shapes) or a seed range (clips); held-out prompts
from the eval split / a disjoint seed range, so the held-out reward measures generalisation.
`probe_clean_latents` encodes real synthetic media to clean latents x0 for the time-convention
check (one explicit function per prompt source; no registration).
"""
from __future__ import annotations

import random
from typing import Callable, Sequence

import torch

from adapters.family import ModelFamily
from contract import (BranchSpec, PromptBundle, Representation, RolloutRequest, SamplerKind,
                      SamplingSpec, Task)
from diffusion.samplers import DETERMINISTIC
from diffusion.windows import sample_sde_window, sliding_sde_window
from trainer.config import PromptSource, SamplerSettings

EVAL_SEED_OFFSET = 1_000_000   # clips have no split: held-out prompts come from far-away seeds


def captions(source: PromptSource, n: int, seed: int, held_out: bool = False) -> list[str]:
    if source is PromptSource.SHAPES:
        from synthetic import shapes
        split = shapes.Split.EVAL if held_out else shapes.Split.TRAIN
        return [shapes.caption(s) for s in shapes.sample_specs(n, seed, split)]
    from synthetic import clips
    return [clips.caption(s) for s in
            clips.sample_specs(n, seed + (EVAL_SEED_OFFSET if held_out else 0))]


def latent_names(adapter: ModelFamily) -> tuple[str, ...]:
    return tuple(s.name for s in adapter.io_spec.artifacts
                 if s.representation == Representation.LATENT)


def request_window(settings: SamplerSettings, seed: int, index: int,
                   step: int = 0) -> tuple[int, int] | None:
    """The SDE window of request `index`: the fixed one, under Flow-GRPO-Fast (window_size)
    one drawn for the whole prompt group from a generator seeded by (seed, index), so every row
    of a group shares it and a resumed run draws the same one; under MixGRPO (sliding_window)
    optimizer step `step`'s window, shared by every request of the step."""
    if settings.sliding_window is not None:
        w = settings.sliding_window
        return sliding_sde_window(step, settings.num_steps, w.size, w.shift_every, w.stride,
                                  w.roll_back)
    if settings.window_size is None:
        return settings.window
    rng = random.Random(seed * 1_000_003 + index)
    return sample_sde_window(settings.num_steps, settings.window_size,
                             settings.random_window_range, rng)


def make_requests(adapter: ModelFamily, bundles: Sequence[PromptBundle],
                  settings: SamplerSettings, group: int, seed: int, version: str | None,
                  sampler: SamplerKind | None = None, num_steps: int | None = None,
                  metadata: Sequence[dict] | None = None, media: Sequence | None = None,
                  task: Task | None = None, step: int = 0,
                  branch: BranchSpec | None = None) -> list[RolloutRequest]:
    """One request per prompt, `group` rows each with seeds seed + i*group + j; metadata[i]
    (handed to the scorers) and media[i] (condition media) per prompt when given; `task`
    (None = the family's first); `step`: the optimizer step sampled for (sliding windows);
    `branch`: every request a branch rollout (Tree GRPO), its rows the tree's leaves."""
    kind = sampler or settings.sampler
    out = []
    for i, bundle in enumerate(bundles):
        sampling = SamplingSpec(
            sampler=kind, num_steps=num_steps or settings.num_steps,
            noise_level=0.0 if kind in DETERMINISTIC else settings.noise_level,
            sde_window=None if kind in DETERMINISTIC else request_window(settings, seed, i, step),
            guidance_scale=settings.guidance_scale,
            flash_compress=None if kind in DETERMINISTIC else settings.flash_compress,
            seeds=tuple(seed + i * group + j for j in range(group)),
            **settings.media_shape(dict(adapter.spec.sampling_defaults)))
        out.append(RolloutRequest(prompt=bundle, sampling=sampling,
                                  task=task or next(iter(adapter.spec.tasks)),
                                  media=media[i] if media else None,
                                  requested_artifacts=None, policy_version=version,
                                  metadata=dict(metadata[i]) if metadata else {},
                                  branch=branch))
    return out


# ---- clean probe latents (time-convention check) -------------------------------------------
def _shapes_latents(family: ModelFamily, n: int, seed: int):
    from adapters.tiny_t2i import vae_encode
    from synthetic import shapes
    specs = shapes.sample_specs(n, seed, shapes.Split.EVAL)
    images = shapes.render_batch(specs)                                  # (n, 3, 32, 32) uint8
    with torch.no_grad():
        x0 = vae_encode(family.load_decoder("image_latent")["vae"], images)   # (n, 4, 8, 8)
    return x0, [shapes.caption(s) for s in specs]


def _clips_latents(family: ModelFamily, n: int, seed: int):
    import numpy as np
    from synthetic import clips
    specs = clips.sample_specs(n, seed + EVAL_SEED_OFFSET)
    rendered = [clips.render(s) for s in specs]
    video = torch.from_numpy(np.stack([r.video for r in rendered]))     # (n, T, 3, H, W) uint8
    audio = torch.from_numpy(np.stack([r.audio for r in rendered]))     # (n, 1, N) float
    with torch.no_grad():
        codec = family.codec
        v = codec.encode_video(family.load_decoder("video_latent")["video_vae"], video)
        a = codec.encode_audio(family.load_decoder("audio_latent")["audio_vae"], audio)
    return codec.pack(v, a), [clips.caption(s) for s in specs]


PROBE_LATENTS: dict[PromptSource, Callable] = {
    PromptSource.SHAPES: _shapes_latents,
    PromptSource.CLIPS: _clips_latents,
}


def probe_clean_latents(source: PromptSource, family: ModelFamily, n: int = 4,
                        seed: int = 123) -> tuple[torch.Tensor, list[PromptBundle]]:
    """(n, *S) clean sampler states of real synthetic media and their prompts' token ids."""
    x0, texts = PROBE_LATENTS[source](family, n, seed)
    return x0.float(), family.conditioner.tokenize(texts)

