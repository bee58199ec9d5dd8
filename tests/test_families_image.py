"""SD3 / SD3.5 and FLUX.1 from tiny real-layout checkpoints, against their diffusers pipelines
(tests/family_conformance.py), plus what is particular to each family."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from adapters.family import Overflow
from contract import (ConfigError, InvalidRequestError, LimitExceededError, RequestLimits,
                      RolloutRequest, SamplingSpec, Task)
from tests.family_conformance import (NEGATIVE, PROMPTS, FamilyConformance,
                                      check_time_convention_flip)

torch.set_num_threads(1)


class TestSD3(FamilyConformance):
    family, checkpoint = "sd3", "sd3"
    options = {"max_sequence_length": 32}
    size = {"height": 64, "width": 96}
    other_sizes = ({"height": 128, "width": 128}, {"height": 32, "width": 160})
    bad_size = {"height": 72, "width": 96}           # 72 is not a multiple of 8 x patch 2
    guidance_scale = 5.0
    negative = True

    def pipeline(self, root):
        from diffusers import StableDiffusion3Pipeline
        return StableDiffusion3Pipeline.from_pretrained(root, local_files_only=True)

    def pipeline_call(self, pipe, x0, output_type):
        return pipe(prompt=[PROMPTS[0]] * x0.shape[0], negative_prompt=[NEGATIVE] * x0.shape[0],
                    latents=x0, num_inference_steps=self.steps,
                    guidance_scale=self.guidance_scale, output_type=output_type,
                    max_sequence_length=32, **self.size)

    def test_clip_truncates_as_declared_and_t5_rejects(self, fam, root):
        from adapters.registry import get_family
        specs = {e.name: e for e in fam.spec.encoders}
        assert specs["clip_l"].overflow is Overflow.TRUNCATE
        assert specs["t5"].overflow is Overflow.REJECT and specs["t5"].max_length == 32
        with pytest.raises(LimitExceededError) as err:      # > 32 T5 tokens: refused
            fam.conditioner.tokenize([" ".join(["red"] * 40)])
        assert err.value.field == "prompts[0]" and "t5" in err.value.expected
        wide = get_family("sd3", root, {"max_sequence_length": 256})
        text = " ".join(["red"] * 120)                        # > 77 CLIP tokens, < 256 T5
        bundle = wide.conditioner.tokenize([text])[0]
        clip_l = {e.name: e for e in wide.spec.encoders}["clip_l"]
        full = wide.conditioner.tokenizer(clip_l)(text)["input_ids"]
        assert len(full) > clip_l.max_length == len(bundle.token_ids)
        assert bundle.token_ids == tuple(wide.conditioner.tokenizer(clip_l)(
            text, truncation=True, max_length=clip_l.max_length)["input_ids"])
        assert set(bundle.truncated) == {"clip_l", "clip_g"}     # recorded, never silent
        assert len(bundle.encoder_token_ids["t5"]) == len(
            wide.conditioner.tokenizer({e.name: e for e in wide.spec.encoders}["t5"])(text)[
                "input_ids"])

    def test_empty_negative_is_a_prompt_not_the_absence_of_one(self, fam, encoders):
        conditioner = fam.conditioner
        with_empty = conditioner.tokenize(["a cat"], [""])[0]
        without = conditioner.tokenize(["a cat"])[0]
        assert with_empty.negative is not None and without.negative is None
        # an explicit "" is encoded as the text "" (here the same ids as SD3's null prompt)
        empty, null = conditioner.unconditional(with_empty), conditioner.unconditional(without)
        assert (empty.token_ids, dict(empty.encoder_token_ids)) == \
            (null.token_ids, dict(null.encoder_token_ids))
        other = conditioner.tokenize(["a cat"], ["a dog"])[0]
        a = conditioner.encode(encoders, [conditioner.unconditional(other)])
        b = conditioner.encode(encoders, [null])
        assert float((a["prompt_embeds"] - b["prompt_embeds"]).abs().max()) > 1e-3

    def test_schedule_shift_is_the_scheduler_shift(self, fam):
        assert fam.schedule_shift(SamplingSpec(seeds=(0,), **self.size)) == 3.0


class TestFlux(FamilyConformance):
    family, checkpoint = "flux", "flux"
    options = {"max_sequence_length": 48}
    size = {"height": 64, "width": 96}
    other_sizes = ({"height": 128, "width": 128}, {"height": 256, "width": 512})
    bad_size = {"height": 64, "width": 88}           # not a multiple of 16 (VAE x 2x2 packing)
    guidance_scale = 3.5

    def pipeline(self, root):
        from diffusers import FluxPipeline
        return FluxPipeline.from_pretrained(root, local_files_only=True)

    def pipeline_call(self, pipe, x0, output_type):
        return pipe(prompt=[PROMPTS[0]] * x0.shape[0], latents=x0,
                    num_inference_steps=self.steps, guidance_scale=self.guidance_scale,
                    output_type=output_type, max_sequence_length=48, **self.size)

    def pipeline_sigmas(self, fam, scheduler, sampling):
        n = sampling.num_steps
        seq = fam.codec.state_shape(sampling)[0]
        scheduler.set_timesteps(sigmas=list(np.linspace(1.0, 1 / n, n)), mu=fam.schedule.mu(seq))
        return scheduler.sigmas.float()

    def test_guidance_is_an_input_and_negative_prompts_are_refused(self, fam, engine, encoders):
        assert fam.spec.guidance.kind.value == "embedded"
        sampling = self.sampling(seeds=(3,))
        a = self.engine_latents(fam, engine, encoders, PROMPTS[1], sampling)["image_latent"]
        b = self.engine_latents(fam, engine, encoders, PROMPTS[1], sampling.model_copy(
            update={"guidance_scale": 1.0}))["image_latent"]
        assert float((a - b).abs().max()) > 1e-3            # the embedding is really used
        bundle = fam.conditioner.tokenize(["a cat"], ["a dog"])[0]
        request = RolloutRequest(prompt=bundle, sampling=sampling, task=Task.T2I)
        with pytest.raises(InvalidRequestError) as err:
            fam.validate_request(request, RequestLimits())
        assert err.value.field == "prompt.negative"

    def test_a_transformer_with_condition_channels_is_refused(self, root, tmp_path):
        """FluxFillPipeline / FluxControlPipeline folders are accepted by class; a Fill
        transformer (384 input channels: latents + masked image + mask) is refused by its
        components, naming them."""
        from adapters.registry import get_family
        folder = tmp_path / "fill"
        shutil.copytree(root, folder)
        path = folder / "transformer" / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) |
                                   {"in_channels": 384, "out_channels": 64}))
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps(index |
                                                            {"_class_name": "FluxFillPipeline"}))
        for adapter in ("auto", "flux"):
            with pytest.raises(ConfigError) as err:
                get_family(adapter, folder, self.options)
            assert (err.value.field, err.value.expected, err.value.actual) == \
                ("weights_path.transformer.in_channels", 64, 384)

    def test_dynamic_shift_depends_on_the_resolution(self, fam):
        small = fam.sigmas(SamplingSpec(seeds=(0,), num_steps=4, height=64, width=64))
        large = fam.sigmas(SamplingSpec(seeds=(0,), num_steps=4, height=512, width=512))
        assert (large[1:-1] > small[1:-1]).all()            # more tokens, more shift
        assert fam.schedule_shift(SamplingSpec(seeds=(0,), height=512, width=512)) > \
            fam.schedule_shift(SamplingSpec(seeds=(0,), height=64, width=64))


@pytest.mark.parametrize("case", [TestSD3, TestFlux])
def test_time_convention_check_against_the_checkpoint_scheduler(case, tiny_checkpoint,
                                                                monkeypatch):
    check_time_convention_flip(case.family, tiny_checkpoint(case.checkpoint), case.options,
                               case.size, monkeypatch)


@pytest.mark.parametrize("config,family", [("configs/sd3.yaml", "sd3"),
                                           ("configs/flux.yaml", "flux")])
def test_shipped_serve_configs_build_on_a_local_checkpoint(config, family, tiny_checkpoint):
    """The README's "your own checkpoint" configs: pointed at a checkpoint folder they build the
    whole Serve application (every stage's family, decoders per latent)."""
    import yaml
    from ray.serve import Application

    from adapters.registry import family_name
    from graph import build_app
    args = yaml.safe_load(open(config))["applications"][0]["args"]
    root = str(tiny_checkpoint(family))
    args["rollout"]["weights_path"] = root
    args["rollout"]["adapter"] = "auto"
    app = build_app(args)

    def bound(a: Application, out: dict) -> dict:     # deployment name -> bound deployment
        d = out.setdefault(a._bound_deployment.name, a._bound_deployment)
        for arg in (*d.init_args, *d.init_kwargs.values()):
            for child in (arg.values() if isinstance(arg, dict) else (arg,)):
                if isinstance(child, Application):
                    bound(child, out)
        return out

    stages = bound(app, {})
    scorers = {f"Scorer_{s['name']}" for s in args.get("scorers", [])}
    assert set(stages) == {"RolloutGraph", "TextEncoder", "DiTRollout",
                           "Decoder_image_latent"} | scorers
    graph_config = stages["RolloutGraph"].init_args[0]
    assert graph_config.weights_path == root
    assert family_name(graph_config.adapter, graph_config.weights_path) == family
    assert stages["TextEncoder"].init_args[:2] == ("auto", root)
    assert stages["Decoder_image_latent"].init_args[:3] == ("auto", root, "image_latent")
    assert stages["DiTRollout"].init_args[0].weights_path == root


def test_token_ids_outside_an_encoders_vocabulary_are_refused_before_any_work(tiny_checkpoint):
    from adapters.registry import get_family
    family = get_family("sd3", tiny_checkpoint("sd3"), {"max_sequence_length": 32})
    bundle = family.conditioner.tokenize(["a cat"])[0]
    bad = bundle.model_copy(update={"encoder_token_ids": {**bundle.encoder_token_ids,
                                                          "t5": (5, 99999)}})
    request = RolloutRequest(prompt=bad, sampling=SamplingSpec(seeds=(0,), height=32, width=32),
                             task=Task.T2I)
    with pytest.raises(InvalidRequestError) as err:
        family.validate_request(request, RequestLimits())
    assert err.value.field == "prompt.t5" and err.value.actual == [99999]
