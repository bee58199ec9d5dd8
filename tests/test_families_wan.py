"""Wan 2.1 T2V, Wan 2.1 I2V and Wan 2.2 (two experts) from tiny real-layout checkpoints, against
WanPipeline / WanImageToVideoPipeline (tests/family_conformance.py), plus what is particular to
Wan: the cleaned prompt's ids and states as the pipeline's encoder sees them, CFG rows batched
against two forwards, the 4n+1 frame rule, the condition image, the expert of each row, one LoRA
slot per expert, a UniPC scheduler config, the time-convention check."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from adapters.registry import get_family
from contract import (ConfigError, InvalidRequestError, LimitExceededError, LoRAMapError,
                      MediaFormatError,
                      MediaInput, MediaRole, Modality, RequestLimits, RolloutRequest,
                      SamplingSpec, Task)
from diffusion.guidance import cfg_velocity
from diffusion.noise import initial_noise
from diffusion.step import Guidance, predict_velocity
from tests.family_conformance import (NEGATIVE, PROMPTS, FamilyConformance,
                                      check_time_convention_flip)

torch.set_num_threads(1)

SIZE = {"height": 32, "width": 48, "num_frames": 9}
IMAGE = torch.randint(0, 256, (3, 32, 48), generator=torch.Generator().manual_seed(5),
                      dtype=torch.uint8)


def pil(image: torch.Tensor):
    from PIL import Image
    return Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())


class WanConformance(FamilyConformance):
    family = "wan"
    options = {"max_sequence_length": 16}
    size = SIZE
    other_sizes = ({"height": 64, "width": 64, "num_frames": 5},
                   {"height": 16, "width": 96, "num_frames": 13})
    bad_size = {"height": 40, "width": 48, "num_frames": 9}     # 40: not a multiple of 8 x 2
    guidance_scale = 5.0
    negative = True

    def pipeline(self, root):
        from diffusers import WanPipeline
        return WanPipeline.from_pretrained(root, local_files_only=True)

    def pipeline_media(self) -> dict:
        return {}

    def pipeline_call(self, pipe, x0, output_type):
        rows = x0.shape[0]
        return pipe(prompt=[PROMPTS[0]] * rows, negative_prompt=[NEGATIVE] * rows, latents=x0,
                    num_inference_steps=self.steps, guidance_scale=self.guidance_scale,
                    output_type=output_type,
                    max_sequence_length=self.options["max_sequence_length"], **self.size,
                    **self.pipeline_media())

    def latents_of(self, result):
        return {"video_latent": result.frames}

    def decode_all(self, fam, latents, sampling):
        return fam.codec.decode("video_latent", fam.load_decoder("video_latent"),
                                latents["video_latent"], sampling)

    def decoded_from_pipeline(self, result):
        frames = torch.from_numpy((result.frames * 255).round().astype("uint8"))
        return frames.permute(0, 1, 4, 2, 3)                       # (B, F, 3, H, W)

    def test_frame_count_and_sizes_are_refused_not_rounded(self, fam):
        for frames in (8, 10, 2):
            with pytest.raises(InvalidRequestError) as err:
                fam.codec.state_shape(SamplingSpec(seeds=(0,), **(SIZE | {"num_frames": frames})))
            assert (err.value.field, err.value.expected, err.value.actual) == \
                ("sampling.num_frames", "4n+1", frames)
        assert fam.codec.state_shape(SamplingSpec(seeds=(0,), **SIZE)) == (16, 3, 4, 6)
        bundle = fam.conditioner.tokenize(["a cat"])[0]
        request = RolloutRequest(prompt=bundle, task=next(iter(fam.spec.tasks)),
                                 sampling=SamplingSpec(seeds=(0,), **(SIZE | {"width": 40})),
                                 media=self.request_media(), request_id="r1")
        with pytest.raises(InvalidRequestError) as err:
            fam.validate_request(request, RequestLimits())
        assert (err.value.field, err.value.actual, err.value.request_id) == \
            ("sampling.width", 40, "r1")


class TestWan21(WanConformance):
    checkpoint = "wan21"

    def test_ids_and_states_are_the_pipeline_encoders(self, fam, root, encoders):
        """prompt_clean runs before tokenizing: the ids are those the pipeline's UMT5 sees, and
        the condition equals the pipeline's prompt_embeds (zero past the prompt)."""
        pipe = self.pipeline(root)
        text = "  a red &amp;amp; circle\n\n on   a   table  "
        seen = {}
        hook = pipe.text_encoder.register_forward_pre_hook(
            lambda module, args: seen.update(ids=args[0].clone(), mask=args[1].clone()))
        try:
            theirs, _ = pipe.encode_prompt(text, do_classifier_free_guidance=False,
                                           max_sequence_length=16)
        finally:
            hook.remove()
        bundle = fam.conditioner.tokenize([text])[0]
        tokenizer = fam.conditioner.tokenizer(fam.spec.encoders[0])
        assert list(bundle.token_ids) != tokenizer(text)["input_ids"]      # it was cleaned
        n = len(bundle.token_ids)
        assert seen["ids"][0, :n].tolist() == list(bundle.token_ids)
        assert seen["mask"][0].tolist() == [1] * n + [0] * (16 - n)
        ours = fam.conditioner.encode(encoders, [bundle])["prompt_embeds"]
        assert ours.shape == theirs.shape == (1, 16, 32)
        # (the pipeline encodes with autograd on, where sdpa takes another CPU kernel)
        assert float((ours - theirs.detach()).abs().max()) <= 1e-5
        assert bool((ours[0, n:] == 0).all())

    def test_the_task_is_the_transformers_not_the_class_name(self, root, tmp_path):
        """A folder of T2V components named WanImageToVideoPipeline serves T2V (the
        conformance save / load); a transformer taking neither T2V's nor I2V's channels
        (LucyEdit's 2 z: latents + a condition video) is refused, naming them."""
        folder = tmp_path / "lucy"
        shutil.copytree(root, folder)
        path = folder / "transformer" / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | {"in_channels": 32}))
        index = json.loads((folder / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps(index |
                                                            {"_class_name": "LucyEditPipeline"}))
        for adapter in ("auto", "wan"):
            with pytest.raises(ConfigError) as err:
                get_family(adapter, folder, self.options)
            assert (err.value.field, err.value.expected, err.value.actual) == \
                ("weights_path.transformer.in_channels", [16, 36], 32)

    def test_concurrent_decodes_equal_one_at_a_time(self, fam):
        """AutoencoderKLWan keeps its causal feature cache on the module: a decoder replica
        decoding requests in threads got wrong frames (and 2 or 8 of 5) before the lock."""
        import threading
        modules = fam.load_decoder("video_latent")
        sampling = SamplingSpec(seeds=(0,), **(SIZE | {"num_frames": 5}))
        latent = torch.randn(1, 16, 2, 4, 6, generator=torch.Generator().manual_seed(3))
        alone = fam.codec.decode("video_latent", modules, latent, sampling)
        results = []

        def decode():
            for _ in range(3):
                results.append(fam.codec.decode("video_latent", modules, latent, sampling))
        threads = [threading.Thread(target=decode) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 9 and all(torch.equal(r, alone) for r in results)

    def test_umt5_rejects_prompts_longer_than_its_window(self, fam):
        assert fam.spec.encoders[0].overflow.value == "reject"
        with pytest.raises(LimitExceededError) as err:
            fam.conditioner.tokenize([" ".join(["red"] * 40)])
        assert err.value.field == "prompts[0]" and "umt5" in err.value.expected

    def test_cfg_rows_batched_equal_two_forwards(self, fam, encoders, engine):
        """The pipeline runs cond and uncond as two forwards; the step batches them."""
        conditioner = fam.conditioner
        bundles = conditioner.tokenize(list(PROMPTS), [NEGATIVE, NEGATIVE])
        cond = conditioner.encode(encoders, bundles)
        uncond = conditioner.encode(encoders, [conditioner.unconditional(b) for b in bundles])
        x = torch.randn(2, 16, 3, 4, 6, generator=torch.Generator().manual_seed(1))
        sigma = torch.tensor([0.9, 0.4])
        scale = Guidance.of(fam.spec.guidance, [5.0, 5.0], uncond)
        batched = predict_velocity(fam.denoiser, engine.models, x, sigma, cond, scale)
        apart = [predict_velocity(fam.denoiser, engine.models, x, sigma, c,
                                  Guidance.none(2)) for c in (uncond, cond)]
        diff = float((batched - cfg_velocity(*apart, scale.scale)).abs().max())
        print(f"wan21 CFG [uncond; cond] batched vs two forwards: max diff {diff:.3g}")
        assert diff <= 1e-4

    def test_unipc_scheduler_config_is_refused_or_sampled_as_declared(self, root, tmp_path):
        from diffusers import UniPCMultistepScheduler
        ckpt = tmp_path / "wan_unipc"
        shutil.copytree(root, ckpt)
        unipc = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=3.0, num_train_timesteps=1000)
        shutil.rmtree(ckpt / "scheduler")
        unipc.save_pretrained(ckpt / "scheduler")
        index = json.loads((ckpt / "model_index.json").read_text())
        index["scheduler"] = ["diffusers", "UniPCMultistepScheduler"]
        (ckpt / "model_index.json").write_text(json.dumps(index))
        with pytest.raises(ConfigError) as err:
            get_family("auto", ckpt, self.options)
        assert err.value.field == "rollout.adapter_options.unipc"
        fam = get_family("auto", ckpt, self.options | {"unipc": "flow_euler"})
        for steps in (4, 10, 50):
            ours = fam.sigmas(SamplingSpec(num_steps=steps, seeds=(0,), **SIZE))
            unipc.set_timesteps(steps)
            # UniPC's own table, but for its first sigma nudged to 1 - 1e-6
            assert float((ours - unipc.sigmas).abs().max()) <= 2e-6 and ours[0] == 1.0
        scheduler = fam.pipeline_scheduler(SamplingSpec(num_steps=4, seeds=(0,), **SIZE))
        assert type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
        karras = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                         use_karras_sigmas=True)
        shutil.rmtree(ckpt / "scheduler")
        karras.save_pretrained(ckpt / "scheduler")
        with pytest.raises(ConfigError) as err:
            get_family("auto", ckpt, self.options | {"unipc": "flow_euler"})
        assert err.value.field == "scheduler"


class TestWan22(WanConformance):
    checkpoint = "wan22"

    def test_expert_per_step_is_the_pipelines(self, fam, root):
        """The pipeline's own choice (which expert each timestep ran) is the family's."""
        assert fam.spec.transformers == ("transformer", "transformer_2")
        assert fam.boundary == 875.0                   # boundary_ratio from model_index.json
        pipe = self.pipeline(root)
        ran = []
        for name in fam.spec.transformers:
            getattr(pipe, name).register_forward_pre_hook(
                lambda m, a, k, name=name: ran.append((name, float(k["timestep"][0]))),
                with_kwargs=True)
        self.pipeline_call(pipe, torch.randn(1, 16, 3, 4, 6), "latent")
        sigmas = fam.sigmas(self.sampling())
        ours = [fam.expert_of(float(s)) for s in sigmas[:-1]]
        theirs = [name for name, _ in ran[::2]]        # cond + uncond forward per step
        assert ours == theirs == ["transformer"] + ["transformer_2"] * 3

    def test_rows_straddling_the_boundary_run_their_own_expert(self, fam, encoders, engine):
        cond = fam.conditioner.encode(encoders, fam.conditioner.tokenize([PROMPTS[0]] * 3))
        x = torch.randn(3, 16, 3, 4, 6, generator=torch.Generator().manual_seed(2))
        sigma = torch.tensor([0.95, 0.5, 0.9])         # high, low, high
        together = predict_velocity(fam.denoiser, engine.models, x, sigma, cond,
                                    Guidance.none(3))
        for i in range(3):                             # each row: its expert's raw forward
            expert = engine.models[fam.expert_of(float(sigma[i]))]
            alone = expert(hidden_states=x[i:i + 1], timestep=sigma[i:i + 1] * 1000,
                           encoder_hidden_states=cond["prompt_embeds"][i:i + 1],
                           return_dict=False)[0]
            assert float((together[i] - alone[0]).abs().max()) <= 1e-5
        swapped = {"transformer": engine.models["transformer_2"],
                   "transformer_2": engine.models["transformer"]}
        other = predict_velocity(fam.denoiser, swapped, x, sigma, cond, Guidance.none(3))
        assert float((other - together).abs().max()) > 1e-2    # a swap would show

    def test_each_expert_has_its_own_lora_slot(self, fam, encoders, engine):
        """A version that trains only the low-noise expert leaves high-noise rows at base."""
        model = engine.models["transformer_2"]
        gen = torch.Generator().manual_seed(0)
        tensors = {}
        for target in ("blocks.0.attn1.to_q", "blocks.1.ffn.net.2"):
            layer = model.get_submodule(target)
            tensors[f"transformer_2.{target}.lora_A.weight"] = \
                torch.randn(2, layer.in_features, generator=gen)
            tensors[f"transformer_2.{target}.lora_B.weight"] = \
                torch.randn(layer.out_features, 2, generator=gen)
        engine.load_lora("low-only", tensors)
        try:
            cond = fam.conditioner.encode(encoders, fam.conditioner.tokenize([PROMPTS[0]] * 2))
            x = torch.randn(2, 16, 3, 4, 6, generator=gen)
            sigma = torch.tensor([0.95, 0.3])
            out = {}
            for version in ("base", "low-only"):
                with engine.slots.active(version):
                    out[version] = predict_velocity(fam.denoiser, engine.models, x, sigma, cond,
                                                    Guidance.none(2))
            assert torch.equal(out["base"][0], out["low-only"][0])      # transformer: base
            assert float((out["base"][1] - out["low-only"][1]).abs().max()) > 1e-3
            with pytest.raises(LoRAMapError) as err:                     # no component prefix
                engine.load_lora("bare", {k.partition(".")[2]: v for k, v in tensors.items()})
            assert "component" in str(err.value)
        finally:
            engine.unload_lora("low-only")


    def test_lora_components_train_only_the_named_expert(self, fam, encoders, engine):
        """lora.components = [transformer_2]: only the low-noise expert carries (and trains) the
        adapter; its export loads into the engine's slots and samples as merged weights do."""
        from trainer import checks
        from trainer.config import OptimizerConfig
        from trainer.learner import Learner
        from trainer.lora import LoRATrainConfig, PolicyRole, lora_layers
        with pytest.raises(ConfigError) as err:
            Learner(fam, fam.load_transformers(), encoders,
                    LoRATrainConfig(rank=2, alpha=2, components=("transformer_3",)),
                    OptimizerConfig())
        assert err.value.field == "lora.components"
        from trainer.config import load_trainer_config
        with pytest.raises(ConfigError) as err:                  # full FT trains every expert
            load_trainer_config({"learner": {"fine_tune": "full"},
                                 "lora": {"components": ["transformer_2"]}})
        assert err.value.field == "lora.components"
        learner = Learner(fam, fam.load_transformers(), encoders,
                          LoRATrainConfig(rank=2, alpha=2, components=("transformer_2",)),
                          OptimizerConfig())
        assert not lora_layers(learner.models["transformer"])
        assert lora_layers(learner.models["transformer_2"])
        tensors, scale = checks.probe_lora(learner)
        assert tensors and all(k.startswith("transformer_2.") for k in tensors)
        learner.load_adapter("default", tensors)
        prompts = fam.conditioner.tokenize([PROMPTS[0]] * 2)
        cond = learner.encode(prompts)
        x = torch.randn(2, 16, 3, 4, 6, generator=torch.Generator().manual_seed(4))
        sigma = torch.tensor([0.95, 0.3])                       # high-noise row, low-noise row
        v = learner.velocity(x, sigma, cond)
        with torch.no_grad():
            v_ref = learner.velocity(x, sigma, cond, PolicyRole.REFERENCE)
        assert torch.equal(v[0], v_ref[0]) and float((v[1] - v_ref[1]).abs().max().detach()) > 1e-3
        v.square().mean().backward()
        assert all(p.grad is not None for p in learner.params)
        assert all(p.grad is None for p in learner.models["transformer"].parameters())
        engine.load_lora("probe-low", tensors, scale)           # one expert's slot only
        try:
            sampling = SamplingSpec(num_steps=4, seeds=(0, 1), sampler="ode", noise_level=0.0,
                                    **SIZE)
            local = checks.sample_local_ode(learner, checks.merged_copy(learner, tensors, scale),
                                            prompts[:1], [0, 1], 4, sampling)
            x = initial_noise((0, 1), (16, 3, 4, 6))             # the engine's Euler ODE
            sigmas = fam.sigmas(sampling)
            with engine.slots.active("probe-low"):
                for i in range(4):
                    v = predict_velocity(fam.denoiser, engine.models, x, sigmas[i].expand(2),
                                         cond, Guidance.none(2))
                    x = x + (sigmas[i + 1] - sigmas[i]) * v
            assert float((x - local).abs().max()) <= 1e-4
        finally:
            engine.unload_lora("probe-low")


class TestWan21I2V(WanConformance):
    checkpoint = "wan21_i2v"
    options = {"max_sequence_length": 512}

    def pipeline(self, root):
        from diffusers import WanImageToVideoPipeline
        return WanImageToVideoPipeline.from_pretrained(root, local_files_only=True)

    def request_media(self):
        return (MediaInput(Modality.IMAGE, MediaRole.FIRST_FRAME, IMAGE),)

    def pipeline_media(self):
        return {"image": pil(IMAGE)}

    def request(self, fam, media, **size) -> RolloutRequest:
        bundle = fam.conditioner.tokenize(["a cat"])[0]
        return RolloutRequest(prompt=bundle, task=Task.I2V, media=media, request_id="i1",
                              sampling=SamplingSpec(seeds=(0,), **(SIZE | size)))

    def test_condition_image_is_required_and_sized(self, fam, encoders, engine):
        assert fam.spec.tasks == {Task.I2V: (MediaRole.FIRST_FRAME,)}
        cond = fam.conditioner.encode(encoders, fam.conditioner.tokenize(["a cat"]))
        with pytest.raises(InvalidRequestError) as err:        # the forward without its inputs
            fam.denoiser.forward(engine.models, torch.zeros(1, 16, 3, 4, 6), torch.ones(1),
                                 torch.full((1,), 1000.0), cond, None, None)
        assert err.value.field == "media.condition"
        with pytest.raises(InvalidRequestError) as err:
            fam.validate_request(self.request(fam, None), RequestLimits())
        assert (err.value.field, err.value.expected) == ("media", ["first_frame"])
        small = (MediaInput(Modality.IMAGE, MediaRole.FIRST_FRAME, IMAGE[:, :, :32]),)
        with pytest.raises(MediaFormatError) as err:
            fam.validate_request(self.request(fam, small), RequestLimits())
        assert err.value.field == "media.first_frame" and "(3, 32, 32)" in err.value.actual
        assert err.value.expected == "uint8 (3, 32, 48)" and err.value.request_id == "i1"
        alias = (MediaInput(Modality.IMAGE, MediaRole.IMAGE, IMAGE),)   # 'image' = first frame
        media = fam.validate_request(self.request(fam, alias), RequestLimits())
        assert torch.equal(media[MediaRole.FIRST_FRAME], IMAGE)

    def test_condition_inputs_equal_the_pipeline_and_the_learner_recomputes_them(
            self, fam, root, engine):
        from trainer.config import OptimizerConfig
        from trainer.learner import Learner
        from trainer.lora import LoRATrainConfig
        pipe = self.pipeline(root)
        sampling = SamplingSpec(seeds=(0,), **SIZE)
        inputs = fam.codec.encode_media(engine.media_modules, sampling,
                                        {MediaRole.FIRST_FRAME: IMAGE}).inputs
        image = pipe.video_processor.preprocess(pil(IMAGE), height=32, width=48)
        _, condition = pipe.prepare_latents(image, 1, 16, 32, 48, 9, torch.float32,
                                            latents=torch.zeros(1, 16, 3, 4, 6))
        assert torch.equal(inputs["condition"], condition)           # mask + latents, (1, 20, ..)
        assert torch.equal(inputs["image_embeds"], pipe.encode_image(pil(IMAGE), "cpu"))
        learner = Learner(fam, fam.load_transformers(), {}, LoRATrainConfig(rank=2, alpha=2),
                          OptimizerConfig(), media_modules=fam.load_media_encoders())
        again = learner.forward_inputs([sampling], [{MediaRole.FIRST_FRAME: IMAGE}], [3])
        assert all(torch.equal(again[k], v.expand(3, *v.shape[1:])) for k, v in inputs.items())

    def test_text_window_must_be_the_transformers_512(self, root):
        with pytest.raises(ConfigError) as err:
            get_family("wan", root, {"max_sequence_length": 16})
        assert (err.value.field, err.value.expected) == \
            ("rollout.adapter_options.max_sequence_length", 512)


@pytest.mark.parametrize("case", [TestWan21, TestWan22])
def test_time_convention_check_against_the_checkpoint_scheduler(case, tiny_checkpoint,
                                                                monkeypatch):
    check_time_convention_flip(case.family, tiny_checkpoint(case.checkpoint), case.options, SIZE,
                               monkeypatch)
