"""Qwen-Image-Edit-Plus: the multi-image edit of the Qwen-Image family on its tiny checkpoint
(Qwen-Image-Edit's tiny components saved by QwenImageEditPlusPipeline) against
QwenImageEditPlusPipeline (tests/family_conformance.py, task edit, two source images), plus
what is particular to it: one "Picture i: " vision block per source image before the prompt,
each source shown to Qwen2.5-VL at the pipeline's condition size (about 384 x 384 pixels), the
sources' VAE latents concatenated in order with one img_shapes entry each, and 1 source image
as well as 2. Guidance is Qwen-Image's true CFG with norm rescaling (NORM_RESCALED_CFG:
pipeline_qwenimage_edit_plus.py:841-845, run when true_cfg_scale > 1 and a negative prompt is
given, :719)."""
from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch

from contract import (InvalidRequestError, LimitExceededError, MediaFormatError, MediaInput,
                      MediaRole, Modality, RequestLimits, RolloutRequest, SamplingSpec, Task)
from tests import family_conformance
from tests.family_conformance import GUIDANCE_PROBES, NEGATIVE, PROMPTS, FamilyConformance

torch.set_num_threads(1)
# two sources at the sizes QwenImageEditPlusPipeline resizes them to for its VAE (about
# 1024 x 1024 pixels at their aspect ratios): square, and 3:2 landscape
SOURCE_SIZES = ((1024, 1024), (832, 1248))
ROLES = (MediaRole.IMAGE, MediaRole.IMAGE_2, MediaRole.IMAGE_3)
# a non-square source's long side passes 1024: the graph's limits must admit it
WIDE_LIMITS = functools.partial(RequestLimits, max_height=1280, max_width=1280)


def source_image(index: int, size: tuple[int, int] | None = None) -> torch.Tensor:
    """A seeded uint8 (3, H, W) picture with structure (stripes + noise), one per index."""
    g = torch.Generator().manual_seed(11 + index)
    h, w = size or SOURCE_SIZES[index % len(SOURCE_SIZES)]
    period = 32 * (index + 1)
    stripes = (torch.arange(w)[None, :] // period % 2 * 150 + torch.arange(h)[:, None] // 16)
    noise = torch.randint(0, 70, (3, h, w), generator=g)
    return (stripes[None] + noise + 20 * index).clamp(0, 255).to(torch.uint8)


def pil(image: torch.Tensor):
    from PIL import Image
    return Image.fromarray(image.permute(1, 2, 0).numpy())


class TestQwenImageEditPlus(FamilyConformance):
    family, checkpoint = "qwen_image", "qwen_image_edit_plus"
    task = Task.EDIT
    options = {"max_sequence_length": 80}
    size = {"height": 64, "width": 96}
    other_sizes = ({"height": 128, "width": 128},)
    bad_size = {"height": 64, "width": 88}
    guidance_scale = 4.0
    negative = True
    steps = 2
    sigma_steps = (2, 3)     # 1 step: the scheduler's shift_terminal divides 0 by 0
    count = 2                # source images of the conformance requests

    # The components are tiny Qwen-Image-Edit's: tests/test_families_qwen_image.py checks the
    # task-independent stage loading on them; the ids are checked with their vision blocks
    # below. QwenImageEditInpaintPipeline and QwenImageLayeredPipeline take these components too
    # and are not served, so the class check over them is not run.
    test_token_ids_are_the_tokenizers_and_reach_the_encoders = None
    test_every_pipeline_class_over_the_components_loads = None
    test_each_stage_loads_only_its_components = None

    @pytest.fixture(autouse=True)
    def wide_limits(self, monkeypatch):
        """The conformance checks validate their requests under limits that admit the 3:2
        source (1248 wide)."""
        monkeypatch.setattr(family_conformance, "RequestLimits", WIDE_LIMITS)

    def sources(self) -> list[torch.Tensor]:
        return [source_image(i) for i in range(self.count)]

    def sampling(self, seeds=(0,), **size) -> SamplingSpec:
        """One row: each forward carries the two ~1 MP sources' 8152 tokens."""
        return super().sampling(seeds, **size)

    # Each forward here attends over the sources' ~8k tokens, so what the default tier's
    # two-source parity (guided, the norm-rescaled form) and the fast checks below already
    # show runs in the integration tier: the guidance probes (Qwen-Image's one rule, shared
    # with the t2i and Edit tests), the parity with one source (its presentation is checked
    # fast below; its latents take Edit's path), the LoRA file through diffusers' loader and
    # the engine-vs-learner log-prob parity with both sources.
    @pytest.mark.integration
    @pytest.mark.parametrize("scale", GUIDANCE_PROBES)
    def test_guidance_rule_is_the_pipelines(self, fam, root, engine, encoders, pipe, scale):
        super().test_guidance_rule_is_the_pipelines(fam, root, engine, encoders, pipe, scale)

    @pytest.mark.integration
    def test_lora_file_round_trip_through_diffusers_loader(self, fam, learner, probe, tmp_path):
        super().test_lora_file_round_trip_through_diffusers_loader(fam, learner, probe,
                                                                   tmp_path)

    @pytest.mark.integration
    def test_engine_and_learner_sde_log_probs_agree(self, fam, learner, probe):
        super().test_engine_and_learner_sde_log_probs_agree(fam, learner, probe)

    def request_media(self):
        return tuple(MediaInput(Modality.IMAGE, role, image)
                     for role, image in zip(ROLES, self.sources()))

    def pipeline(self, root):
        from diffusers import QwenImageEditPlusPipeline
        return QwenImageEditPlusPipeline.from_pretrained(root, local_files_only=True)

    def pipeline_call(self, pipe, x0, output_type):
        """One pipeline call gives both results the parity compares: its decoded images, and
        its final latents as its step-end callback sees them after the last step (what
        output_type="latent" returns); a following "np" call with the same x0 gets that call's
        images instead of denoising the ~8k-token sequence again."""
        from types import SimpleNamespace
        stash = getattr(self, "_stash", None)
        if output_type == "np" and stash is not None and torch.equal(stash[0], x0) and \
                stash[1] == (self.count, self.guidance_scale):
            return stash[2]
        final = {}

        def keep(_pipe, step, timestep, tensors):
            final["latents"] = tensors["latents"].clone()
            return {}
        # one prompt, a row per seed (the pipeline takes one prompt per call)
        result = pipe(image=[pil(s) for s in self.sources()], prompt=PROMPTS[0],
                      negative_prompt=NEGATIVE, num_images_per_prompt=x0.shape[0],
                      true_cfg_scale=self.guidance_scale, latents=x0.clone(),
                      num_inference_steps=self.steps, output_type="np", **self.size,
                      callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"])
        if output_type == "np":
            return result
        self._stash = (x0.clone(), (self.count, self.guidance_scale), result)
        return SimpleNamespace(images=final["latents"])

    def pipeline_sigmas(self, fam, scheduler, sampling):
        n = sampling.num_steps
        seq = fam.codec.state_shape(sampling)[0]
        scheduler.set_timesteps(sigmas=list(np.linspace(1.0, 1 / n, n)), mu=fam.schedule.mu(seq))
        return scheduler.sigmas.float()

    def test_the_folder_serves_the_multi_image_edit(self, fam, tiny_checkpoint):
        from adapters.registry import get_family
        from diffusion.guidance import NORM_RESCALED_CFG
        assert fam.pipeline_class == "QwenImageEditPlusPipeline" and fam.edit_plus
        assert dict(fam.spec.tasks) == {Task.EDIT: (MediaRole.IMAGE,)}
        assert dict(fam.spec.optional_media) == {Task.EDIT: ROLES[1:]}
        assert fam.conditioner.media_roles == ROLES and fam.codec.source_roles == ROLES
        assert fam.drop == 64 and "<|vision_start|>" not in fam.template
        assert fam.denoiser.guidance_form is NORM_RESCALED_CFG
        # the same components saved by QwenImageEditPipeline: one source, in its template
        edit = get_family("auto", tiny_checkpoint("qwen_image_edit"), self.options)
        assert not edit.edit_plus and dict(edit.spec.optional_media) == {}
        assert edit.codec.source_roles == (MediaRole.IMAGE,)

    @pytest.mark.parametrize("count", [1, 2])
    def test_presentation_ids_and_embeddings_are_the_pipelines(self, fam, encoders, pipe, count):
        """The ids with a "Picture i" block per source are the processor's on the pipeline's
        own text, the vision inputs its processor's on the pipeline's condition-size resize of
        each source; the embeddings are the pipeline's encode_prompt rows."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus
        conditioner = fam.conditioner
        bundle = conditioner.tokenize([PROMPTS[1]])[0]
        images = [source_image(i) for i in range(count)]
        shown = []                          # the pipeline's own condition images (:699-705)
        for image in images:
            w, h = plus.calculate_dimensions(plus.CONDITION_IMAGE_SIZE,
                                             image.shape[2] / image.shape[1])
            shown.append(pipe.image_processor.resize(pil(image), h, w))
        vision = conditioner.vision_inputs(images)
        ours = conditioner.presentation_ids(bundle, vision["image_grid_thw"])
        blocks = "".join(f"Picture {i + 1}: <|vision_start|><|image_pad|><|vision_end|>"
                         for i in range(count))
        theirs = pipe.processor(text=[pipe.prompt_template_encode.format(blocks + PROMPTS[1])],
                                images=shown, padding=True, return_tensors="pt")
        assert ours == theirs["input_ids"][0].tolist()
        assert torch.equal(vision["pixel_values"], theirs["pixel_values"])
        assert torch.equal(vision["image_grid_thw"], theirs["image_grid_thw"])
        item = dict(zip(ROLES, images))
        cond = conditioner.encode_with_media(encoders, [bundle], [item])
        embeds, mask = pipe.encode_prompt(PROMPTS[1], image=shown, device="cpu")
        valid = int(cond["prompt_mask"][0].sum())
        assert valid == embeds.shape[1] == len(ours) - 64 and mask is None
        assert cond["prompt_embeds"].shape[1] == 80
        diff = float((cond["prompt_embeds"][0, :valid] - embeds[0].detach()).abs().max())
        print(f"qwen_image_edit_plus {count} source(s) prompt_embeds: max |ours - encode_prompt|"
              f" = {diff:.3g}")
        assert diff <= 1e-6 and not cond["prompt_embeds"][0, valid:].any()

    @pytest.mark.integration
    def test_one_source_image_latents_and_media_equal_the_pipeline(self, fam, root, engine,
                                                                   encoders):
        """The conformance parity (same initial latents and sigmas, guided) with one source."""
        case = copy.copy(self)
        case.count = 1
        case.test_ode_latents_and_media_equal_the_pipeline(fam, root, engine, encoders)

    def test_source_order_reaches_the_condition(self, fam, encoders):
        """Swapping the two sources changes the embeddings: their order is the request's (the
        latents' order against the pipeline's: the two-source parity above)."""
        bundle = fam.conditioner.tokenize([PROMPTS[0]])[0]
        a, b = source_image(0), source_image(1)
        c1 = fam.conditioner.encode_with_media(encoders, [bundle], [{ROLES[0]: a, ROLES[1]: b}])
        c2 = fam.conditioner.encode_with_media(encoders, [bundle], [{ROLES[0]: b, ROLES[1]: a}])
        assert torch.equal(c1["prompt_mask"], c2["prompt_mask"])
        diff = float((c1["prompt_embeds"] - c2["prompt_embeds"]).abs().max())
        assert diff > 1e-3, diff

    def test_multi_image_bad_input_is_typed_and_names_the_field(self, fam, encoders,
                                                               tiny_checkpoint):
        from adapters.registry import get_family
        bundle = fam.conditioner.tokenize([PROMPTS[0]], [NEGATIVE])[0]
        sampling = SamplingSpec(seeds=(0,), num_steps=2, **self.size)

        def request(*pairs):
            return RolloutRequest(prompt=bundle, sampling=sampling, task=Task.EDIT, media=tuple(
                MediaInput(Modality.IMAGE, role, image) for role, image in pairs))
        a, b = source_image(0), source_image(1)
        fam.validate_request(request((ROLES[0], a), (ROLES[1], b), (ROLES[2], a)),
                             RequestLimits(max_width=1248))
        for pairs in (((ROLES[1], b),),                     # no first source
                      ((ROLES[0], a), (ROLES[2], b))):      # a gap in the order
            with pytest.raises(InvalidRequestError) as err:
                fam.validate_request(request(*pairs), RequestLimits(max_width=1248))
            assert err.value.field == "media"
            assert err.value.expected == {"required": ["image"], "then": ["image_2", "image_3"]}
        with pytest.raises(InvalidRequestError) as err:       # nor encoded so
            fam.conditioner.encode_with_media(encoders, [bundle], [{ROLES[0]: a, ROLES[2]: b}])
        assert err.value.field == "media[0]"
        # a second source at a size the pipeline would resize: refused naming it and its size
        small = torch.zeros(3, 512, 768, dtype=torch.uint8)
        with pytest.raises(MediaFormatError) as err:
            fam.validate_request(request((ROLES[0], a), (ROLES[1], small)), RequestLimits())
        assert err.value.field == "media.image_2" and err.value.expected == "(3, 832, 1248)"
        with pytest.raises(LimitExceededError) as err:        # its own size, over the bound
            fam.validate_request(request((ROLES[0], a), (ROLES[1], b)), RequestLimits())
        assert err.value.field == "media.image_2" and err.value.actual == (3, 832, 1248)
        # Qwen-Image-Edit (the same components, its own pipeline) takes one source only
        edit = get_family("auto", tiny_checkpoint("qwen_image_edit"), {"max_sequence_length": 48})
        with pytest.raises(InvalidRequestError) as err:
            edit.validate_request(RolloutRequest(
                prompt=edit.conditioner.tokenize([PROMPTS[0]], [NEGATIVE])[0], sampling=sampling,
                task=Task.EDIT, media=(MediaInput(Modality.IMAGE, ROLES[0], a),
                                       MediaInput(Modality.IMAGE, ROLES[1], a))), RequestLimits())
        assert err.value.field == "media" and err.value.actual == ["image", "image_2"]
        # three sources' vision blocks beyond a small window: refused naming the prompt
        narrow = get_family("auto", fam.root, {"max_sequence_length": 24})
        short = narrow.conditioner.tokenize([PROMPTS[0]])[0]
        with pytest.raises(LimitExceededError) as err:
            narrow.conditioner.encode_with_media(encoders, [short],
                                                 [{ROLES[0]: a, ROLES[1]: b, ROLES[2]: a}])
        assert err.value.field == "prompts[0].qwen" and err.value.expected == "<= 24"


def test_several_images_over_http_reach_the_family_in_order(tiny_checkpoint):
    """In process (deployments/http.py): an edit request's `images` entry as an ordered list
    becomes the media roles image, image_2 in that order, pixels unchanged; a list longer than
    the family takes, or than any edit takes, is a typed 4xx naming images[i] before any
    rollout."""
    from adapters.registry import get_family
    from deployments.config import load_graph_config
    from tests.test_http_edit import GateOnly, encoded, post

    root = str(tiny_checkpoint("qwen_image_edit_plus"))
    options = {"max_sequence_length": 80}
    config = load_graph_config({"rollout": {"adapter": "qwen_image", "weights_path": root,
                                            "adapter_options": options},
                                "limits": {"max_prompts": 2, "max_height": 1024,
                                           "max_width": 1280, "max_body_bytes": 16 << 20}})
    front = GateOnly(config, get_family("qwen_image", root, options))
    first, second = (source_image(i, (48, 80)).permute(1, 2, 0).numpy() for i in range(2))
    body = {"prompts": ["put the left one on the right one"], "task": "edit", "num_steps": 2,
            "height": 64, "width": 96, "images": [[encoded(first), encoded(second)]]}
    status, answer, reached = post(front, body)
    assert reached and status == 503, answer
    [request] = front.reached[-1]
    assert [(m.role, m.modality) for m in request.media] == [(MediaRole.IMAGE, Modality.IMAGE),
                                                             (MediaRole.IMAGE_2, Modality.IMAGE)]
    for item, pixels in zip(request.media, (first, second)):
        assert torch.equal(item.data, torch.from_numpy(pixels).permute(2, 0, 1))
    status, answer, reached = post(front, body | {"images": [encoded(first)]})    # one: a str
    assert reached and [m.role for m in front.reached[-1][0].media] == [MediaRole.IMAGE]
    # sources at the pipeline's VAE sizes pass the family's own checks as the ingress runs them
    sources = [source_image(i) for i in range(2)]
    status, answer, reached = post(front, body | {
        "images": [[encoded(s.permute(1, 2, 0).numpy()) for s in sources]]})
    assert reached, answer
    [request] = front.reached[-1]
    media = front.family.validate_request(request, config.limits)
    assert list(media) == [MediaRole.IMAGE, MediaRole.IMAGE_2]
    assert all(torch.equal(media[r], s) for r, s in zip(ROLES, sources))
    for images, field, expected in (([[encoded(first)] * 4], "images[0]", "<= 3"),
                                    ([[]], "images[0]", "1..3"),
                                    ([[encoded(first), "!!"]], "images[0][1]", None)):
        status, answer, reached = post(front, body | {"images": images})
        assert not reached and 400 <= status < 500, answer
        assert answer["error"]["field"] == field, answer
        if expected is not None:
            assert answer["error"]["expected"] == expected, answer


@pytest.mark.timeout(900)
def test_a_two_source_edit_over_http_through_the_graph(ray_cluster, tiny_checkpoint):
    """The deployed graph of the tiny Qwen-Image-Edit-Plus checkpoint: a guided edit with two
    ordered sources over HTTP (the encoder stage shows both to the conditioner, for the prompt
    and its negative; the rollout stage VAE-encodes both), and a second source at a size the
    pipeline would resize refused with a 400 naming media.image_2 (integration tier: Ray)."""
    import base64
    import io

    import httpx
    from ray import serve

    from graph import build_app, delete_graph

    def png(image: torch.Tensor) -> str:
        out = io.BytesIO()
        pil(image).save(out, format="PNG")
        return base64.b64encode(out.getvalue()).decode()

    config = {"app_name": "fam_qwen_image_edit_plus",
              "rollout": {"adapter": "qwen_image",
                          "weights_path": str(tiny_checkpoint("qwen_image_edit_plus")),
                          "adapter_options": {"max_sequence_length": 80}},
              "rollout_stage": {"num_cpus": 0.5},
              "scorers": [{"name": "image_attributes", "scorer": {"kind": "image_attributes"},
                           "inputs": ["image"], "reward": {"policy": "required"}}],
              "limits": {"max_prompts": 1, "max_samples_per_prompt": 1, "max_steps": 4,
                         "max_frames": 1, "max_width": 1280,
                         "max_body_bytes": 16 << 20},     # two ~1 MP noisy PNGs
              "policy_store": "fam_qwen_image_edit_plus_store"}
    serve.run(build_app(config), name=config["app_name"], route_prefix="/qwen_image_edit_plus")
    url = f"http://127.0.0.1:{ray_cluster['http_port']}/qwen_image_edit_plus/rollout"
    sources = [png(source_image(i)) for i in range(2)]
    body = {"prompts": ["a red circle at the top left on a black background"],
            "negative_prompts": [" "], "task": "edit", "images": [sources],
            "samples_per_prompt": 1, "seed": 3, "num_steps": 2, "sampler": "ode",
            "noise_level": 0.0, "guidance_scale": 4.0, "height": 64, "width": 96}
    try:
        reply = httpx.post(url, json=body, timeout=600)
        assert reply.status_code == 200, reply.text
        [result] = reply.json()["results"]
        [sample] = result["samples"]
        assert {a["name"]: a["shape"] for a in sample["artifacts"]}["image"] == [3, 64, 96]
        small = torch.zeros(3, 512, 768, dtype=torch.uint8)
        bad = httpx.post(url, json=body | {"images": [[sources[0], png(small)]]}, timeout=120)
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["field"] == "media.image_2" and error["expected"] == "(3, 832, 1248)", error
    finally:
        delete_graph(config)
