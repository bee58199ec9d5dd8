"""Rollout strategies: diffusion (DiT + stochastic sampler) and autoregressive (causal LM).

`build_strategy(config)` is the one place the strategy kind is read (a dict keyed by the enum);
`build_engine` the one place the engine kind is read. Each strategy owns its config, input
lowering, engine call and output building.
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch

from adapters.base import Components, DiffusionAdapter, TextCondition
from contract import (ConfigError, InvalidRequestError, MediaRole, Representation,
                      RolloutOutput, RolloutRequest, TokenOutput,
                      check_requested_artifacts)
from rollout.ar import ARStrategy
from rollout.config import EngineKind, RolloutConfig, StrategyKind
from rollout.engine import EmbeddedEngine
from rollout.engine_api import DiffusionEngine, EngineRequest


def _build_embedded(config: RolloutConfig, adapter: DiffusionAdapter,
                    components: Components) -> DiffusionEngine:
    return EmbeddedEngine(adapter, components, config.limits, config.device)


def _build_vllm_omni(config: RolloutConfig, adapter: DiffusionAdapter,
                     components: Components) -> DiffusionEngine:
    import rollout.vllm_omni as vllm_omni          # GPU-only dependency, imported on demand
    build = getattr(vllm_omni, "build_engine", None)
    if build is None:
        raise ConfigError("rollout.vllm_omni provides no build_engine(config, adapter, "
                          "components)", field="engine", expected=EngineKind.EMBEDDED.value,
                          actual=config.engine.value)
    return build(config, adapter, components)


ENGINE_BUILDERS: dict[EngineKind, Callable[[RolloutConfig, DiffusionAdapter, Components],
                                           DiffusionEngine]] = {
    EngineKind.EMBEDDED: _build_embedded,
    EngineKind.VLLM_OMNI: _build_vllm_omni,
}


def build_engine(config: RolloutConfig, adapter: DiffusionAdapter,
                 components: Components) -> DiffusionEngine:
    return ENGINE_BUILDERS[config.engine](config, adapter, components)


class DiffusionStrategy:
    """Validate a RolloutRequest against the adapter, lower it to an EngineRequest, run the
    engine, and build the RolloutOutput (latent artifacts + trajectory; decoding is downstream)."""

    def __init__(self, config: RolloutConfig, adapter: DiffusionAdapter, components: Components,
                 engine: DiffusionEngine):
        self.config = config
        self.adapter = adapter
        self.components = components
        self.engine = engine

    @classmethod
    def build(cls, config: RolloutConfig) -> "DiffusionStrategy":
        from adapters.registry import get_adapter
        adapter = get_adapter(config.adapter)
        components = adapter.load(config.weights_path)
        return cls(config, adapter, components, build_engine(config, adapter, components))

    # ---- lowering -----------------------------------------------------------------------
    def resolve_artifacts(self, request: RolloutRequest) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(requested names, latent names the engine must produce for them)."""
        io_spec = self.adapter.io_spec
        names = io_spec.defaults if request.requested_artifacts is None else \
            check_requested_artifacts(request, io_spec.names)
        return tuple(names), io_spec.latent_needed(names)

    def validate(self, request: RolloutRequest) -> dict[MediaRole, torch.Tensor]:
        """Contract checks against this adapter; returns the canonical condition media."""
        return self.adapter.validate_request(request, self.config.request_limits)

    def encode(self, request: RolloutRequest) -> tuple[TextCondition, TextCondition | None]:
        """The prompt (and unconditional prompt under CFG) through this replica's text encoder.
        The graph's text-encoder stage passes its own conditions to `generate` instead."""
        prompt = request.prompt
        cond = self.adapter.encode(self.components.text_encoder, [prompt])
        if request.sampling.guidance_scale == 1.0:
            return cond, None
        if prompt.negative_token_ids is None:
            negative = self.adapter.null_prompt()
        else:
            negative = type(prompt)(token_ids=prompt.negative_token_ids or
                                    self.adapter.null_prompt().token_ids)
        return cond, self.adapter.encode(self.components.text_encoder, [negative])

    def lower(self, request: RolloutRequest, cond: TextCondition,
              negative: TextCondition | None) -> EngineRequest:
        media = self.validate(request)
        _, latent_names = self.resolve_artifacts(request)
        version = request.policy_version or self._latest_version()
        if request.sampling.guidance_scale != 1.0 and negative is None:
            raise InvalidRequestError("guidance_scale != 1 needs the unconditional condition",
                                      field="negative", request_id=request.request_id)
        return EngineRequest(request=request, cond=cond, negative=negative,
                             latent_artifacts=latent_names, media=media, policy_version=version)

    def _latest_version(self) -> str:
        latest = getattr(self.engine, "latest_version", None)
        return latest() if latest is not None else self.engine.versions()[-1]

    # ---- run ----------------------------------------------------------------------------
    async def generate(self, request: RolloutRequest, cond: TextCondition | None = None,
                       negative: TextCondition | None = None) -> RolloutOutput:
        if cond is None:
            self.validate(request)          # fail on bad input before running the encoder
            cond, negative = self.encode(request)
        engine_request = self.lower(request, cond, negative)
        result = await self.engine.generate(engine_request)
        names, latent_names = self.resolve_artifacts(request)
        io_spec = self.adapter.io_spec
        decode = {n: io_spec[n].source for n in names
                  if io_spec[n].representation == Representation.DECODED}
        return RolloutOutput(
            request_id=request.request_id, artifacts=dict(result.latents),
            trajectory=result.trajectory, policy_version=result.policy_version,
            seeds=request.sampling.seeds, stop_reason=result.stop_reason,
            metrics=dict(result.metrics),
            metadata={"requested_artifacts": names, "latent_artifacts": latent_names,
                      "decode": decode})


STRATEGY_BUILDERS: Mapping[StrategyKind, Callable[[RolloutConfig], object]] = {
    StrategyKind.DIFFUSION: DiffusionStrategy.build,
    StrategyKind.AR: ARStrategy.build,
}


def build_strategy(config: RolloutConfig) -> DiffusionStrategy | ARStrategy:
    """The one place the strategy kind is read."""
    return STRATEGY_BUILDERS[config.strategy](config)


__all__ = ["ARStrategy", "DiffusionStrategy", "TokenOutput", "build_engine", "build_strategy"]
