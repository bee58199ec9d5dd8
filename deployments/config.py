"""Validated graph configuration: one pydantic model per stage, unknown fields forbidden.

Serve options (resources, autoscaling, placement) are derived from these models in one place,
`StageOptions.deployment_options()`; raw Serve options are not accepted.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from contract import ConfigError, RequestLimits
from rewards.combine import RewardConfig, ScorerWeight
from rewards.registry import ScorerSpec
from rollout.config import RolloutConfig


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class Autoscaling(Model):
    """Per-stage Serve autoscaling (fields as in Ray Serve's AutoscalingConfig)."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float = Field(2.0, gt=0)
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    look_back_period_s: float = Field(30.0, gt=0)
    metrics_interval_s: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "Autoscaling":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas {self.min_replicas} > max_replicas {self.max_replicas}")
        return self


class StageOptions(Model):
    """Resources and scaling of one deployment."""

    num_cpus: float = Field(0.25, ge=0, description="Logical CPUs per replica.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica.")
    num_replicas: int = Field(1, ge=1, description="Fixed replica count when autoscaling is off.")
    max_ongoing_requests: int = Field(16, ge=1)
    autoscaling: Autoscaling | None = None

    def deployment_options(self, name: str) -> dict[str, Any]:
        opts: dict[str, Any] = {
            "name": name,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "max_ongoing_requests": self.max_ongoing_requests,
            "graceful_shutdown_wait_loop_s": 0.0,
            "graceful_shutdown_timeout_s": 2.0,
        }
        if self.autoscaling is not None:
            opts["autoscaling_config"] = self.autoscaling.model_dump(exclude_none=True)
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


class EncoderStage(StageOptions):
    etp: int = Field(1, ge=1, description="Encoder tensor-parallel degree (shard workers).")
    num_cpus_per_shard: float = Field(0.25, gt=0)
    num_gpus_per_shard: float = Field(0.0, ge=0, description="1 per shard for nccl on GPU.")
    device: str = Field("cpu", description="torch device of the encoder (and its shards).")


class ScorerRuntimeEnv(Model):
    """A scorer replica's own Ray runtime_env: packages the graph's environment lacks (or pins
    differently) are installed into a virtualenv of that replica alone, on top of the graph's
    site-packages, so a scorer with conflicting dependencies runs beside the others."""

    pip: tuple[str, ...] = Field((), description="requirement specifiers (or local wheel "
                                 "paths) installed for the replica by pip")
    env_vars: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> "ScorerRuntimeEnv":
        for i, spec in enumerate(self.pip):
            if not spec.strip() or spec.lstrip().startswith("-"):
                raise ValueError(f"pip[{i}] must be a requirement specifier, got {spec!r}")
        return self

    def to_ray(self) -> dict[str, Any]:
        env: dict[str, Any] = {}
        if self.pip:
            env["pip"] = {"packages": list(self.pip), "pip_check": False}
        if self.env_vars:
            env["env_vars"] = dict(self.env_vars)
        return env


class ScorerStageOptions(StageOptions):
    """A scorer deployment's resources, plus its own environment and custom Ray resources."""

    runtime_env: ScorerRuntimeEnv | None = None
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray "
                                        "resources per replica, e.g. {'reward_node': 1}")

    def deployment_options(self, name: str) -> dict[str, Any]:
        opts = super().deployment_options(name)
        if self.runtime_env is not None:
            opts["ray_actor_options"]["runtime_env"] = self.runtime_env.to_ray()
        if self.resources:
            opts["ray_actor_options"]["resources"] = dict(self.resources)
        return opts


class ScorerStage(Model):
    """One scorer deployment (a scorer family): what it is, what it reads, how it counts."""

    name: str
    scorer: ScorerSpec = Field(description="Scorer kind and parameters (rewards.registry).")
    inputs: tuple[str, ...] = Field(min_length=1, description="Decoded artifact names it reads.")
    reward: ScorerWeight = Field(default_factory=ScorerWeight,
                                 description="Weight, required/optional policy, timeout.")
    stage: ScorerStageOptions = Field(default_factory=ScorerStageOptions)
    max_batch_size: int = Field(8, ge=1, description="@serve.batch micro-batch (requests).")
    batch_wait_timeout_s: float = Field(0.01, ge=0)


class HttpOptions(Model):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_preview_pixels: int = Field(64 * 64 * 16, description="Largest media returned as base64.")


class GraphConfig(Model):
    """The whole rollout graph."""

    app_name: str = "omni"
    rollout: RolloutConfig = Field(default_factory=RolloutConfig,
                                   description="Strategy, engine, adapter and weights (the one "
                                               "place the adapter is named).")
    encoder: EncoderStage = Field(default_factory=EncoderStage)
    rollout_stage: StageOptions = Field(default_factory=StageOptions)
    decoder: StageOptions = Field(default_factory=StageOptions)
    scorers: tuple[ScorerStage, ...] = ()
    ingress: StageOptions = Field(default_factory=StageOptions)
    limits: RequestLimits = Field(default_factory=RequestLimits)
    http: HttpOptions = Field(default_factory=HttpOptions)
    policy_store: str = Field("omni_policy_store", description="Named actor holding LoRA versions.")

    @property
    def reward_config(self) -> RewardConfig | None:
        if not self.scorers:
            return None
        return RewardConfig(scorers={s.name: s.reward for s in self.scorers})

    @property
    def adapter(self) -> str:
        return self.rollout.adapter

    @property
    def weights_path(self) -> str | None:
        return self.rollout.weights_path

    @model_validator(mode="after")
    def _check(self) -> "GraphConfig":
        names = [s.name for s in self.scorers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"scorer names must be unique, repeated: {dupes}")
        return self


def load_graph_config(source: dict[str, Any] | str | Path | GraphConfig) -> GraphConfig:
    """Validate a dict / YAML file into GraphConfig; errors name the field (ConfigError)."""
    if isinstance(source, GraphConfig):
        return source
    if isinstance(source, (str, Path)):
        data = yaml.safe_load(Path(source).read_text())
        data = _serve_args(data)
    else:
        data = dict(source)
    try:
        return GraphConfig.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"invalid graph config: {first['msg']}", field=field,
                          actual=first.get("input")) from exc


def _serve_args(data: dict[str, Any]) -> dict[str, Any]:
    """Accept either bare GraphConfig YAML or Serve's config-file form (applications[0].args)."""
    if isinstance(data, dict) and "applications" in data:
        apps = data["applications"]
        if not apps:
            raise ConfigError("Serve config has no applications", field="applications")
        return dict(apps[0].get("args") or {})
    return data
