"""The checks every edit family (task edit: source image(s) + an instruction -> an image) passes
on top of the conformance mixin (tests/family_conformance.py).

A family's edit test module subclasses `EditConformance`, says what its source images are
(`source_image`, or `source_media` for several) and how the pipeline is called with them; the
mixin then requests the edit with those sources and checks, on the real embedded engine:
  - the source conditions the edit: the same prompt and seed with the inverted source (255 - x)
    moves the latents,
  - an edit without its source image, or with a source of a mode the family does not take
    (one channel), is refused with typed errors naming the field (`check_edit_needs_an_rgb_source`,
    called from the family's own bad-input test beside its own size rules),
  - an edit trains: rollouts of two prompts (each with its source, the second inverted) under
    the learner's adapter, decoded and scored by clip_directional reading each sample's source
    as the ingress hands it, then one FlowGRPO step whose learner re-encodes prompt and source:
    log-probs at parity (<= 1e-4), the adapter moves.
"""
from __future__ import annotations

import pytest
import torch

from contract import (InvalidRequestError, MediaInput, MediaRole, Modality, RequestLimits,
                      RolloutRequest, SamplingSpec, Task)
from diffusion.step import doubles_rows
from tests.family_conformance import PROMPTS, FamilyConformance

SOURCE_CAPTIONS = ("grey stripes", "grey stripes, inverted")   # the trained edits' sources


def striped_image(size: tuple[int, int], stripe: int, rise: float, seed: int = 3,
                  inverted: bool = False) -> torch.Tensor:
    """A seeded uint8 (3, H, W) picture with structure: vertical stripes `stripe` pixels wide
    (0 / 160), a vertical ramp of `rise` levels per row and uniform noise in [0, 60); its
    negative (255 - x) when `inverted`."""
    g = torch.Generator().manual_seed(seed)
    h, w = size
    stripes = (torch.arange(w)[None, :] // stripe % 2 * 160
               + (torch.arange(h)[:, None] * rise).long())
    noise = torch.randint(0, 60, (3, h, w), generator=g)
    image = (stripes[None] + noise).clamp(0, 255).to(torch.uint8)
    return 255 - image if inverted else image


def pil(image: torch.Tensor):
    """A uint8 (3, H, W) tensor as the PIL image a diffusers pipeline takes."""
    from PIL import Image
    return Image.fromarray(image.permute(1, 2, 0).numpy())


def edit_request(bundle, sampling: SamplingSpec, *images: torch.Tensor) -> RolloutRequest:
    """An edit request showing `images` in role order (image, image_2, ...)."""
    roles = (MediaRole.IMAGE, MediaRole.IMAGE_2, MediaRole.IMAGE_3)
    return RolloutRequest(prompt=bundle, sampling=sampling, task=Task.EDIT, media=tuple(
        MediaInput(Modality.IMAGE, role, image) for role, image in zip(roles, images)))


class EditConformance(FamilyConformance):
    task = Task.EDIT
    samples_per_prompt: int = 2       # rows per prompt of the trained edit
    inverted: bool = False            # the conformance requests show the inverted source(s)

    # ---- per family -------------------------------------------------------------------------
    def source_image(self, inverted: bool = False) -> torch.Tensor:
        """The source image of the family's edit requests (uint8 (3, H, W)), or its negative."""
        raise NotImplementedError

    def source_media(self, inverted: bool = False) -> tuple[MediaInput, ...]:
        """The condition media of an edit request: its source image(s), or their negatives."""
        return (MediaInput(Modality.IMAGE, MediaRole.IMAGE, self.source_image(inverted)),)

    def request_media(self):
        return self.source_media(self.inverted)

    # ---- checks -------------------------------------------------------------------------------
    def check_edit_needs_an_rgb_source(self, fam, bundle, gray_size: tuple[int, int]) -> None:
        """An edit without its image, and one with a one-channel source of `gray_size` (a size
        the family otherwise takes), are refused naming the media field."""
        sampling = SamplingSpec(seeds=(0,), num_steps=2, **self.size)
        with pytest.raises(InvalidRequestError) as err:
            fam.validate_request(RolloutRequest(prompt=bundle, sampling=sampling,
                                                task=Task.EDIT), RequestLimits())
        assert err.value.field == "media" and err.value.expected == ["image"]
        gray = torch.zeros(1, *gray_size, dtype=torch.uint8)
        with pytest.raises(InvalidRequestError) as err:
            fam.validate_request(edit_request(bundle, sampling, gray), RequestLimits())
        assert err.value.field.startswith("media")

    def test_the_source_image_conditions_the_edit(self, fam, engine, encoders):
        sampling = self.sampling(seeds=(5,))
        edited = self.engine_latents(fam, engine, encoders, PROMPTS[1], sampling)
        self.inverted = True
        try:
            changed = self.engine_latents(fam, engine, encoders, PROMPTS[1], sampling)
        finally:
            self.inverted = False
        diff = float((edited["image_latent"] - changed["image_latent"]).abs().max())
        print(f"{self.checkpoint}: the inverted source moves the latents by {diff:.3g}")
        assert diff > 1e-3, diff      # fp32 noise is ~1e-6

    def test_an_edit_trains_a_flow_grpo_step_scored_by_clip_directional(self, fam, engine,
                                                                       learner, tmp_path):
        """Through the pieces the graph chains: edit rollouts (the source shown to the
        conditioner where it reads it, VAE-encoded by the rollout; guided where the family's
        rule doubles the rows), decoded and scored by clip_directional reading each sample's
        source as the ingress hands it (metadata under the role name), then one FlowGRPO step
        whose learner re-encodes prompt and source: log-probs at parity, the adapter moves."""
        import asyncio

        from contract import Algorithm, MediaArtifact, RewardReport, RolloutOutput
        from rewards.base import ScoreRequest
        from rewards.registry import ScorerKind, ScorerSpec, build_scorer
        from rollout.engine_api import EngineRequest
        from testing.snapshots import write_clip_dir
        from trainer import checks
        from trainer.config import load_trainer_config
        from trainer.prompts import make_requests
        from trainer.rollout_batch import build_batch
        from trainer.updates import UPDATES

        rows = self.samples_per_prompt
        cfg = load_trainer_config({
            "algorithm": "flow_grpo", "task": "edit", "prompts_per_step": 2,
            "samples_per_prompt": rows, "lora": {"rank": 4, "alpha": 4},
            "sampler": {"sampler": "sde", "num_steps": self.steps, "noise_level": 0.7,
                        "guidance_scale": self.guidance_scale, **self.size},
            "flow_grpo": {"clip_range": 0.2, "old_log_probs": "recompute"}})
        scorer = build_scorer(ScorerSpec(kind=ScorerKind.CLIP_DIRECTIONAL, params={
            "model": write_clip_dir(tmp_path / "clip")}))
        bundles = fam.conditioner.tokenize(["make the stripes red", "add a blue circle"],
                                           [" ", " "] if self.negative else None)
        media = [self.source_media(), self.source_media(inverted=True)]
        guided = doubles_rows(fam.spec.guidance, self.guidance_scale)
        tensors, scale = learner.export()
        engine.load_lora("edit-v0", tensors, scale)
        requests = make_requests(fam, bundles, cfg.sampler, rows, 0, "edit-v0", media=media,
                                 task=Task.EDIT)
        canonical = [fam.validate_request(r, RequestLimits()) for r in requests]

        async def generate():
            return [await engine.generate(EngineRequest(
                r, learner.encode([b], [m]), learner.uncond([b], [m]) if guided else None,
                ("image_latent",), m, "edit-v0")) for r, b, m in zip(requests, bundles, canonical)]
        results = asyncio.run(generate())
        decoder = fam.load_decoder("image_latent")
        image = next(a for a in fam.io_spec.artifacts if a.name == "image")
        outputs = []
        for request, result, m, caption in zip(requests, results, canonical, SOURCE_CAPTIONS):
            pixels = fam.codec.decode("image_latent", decoder,
                                      result.latents["image_latent"].data, request.sampling)
            meta = tuple({MediaRole.IMAGE.value: m[MediaRole.IMAGE], "source_caption": caption}
                         for _ in range(rows))
            scored = scorer.score(ScoreRequest({"image": MediaArtifact(image, pixels)},
                                               (request.prompt.text,) * rows, meta))
            outputs.append(RolloutOutput(request.request_id, dict(result.latents),
                                         result.trajectory, result.policy_version,
                                         request.sampling.seeds, rewards=RewardReport(
                                             {}, tuple(scored.scores[scorer.primary]), {})))
        batch = build_batch(learner, bundles, outputs, [r.sampling for r in requests],
                            canonical)
        assert (batch.uncond is not None) == guided
        parity = checks.logprob_mismatch(learner, batch.trajectory, batch.cond,
                                         {"edit-v0": tensors}.__getitem__, batch.versions, 1e-4,
                                         batch.uncond, batch.inputs)
        assert parity["logprob_ratio_err_max"] <= 1e-4
        before = [p.detach().clone() for p in learner.params]
        metrics = UPDATES[Algorithm.FLOW_GRPO](learner, batch, cfg,
                                               torch.Generator().manual_seed(0))
        assert torch.isfinite(torch.tensor(metrics["loss"]))
        assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))
