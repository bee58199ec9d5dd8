"""Rollout configuration: which strategy, which engine, which adapter, and the engine's bounds.

One pydantic model (extra fields forbidden) validated at build time. The strategy kind is read in
exactly one place, `rollout.strategy.build_strategy`; the engine kind in `rollout.strategy.build_engine`.
"""
from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class StrategyKind(str, Enum):
    DIFFUSION = "diffusion"   # DiT rollout with a stochastic sampler + trajectory


class EngineKind(str, Enum):
    EMBEDDED = "embedded"     # in-process torch engine (rollout/engine.py), CPU or one GPU
    VLLM_OMNI = "vllm_omni"   # vLLM-Omni diffusion engine (rollout/vllm_omni/)


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class EngineLimits(_Config):
    """Bounds of one engine loop."""

    max_batch_rows: int = Field(32, ge=1, description="Rows (before CFG doubling) in one forward.")
    max_queue_requests: int = Field(64, ge=1, description="Requests waiting + running; one more "
                                    "is refused at once with QueueFullError.")
    max_resident_lora_versions: int = Field(3, ge=1, description="LoRA versions held at once "
                                            "besides 'base'; the least recently used unpinned "
                                            "one is evicted when a new one is loaded.")
    max_resident_full_versions: int = Field(1, ge=1, description="Full-weight versions (a full "
                                            "fine-tune's) held at once besides the base "
                                            "weights; each costs one model's weights.")


class RolloutConfig(_Config):
    """Everything the DiT-rollout stage needs to build itself."""

    strategy: StrategyKind = StrategyKind.DIFFUSION
    engine: EngineKind = EngineKind.EMBEDDED
    adapter: str = Field("tiny_t2i", description="Model family in adapters.registry, or 'auto' "
                         "(from the checkpoint's model_index.json).")
    weights_path: str | None = Field(None, description="Local checkpoint dir; None = the "
                                     "weights an embedded family ships.")
    adapter_options: dict[str, Any] = Field(default_factory=dict, description="The family's "
                                            "own settings (e.g. sd3: max_sequence_length).")
    architecture: str | None = Field(None, description="A shipped architecture description "
                                     "(adapters/architectures, e.g. sd3.5-medium) the family's "
                                     "declarations are read from where weights_path is not on "
                                     "this machine (config check, planner, manifests); the "
                                     "stages always load weights_path.")
    device: str = Field("cpu", description="torch device of the embedded engine.")
    dtype: str = Field("float32", description="Weights dtype of the transformer(s) (float32, "
                       "bfloat16, float16); sampler math and trajectories stay fp32.")
    packed_inference_form: bool = Field(False, description="Serve fused q/k/v and sharded fc1 "
                                        "(the family's packed form; LoRA through its packed "
                                        "map) instead of the training form.")
    limits: EngineLimits = Field(default_factory=EngineLimits)
