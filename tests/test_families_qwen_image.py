"""Qwen-Image from its tiny real-layout checkpoint, against QwenImagePipeline
(tests/family_conformance.py), plus what is particular to it: the chat template and the tokens
the pipeline drops, masked embeddings, and true CFG with norm rescaling."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from contract import ConfigError, InvalidRequestError, RequestLimits, RolloutRequest, Task
from diffusion.guidance import cfg_velocity_norm_rescaled
from tests.family_conformance import (NEGATIVE, PROMPTS, FamilyConformance,
                                      check_time_convention_flip)

torch.set_num_threads(1)


class TestQwenImage(FamilyConformance):
    family, checkpoint = "qwen_image", "qwen_image"
    options = {"max_sequence_length": 32}
    size = {"height": 64, "width": 96}
    other_sizes = ({"height": 128, "width": 128}, {"height": 256, "width": 512})
    bad_size = {"height": 64, "width": 88}           # not a multiple of 16 (VAE x 2x2 packing)
    guidance_scale = 4.0
    negative = True
    steps = 3
    sigma_steps = (2, 3, 10)     # 1 step: the scheduler's shift_terminal divides 0 by 0

    def pipeline(self, root):
        from diffusers import QwenImagePipeline
        return QwenImagePipeline.from_pretrained(root, local_files_only=True)

    def pipeline_call(self, pipe, x0, output_type):
        return pipe(prompt=[PROMPTS[0]] * x0.shape[0], negative_prompt=[NEGATIVE] * x0.shape[0],
                    true_cfg_scale=self.guidance_scale, latents=x0,
                    num_inference_steps=self.steps, output_type=output_type,
                    max_sequence_length=32, **self.size)

    def pipeline_sigmas(self, fam, scheduler, sampling):
        n = sampling.num_steps
        seq = fam.codec.state_shape(sampling)[0]
        scheduler.set_timesteps(sigmas=list(np.linspace(1.0, 1 / n, n)), mu=fam.schedule.mu(seq))
        return scheduler.sigmas.float()

    def test_token_ids_are_the_tokenizers_and_reach_the_encoders(self, fam, encoders):
        """The ids are the tokenizer's of the prompt in the pipeline's template, padded to the
        window with a mask, and the embeddings are the pipeline's own encode_prompt rows."""
        from diffusers import QwenImagePipeline
        conditioner = fam.conditioner
        spec = fam.spec.encoder("qwen")
        bundle = conditioner.tokenize([PROMPTS[1]])[0]
        tok = conditioner.tokenizer(spec)
        assert list(bundle.token_ids) == tok(fam.template.format(PROMPTS[1]))["input_ids"]
        seen = {}
        def record(module, args, kwargs):
            seen.setdefault("ids", kwargs["input_ids"].clone())
        hook = encoders["qwen"].register_forward_pre_hook(record, with_kwargs=True)
        try:
            cond = conditioner.encode(encoders, [bundle])
        finally:
            hook.remove()
        n = len(bundle.token_ids)
        row = seen["ids"][0].tolist()
        assert row[:n] == list(bundle.token_ids) and set(row[n:]) <= {tok.pad_token_id}
        assert len(row) == spec.max_length == 34 + 32
        pipe = QwenImagePipeline(text_encoder=encoders["qwen"], tokenizer=tok, transformer=None,
                                 vae=None, scheduler=None)
        theirs, mask = pipe.encode_prompt(PROMPTS[1], device="cpu", max_sequence_length=32)
        valid = int(cond["prompt_mask"][0].sum())
        assert valid == theirs.shape[1] == n - 34 and mask is None
        assert float((cond["prompt_embeds"][0, :valid] - theirs[0]).abs().max()) <= 1e-6
        assert not cond["prompt_embeds"][0, valid:].any()

    def test_guided_without_a_negative_prompt_is_refused(self, fam):
        """The pipeline guides only with a negative prompt; the project never invents one."""
        bundle = fam.conditioner.tokenize(["a cat"])[0]
        request = RolloutRequest(prompt=bundle, sampling=self.sampling(seeds=(0,)), task=Task.T2I)
        with pytest.raises(InvalidRequestError) as err:
            fam.validate_request(request, RequestLimits())
        assert err.value.field == "prompt.negative"
        unguided = RolloutRequest(prompt=bundle, task=Task.T2I, sampling=self.sampling(
            seeds=(0,)).model_copy(update={"guidance_scale": 1.0}))
        fam.validate_request(unguided, RequestLimits())

    def test_one_step_whose_schedule_is_not_finite_is_refused(self, fam):
        """shift_terminal stretches the one-step table [1, 0] by 0 / 0: the pipeline would
        sample NaN; the request is refused, naming the step count."""
        bundle = fam.conditioner.tokenize(["a cat"], [" "])[0]
        request = RolloutRequest(prompt=bundle, task=Task.T2I, sampling=self.sampling(
            seeds=(0,)).model_copy(update={"num_steps": 1}))
        with pytest.raises(InvalidRequestError) as err:
            fam.validate_request(request, RequestLimits())
        assert (err.value.field, err.value.actual) == ("sampling.num_steps", 1)

    def test_a_prompt_longer_than_the_window_is_refused(self, fam):
        from contract import LimitExceededError
        with pytest.raises(LimitExceededError) as err:
            fam.conditioner.tokenize([" ".join(["red cat"] * 40)])
        assert err.value.field == "prompts[0]"

    def test_a_template_the_tokenizer_does_not_split_at_the_drop_is_refused(self, root):
        """The pipeline drops a fixed 34 ids; a tokenizer (or template) for which they are not
        exactly the template's part before the prompt is refused at load, naming it."""
        from adapters.qwen_image import QwenImageFamily

        class Shifted(QwenImageFamily):
            template = "<|im_start|>system\nDescribe:<|im_end|>\n<|im_start|>user\n{}"
        with pytest.raises(ConfigError) as err:
            Shifted(root, self.options)
        assert err.value.field == "weights_path.tokenizer" and err.value.expected == 34
        assert err.value.actual < 34


def test_norm_rescaled_cfg_is_the_pipelines_formula():
    """pipeline_qwenimage.py:668-672 on random tensors: comb = u + g (c - u), then
    comb * |c| / |comb| over the last axis; a per-row scale as the engine passes it."""
    g = torch.Generator().manual_seed(0)
    u, c = torch.randn(3, 5, 8, generator=g), torch.randn(3, 5, 8, generator=g)
    comb = u + 4.0 * (c - u)
    expected = comb * (torch.norm(c, dim=-1, keepdim=True) / torch.norm(comb, dim=-1,
                                                                          keepdim=True))
    assert torch.allclose(cfg_velocity_norm_rescaled(u, c, torch.full((3,), 4.0)), expected,
                          rtol=1e-6, atol=1e-6)
    got = cfg_velocity_norm_rescaled(u, c, 4.0)
    assert torch.allclose(got.norm(dim=-1), c.norm(dim=-1), rtol=1e-5)


def test_time_convention_check_against_the_checkpoint_scheduler(tiny_checkpoint, monkeypatch):
    check_time_convention_flip("qwen_image", tiny_checkpoint("qwen_image"), {
        "max_sequence_length": 32}, {"height": 64, "width": 96}, monkeypatch)
