"""The worker-side vLLM-Omni pipeline: our adapter's DiT driven by OUR sampler (`diffusion/`).

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

from adapters.base import Components, DiffusionAdapter, TextCondition
from contract import (ConfigError, InvalidRequestError, MediaRole, SamplerKind, SamplingSpec)
from diffusion.conventions import model_time, predict_velocity
from diffusion.guidance import cfg_velocity
from diffusion.noise import initial_noise, row_noise
from diffusion.samplers import sampler_step
from diffusion.schedule import flow_match_sigmas
from diffusion.windows import uses_sde
from rollout.vllm_omni.lora import ResidentLoRAs
from rollout.vllm_omni.lowering import build_envelope, read_condition, read_sampling


def _rows(cond: TextCondition, rows: int) -> TextCondition:
    """(1, L, D) prompt condition -> (rows, L, D)."""
    if cond.hidden.shape[0] != 1:
        raise InvalidRequestError("condition must hold one prompt", field="prompt.extra_args",
                                  expected=1, actual=int(cond.hidden.shape[0]))
    return cond.index_select(torch.zeros(rows, dtype=torch.long, device=cond.hidden.device))


def _cat(a: TextCondition, b: TextCondition) -> TextCondition:
    if a.hidden.shape[1:] != b.hidden.shape[1:]:
        raise InvalidRequestError("negative and positive conditions differ in shape",
                                  field="prompt.extra_args.negative_prompt_embeds",
                                  expected=tuple(a.hidden.shape[1:]),
                                  actual=tuple(b.hidden.shape[1:]))
    pooled = None if a.pooled is None else torch.cat([a.pooled, b.pooled])
    return TextCondition(torch.cat([a.hidden, b.hidden]), torch.cat([a.mask, b.mask]), pooled)


@torch.no_grad()
def sample_request(adapter: DiffusionAdapter, transformer: nn.Module, sampling: SamplingSpec,
                   cond: TextCondition, negative: TextCondition | None,
                   media: Mapping[MediaRole, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """Run one request's rows through the flow-matching sampler, recording the fp32 trajectory.

    Flow matching x_sigma = (1 - sigma) x0 + sigma eps, v = eps - x0 (Lipman et al. 2023);
    SDE window steps follow FlowGRPO (Liu et al. 2025, eq. 9-10) via diffusion.sampler_step.
    Returns state (B, *S), latents (B, W+1, *S), log_probs (B, W), sigmas (N+1,),
    model_timesteps (N,), window.
    """
    seeds, rows = sampling.seeds, sampling.samples_per_prompt
    shape = adapter.state_shape(sampling)                                   # S
    sigmas = flow_match_sigmas(sampling.num_steps, adapter.schedule_shift)  # (N+1,) fp32
    window = sampling.window
    dtype = next(transformer.parameters()).dtype
    use_cfg = sampling.guidance_scale != 1.0
    if use_cfg and negative is None:
        raise InvalidRequestError("guidance_scale != 1 needs the negative condition",
                                  field="prompt.extra_args.negative_prompt_embeds",
                                  actual=None)
    cond_rows = _rows(cond, rows)
    if use_cfg:
        cond_rows = _cat(_rows(negative, rows), cond_rows)                  # (2B, L, D)
    cond_rows = TextCondition(cond_rows.hidden.to(device, dtype), cond_rows.mask.to(device),
                              None if cond_rows.pooled is None
                              else cond_rows.pooled.to(device, dtype))
    media = {role: t.to(device) for role, t in media.items()}

    def model_fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:     # (B, *S), (B,)
        if use_cfg:
            raw = adapter.model_forward(transformer, torch.cat([x, x]).to(dtype),
                                        torch.cat([t, t]).to(dtype), cond_rows)
            uncond, cond_ = raw.float().chunk(2)
            return cfg_velocity(uncond, cond_, sampling.guidance_scale)
        return adapter.model_forward(transformer, x.to(dtype), t.to(dtype), cond_rows).float()

    x = adapter.apply_conditions(initial_noise(seeds, shape, device=device), media)
    latents, log_probs, timesteps = [], [], []
    for i in range(sampling.num_steps):
        sigma = sigmas[i].to(device).expand(rows)                           # (B,)
        sigma_next = sigmas[i + 1].to(device).expand(rows)
        timesteps.append(float(model_time(sigmas[i], adapter.time_convention,
                                          adapter.model_time_scale)))
        v = predict_velocity(model_fn, x, sigma, adapter.time_convention,
                             adapter.model_time_scale)                      # (B, *S) fp32
        stochastic = uses_sde(i, window)
        if stochastic and i == window[0]:
            latents.append(x)
        kind = sampling.sampler if stochastic else SamplerKind.ODE
        noise = row_noise(seeds, i, shape, device=device) if stochastic else None
        step = sampler_step(kind, x, v, sigma, sigma_next, sampling.noise_level, noise)
        x = adapter.apply_conditions(step.prev_sample, media)
        if stochastic:
            latents.append(x)
            log_probs.append(step.log_prob)
    if not latents:                     # ODE (empty window): the trajectory is the start only
        latents.append(initial_noise(seeds, shape, device=device))
    return {"state": x,
            "latents": torch.stack(latents, dim=1),                             # (B, W+1, *S)
            "log_probs": (torch.stack(log_probs, dim=1) if log_probs
                          else torch.zeros(rows, 0, device=device)),            # (B, W)
            "sigmas": sigmas, "model_timesteps": torch.tensor(timesteps), "window": window}


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
        from adapters.registry import get_adapter    # adapters import diffusers/transformers

        self.adapter: DiffusionAdapter = get_adapter(args["adapter"])
        components: Components = self.adapter.load(od_config.model)
        self.transformer = components.transformer.eval().requires_grad_(False)
        components.text_encoder = None                 # the encoder stage runs elsewhere
        self._components = components                  # encode_media for media tasks
        self.loras = ResidentLoRAs(self.transformer, self.adapter.lora_map,
                                   int(args.get("max_resident_loras", 4)))
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
                                      field="prompt.extra_args.prompt_embeds", request_id=rid)
        media = {MediaRole(k): v for k, v in (extra.get("media") or {}).items()}
        cond_latents = self.adapter.encode_media(self._components, sampling, media)
        lora_id = self.loras.activate(params.lora_request)
        out = sample_request(self.adapter, self.transformer, sampling, cond,
                             read_condition(extra, "negative_prompt"), cond_latents, device)
        split = self.adapter.split_state(out["state"], sampling)
        latents = {name: split[name] for name in names if name in split}
        envelope = build_envelope(latents, sampling, out["sigmas"], out["window"], lora_id)
        return self._output_cls(output=envelope, trajectory_latents=out["latents"],
                                trajectory_timesteps=out["model_timesteps"],
                                trajectory_log_probs=out["log_probs"], to_cpu=True)
