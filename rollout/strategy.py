"""The rollout strategy: diffusion (DiT + stochastic sampler).

`build_strategy(config, limits)` is the one place the strategy kind is read (a dict keyed by the
enum); `build_engine` the one place the engine kind is read. Each strategy owns its config, input
lowering, engine call and output building. Request bounds are the graph's RequestLimits
(GraphConfig.limits), the same set the ingress checks.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import torch

from adapters.family import ModelFamily
from adapters.registry import get_family
from contract import (Condition, ConfigError, InvalidRequestError, MediaRole, Representation,
                      RequestLimits, RolloutOutput, RolloutRequest, check_requested_artifacts)
from rollout.config import EngineKind, RolloutConfig, StrategyKind
from rollout.engine import EmbeddedEngine
from rollout.engine_api import DiffusionEngine, EngineRequest, forks_of


def _build_embedded(config: RolloutConfig, family: ModelFamily) -> DiffusionEngine:
    """The rollout stage's components: the transformer(s), once, and what encodes condition
    media (a VAE) when the family has conditioned tasks. No text encoder, no decoder."""
    models = family.load_transformers(config.dtype, config.device)
    media = family.load_media_encoders(config.dtype, config.device)
    maps = None
    if config.packed_inference_form:                # fused q/k/v + sharded fc1, one copy
        packed = {name: family.packed_form(name, model) for name, model in models.items()}
        models = {name: module for name, (module, _) in packed.items()}
        maps = {name: lora_map for name, (_, lora_map) in packed.items()}
    return EmbeddedEngine(family, models, media, config.limits, config.device, maps)


def _build_vllm_omni(config: RolloutConfig, family: ModelFamily) -> DiffusionEngine:
    import rollout.vllm_omni as vllm_omni          # GPU-only dependency, imported on demand
    build = getattr(vllm_omni, "build_engine", None)
    if build is None:
        raise ConfigError("rollout.vllm_omni provides no build_engine(config, family)",
                          field="engine", expected=EngineKind.EMBEDDED.value,
                          actual=config.engine.value)
    return build(config, family)


ENGINE_BUILDERS: dict[EngineKind, Callable[[RolloutConfig, ModelFamily], DiffusionEngine]] = {
    EngineKind.EMBEDDED: _build_embedded,
    EngineKind.VLLM_OMNI: _build_vllm_omni,
}


def build_engine(config: RolloutConfig, family: ModelFamily) -> DiffusionEngine:
    return ENGINE_BUILDERS[config.engine](config, family)


class DiffusionStrategy:
    """Validate a RolloutRequest against the family, lower it to an EngineRequest with the
    conditions the encoder stage computed, run the engine, and build the RolloutOutput (latent
    artifacts + trajectory; decoding is downstream)."""

    def __init__(self, config: RolloutConfig, family: ModelFamily, engine: DiffusionEngine,
                 limits: RequestLimits):
        self.config = config
        self.limits = limits
        self.family = family
        self.engine = engine

    @classmethod
    def build(cls, config: RolloutConfig, limits: RequestLimits) -> "DiffusionStrategy":
        family = get_family(config.adapter, config.weights_path, config.adapter_options)
        return cls(config, family, build_engine(config, family), limits)

    # ---- lowering -----------------------------------------------------------------------
    def resolve_artifacts(self, request: RolloutRequest) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(requested names, latent names the engine must produce for them)."""
        io_spec = self.family.io_spec
        names = io_spec.defaults if request.requested_artifacts is None else \
            check_requested_artifacts(request, io_spec.names)
        return tuple(names), io_spec.latent_needed(names)

    def validate(self, request: RolloutRequest) -> dict[MediaRole, torch.Tensor]:
        """Contract checks against this family; returns the canonical condition media."""
        return self.family.validate_request(request, self.limits)

    def lower(self, request: RolloutRequest, cond: Condition,
              negative: Condition | None) -> EngineRequest:
        """The request for the engine; a branch rollout (request.branch) as its forks."""
        forks = forks_of(request.branch)
        if forks and not getattr(self.engine, "supports_forks", False):
            raise InvalidRequestError("this engine runs no branch rollouts", field="branch",
                                      expected=None, actual=request.branch.model_dump(),
                                      request_id=request.request_id)
        media = self.validate(request)      # the branch against the limits and schedule too
        # the scale the rows run at (the family's guidance rule), as the trajectory records it
        request = dataclasses.replace(request,
                                      sampling=self.family.sampling_as_run(request.sampling))
        _, latent_names = self.resolve_artifacts(request)
        version = request.policy_version or self._latest_version()
        return EngineRequest(request=request, cond=cond, negative=negative,
                             latent_artifacts=latent_names, media=media, policy_version=version,
                             forks=forks)

    def _latest_version(self) -> str:
        latest = getattr(self.engine, "latest_version", None)
        return latest() if latest is not None else self.engine.versions()[-1]

    # ---- run ----------------------------------------------------------------------------
    async def generate(self, request: RolloutRequest, cond: Condition,
                       negative: Condition | None = None) -> RolloutOutput:
        """cond / negative: the prompt's (and, under CFG, the unconditional) condition from
        the encoder stage, one row each. A branch rollout (request.branch): the output's rows
        are the tree's leaves (their own seeds), `tree` the engine's RolloutTree."""
        engine_request = self.lower(request, cond, negative)
        result = await self.engine.generate(engine_request)
        names, latent_names = self.resolve_artifacts(request)
        io_spec = self.family.io_spec
        decode = {n: io_spec[n].source for n in names
                  if io_spec[n].representation == Representation.DECODED}
        return RolloutOutput(
            request_id=request.request_id, artifacts=dict(result.latents),
            trajectory=result.trajectory, policy_version=result.policy_version,
            seeds=result.trajectory.seeds if result.tree else request.sampling.seeds,
            stop_reason=result.stop_reason,
            metrics=dict(result.metrics),
            metadata={"requested_artifacts": names, "latent_artifacts": latent_names,
                      "decode": decode}, tree=result.tree)


STRATEGY_BUILDERS: Mapping[StrategyKind, Callable[[RolloutConfig, RequestLimits], object]] = {
    StrategyKind.DIFFUSION: DiffusionStrategy.build,
}


def build_strategy(config: RolloutConfig, limits: RequestLimits) -> DiffusionStrategy:
    """The one place the strategy kind is read. `limits`: the graph's request bounds."""
    return STRATEGY_BUILDERS[config.strategy](config, limits)


__all__ = ["DiffusionStrategy", "build_engine", "build_strategy"]
