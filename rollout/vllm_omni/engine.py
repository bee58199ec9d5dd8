"""The vLLM-Omni 0.30 engine: rollout.engine_api.DiffusionEngine over `AsyncOmni`.

One `AsyncOmni` per replica runs `RolloutPipeline` (our adapter + our sampler) in its worker
process. This class only lowers requests, keeps the policy-version -> LoRA id table and
normalises outputs; see lowering.py for the translation and lora.py for the LoRA hand-off.
vLLM is imported only by `VllmOmniEngine.create` (through api.load_real_api), never at import.
"""
from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping

import torch

from adapters.family import ModelFamily
from adapters.lora_targets import LoRATargetMap
from contract import (ConfigError, PolicyVersionError, ReplicaFailedError,
                      RequestCancelledError)
from rollout.engine_api import EngineRequest, EngineResult
from rollout.vllm_omni.api import SERVED_ARCHITECTURES
from rollout.vllm_omni.lora import check_lora_tensors, lora_module_shapes, write_peft_dir
from rollout.vllm_omni.lowering import lower_prompt, lower_sampling_kwargs, normalize_output

BASE_VERSION = "base"
PIPELINE_CLASS = "rollout.vllm_omni.pipeline.RolloutPipeline"


def check_architecture(family: ModelFamily) -> None:
    """A checkpoint family's folder must resolve to an architecture vLLM-Omni registers (its
    model_index.json `_class_name`); the embedded tiny families write their own index."""
    cls = getattr(family, "pipeline_class", None)
    if cls is not None and cls not in SERVED_ARCHITECTURES:
        raise ConfigError("vLLM-Omni does not register this checkpoint's pipeline class",
                          field="rollout.engine", expected=list(SERVED_ARCHITECTURES),
                          actual=cls)


def served_lora_map(family: ModelFamily) -> LoRATargetMap:
    """The worker applies LoRA with peft on the training-form transformer: the identity map
    over the family's explicit targets."""
    return LoRATargetMap.identity(family.spec.lora_targets["transformer"])


class VllmOmniEngine:
    """DiffusionEngine over a (real or fake) AsyncOmni. Build with `VllmOmniEngine.create`."""

    def __init__(self, omni: Any, api: SimpleNamespace, adapter: ModelFamily,
                 lora_modules: Mapping[str, tuple[int, int]], lora_root: Path):
        self._omni, self._api, self.adapter = omni, api, adapter
        self._lora_modules = dict(lora_modules)
        self._lora_root = lora_root
        self._lora_ids = itertools.count(1)          # never reused: a new id per loaded version
        self._loras: dict[str, Any] = {}             # version -> LoRARequest
        self._inflight: dict[str, asyncio.Task] = {}
        self._cancelled: set[str] = set()

    @classmethod
    def create(cls, adapter_name: str, model_path: str, *, api: SimpleNamespace | None = None,
               lora_root: str | None = None, max_num_seqs: int = 1,
               max_resident_loras: int = 4, enable_sleep_mode: bool = True,
               dtype: torch.dtype = torch.bfloat16, **engine_kwargs: Any) -> "VllmOmniEngine":
        """Start AsyncOmni on `model_path` with the project pipeline. `api` defaults to the real
        vLLM-Omni classes (api.load_real_api); CPU tests pass the fake's namespace."""
        from adapters.registry import get_family
        from rollout.vllm_omni.api import load_real_api

        api = api or load_real_api()
        adapter = get_family(adapter_name, model_path)
        check_architecture(adapter)
        transformer = adapter.load("transformer")      # LoRA targets for load_lora checks
        modules = lora_module_shapes(transformer, served_lora_map(adapter))
        del transformer
        omni = api.AsyncOmni(
            model=model_path,
            custom_pipeline_args={"pipeline_class": PIPELINE_CLASS, "adapter": adapter_name,
                                  "max_resident_loras": max_resident_loras},
            output_type="latent", max_num_seqs=max_num_seqs,
            enable_sleep_mode=enable_sleep_mode, dtype=dtype, **engine_kwargs)
        root = Path(lora_root) if lora_root else Path(tempfile.mkdtemp(prefix="omni-lora-"))
        root.mkdir(parents=True, exist_ok=True)
        return cls(omni, api, adapter, modules, root)

    # ---- generation --------------------------------------------------------------------
    async def generate(self, request: EngineRequest) -> EngineResult:
        rid = request.request.request_id
        lora = self._lora_request(request.policy_version, rid)
        params = self._api.OmniDiffusionSamplingParams(**lower_sampling_kwargs(request),
                                                       lora_request=lora)
        prompt = lower_prompt(request)
        start = time.perf_counter()
        task = asyncio.ensure_future(self._last_output(prompt, rid, params))
        self._inflight[rid] = task
        try:
            out = await task
        except asyncio.CancelledError:
            if rid in self._cancelled:
                raise RequestCancelledError("request was cancelled", request_id=rid) from None
            raise
        finally:
            self._inflight.pop(rid, None)
        if rid in self._cancelled:
            self._cancelled.discard(rid)
            raise RequestCancelledError("request was cancelled", request_id=rid)
        metrics = {"engine_s": time.perf_counter() - start,
                   "rows": float(request.request.sampling.samples_per_prompt)}
        return normalize_output(out, request, self.adapter,
                                0 if lora is None else lora.lora_int_id, metrics)

    async def _last_output(self, prompt: dict, rid: str, params: Any) -> Any:
        last = None
        async for out in self._omni.generate(prompt=prompt, request_id=rid,
                                             sampling_params_list=[params]):
            last = out
        return last

    def cancel(self, request_id: str) -> bool:
        """Abort an in-flight request; its generate raises RequestCancelledError."""
        task = self._inflight.get(request_id)
        if task is None or task.done():
            return False
        self._cancelled.add(request_id)
        task.get_loop().create_task(self._omni.abort(request_id))
        task.cancel()
        return True

    # ---- LoRA versions -----------------------------------------------------------------
    def _lora_request(self, version: str, rid: str) -> Any:
        if version == BASE_VERSION:
            return None
        if version not in self._loras:
            raise PolicyVersionError("policy version is not loaded", field="policy_version",
                                     expected=self.versions(), actual=version, request_id=rid)
        return self._loras[version]

    def load_lora(self, version: str, tensors: Mapping[str, torch.Tensor],
                  scale: float = 1.0, copy: bool = True) -> None:
        """Validate peft-format tensors against the DiT, write them as a peft directory and
        register a LoRARequest with a NEW lora_int_id (ids are never reused, so the worker's
        cache can never serve stale weights under an old id). `copy` has no effect here: the
        tensors are always written out, never kept."""
        if version == BASE_VERSION:
            raise ConfigError("the base version cannot carry a LoRA", field="version",
                              actual=version)
        rank = check_lora_tensors(tensors, self._lora_modules, served_lora_map(self.adapter))
        lora_id = next(self._lora_ids)
        path = self._lora_root / f"{lora_id:06d}"
        write_peft_dir(path, tensors, rank, scale)
        old = self._loras.get(version)
        self._loras[version] = self._api.LoRARequest(lora_name=version, lora_int_id=lora_id,
                                                     lora_path=str(path))
        if old is not None:
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def unload_lora(self, version: str) -> None:
        lora = self._loras.pop(version, None)
        if lora is None:
            raise PolicyVersionError("policy version is not loaded", field="version",
                                     expected=self.versions(), actual=version)
        shutil.rmtree(lora.lora_path, ignore_errors=True)

    def lora_id(self, version: str) -> int:
        """The lora_int_id requests of `version` are sent with (0 = base model)."""
        return 0 if version == BASE_VERSION else self._lora_request(version, "").lora_int_id

    def versions(self) -> tuple[str, ...]:
        return (BASE_VERSION, *self._loras)

    # ---- lifecycle ---------------------------------------------------------------------
    async def sleep(self, level: int = 1) -> None:
        """Offload weights (level 1; level 2 cannot be woken in vLLM-Omni 0.30)."""
        if level != 1:
            raise ConfigError("only sleep level 1 can be woken up in vLLM-Omni 0.30",
                              field="level", expected=1, actual=level)
        self._check_acks(await self._omni.sleep(level=level), "sleep")

    async def wake_up(self) -> None:
        self._check_acks(await self._omni.wake_up(), "wake_up")

    @staticmethod
    def _check_acks(acks: Any, what: str) -> None:
        failed = [a for a in acks or () if getattr(a, "status", "SUCCESS") != "SUCCESS"]
        if failed:
            raise ReplicaFailedError(f"{what} failed on a worker", field=what,
                                     actual=[getattr(a, "error_msg", None) for a in failed])

    async def shutdown(self) -> None:
        for task in list(self._inflight.values()):
            task.cancel()
        self._omni.shutdown()
        for lora in self._loras.values():      # only the directories this engine wrote
            shutil.rmtree(lora.lora_path, ignore_errors=True)
        self._loras.clear()
