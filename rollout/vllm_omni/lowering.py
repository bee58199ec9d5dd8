"""Pure translation between the project's engine boundary and vLLM-Omni's request/output shapes.

Client side: EngineRequest -> (OmniCustomPrompt dict, OmniDiffusionSamplingParams kwargs) and
OmniRequestOutput -> EngineResult. Worker side: one request's sampler result -> the canonical
post-process envelope `{"payload": {"output": {latent name: (B, *layout)}}, "metadata": {"rl":
{...}}}` plus the `trajectory_*` fields of DiffusionOutput. Nothing here imports vLLM.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from adapters.family import ModelFamily
from contract import (Condition, MediaArtifact, MissingArtifactError, OutputContractError,
                      PolicyVersionError, ReplicaFailedError, SamplerKind, SamplingSpec, StopReason,
                      Trajectory, UnexpectedArtifactError, collect_artifacts)
from rollout.engine_api import EngineRequest, EngineResult
from rollout.recorder import check_finite

RL_GROUP = "rl"   # our metadata group inside the envelope (vLLM-Omni tolerates unknown groups)


# ---- client side: lowering ---------------------------------------------------------------------
def _condition_args(prefix: str, cond: Condition) -> dict[str, torch.Tensor]:
    """A Condition's named tensors as `extra_args` entries `<prefix>.<name>`."""
    return {f"{prefix}.{name}": tensor for name, tensor in cond.tensors.items()}


def lower_prompt(request: EngineRequest) -> dict[str, Any]:
    """EngineRequest -> an OmniCustomPrompt dict (token ids, never text).

    The encoder stage already ran, so the pipeline conditions on the embeddings carried in
    `extra_args`; `prompt_ids` are the exact ids the encoder saw (kept for provenance checks).
    """
    bundle = request.request.prompt
    prompt: dict[str, Any] = {"prompt_ids": list(bundle.token_ids)}
    if bundle.attention_mask is not None:
        prompt["prompt_mask"] = torch.tensor(bundle.attention_mask, dtype=torch.long)
    if bundle.negative is not None:
        prompt["negative_prompt_ids"] = list(bundle.negative.token_ids)
    extra: dict[str, Any] = _condition_args("prompt", request.cond)
    if request.negative is not None:
        extra.update(_condition_args("negative_prompt", request.negative))
    extra["media"] = {role.value: tensor for role, tensor in request.media.items()}
    prompt["extra_args"] = extra
    return prompt


def lower_sampling_kwargs(request: EngineRequest) -> dict[str, Any]:
    """Keyword arguments for OmniDiffusionSamplingParams (real field names, see api.REAL_API).

    The real fields carry what vLLM-Omni's scheduler batches on (steps, size, guidance, rows);
    `extra_args` carries the project's full SamplingSpec so the pipeline samples exactly it.
    """
    s = request.request.sampling
    return dict(num_inference_steps=s.num_steps, guidance_scale=s.guidance_scale,
                seed=s.seeds[0], height=s.height, width=s.width, num_frames=s.num_frames,
                num_outputs_per_prompt=s.samples_per_prompt, eta=s.noise_level,
                output_type="latent",
                extra_args={"sampling": s.model_dump(mode="json"),
                            "latent_artifacts": list(request.latent_artifacts)})


def read_sampling(extra_args: Mapping[str, Any]) -> tuple[SamplingSpec, tuple[str, ...]]:
    """Worker side inverse of lower_sampling_kwargs."""
    if "sampling" not in extra_args or "latent_artifacts" not in extra_args:
        raise OutputContractError("sampling params lack the project's extra_args",
                                  field="sampling_params.extra_args",
                                  expected=["sampling", "latent_artifacts"],
                                  actual=sorted(extra_args))
    return (SamplingSpec.model_validate(extra_args["sampling"]),
            tuple(extra_args["latent_artifacts"]))


def read_condition(extra_args: Mapping[str, Any], prefix: str) -> Condition | None:
    """Worker side inverse of `_condition_args` (None when the prefix is absent)."""
    head = f"{prefix}."
    tensors = {k[len(head):]: v for k, v in extra_args.items() if k.startswith(head)}
    return Condition(tensors) if tensors else None


# ---- worker side: the envelope ----------------------------------------------------------------
def build_envelope(latents: Mapping[str, torch.Tensor], sampling: SamplingSpec,
                   sigmas: torch.Tensor, window: tuple[int, int],
                   lora_int_id: int, frozen_mask: torch.Tensor | None = None) -> dict[str, Any]:
    """Named latents (B, *layout) + RL metadata -> the canonical payload/metadata envelope."""
    return {"payload": {"output": dict(latents)},
            "metadata": {RL_GROUP: {"sigmas": sigmas.tolist(), "window": list(window),
                                    "seeds": list(sampling.seeds),
                                    "sampler": sampling.sampler.value,
                                    "noise_level": sampling.noise_level,
                                    "guidance_scale": sampling.guidance_scale,
                                    "lora_int_id": lora_int_id,
                                    "frozen_mask": None if frozen_mask is None
                                    else frozen_mask.cpu()}}}


# ---- client side: normalising the output ------------------------------------------------------
def normalize_output(out: Any, request: EngineRequest, adapter: ModelFamily,
                     lora_int_id: int, metrics: Mapping[str, float]) -> EngineResult:
    """The last OmniRequestOutput of one request -> EngineResult. Fails closed on anything
    missing or undeclared; never substitutes a value."""
    rid = request.request.request_id
    if out is None:
        raise ReplicaFailedError("engine finished the request without any output",
                                 field="outputs", request_id=rid)
    if getattr(out, "error", None):
        raise ReplicaFailedError("engine reported an error", field="error", actual=out.error,
                                 request_id=rid)
    if not out.finished:
        raise OutputContractError("last output is not finished", field="finished",
                                  expected=True, actual=out.finished, request_id=rid)
    images = out.images
    if not (isinstance(images, list) and len(images) == 1 and isinstance(images[0], dict)):
        raise MissingArtifactError("primary payload must be one dict of named latents",
                                   field="images", expected="[{name: tensor}]",
                                   actual=type(images[0]).__name__ if images else images,
                                   request_id=rid)
    produced = []
    for name, data in images[0].items():
        if name not in adapter.io_spec.names:
            raise UnexpectedArtifactError("returned artifact is not declared",
                                          field=f"artifacts.{name}",
                                          expected=list(adapter.io_spec.names), actual=name,
                                          request_id=rid)
        if isinstance(data, torch.Tensor) and data.is_floating_point():
            check_finite(data, f"artifacts.{name}", rid)     # the server's fault, not a 4xx
        produced.append(MediaArtifact(adapter.io_spec[name], data))
    latents = collect_artifacts(adapter.io_spec, request.latent_artifacts, produced, rid)

    mm = out.multimodal_output or {}
    rl = (mm.get("metadata") or {}).get(RL_GROUP)
    if rl is None:
        raise MissingArtifactError("output lacks the RL metadata group",
                                   field=f"multimodal_output.metadata.{RL_GROUP}", request_id=rid)
    if rl["lora_int_id"] != lora_int_id:
        raise PolicyVersionError("output was sampled with another LoRA id",
                                 field="lora_int_id", expected=lora_int_id,
                                 actual=rl["lora_int_id"], request_id=rid)
    for name in ("trajectory_latents", "trajectory_timesteps", "trajectory_log_probs"):
        if getattr(out, name, None) is None:
            raise MissingArtifactError("output lacks a trajectory field", field=name,
                                       request_id=rid)
    s = request.request.sampling
    trajectory = Trajectory(
        latents=out.trajectory_latents.float(),
        sigmas=torch.tensor(rl["sigmas"], dtype=torch.float32),
        model_timesteps=out.trajectory_timesteps.float(),
        log_probs=out.trajectory_log_probs.float(),
        window=tuple(rl["window"]), sampler=SamplerKind(rl["sampler"]),
        noise_level=float(rl["noise_level"]), guidance_scale=float(rl["guidance_scale"]),
        seeds=tuple(rl["seeds"]), policy_version=request.policy_version,
        frozen_mask=rl.get("frozen_mask"))
    _check_trajectory(trajectory, s, rid)
    check_finite(trajectory.latents, "trajectory.latents", rid)
    check_finite(trajectory.log_probs, "trajectory.log_probs", rid)
    return EngineResult(request_id=rid, latents=latents, trajectory=trajectory,
                        policy_version=request.policy_version, stop_reason=StopReason.FINISHED,
                        metrics=dict(metrics))


def _check_trajectory(t: Trajectory, s: SamplingSpec, rid: str) -> None:
    rows, (start, end) = len(s.seeds), t.window
    checks = [("trajectory.seeds", t.seeds, tuple(s.seeds)),
              ("trajectory.sigmas.shape", tuple(t.sigmas.shape), (s.num_steps + 1,)),
              ("trajectory.model_timesteps.shape", tuple(t.model_timesteps.shape),
               (s.num_steps,)),
              ("trajectory.log_probs.shape", tuple(t.log_probs.shape), (rows, end - start)),
              ("trajectory.latents.shape[:2]", tuple(t.latents.shape[:2]),
               (rows, end - start + 1))]
    for field_name, actual, expected in checks:
        if actual != expected:
            raise OutputContractError("trajectory does not match the request", field=field_name,
                                      expected=expected, actual=actual, request_id=rid)
