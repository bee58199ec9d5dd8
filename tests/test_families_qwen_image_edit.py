"""Qwen-Image-Edit: the edit task of the Qwen-Image family on its tiny checkpoint
(QwenImageEditPipeline layout: Qwen-Image's components and a Qwen2VLProcessor) against
QwenImageEditPipeline (tests/family_conformance.py, task edit; the edit checks of
tests/edit_conformance.py), plus what is particular to it: the source image shown to Qwen2.5-VL
(image-dependent ids, the edit template's 64 dropped tokens), the source latents appended to the
sequence, and the source size the pipeline would resize to, required here."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from contract import (InvalidRequestError, LimitExceededError, MediaFormatError, MediaRole,
                      RequestLimits, SamplingSpec, Task)
from tests.edit_conformance import EditConformance, edit_request, pil, striped_image
from tests.family_conformance import NEGATIVE, PROMPTS

torch.set_num_threads(1)
SOURCE_SIZE = (1024, 1024)    # the size QwenImageEditPipeline resizes a square source to


def source_image(inverted: bool = False) -> torch.Tensor:
    """The edit's source (stripes + noise at the pipeline's size), or its negative."""
    return striped_image(SOURCE_SIZE, stripe=64, rise=1 / 16, inverted=inverted)


class TestQwenImageEdit(EditConformance):
    family, checkpoint = "qwen_image", "qwen_image_edit"
    options = {"max_sequence_length": 48}
    size = {"height": 64, "width": 96}
    other_sizes = ({"height": 128, "width": 128},)
    bad_size = {"height": 64, "width": 88}
    guidance_scale = 4.0
    negative = True
    steps = 2
    sigma_steps = (2, 3)     # 1 step: the scheduler's shift_terminal divides 0 by 0

    # the components are tiny Qwen-Image's: tests/test_families_qwen_image.py::TestQwenImage
    # checks the task-independent parts on them (LoRA targets and file, stage loading); the
    # ids are checked with their vision tokens below. QwenImageEditInpaintPipeline and
    # QwenImageLayeredPipeline take these components too and are not served, so the class
    # check over them is not run (Edit Plus: tests/test_families_qwen_image_edit_plus.py).
    test_token_ids_are_the_tokenizers_and_reach_the_encoders = None
    test_every_pipeline_class_over_the_components_loads = None
    test_every_declared_lora_target_exists = None
    test_lora_file_round_trip_through_diffusers_loader = None
    test_each_stage_loads_only_its_components = None

    def source_image(self, inverted=False):
        return source_image(inverted)

    def pipeline(self, root):
        from diffusers import QwenImageEditPipeline
        return QwenImageEditPipeline.from_pretrained(root, local_files_only=True)

    def pipeline_call(self, pipe, x0, output_type):
        image = pil(source_image(self.inverted))
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
        conditioner = fam.conditioner
        bundle = conditioner.tokenize([PROMPTS[1]])[0]
        image = source_image()
        vision = conditioner.vision_inputs(image)
        ours = conditioner.presentation_ids(bundle, vision["image_grid_thw"])
        theirs = pipe.processor(text=[fam.template.format(PROMPTS[1])], images=[pil(image)],
                                padding=True, return_tensors="pt")
        assert ours == theirs["input_ids"][0].tolist()
        assert torch.equal(vision["pixel_values"], theirs["pixel_values"])
        cond = conditioner.encode_with_media(encoders, [bundle], [{MediaRole.IMAGE: image}])
        embeds, mask = pipe.encode_prompt(PROMPTS[1], image=pil(image), device="cpu")
        valid = int(cond["prompt_mask"][0].sum())
        assert valid == embeds.shape[1] == len(ours) - 64 and mask is None
        assert cond["prompt_embeds"].shape[1] == 48
        diff = float((cond["prompt_embeds"][0, :valid] - embeds[0].detach()).abs().max())
        print(f"qwen_image_edit prompt_embeds: max |ours - encode_prompt| = {diff:.3g}")
        assert diff <= 1e-6 and not cond["prompt_embeds"][0, valid:].any()

    def test_edit_bad_input_is_typed_and_names_the_field(self, fam, encoders):
        bundle = fam.conditioner.tokenize([PROMPTS[0]], [NEGATIVE])[0]
        sampling = SamplingSpec(seeds=(0,), num_steps=2, **self.size)
        self.check_edit_needs_an_rgb_source(fam, bundle, SOURCE_SIZE)
        with pytest.raises(InvalidRequestError) as err:        # nor encoded without it
            fam.conditioner.encode(encoders, [bundle])
        assert err.value.field == "media"
        with pytest.raises(InvalidRequestError) as err:
            fam.conditioner.encode_with_media(encoders, [bundle], [{}])
        assert err.value.field == "media[0]"
        # a size the pipeline would resize: refused, naming the size it must have
        for shape, expected in (((3, 512, 512), "(3, 1024, 1024)"),
                                ((3, 64, 96), "(3, 832, 1248)")):
            request = edit_request(bundle, sampling, torch.zeros(shape, dtype=torch.uint8))
            with pytest.raises(MediaFormatError) as err:       # refused before any work
                fam.validate_request(request, RequestLimits())
            assert err.value.field == "media.image" and err.value.expected == expected
            assert str(shape) in err.value.actual and err.value.request_id == request.request_id
        wide = torch.zeros(3, 832, 1248, dtype=torch.uint8)    # its own size, over the bound
        request = edit_request(bundle, sampling, wide)
        with pytest.raises(LimitExceededError) as err:
            fam.validate_request(request, RequestLimits())
        assert err.value.field == "media.image" and err.value.actual == (3, 832, 1248)
        fam.validate_request(request, RequestLimits(max_width=1248))


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
