"""The JSON body of POST /rollout. Unknown fields are rejected; sizes are bounded by RequestLimits
at the ingress. Text prompts are tokenized once, at the ingress, by the adapter's tokenizer."""
from __future__ import annotations

from pydantic import Field

from contract.enums import SamplerKind, Task
from contract.request import FrozenModel


class HTTPRolloutRequest(FrozenModel):
    prompts: tuple[str, ...] = Field(min_length=1, description="One request (group) per prompt.")
    samples_per_prompt: int = Field(1, ge=1)
    seed: int = Field(0, ge=0, description="Row seeds are seed + row index (returned per sample).")
    num_steps: int = Field(10, ge=1)
    task: Task | None = Field(None, description="None = the adapter's first task.")
    sampler: SamplerKind = SamplerKind.SDE
    noise_level: float = Field(0.7, ge=0.0, le=2.0)
    sde_window: tuple[int, int] | None = None
    guidance_scale: float = Field(1.0, ge=0.0)
    height: int | None = Field(None, ge=8)
    width: int | None = Field(None, ge=8)
    num_frames: int | None = Field(None, ge=1)
    artifacts: tuple[str, ...] | None = Field(None, description="None = adapter defaults.")
    include_media: bool = Field(False, description="Return small decoded media as data URLs.")
    policy_version: str | None = None
