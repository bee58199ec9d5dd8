"""The worker-side vLLM-Omni pipeline: our family's DiT driven by OUR denoising step
(`diffusion.step.denoise_step`, the one the embedded engine runs).

Loaded by vLLM-Omni through `custom_pipeline_args={"pipeline_class":
"rollout.vllm_omni.pipeline.RolloutPipeline", "adapter": "<registry name>"}`; vLLM-Omni builds it
as `RolloutPipeline(od_config=...)`, moves it to the device and calls `forward(batch)` once per
scheduled wave of requests. Each request comes back as one DiffusionOutput whose `output` is the
canonical envelope (named latents + RL metadata, see lowering.build_envelope) and whose
`trajectory_latents / _timesteps / _log_probs` hold the fp32 trajectory.

This module imports no vLLM: the DiffusionOutput class is resolved when the pipeline is built
(or injected, which is how the CPU fake runs this same class).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from torch import nn

from adapters.family import ModelFamily
from contract import Condition, ConfigError, InvalidRequestError, MediaRole, SamplingSpec
from diffusion.conventions import model_time
from diffusion.noise import initial_noise
from diffusion.step import Guidance, doubles_rows, predict_velocity
from rollout.recorder import SampleRecorder
from rollout.vllm_omni.lora import ResidentLoRAs
from rollout.vllm_omni.lowering import build_envelope, read_condition, read_sampling


@torch.no_grad()
def sample_request(family: ModelFamily, models: Mapping[str, nn.Module], sampling: SamplingSpec,
                   cond: Condition, negative: Condition | None,
                   media_modules: Mapping[str, nn.Module],
                   media: Mapping[MediaRole, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """Run one request's rows through the project's denoising step, recording the fp32
    trajectory exactly as the embedded engine does (same noise streams, guidance decision,
    frozen condition entries). Returns state (B, *S), latents (B, W+1, *S), log_probs (B, W),
    sigmas (N+1,), model_timesteps (N,), window, frozen_mask."""
    seeds, rows = sampling.seeds, sampling.samples_per_prompt
    shape = family.codec.state_shape(sampling)                               # S
    sigmas = family.sigmas(sampling).to(torch.float32)                       # (N+1,)
    window = sampling.window
    guided = doubles_rows(family.spec.guidance, sampling.guidance_scale)
    if guided and negative is None:
        raise InvalidRequestError("rows the family's rule guides need the negative condition",
                                  field="prompt.extra_args.negative_prompt", actual=None)
    if cond.rows != 1:
        raise InvalidRequestError("condition must hold one prompt", field="prompt.extra_args",
                                  expected=1, actual=cond.rows)
    cond_rows = cond.expand_rows(rows)
    guidance = Guidance.of(family.spec.guidance, [sampling.guidance_scale] * rows,
                           negative.expand_rows(rows) if guided else None)
    mc = family.codec.encode_media(media_modules, sampling, dict(media))
    inputs = {k: v.to(device).expand(rows, *v.shape[1:]) for k, v in mc.inputs.items()}
    frozen = None if mc.frozen is None else type(mc.frozen)(
        mc.frozen.mask.expand(rows, *shape).to(device),
        mc.frozen.values.expand(rows, *shape).to(device))
    x = initial_noise(seeds, shape, device=device)
    if frozen is not None:
        x = frozen.apply(x)
    denoiser = family.denoiser
    timesteps = model_time(sigmas[:-1], denoiser.time_convention, denoiser.model_time_scale)
    recorder = SampleRecorder(sampling, sigmas.to(device), frozen)    # the embedded engine's
    while not recorder.done:
        sigma, _ = recorder.sigmas_now(rows)
        v = predict_velocity(denoiser, models, x, sigma, cond_rows, guidance, inputs)
        x = recorder.advance(x, v)
    trajectory = recorder.trajectory(timesteps, "")
    return {"state": x, "latents": trajectory.latents, "log_probs": trajectory.log_probs,
            "sigmas": sigmas, "model_timesteps": timesteps, "window": window,
            "frozen_mask": trajectory.frozen_mask}


def _real_output_cls() -> Callable[..., Any]:
    from vllm_omni.diffusion.data import DiffusionOutput
    return DiffusionOutput


class RolloutPipeline(nn.Module):
    """vLLM-Omni custom pipeline over a project adapter (duck-typed to vLLM-Omni 0.30's
    pipeline interface: od_config constructor, weights_sources, load_weights, forward)."""

    supports_request_batch = True   # forward returns one DiffusionOutput per request
    lora_is_fused = True            # the worker skips its LoRA manager; we apply LoRA (lora.py)
    _dit_modules = ["transformer"]

    def __init__(self, *, od_config: Any, prefix: str = "",
                 output_cls: Callable[..., Any] | None = None):
        super().__init__()
        args = dict(getattr(od_config, "custom_pipeline_args", None) or {})
        if "adapter" not in args:
            raise ConfigError("custom_pipeline_args must name the adapter",
                              field="custom_pipeline_args.adapter", actual=sorted(args))
        from adapters.lora_targets import LoRATargetMap
        from adapters.registry import get_family     # families import diffusers/transformers

        self.family: ModelFamily = get_family(args["adapter"], od_config.model)
        models = self.family.load_transformers()       # the encoder stage runs elsewhere
        self.transformer = models["transformer"]
        self.media_modules = nn.ModuleDict(self.family.load_media_encoders())  # condition media
        self.loras = ResidentLoRAs(self.transformer, LoRATargetMap.identity(
            self.family.spec.lora_targets["transformer"]), int(args.get("max_resident_loras", 4)))
        self._output_cls = output_cls or _real_output_cls()
        self.weights_sources: list = []                # weights come from adapter.load above
        self._loaded = {n for n, _ in self.named_parameters()}

    def load_weights(self, weights) -> set[str]:
        """vLLM-Omni's loader hook. The adapter already loaded every parameter from
        od_config.model in __init__; consume the (empty) stream and report them loaded."""
        for name, _ in weights:
            raise ConfigError("RolloutPipeline loads its weights through the adapter",
                              field="weights_sources", actual=name)
        return set(self._loaded)

    def forward(self, batch: Any) -> list[Any]:
        if batch.is_dummy_run():
            # vLLM-Omni's start-up warm-up sends a text prompt ("dummy run"); this pipeline only
            # takes encoded conditions, so the warm-up is acknowledged without sampling.
            return [self._output_cls(output=None) for _ in batch.request_ids]
        device = next(self.transformer.parameters()).device
        outputs = []
        for rid, prompt, params in zip(batch.request_ids, batch.prompts,
                                       batch.sampling_params_list):
            outputs.append(self._one(rid, prompt, params, device))
        return outputs

    def _one(self, rid: str, prompt: Mapping[str, Any], params: Any,
             device: torch.device) -> Any:
        sampling, names = read_sampling(params.extra_args)
        extra = prompt.get("extra_args") or {}
        cond = read_condition(extra, "prompt")
        if cond is None:
            raise InvalidRequestError("prompt carries no encoded condition",
                                      field="prompt.extra_args.prompt", request_id=rid)
        media = {MediaRole(k): v for k, v in (extra.get("media") or {}).items()}
        lora_id = self.loras.activate(params.lora_request)
        out = sample_request(self.family, {"transformer": self.transformer}, sampling, cond,
                             read_condition(extra, "negative_prompt"), self.media_modules, media,
                             device)
        split = self.family.codec.split_state(out["state"], sampling)
        latents = {name: split[name] for name in names if name in split}
        envelope = build_envelope(latents, sampling, out["sigmas"], out["window"], lora_id,
                                  out["frozen_mask"])
        return self._output_cls(output=envelope, trajectory_latents=out["latents"],
                                trajectory_timesteps=out["model_timesteps"],
                                trajectory_log_probs=out["log_probs"], to_cpu=True)
