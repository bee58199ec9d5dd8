"""A CPU stand-in for vLLM-Omni 0.30's AsyncOmni, for tests on machines without a GPU.

It mirrors the real names, signatures and behaviours rollout/vllm_omni/engine.py relies on (see
rollout/vllm_omni/api.py REAL_API, checked against the wheel on the GPU machine): `AsyncOmni(model, **kwargs)` loading the custom pipeline by qualified name with
`od_config.model` / `custom_pipeline_args`; `generate(prompt, sampling_params=None,
request_id="", *, sampling_params_list=None, ...)` as an async generator of request outputs,
refusing list prompts (ValueError) and requests while asleep (RuntimeError);
`sleep(stage_ids=None, level=2, mode="abort")` / `wake_up(stage_ids=None, tags=None)` returning
ACKs, needing `enable_sleep_mode`; `abort(request_id, *, timeout=None)`; `shutdown(timeout=None)`.
Underneath it runs the REAL RolloutPipeline (real diffusers DiT, our sampler) in a worker thread
and formats its envelope the way vLLM-Omni's output formatter does (primary payload -> `images`,
metadata -> `multimodal_output["metadata"]`, DiffusionOutput.trajectory_* -> trajectory_*).
"""
from __future__ import annotations

import asyncio
import importlib
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, AsyncGenerator, Sequence

import torch


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None


@dataclass
class OmniDiffusionSamplingParams:
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int = 1
    num_outputs_per_prompt: int = 1
    eta: float = 0.0
    output_type: str | None = None
    extra_args: dict = field(default_factory=dict)
    lora_request: LoRARequest | None = None
    lora_scale: float = 1.0


@dataclass
class DiffusionOutput:
    output: Any = None
    trajectory_timesteps: Any = None
    trajectory_latents: Any = None
    trajectory_log_probs: Any = None
    error: str | None = None
    to_cpu: bool = False

    def __post_init__(self) -> None:
        if self.to_cpu:
            for name in ("trajectory_timesteps", "trajectory_latents", "trajectory_log_probs"):
                value = getattr(self, name)
                if isinstance(value, torch.Tensor):
                    setattr(self, name, value.detach().cpu())


@dataclass
class OmniRequestOutput:
    request_id: str
    finished: bool = True
    images: list = field(default_factory=list)
    trajectory_latents: Any = None
    trajectory_timesteps: Any = None
    trajectory_log_probs: Any = None
    multimodal_output: dict = field(default_factory=dict)
    error: str | None = None
    stage_durations: dict = field(default_factory=dict)


@dataclass
class OmniACK:
    task_id: str
    status: str
    freed_bytes: int = 0
    error_msg: str | None = None


@dataclass
class _Request:
    request_id: str
    prompt: Any
    sampling_params: OmniDiffusionSamplingParams


@dataclass
class DiffusionRequestBatch:
    requests: list[_Request]

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @property
    def prompts(self) -> list[Any]:
        return [r.prompt for r in self.requests]

    @property
    def sampling_params_list(self) -> list[OmniDiffusionSamplingParams]:
        return [r.sampling_params for r in self.requests]

    def is_dummy_run(self) -> bool:
        return self.request_ids == ["dummy_req_id"]


def _format(request_id: str, out: DiffusionOutput) -> OmniRequestOutput:
    """The subset of vLLM-Omni's normalise + format path our pipeline's envelope exercises."""
    if out.error:
        raise RuntimeError(out.error)   # DiffusionEngine.postprocess_output raises on errors
    envelope = out.output or {}
    payload, metadata = envelope.get("payload", {}), envelope.get("metadata", {})
    primary = next((k for k in ("video", "image", "text", "audio", "output") if k in payload),
                   None)
    value = payload.get(primary) if primary else None
    images = value if isinstance(value, list) else ([value] if value is not None else [])
    return OmniRequestOutput(request_id=request_id, images=images,
                             trajectory_latents=out.trajectory_latents,
                             trajectory_timesteps=out.trajectory_timesteps,
                             trajectory_log_probs=out.trajectory_log_probs,
                             multimodal_output={"metadata": metadata} if metadata else {})


class AsyncOmni:
    def __init__(self, model: str = "", *args: Any, **kwargs: Any):
        if "diffusion_batch_size" in kwargs:
            raise ValueError("`diffusion_batch_size` is removed. Use `max_num_seqs`.")
        custom = kwargs.get("custom_pipeline_args") or {}
        self.enable_sleep_mode = bool(kwargs.get("enable_sleep_mode", False))
        self.od_config = SimpleNamespace(model=model, custom_pipeline_args=custom,
                                         output_type=kwargs.get("output_type", "pil"),
                                         max_num_seqs=kwargs.get("max_num_seqs", 1),
                                         dtype=kwargs.get("dtype", torch.bfloat16))
        module, _, name = custom["pipeline_class"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        self.pipeline = cls(od_config=self.od_config, output_cls=DiffusionOutput)
        self.pipeline.to(dtype=self.od_config.dtype)
        self.pipeline.load_weights(iter(()))
        self._sleeping_tags: set[str] = set()
        self._aborted: set[str] = set()
        self.generate_calls: list[tuple[Any, OmniDiffusionSamplingParams]] = []
        # start-up warm-up, as DiffusionEngine._dummy_run does
        self.pipeline.forward(DiffusionRequestBatch([_Request(
            "dummy_req_id", {"prompt": "dummy run"},
            OmniDiffusionSamplingParams(height=512, width=512, num_inference_steps=2))]))

    async def generate(self, prompt: Any, sampling_params: Any = None, request_id: str = "", *,
                       sampling_params_list: Sequence[OmniDiffusionSamplingParams] | None = None,
                       lora_request: LoRARequest | None = None,
                       **kwargs: Any) -> AsyncGenerator[OmniRequestOutput, None]:
        if isinstance(prompt, list):
            raise ValueError("Submit multiple independent requests to use scheduler batching")
        if self._sleeping_tags:
            raise RuntimeError("engine is sleeping; call wake_up() first")
        params = (sampling_params_list[0] if sampling_params_list else sampling_params)
        if params is None:
            params = OmniDiffusionSamplingParams()
        internal = f"{request_id}-{uuid.uuid4().hex[:8]}"
        self.generate_calls.append((prompt, params))
        batch = DiffusionRequestBatch([_Request(internal, prompt, params)])
        (out,) = await asyncio.to_thread(self.pipeline.forward, batch)
        if request_id in self._aborted:
            return
        yield _format(request_id, out)

    async def abort(self, request_id: str, *, timeout: float | None = None) -> None:
        self._aborted.add(request_id)

    async def sleep(self, stage_ids: list[int] | None = None, level: int = 2,
                    mode: str = "abort") -> list[OmniACK]:
        if not self.enable_sleep_mode:
            return [OmniACK(uuid.uuid4().hex, "ERROR", error_msg="enable_sleep_mode is off")]
        freed = sum(p.numel() * p.element_size() for p in self.pipeline.parameters())
        self._sleeping_tags = {"weights"}
        self._sleep_level = level
        return [OmniACK(uuid.uuid4().hex, "SUCCESS", freed_bytes=freed)]

    async def wake_up(self, stage_ids: list[int] | None = None,
                      tags: list[str] | None = None) -> list[OmniACK]:
        if self._sleeping_tags and getattr(self, "_sleep_level", 1) == 2:
            raise NotImplementedError("wake_up after sleep(level=2) is not supported")
        self._sleeping_tags = set()
        return [OmniACK(uuid.uuid4().hex, "SUCCESS")]

    def is_sleeping(self) -> bool:
        return bool(self._sleeping_tags)

    def shutdown(self, timeout: float | None = None) -> None:
        self.pipeline = None


def fake_api() -> SimpleNamespace:
    """The fake's classes under the names api.load_real_api() returns."""
    return SimpleNamespace(AsyncOmni=AsyncOmni,
                           OmniDiffusionSamplingParams=OmniDiffusionSamplingParams,
                           LoRARequest=LoRARequest, DiffusionOutput=DiffusionOutput)
