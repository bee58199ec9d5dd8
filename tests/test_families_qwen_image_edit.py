"""Qwen-Image-Edit: the edit task of the Qwen-Image family on its tiny checkpoint
(QwenImageEditPipeline layout: Qwen-Image's components and a Qwen2VLProcessor) against
QwenImageEditPipeline (tests/family_conformance.py, task edit), plus what is particular to it:
the source image shown to Qwen2.5-VL (image-dependent ids, the edit template's 64 dropped
tokens), the source latents appended to the sequence, and the source size the pipeline would
resize to, required here."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from contract import (InvalidRequestError, LimitExceededError, MediaFormatError, MediaInput,
                      MediaRole, Modality, RequestLimits, RolloutRequest, SamplingSpec, Task)
from tests.family_conformance import NEGATIVE, PROMPTS, FamilyConformance

torch.set_num_threads(1)
SOURCE_SIZE = (1024, 1024)    # the size QwenImageEditPipeline resizes a square source to


def source_image(inverted: bool = False) -> torch.Tensor:
    """A seeded uint8 (3, H, W) picture with structure (stripes + noise), or its negative."""
    g = torch.Generator().manual_seed(3)
    h, w = SOURCE_SIZE
    stripes = (torch.arange(w)[None, :] // 64 % 2 * 160 + torch.arange(h)[:, None] // 16)
    noise = torch.randint(0, 60, (3, h, w), generator=g)
    image = (stripes[None] + noise).clamp(0, 255).to(torch.uint8)
    return 255 - image if inverted else image


class TestQwenImageEdit(FamilyConformance):
    family, checkpoint = "qwen_image", "qwen_image_edit"
    task = Task.EDIT
    options = {"max_sequence_length": 48}
    size = {"height": 64, "width": 96}
    other_sizes = ({"height": 128, "width": 128},)
    bad_size = {"height": 64, "width": 88}
    guidance_scale = 4.0
    negative = True
    steps = 2
    sigma_steps = (2, 3)     # 1 step: the scheduler's shift_terminal divides 0 by 0
    inverted = False

    # the components are tiny Qwen-Image's: tests/test_families_qwen_image.py::TestQwenImage
    # checks the task-independent parts on them (LoRA targets and file, stage loading); the
    # ids are checked with their vision tokens below. Edit Plus (its multi-image presentation)
    # is not served, so the class check over these components is not run.
    test_token_ids_are_the_tokenizers_and_reach_the_encoders = None
    test_every_pipeline_class_over_the_components_loads = None
    test_every_declared_lora_target_exists = None
    test_lora_file_round_trip_through_diffusers_loader = None
    test_each_stage_loads_only_its_components = None

    def request_media(self):
        return (MediaInput(Modality.IMAGE, MediaRole.IMAGE, source_image(self.inverted)),)

    def pipeline(self, root):
        from diffusers import QwenImageEditPipeline
        return QwenImageEditPipeline.from_pretrained(root, local_files_only=True)

    def pipeline_call(self, pipe, x0, output_type):
        from PIL import Image
        image = Image.fromarray(source_image(self.inverted).permute(1, 2, 0).numpy())
        # one prompt, a row per seed: with a list of prompts the pipeline's processor call
        # counts one <|image_pad|> per prompt against one image and raises
        return pipe(image=image, prompt=PROMPTS[0], negative_prompt=NEGATIVE,
                    num_images_per_prompt=x0.shape[0], true_cfg_scale=self.guidance_scale,
                    latents=x0,
                    num_inference_steps=self.steps, output_type=output_type, **self.size)

    def pipeline_sigmas(self, fam, scheduler, sampling):
        n = sampling.num_steps
        seq = fam.codec.state_shape(sampling)[0]
        scheduler.set_timesteps(sigmas=list(np.linspace(1.0, 1 / n, n)), mu=fam.schedule.mu(seq))
        return scheduler.sigmas.float()

    def test_the_folder_serves_the_edit_task(self, fam):
        assert dict(fam.spec.tasks) == {Task.EDIT: (MediaRole.IMAGE,)}
        assert fam.spec.media_encoders == ("vae",) and fam.drop == 64

    def test_presentation_ids_and_embeddings_are_the_pipelines(self, fam, encoders, pipe):
        """The ids with the source's vision tokens are the processor's; the embeddings are the
        pipeline's own encode_prompt rows (64 template tokens dropped, the vision block kept)."""
        from PIL import Image
        conditioner = fam.conditioner
        bundle = conditioner.tokenize([PROMPTS[1]])[0]
        image = source_image()
        vision = conditioner.vision_inputs(image)
        ours = conditioner.presentation_ids(bundle, vision["image_grid_thw"])
        pil = Image.fromarray(image.permute(1, 2, 0).numpy())
        theirs = pipe.processor(text=[fam.template.format(PROMPTS[1])], images=[pil],
                                padding=True, return_tensors="pt")
        assert ours == theirs["input_ids"][0].tolist()
        assert torch.equal(vision["pixel_values"], theirs["pixel_values"])
        cond = conditioner.encode_with_media(encoders, [bundle], [{MediaRole.IMAGE: image}])
        embeds, mask = pipe.encode_prompt(PROMPTS[1], image=pil, device="cpu")
        valid = int(cond["prompt_mask"][0].sum())
        assert valid == embeds.shape[1] == len(ours) - 64 and mask is None
        assert cond["prompt_embeds"].shape[1] == 48
        diff = float((cond["prompt_embeds"][0, :valid] - embeds[0].detach()).abs().max())
        print(f"qwen_image_edit prompt_embeds: max |ours - encode_prompt| = {diff:.3g}")
        assert diff <= 1e-6 and not cond["prompt_embeds"][0, valid:].any()

    def test_the_source_image_conditions_the_edit(self, fam, engine, encoders):
        sampling = self.sampling(seeds=(5,))
        edited = self.engine_latents(fam, engine, encoders, PROMPTS[1], sampling)
        self.inverted = True
        try:
            changed = self.engine_latents(fam, engine, encoders, PROMPTS[1], sampling)
        finally:
            self.inverted = False
        diff = float((edited["image_latent"] - changed["image_latent"]).abs().max())
        print(f"qwen_image_edit: source image inverted moves the latents by {diff:.3g}")
        assert diff > 1e-3, diff      # fp32 noise is ~1e-6

    def test_edit_bad_input_is_typed_and_names_the_field(self, fam, encoders):
        bundle = fam.conditioner.tokenize([PROMPTS[0]], [NEGATIVE])[0]
        sampling = SamplingSpec(seeds=(0,), num_steps=2, **self.size)
        with pytest.raises(InvalidRequestError) as err:        # an edit without its image
            fam.validate_request(RolloutRequest(prompt=bundle, sampling=sampling,
                                                task=Task.EDIT), RequestLimits())
        assert err.value.field == "media" and err.value.expected == ["image"]
        with pytest.raises(InvalidRequestError) as err:        # nor encoded without it
            fam.conditioner.encode(encoders, [bundle])
        assert err.value.field == "media"
        with pytest.raises(InvalidRequestError) as err:
            fam.conditioner.encode_with_media(encoders, [bundle], [{}])
        assert err.value.field == "media[0]"
        # a size the pipeline would resize: refused, naming the size it must have
        for shape, expected in (((3, 512, 512), "(3, 1024, 1024)"),
                                ((3, 64, 96), "(3, 832, 1248)")):
            image = torch.zeros(shape, dtype=torch.uint8)
            request = RolloutRequest(prompt=bundle, sampling=sampling, task=Task.EDIT, media=(
                MediaInput(Modality.IMAGE, MediaRole.IMAGE, image),))
            with pytest.raises(MediaFormatError) as err:       # refused before any work
                fam.validate_request(request, RequestLimits())
            assert err.value.field == "media.image" and err.value.expected == expected
            assert str(shape) in err.value.actual and err.value.request_id == request.request_id
        wide = torch.zeros(3, 832, 1248, dtype=torch.uint8)    # its own size, over the bound
        request = RolloutRequest(prompt=bundle, sampling=sampling, task=Task.EDIT, media=(
            MediaInput(Modality.IMAGE, MediaRole.IMAGE, wide),))
        with pytest.raises(LimitExceededError) as err:
            fam.validate_request(request, RequestLimits())
        assert err.value.field == "media.image" and err.value.actual == (3, 832, 1248)
        fam.validate_request(request, RequestLimits(max_width=1248))
        gray = torch.zeros(1, 1024, 1024, dtype=torch.uint8)   # a mode the family does not take
        request = RolloutRequest(prompt=bundle, sampling=sampling, task=Task.EDIT, media=(
            MediaInput(Modality.IMAGE, MediaRole.IMAGE, gray),))
        with pytest.raises(InvalidRequestError) as err:
            fam.validate_request(request, RequestLimits())
        assert err.value.field.startswith("media")

    def test_an_edit_trains_a_flow_grpo_step_scored_by_clip_directional(self, fam, engine,
                                                                       learner, tmp_path):
        """Through the pieces the graph chains: guided edit rollouts (source image shown to
        the conditioner and VAE-encoded by the rollout), decoded and scored by clip_directional
        reading each sample's source as the ingress hands it, then one FlowGRPO step whose
        learner re-encodes prompt and source: log-probs at parity, the adapter moves."""
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
            "samples_per_prompt": 2, "lora": {"rank": 4, "alpha": 4},
            "sampler": {"sampler": "sde", "num_steps": 2, "noise_level": 0.7,
                        "guidance_scale": self.guidance_scale, **self.size},
            "flow_grpo": {"clip_range": 0.2, "old_log_probs": "recompute"}})
        scorer = build_scorer(ScorerSpec(kind=ScorerKind.CLIP_DIRECTIONAL, params={
            "model": write_clip_dir(tmp_path / "clip")}))
        sources = (source_image(), source_image(inverted=True))
        captions = ("grey stripes", "grey stripes, inverted")
        bundles = fam.conditioner.tokenize(["make the stripes red", "add a blue circle"],
                                           [" ", " "])
        media = [(MediaInput(Modality.IMAGE, MediaRole.IMAGE, s),) for s in sources]
        tensors, scale = learner.export()
        engine.load_lora("edit-v0", tensors, scale)
        requests = make_requests(fam, bundles, cfg.sampler, 2, 0, "edit-v0", media=media,
                                 task=Task.EDIT)
        canonical = [fam.validate_request(r, RequestLimits()) for r in requests]

        async def generate():
            return [await engine.generate(EngineRequest(r, learner.encode([b], [m]),
                                                        learner.uncond([b], [m]),
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
                         for _ in range(2))
            scored = scorer.score(ScoreRequest({"image": MediaArtifact(image, pixels)},
                                               (request.prompt.text,) * 2, meta))
            outputs.append(RolloutOutput(request.request_id, dict(result.latents),
                                         result.trajectory, result.policy_version,
                                         request.sampling.seeds, rewards=RewardReport(
                                             {}, tuple(scored.scores[scorer.primary]), {})))
        batch = build_batch(learner, bundles, outputs, [r.sampling for r in requests],
                            canonical)
        assert batch.uncond is not None
        parity = checks.logprob_mismatch(learner, batch.trajectory, batch.cond,
                                         {"edit-v0": tensors}.__getitem__, batch.versions, 1e-4,
                                         batch.uncond, batch.inputs)
        assert parity["logprob_ratio_err_max"] <= 1e-4
        before = [p.detach().clone() for p in learner.params]
        metrics = UPDATES[Algorithm.FLOW_GRPO](learner, batch, cfg,
                                               torch.Generator().manual_seed(0))
        assert torch.isfinite(torch.tensor(metrics["loss"]))
        assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))


@pytest.mark.timeout(900)
def test_a_guided_edit_over_http_through_the_graph(ray_cluster, tiny_checkpoint):
    """The deployed graph of the tiny Qwen-Image-Edit checkpoint: an edit with a negative
    prompt and CFG 4 over HTTP (the encoder stage shows the source to the conditioner for the
    prompt and for its negative), and a source at a size the pipeline would resize refused
    with a 400 naming it (integration tier: Ray)."""
    import base64
    import io

    import httpx
    from PIL import Image
    from ray import serve

    from graph import build_app, delete_graph

    def png(image: torch.Tensor) -> str:
        out = io.BytesIO()
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(out, format="PNG")
        return base64.b64encode(out.getvalue()).decode()

    config = {"app_name": "fam_qwen_image_edit",
              "rollout": {"adapter": "qwen_image",
                          "weights_path": str(tiny_checkpoint("qwen_image_edit")),
                          "adapter_options": {"max_sequence_length": 48}},
              "rollout_stage": {"num_cpus": 0.5},
              "scorers": [{"name": "image_attributes", "scorer": {"kind": "image_attributes"},
                           "inputs": ["image"], "reward": {"policy": "required"}}],
              "limits": {"max_prompts": 2, "max_samples_per_prompt": 2, "max_steps": 4,
                         "max_frames": 1, "max_body_bytes": 8 << 20},   # a ~1 MP noisy PNG
              "policy_store": "fam_qwen_image_edit_store"}
    serve.run(build_app(config), name=config["app_name"], route_prefix="/qwen_image_edit")
    url = f"http://127.0.0.1:{ray_cluster['http_port']}/qwen_image_edit/rollout"
    body = {"prompts": ["a red circle at the top left on a black background"],
            "negative_prompts": [" "], "task": "edit",
            "images": [png(source_image())], "samples_per_prompt": 2, "seed": 3,
            "num_steps": 2, "sampler": "ode", "noise_level": 0.0, "guidance_scale": 4.0,
            "height": 64, "width": 96}
    try:
        reply = httpx.post(url, json=body, timeout=600)
        assert reply.status_code == 200, reply.text
        [result] = reply.json()["results"]
        for sample in result["samples"]:
            assert {a["name"]: a["shape"] for a in sample["artifacts"]}["image"] == [3, 64, 96]
        small = torch.zeros(3, 512, 512, dtype=torch.uint8)
        bad = httpx.post(url, json=body | {"images": [png(small)]}, timeout=120)
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["field"].startswith("images") or error["field"].startswith("media"), error
        assert "1024" in str(error["expected"])
    finally:
        delete_graph(config)


@pytest.mark.timeout(600)
def test_sharded_encoder_with_the_source_image_equals_unsharded(ray_cluster, tiny_checkpoint):
    """The edit's presentation (prompt + the source's vision block) through the TextEncoder
    deployment at etp 2 (Qwen2.5-VL's language model split over 2 gloo workers, the vision
    tower replicated) equals the unsharded conditioner's (integration tier: Ray)."""
    from ray import serve

    from adapters.registry import get_family
    from deployments.encoder import TextEncoderServer, load_encoders

    root = str(tiny_checkpoint("qwen_image_edit"))
    options = {"max_sequence_length": 48}
    family = get_family("qwen_image", root, options)
    prompts = family.conditioner.tokenize([PROMPTS[0], PROMPTS[1]])
    media = [{MediaRole.IMAGE: source_image()}, {MediaRole.IMAGE: source_image(inverted=True)}]
    ref = family.conditioner.encode_with_media(load_encoders(family), prompts, media)
    etp, cpus = 2, 0.25
    opts = {"name": "TextEncoder", "ray_actor_options": {"num_cpus": cpus},
            "graceful_shutdown_wait_loop_s": 0.0, "graceful_shutdown_timeout_s": 2.0,
            **TextEncoderServer.deployment_options(etp, cpus, cpus)}
    handle = serve.run(serve.deployment(TextEncoderServer, **opts).bind(
        "qwen_image", root, etp, "cpu", "float32", options), name="etp_qwen_edit",
        route_prefix=None)
    try:
        cond = handle.encode.remote(prompts, media).result(timeout_s=300)
        diff = float((cond["prompt_embeds"] - ref["prompt_embeds"]).abs().max())
        print(f"Qwen2.5-VL edit etp=2: max |sharded - unsharded| = {diff:.3g}")
        assert cond["prompt_embeds"].shape == ref["prompt_embeds"].shape == (2, 48, 32)
        assert diff <= 1e-5 and torch.equal(cond["prompt_mask"], ref["prompt_mask"])
    finally:
        serve.delete("etp_qwen_edit")
