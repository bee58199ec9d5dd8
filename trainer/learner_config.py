"""Where and how the learner runs: device and dtype, memory knobs, LoRA or full fine-tuning, and
the data-parallel worker group (Ray Train) with its placement beside the rollout replicas.

    learner:
      device: cuda            # the learner's device (each Ray Train worker's own GPU)
      dtype: bfloat16         # transformer weights; LoRA / full-FT master weights stay fp32
      gradient_checkpointing: true
      micro_batch_size: 2     # rows per forward; gradients accumulate over micro-batches
      fine_tune: lora         # lora: DDP-style all-reduce of the LoRA grads; full: FSDP2
      workers: 4              # 0 = in the trainer process; N >= 1 = a Ray Train worker group
      resources_per_worker: {GPU: 1}
      placement: disaggregated   # or colocated (the rollout engines sleep while learners step)

The recipe is defined globally: group size, the global batch (prompts_per_step x
samples_per_prompt) and the update do not depend on `workers` or `micro_batch_size`; both only
decide where and in how many pieces the same gradient is computed.
"""
from __future__ import annotations

from enum import Enum

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from adapters.checkpoint import DTYPES, resolve_dtype
from contract import ConfigError, PolicyKind


class Placement(str, Enum):
    """Rollout replicas and learner workers on the same devices or on their own."""

    DISAGGREGATED = "disaggregated"  # each side on its declared resources; rollouts of step k+1
                                     # run while the learners train step k (pipeline.mode async)
    COLOCATED = "colocated"          # the learners share the rollout replicas' devices: the
                                     # rollout engines sleep while the learners step


class LearnerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$",
                        description="torch device of the learner (of each worker).")
    dtype: str = Field("float32", description="Transformer (and text encoder) weights; LoRA and "
                       "full-FT master weights are fp32, sampler / log-prob math fp32.")
    gradient_checkpointing: bool = Field(False, description="Recompute the transformer blocks' "
                                         "activations in backward (diffusers models).")
    micro_batch_size: int | None = Field(None, ge=1, description="Rows per forward (CFG doubles "
                                         "them); None = every row of the worker's shard at once.")
    fine_tune: PolicyKind = Field(PolicyKind.LORA, description="lora: train the `lora` adapter; "
                                  "full: every transformer weight (versions publish full weights).")
    workers: int = Field(0, ge=0, description="0: the learner runs in the trainer process; N >= "
                         "1: N Ray Train workers, each training its shard of the prompt groups.")
    resources_per_worker: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0}, description="Ray resources of each worker "
        "(ScalingConfig.resources_per_worker), e.g. {GPU: 1} or {CPU: 0.5}.")
    label_selector: dict[str, str] = Field(default_factory=dict, description="Ray node labels "
                                           "the workers must land on, e.g. {omni.role: learner}.")
    placement: Placement = Placement.DISAGGREGATED
    backend: str | None = Field(None, pattern="^(gloo|nccl)$", description="torch.distributed "
                                "backend; None = nccl on cuda, gloo on cpu.")
    collective_timeout_s: int = Field(600, ge=10, description="A worker waits this long in a "
                                      "collective before its group fails.")

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, value: str) -> str:
        if value not in DTYPES:
            raise ValueError(f"unknown dtype {value!r}; one of {sorted(DTYPES)}")
        return value

    @property
    def distributed(self) -> bool:
        return self.workers >= 1

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def process_group_backend(self) -> str:
        return self.backend or ("nccl" if self.device.startswith("cuda") else "gloo")

    def check_device(self, device: str | None = None) -> tuple[torch.device, torch.dtype]:
        """(device, dtype) this machine can run, or ConfigError naming `learner.device` /
        `learner.dtype` -- called before any weight is loaded."""
        device = torch.device(device or self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("the learner's device is not available on this machine",
                              field="learner.device", expected="cpu", actual=str(device))
        return device, resolve_dtype(self.dtype, device, field="learner.dtype")

    def check_batch(self, prompts_per_step: int) -> None:
        """The global batch splits into equal shards of whole prompt groups."""
        if self.workers > 1 and prompts_per_step % self.workers:
            raise ConfigError(f"learner.workers={self.workers} does not divide the global batch "
                              f"of prompts_per_step={prompts_per_step} prompt groups",
                              field="learner.workers",
                              expected=f"a divisor of {prompts_per_step}", actual=self.workers)


def check_recipe(cfg) -> None:
    """Learner settings against the rest of a TrainerConfig (ConfigError naming the field)."""
    learner = cfg.learner
    learner.check_batch(cfg.prompts_per_step)
    if learner.placement is Placement.COLOCATED and cfg.pipeline.mode.value != "serial":
        raise ConfigError("colocated learners train while the rollout engines sleep: the next "
                          "batch cannot be sampled meanwhile", field="learner.placement",
                          expected="pipeline.mode: serial", actual=cfg.pipeline.mode.value)
    if learner.fine_tune is PolicyKind.FULL and cfg.lora.components is not None:
        raise ConfigError("a full fine-tune trains every transformer", field="lora.components",
                          expected=None, actual=list(cfg.lora.components))
    if learner.fine_tune is PolicyKind.FULL and cfg.lora.init_from is not None:
        raise ConfigError("a LoRA file cannot start a full fine-tune", field="lora.init_from",
                          expected=None, actual=cfg.lora.init_from)
