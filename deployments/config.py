"""Validated graph configuration: one pydantic model per stage, unknown fields forbidden.

Serve options (resources, autoscaling, placement) are derived from these models in one place,
`StageOptions.deployment_options()`; raw Serve options are not accepted.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from contract import ConfigError, RequestLimits
from deployments.objects import (DEFAULT_MAX_OBJECTS, DEFAULT_TTL_S, HolderSpec,
                                 holder_name)
from deployments.placement import check_resource_names, check_selector
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


def mib_to_bytes(mib: int | None) -> int | None:
    """A `memory_mib`-style bound in bytes (None: no bound)."""
    return None if mib is None else mib * 2**20


class StageOptions(Model):
    """Resources and scaling of one deployment."""

    num_cpus: float = Field(0.25, ge=0, description="Logical CPUs per replica.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica.")
    num_replicas: int = Field(1, ge=1, description="Fixed replica count when autoscaling is off.")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources per replica: the stage runs only "
        "on nodes started with them (`ray start --resources`), e.g. {rollout_node: 0.01}.")
    node_labels: dict[str, str] = Field(
        default_factory=dict, description="Ray label selector: the stage runs only on nodes whose "
        "labels match (`ray start --labels`); values 'v', '!v', 'in(a,b)', '!in(a,b)'.")
    max_ongoing_requests: int = Field(16, ge=1)
    memory_mib: int | None = Field(
        None, ge=64, description="Memory per replica (MiB): Ray schedules the replica by it and "
        "the replica ends itself when its anonymous RSS passes it (deployments/memory.py), so a "
        "runaway replica is the one replaced. None = no request, no bound.")
    autoscaling: Autoscaling | None = None

    @property
    def memory_bytes(self) -> int | None:
        return mib_to_bytes(self.memory_mib)

    def deployment_options(self, name: str) -> dict[str, Any]:
        actor = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory_bytes is not None:
            actor["memory"] = self.memory_bytes
        opts: dict[str, Any] = {
            "name": name,
            "ray_actor_options": actor,
            "max_ongoing_requests": self.max_ongoing_requests,
            "graceful_shutdown_wait_loop_s": 0.0,
            "graceful_shutdown_timeout_s": 2.0,
        }
        if self.resources:
            opts["ray_actor_options"]["resources"] = dict(self.resources)
        if self.node_labels:
            opts["ray_actor_options"]["label_selector"] = dict(self.node_labels)
        if self.autoscaling is not None:
            opts["autoscaling_config"] = self.autoscaling.model_dump(exclude_none=True)
        else:
            opts["num_replicas"] = self.num_replicas
        return opts

    @field_validator("resources", "node_labels")
    @classmethod
    def _check_placement(cls, value: dict, info) -> dict:
        check = check_resource_names if info.field_name == "resources" else check_selector
        try:
            return dict(check(value))
        except ConfigError as exc:
            raise ValueError(f"{exc.message} ({exc.field}={exc.actual!r})") from None


class MicroBatch(Model):
    """A stage's `@serve.batch` micro-batch of concurrent calls (deployments/microbatch.py)."""

    max_batch_size: int = Field(8, ge=1, description="Calls in one micro-batch at most.")
    batch_wait_timeout_s: float = Field(
        0.0, ge=0, le=1.0, description="How long a micro-batch waits for more calls after its "
        "first. 0: a call alone runs at once and calls arriving meanwhile queue into the next "
        "batch (batches form under load, a lone request never waits; bench/graph_bench).")


class IngressStage(StageOptions):
    memory_mib: int | None = Field(2048, ge=64, description="The ingress holds no tensors (only "
                                   "the tokenizer): 2 GiB bounds it for every model family.")


class EncoderStage(StageOptions, MicroBatch):
    """The text encoder: concurrent calls' uncached prompts (requests' prompts and their CFG
    negatives) run in one forward."""

    max_batch_size: int = Field(16, ge=1, description="Calls whose uncached prompts share one "
                                "encoder forward at most.")
    etp: int = Field(1, ge=1, description="Encoder tensor-parallel degree (shard workers).")
    num_cpus_per_shard: float = Field(0.25, gt=0)
    num_gpus_per_shard: float = Field(0.0, ge=0, description="1 per shard for nccl on GPU.")
    memory_mib_per_shard: int | None = Field(
        None, ge=64, description="Memory per ETP shard worker (MiB), as `memory_mib` for the "
        "replica: in its placement-group bundle and its own guard (a worker over it ends, the "
        "replica fails its health check and Serve replaces the group). None = no bound.")
    device: str = Field("cpu", description="torch device of the encoder (and its shards).")
    dtype: str = Field("float32", description="Weights dtype of the text encoders.")
    prompt_cache_mib: int = Field(
        256, ge=0, description="Bound of the replica's prompt-embedding cache (MiB of tensors; "
        "least recently used out first): each prompt is encoded once per encoder version. "
        "0 = no cache. Below `memory_mib` when that is set (the cache lives in the replica).")

    @property
    def memory_bytes_per_shard(self) -> int | None:
        return mib_to_bytes(self.memory_mib_per_shard)

    @property
    def prompt_cache_bytes(self) -> int:
        return self.prompt_cache_mib * 2**20

    @model_validator(mode="after")
    def _check_cache(self) -> "EncoderStage":
        if self.memory_mib is not None and self.prompt_cache_mib >= self.memory_mib:
            raise ValueError(f"prompt_cache_mib {self.prompt_cache_mib} must be below the "
                             f"replica's memory_mib {self.memory_mib}")
        return self


class DecoderStage(StageOptions, MicroBatch):
    """The decoders: concurrent requests' latents of one shape decode in one forward."""

    device: str = Field("cpu", description="torch device of the decoders (VAE, vocoder).")
    dtype: str = Field("float32", description="Weights dtype of the decoders.")


def check_pip_spec(spec: str, field: str) -> None:
    """One requirement (`name[extras]<op>version`, `name @ url` written without spaces) or one
    local wheel: Ray writes each entry as a line of a requirements file, so whitespace, a
    newline or a leading `-` would smuggle in pip options (`--index-url`, `-e`, `-r`)."""
    from packaging.requirements import InvalidRequirement, Requirement
    if not spec or any(c.isspace() or not c.isprintable() for c in spec) or \
            spec.startswith("-"):
        raise ValueError(f"{field} must be one requirement without whitespace or options, "
                         f"got {spec!r}")
    if spec.endswith(".whl") and "://" not in spec and ";" not in spec:
        return
    try:
        Requirement(spec)
    except InvalidRequirement as exc:
        raise ValueError(f"{field} is not a requirement specifier ({exc}), got {spec!r}") \
            from None


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
            check_pip_spec(spec, f"pip[{i}]")
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


class ScorerStage(MicroBatch):
    """One scorer deployment (a scorer family): what it is, what it reads, how it counts;
    concurrent requests' samples of one media shape are scored in one call."""

    name: str
    scorer: ScorerSpec = Field(description="Scorer kind and parameters (rewards.registry).")
    inputs: tuple[str, ...] = Field(min_length=1, description="Artifact names it reads: decoded "
                                    "ones (decoded for it) or latents (read from the rollout).")
    reward: ScorerWeight = Field(default_factory=ScorerWeight,
                                 description="Weight, required/optional policy, timeout.")
    stage: ScorerStageOptions = Field(default_factory=ScorerStageOptions)


class HttpOptions(Model):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    max_preview_pixels: int = Field(64 * 64 * 16, description="Largest media returned as base64.")
    allowed_hosts: tuple[str, ...] = Field(
        ("127.0.0.1", "localhost", "::1"), min_length=1,
        description="Host header names answered (port aside); any other is a 421, so a web page "
                    "whose DNS name is rebound to this address cannot read the answers.")

    @field_validator("allowed_hosts")
    @classmethod
    def _lower_hosts(cls, hosts: tuple[str, ...]) -> tuple[str, ...]:
        for host in hosts:
            if not host or host != host.strip() or "/" in host or host.startswith("["):
                raise ValueError(f"a host name or address without port or brackets, got {host!r}")
        return tuple(h.lower().rstrip(".") for h in hosts)


class ObjectsOptions(Model):
    """Bounds of the graph's ObjectHolder (deployments/objects.py): stage outputs a caller never
    releases are dropped after `ttl_s` or past `max_objects` references. A trainer checks at
    start-up that `ttl_s` covers its expected step time (trainer/config.py)."""

    ttl_s: float = Field(DEFAULT_TTL_S, gt=0, description="Seconds a held stage output lives "
                         "unreleased (a caller that fetched it releases it at once).")
    max_objects: int = Field(DEFAULT_MAX_OBJECTS, ge=1, description="References held at most; "
                             "the oldest go first.")
    shards: int = Field(1, ge=1, le=64, description="Holder actors: each request's references "
                        "live on the one its id hashes to, so holds and releases spread over "
                        "them (raise it with the ingress and stage replica counts); each holds "
                        "its share of max_objects.")


class GraphConfig(Model):
    """The whole rollout graph."""

    app_name: str = "omni"
    rollout: RolloutConfig = Field(default_factory=RolloutConfig,
                                   description="Strategy, engine, adapter and weights (the one "
                                               "place the adapter is named).")
    encoder: EncoderStage = Field(default_factory=EncoderStage)
    rollout_stage: StageOptions = Field(default_factory=StageOptions)
    decoder: DecoderStage = Field(default_factory=DecoderStage)
    scorers: tuple[ScorerStage, ...] = ()
    ingress: IngressStage = Field(default_factory=IngressStage)
    limits: RequestLimits = Field(default_factory=RequestLimits)
    http: HttpOptions = Field(default_factory=HttpOptions)
    policy_store: str = Field("omni_policy_store", description="Named actor holding LoRA versions.")
    objects: ObjectsOptions = Field(default_factory=ObjectsOptions)
    stage_wait_s: float = Field(60.0, gt=0, description="Longest a request waits for a replica "
                                "of a stage to take it (none running: node lost, replicas "
                                "restarting); then StageUnavailableError, 503, retryable.")
    group_affinity: bool = Field(
        False, description="Route the requests of one prompt group (one prompt's ids) to one "
        "encoder and one rollout replica (deployments/routing.py), where they share the prompt "
        "cache and batch together. Off by default: with it on, a trainer's rollouts through the "
        "full graph were seen to stall; false = Serve's default power-of-two-choices routing.")

    @property
    def reward_config(self) -> RewardConfig | None:
        if not self.scorers:
            return None
        return RewardConfig(scorers={s.name: s.reward for s in self.scorers})

    @property
    def adapter(self) -> str:
        return self.rollout.adapter

    @property
    def object_holder(self) -> HolderSpec:
        """The graph's ObjectHolder actor and its bounds, as every stage gets it."""
        return HolderSpec(holder_name(self.app_name), self.objects.ttl_s,
                          self.objects.max_objects, self.objects.shards)

    @property
    def weights_path(self) -> str | None:
        return self.rollout.weights_path

    @property
    def adapter_options(self) -> dict[str, Any]:
        return dict(self.rollout.adapter_options)

    @model_validator(mode="after")
    def _check(self) -> "GraphConfig":
        names = [s.name for s in self.scorers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"scorer names must be unique, repeated: {dupes}")
        return self


def load_graph_config(source: dict[str, Any] | str | Path | GraphConfig) -> GraphConfig:
    """Validate a dict / YAML file into GraphConfig; every error is a ConfigError naming the
    field (or the file and line), never another exception."""
    if isinstance(source, GraphConfig):
        return source
    if isinstance(source, (str, Path)):
        data = read_yaml(source)
        if isinstance(data, Mapping) and "graph" in data and "applications" not in data:
            graph = data["graph"] if isinstance(data["graph"], str) else "inline"
            raise ConfigError(f"{source} is a trainer config, not a graph config (check it with "
                              f"`python -m trainer --config {source} --check`); its graph: "
                              f"{graph}", field="graph", expected="a Serve config file",
                              actual=str(source))
        data = _serve_args(data)
    elif isinstance(source, Mapping):
        data = dict(source)
    else:
        raise ConfigError("a graph config is a mapping, a YAML path or a GraphConfig",
                          field="config", actual=type(source).__name__)
    try:
        return GraphConfig.model_validate(data)
    except ValidationError as exc:
        raise config_error(exc, "invalid graph config") from exc


def _serve_args(data: Any) -> Any:
    """Accept either bare GraphConfig YAML or Serve's config-file form (applications[0].args)."""
    if isinstance(data, Mapping) and "applications" in data:
        apps = data["applications"]
        if not isinstance(apps, list) or not apps:
            raise ConfigError("Serve config needs a non-empty list of applications",
                              field="applications", actual=type(apps).__name__)
        if not isinstance(apps[0], Mapping):
            raise ConfigError("a Serve application is a mapping", field="applications[0]",
                              actual=type(apps[0]).__name__)
        args = apps[0].get("args") or {}
        if not isinstance(args, Mapping):
            raise ConfigError("a Serve application's args are a mapping (the graph config)",
                              field="applications[0].args", actual=type(args).__name__)
        return dict(args)
    return data


def read_yaml(path: str | Path, field: str = "config") -> Any:
    """The data of a YAML file, or a ConfigError naming the file (missing, unreadable, not
    UTF-8, not YAML with its line and column, nested too deeply to load)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config file not found", field=field, expected="a YAML file",
                          actual=str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError("config file is not UTF-8 text", field=field,
                          actual=f"{path}: byte {exc.start}") from None
    except OSError as exc:
        raise ConfigError(f"config file cannot be read ({exc.strerror})", field=field,
                          actual=str(path)) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"config file is not valid YAML: {problem}", field=field,
                          actual=where) from None
    except RecursionError:
        raise ConfigError("config file nests too deeply to load", field=field,
                          actual=str(path)) from None


# pydantic puts the member of a union it tried into `loc` ("str", "GraphConfig", ...)
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "tuple", "set"}


def config_error(exc: ValidationError, what: str) -> ConfigError:
    """The most specific of a ValidationError's errors as a ConfigError whose field is the
    dotted path of config keys (union member tags left out)."""
    errors = exc.errors(include_url=False)
    best = max(errors, key=lambda e: len(e["loc"]))
    models = {cls.__name__ for cls in _subclasses(BaseModel)}
    parts = [p for p in best["loc"] if not (isinstance(p, str) and (
        p in models or p in _TYPE_TAGS or p.startswith("function-") or "[" in p))]
    field = "".join(f"[{p}]" if isinstance(p, int) else ("." if i else "") + str(p)
                    for i, p in enumerate(parts))
    actual = best.get("input")
    if isinstance(actual, (dict, list, tuple)) or (isinstance(actual, str) and len(actual) > 200):
        actual = type(actual).__name__
    return ConfigError(f"{what}: {best['msg']}", field=field or "config", actual=actual)


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out
