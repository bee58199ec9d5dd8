"""The edit task (a source image + an instruction -> an image) on FLUX.1 Kontext: the tiny FLUX
checkpoint saved as FluxKontextPipeline (the same components) against FluxKontextPipeline
(tests/family_conformance.py, task edit), plus the edit's own bad input."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from contract import (InvalidRequestError, LimitExceededError, MediaFormatError, MediaInput,
                      MediaRole, Modality, RequestLimits, RolloutRequest, SamplingSpec, Task)
from tests.family_conformance import PROMPTS, FamilyConformance

torch.set_num_threads(1)
SOURCE_SIZE = (48, 80)             # the source image's H, W: another size than the output's


def source_image() -> torch.Tensor:
    """A seeded uint8 (3, H, W) picture with structure (stripes + noise)."""
    g = torch.Generator().manual_seed(3)
    h, w = SOURCE_SIZE
    stripes = (torch.arange(w)[None, :] // 8 % 2 * 160 + torch.arange(h)[:, None] * 2)
    noise = torch.randint(0, 60, (3, h, w), generator=g)
    return (stripes[None] + noise).clamp(0, 255).to(torch.uint8)


class TestFluxKontext(FamilyConformance):
    family, checkpoint = "flux", "flux"
    task = Task.EDIT
    options = {"max_sequence_length": 48}
    size = {"height": 64, "width": 96}
    other_sizes = ({"height": 128, "width": 128},)
    bad_size = {"height": 64, "width": 88}
    guidance_scale = 2.5
    steps = 3
    sigma_steps = (1, 3)

    # the components are tiny FLUX's, checked by tests/test_families_image.py::TestFlux: the
    # checks that do not depend on the task are not repeated here
    test_sigmas_equal_the_pipeline_scheduler = None
    test_token_ids_are_the_tokenizers_and_reach_the_encoders = None
    test_bad_sizes_paths_and_dtypes_are_typed_errors = None
    test_every_pipeline_class_over_the_components_loads = None
    test_every_declared_lora_target_exists = None
    test_lora_file_round_trip_through_diffusers_loader = None

    @pytest.fixture(scope="class")
    def root(self, tiny_checkpoint, tmp_path_factory):
        """The tiny FLUX components saved by FluxKontextPipeline (model_index names it)."""
        folder = tmp_path_factory.mktemp("kontext") / "flux_kontext"
        shutil.copytree(tiny_checkpoint("flux"), folder)
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps(
            index | {"_class_name": "FluxKontextPipeline"}))
        return folder

    def request_media(self):
        return (MediaInput(Modality.IMAGE, MediaRole.IMAGE, source_image()),)

    def pipeline(self, root):
        from diffusers import FluxKontextPipeline
        return FluxKontextPipeline.from_pretrained(root, local_files_only=True)

    def pipeline_call(self, pipe, x0, output_type):
        from PIL import Image
        image = Image.fromarray(source_image().permute(1, 2, 0).numpy())
        return pipe(image=image, prompt=[PROMPTS[0]] * x0.shape[0], latents=x0,
                    num_inference_steps=self.steps, guidance_scale=self.guidance_scale,
                    output_type=output_type, max_sequence_length=48, _auto_resize=False,
                    max_area=self.size["height"] * self.size["width"], **self.size)

    def pipeline_sigmas(self, fam, scheduler, sampling):
        n = sampling.num_steps
        seq = fam.codec.state_shape(sampling)[0]
        scheduler.set_timesteps(sigmas=list(np.linspace(1.0, 1 / n, n)), mu=fam.schedule.mu(seq))
        return scheduler.sigmas.float()

    def test_the_source_image_conditions_the_edit(self, fam, engine, encoders):
        sampling = self.sampling(seeds=(5,))
        edited = self.engine_latents(fam, engine, encoders, PROMPTS[1], sampling)
        other = self.request_media

        def flipped():
            return (MediaInput(Modality.IMAGE, MediaRole.IMAGE, source_image().flip(-1)),)
        self.request_media = flipped
        try:
            changed = self.engine_latents(fam, engine, encoders, PROMPTS[1], sampling)
        finally:
            self.request_media = other
        diff = float((edited["image_latent"] - changed["image_latent"]).abs().max())
        assert diff > 1e-3, diff

    def test_edit_bad_input_is_typed_and_names_the_field(self, fam):
        bundle = fam.conditioner.tokenize([PROMPTS[0]])[0]
        sampling = SamplingSpec(seeds=(0,), num_steps=2, **self.size)
        with pytest.raises(InvalidRequestError) as err:        # an edit without its image
            fam.validate_request(RolloutRequest(prompt=bundle, sampling=sampling,
                                                task=Task.EDIT), RequestLimits())
        assert err.value.field == "media" and err.value.expected == ["image"]
        odd = torch.zeros(3, 40, 88, dtype=torch.uint8)       # not multiples of 16
        request = RolloutRequest(prompt=bundle, sampling=sampling, task=Task.EDIT, media=(
            MediaInput(Modality.IMAGE, MediaRole.IMAGE, odd),))
        with pytest.raises(MediaFormatError) as err:          # refused before any work
            fam.validate_request(request, RequestLimits())
        assert err.value.field == "media.image" and "(3, 40, 88)" in err.value.actual
        assert err.value.request_id == request.request_id
        big = torch.zeros(3, 64, 2048, dtype=torch.uint8)
        request = RolloutRequest(prompt=bundle, sampling=sampling, task=Task.EDIT, media=(
            MediaInput(Modality.IMAGE, MediaRole.IMAGE, big),))
        with pytest.raises(LimitExceededError) as err:
            fam.validate_request(request, RequestLimits())
        assert err.value.field == "media.image" and err.value.actual == (3, 64, 2048)
        gray = torch.zeros(1, 64, 96, dtype=torch.uint8)      # a mode the family does not take
        request = RolloutRequest(prompt=bundle, sampling=sampling, task=Task.EDIT, media=(
            MediaInput(Modality.IMAGE, MediaRole.IMAGE, gray),))
        with pytest.raises(InvalidRequestError) as err:
            fam.validate_request(request, RequestLimits())
        assert err.value.field.startswith("media")

    def test_an_edit_trains_a_flow_grpo_step_scored_by_clip_directional(self, fam, engine,
                                                                       learner, tmp_path):
        """Through the pieces the graph chains: edit rollouts (source image encoded by the
        rollout's VAE), decoded and scored by clip_directional reading each sample's source
        image as the ingress hands it (metadata under the role name), then one FlowGRPO step
        whose learner re-encodes the same source: log-probs at parity, the adapter moves."""
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

        cfg = load_trainer_config({
            "algorithm": "flow_grpo", "task": "edit", "prompts_per_step": 2,
            "samples_per_prompt": 4, "lora": {"rank": 4, "alpha": 4},
            "sampler": {"sampler": "sde", "num_steps": 3, "noise_level": 0.7,
                        "guidance_scale": self.guidance_scale, **self.size},
            "flow_grpo": {"clip_range": 0.2, "old_log_probs": "recompute"}})
        scorer = build_scorer(ScorerSpec(kind=ScorerKind.CLIP_DIRECTIONAL, params={
            "model": write_clip_dir(tmp_path / "clip")}))
        sources = (source_image(), source_image().flip(-1))
        captions = ("grey stripes", "grey stripes, mirrored")
        bundles = fam.conditioner.tokenize(["make the stripes red", "add a blue circle"])
        media = [(MediaInput(Modality.IMAGE, MediaRole.IMAGE, s),) for s in sources]
        tensors, scale = learner.export()
        engine.load_lora("edit-v0", tensors, scale)
        requests = make_requests(fam, bundles, cfg.sampler, 4, 0, "edit-v0", media=media,
                                 task=Task.EDIT)
        canonical = [fam.validate_request(r, RequestLimits()) for r in requests]

        async def generate():
            return [await engine.generate(EngineRequest(r, learner.encode([b]), None,
                                                        ("image_latent",), m, "edit-v0"))
                    for r, b, m in zip(requests, bundles, canonical)]
        results = asyncio.run(generate())
        decoder = fam.load_decoder("image_latent")
        image = next(a for a in fam.io_spec.artifacts if a.name == "image")
        outputs = []
        for request, result, m, caption in zip(requests, results, canonical, captions):
            pixels = fam.codec.decode("image_latent", decoder,
                                      result.latents["image_latent"].data, request.sampling)
            meta = tuple({MediaRole.IMAGE.value: m[MediaRole.IMAGE], "source_caption": caption}
                         for _ in range(4))
            scored = scorer.score(ScoreRequest({"image": MediaArtifact(image, pixels)},
                                               (request.prompt.text,) * 4, meta))
            outputs.append(RolloutOutput(request.request_id, dict(result.latents),
                                         result.trajectory, result.policy_version,
                                         request.sampling.seeds, rewards=RewardReport(
                                             {}, tuple(scored.scores[scorer.primary]), {})))
        batch = build_batch(learner, bundles, outputs, [r.sampling for r in requests],
                            canonical)
        parity = checks.logprob_mismatch(learner, batch.trajectory, batch.cond,
                                         {"edit-v0": tensors}.__getitem__, batch.versions, 1e-4,
                                         batch.uncond, batch.inputs)
        assert parity["logprob_ratio_err_max"] <= 1e-4
        before = [p.detach().clone() for p in learner.params]
        metrics = UPDATES[Algorithm.FLOW_GRPO](learner, batch, cfg,
                                               torch.Generator().manual_seed(0))
        assert torch.isfinite(torch.tensor(metrics["loss"]))
        assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))
