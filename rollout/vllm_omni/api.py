"""Every vLLM-Omni 0.30.0 name this engine relies on, in one list, and the lazy loader for them.

`REAL_API` is the single source of truth shared by the adapter (which resolves its classes from it)
and by `tests/test_vllm_omni_wheel_contract.py` (which checks each entry against the source of the
real `vllm-omni==0.30.0` wheel with `ast`, without importing it). Adding a use of a new upstream
name means adding it here, so the adapter and the check cannot drift apart.

Nothing here imports vllm or vllm_omni at module import time; `load_real_api()` does, and only the
engine's construction path calls it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import Enum
from types import SimpleNamespace

VLLM_OMNI_VERSION = "0.30.0"


class ApiKind(str, Enum):
    CLASS = "class"          # a class defined in the module (or re-exported by an import there)
    METHOD = "method"        # "Class.method": a (possibly async) def in the class body
    PARAM = "param"          # "Class.method:name": a parameter of that method
    FIELD = "field"          # "Class.field": an annotated field of a dataclass / struct / TypedDict
    ATTRIBUTE = "attribute"  # "Class.attr": a field, a property or a method (read on instances)


@dataclass(frozen=True)
class ApiName:
    module: str      # dotted module path inside the wheel, e.g. "vllm_omni.inputs.data"
    name: str        # see ApiKind for the spelling
    kind: ApiKind


def _entries(module: str, kind: ApiKind, *names: str) -> list[ApiName]:
    return [ApiName(module, n, kind) for n in names]


_ASYNC = "vllm_omni.entrypoints.async_omni"
_BASE = "vllm_omni.entrypoints.async_omni_base"
_INPUTS = "vllm_omni.inputs.data"
_OUTPUTS = "vllm_omni.outputs"
_DATA = "vllm_omni.diffusion.data"
_BATCH = "vllm_omni.diffusion.worker.request_batch"
_WORKER = "vllm_omni.diffusion.worker.diffusion_worker"

REAL_API: tuple[ApiName, ...] = tuple(
    # --- client: engine construction, generate, control ------------------------------------
    _entries(_ASYNC, ApiKind.CLASS, "AsyncOmni")
    + _entries(_ASYNC, ApiKind.METHOD, "AsyncOmni.generate", "AsyncOmni.abort",
               "AsyncOmni.sleep", "AsyncOmni.wake_up", "AsyncOmni.remove_lora")
    + _entries(_ASYNC, ApiKind.PARAM, "AsyncOmni.generate:prompt",
               "AsyncOmni.generate:request_id", "AsyncOmni.generate:sampling_params_list",
               "AsyncOmni.sleep:level", "AsyncOmni.abort:request_id",
               "AsyncOmni.remove_lora:adapter_id")
    + _entries(_BASE, ApiKind.METHOD, "AsyncOmniBase.shutdown")
    # --- OmniDiffusionConfig kwargs passed to AsyncOmni(...) ---------------------------------
    + _entries(_DATA, ApiKind.FIELD, "OmniDiffusionConfig.custom_pipeline_args",
               "OmniDiffusionConfig.output_type", "OmniDiffusionConfig.max_num_seqs",
               "OmniDiffusionConfig.enable_sleep_mode", "OmniDiffusionConfig.dtype",
               "OmniDiffusionConfig.model")
    # --- prompt and sampling params --------------------------------------------------------
    + _entries(_INPUTS, ApiKind.FIELD, "OmniCustomPrompt.prompt_ids",
               "OmniCustomPrompt.prompt_mask", "OmniCustomPrompt.negative_prompt_ids",
               "OmniCustomPrompt.negative_prompt_mask", "OmniCustomPrompt.extra_args")
    + _entries(_INPUTS, ApiKind.CLASS, "OmniDiffusionSamplingParams")
    + _entries(_INPUTS, ApiKind.FIELD, *(f"OmniDiffusionSamplingParams.{f}" for f in (
        "num_inference_steps", "guidance_scale", "seed", "height", "width", "num_frames",
        "num_outputs_per_prompt", "eta", "output_type", "extra_args", "lora_request",
        "lora_scale")))
    + [ApiName("vllm_omni.lora.request", "LoRARequest", ApiKind.CLASS)]
    # --- client-side output ----------------------------------------------------------------
    + _entries(_OUTPUTS, ApiKind.ATTRIBUTE, *(f"OmniRequestOutput.{f}" for f in (
        "request_id", "finished", "images", "trajectory_latents", "trajectory_timesteps",
        "trajectory_log_probs", "multimodal_output", "error", "stage_durations")))
    # --- worker side: the custom pipeline ---------------------------------------------------
    + _entries(_DATA, ApiKind.CLASS, "DiffusionOutput")
    + _entries(_DATA, ApiKind.FIELD, *(f"DiffusionOutput.{f}" for f in (
        "output", "trajectory_latents", "trajectory_timesteps", "trajectory_log_probs",
        "error", "to_cpu")))
    + _entries(_BATCH, ApiKind.ATTRIBUTE, *(f"DiffusionRequestBatch.{f}" for f in (
        "prompts", "request_ids", "sampling_params_list", "is_dummy_run")))
    + _entries(_WORKER, ApiKind.METHOD, "CustomPipelineWorkerExtension.re_init_pipeline")
)

# LoRARequest is vLLM's msgspec struct re-exported by vllm_omni.lora.request; its fields live in
# the vllm wheel. These are the three the adapter passes (printed from the real class).
LORA_REQUEST_FIELDS = ("lora_name", "lora_int_id", "lora_path")


# Architectures vLLM-Omni resolves a checkpoint folder to (model_index.json `_class_name`), one
# per checkpoint family the project serves on it; checked against the wheel's registry
# (`vllm_omni/diffusion/registry.py::_DIFFUSION_MODELS`) by the wheel-contract test.
REGISTRY_MODULE = "vllm_omni.diffusion.registry"
REGISTRY_TABLE = "_DIFFUSION_MODELS"
SERVED_ARCHITECTURES: tuple[str, ...] = (
    "StableDiffusion3Pipeline", "FluxPipeline", "WanPipeline", "WanImageToVideoPipeline",
    "LTX2Pipeline",
    "FluxKontextPipeline",     # the FLUX family's folders saved by it (edit)
    "QwenImagePipeline")       # vllm_omni.diffusion.models.qwen_image.pipeline_qwen_image


def load_real_api() -> SimpleNamespace:
    """Import the real classes (GPU machines with the `vllm` extra installed)."""
    def get(module: str, name: str):
        return getattr(importlib.import_module(module), name)

    return SimpleNamespace(
        AsyncOmni=get(_ASYNC, "AsyncOmni"),
        OmniDiffusionSamplingParams=get(_INPUTS, "OmniDiffusionSamplingParams"),
        LoRARequest=get("vllm_omni.lora.request", "LoRARequest"),
        DiffusionOutput=get(_DATA, "DiffusionOutput"),
    )
