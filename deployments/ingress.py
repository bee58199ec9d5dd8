"""RolloutGraph, the ingress: validate, chain stages by DeploymentResponse, fan out per artifact.

encoder -> rollout -> decoders (one per requested latent kind) -> scorers. Every hop passes a
DeploymentResponse as a top-level argument, so Serve resolves it inside the receiving replica;
stage outputs are `StageOutput`s holding object refs, so this class only ever awaits small
metadata and never deserializes a tensor (`ingress_tensor_bytes` counts any that would arrive).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, Mapping, Sequence

import torch
from pydantic import ValidationError
from ray.exceptions import ActorDiedError, ActorUnavailableError, ObjectLostError, RayActorError
from ray.serve.exceptions import RayServeException
from starlette.requests import Request
from starlette.responses import JSONResponse

from adapters.registry import get_adapter
from contract import (GraphResult, LimitExceededError, PromptBundle, ReplicaFailedError,
                      Representation, RewardReport, RolloutError, RolloutRequest, SamplingSpec,
                      ScorerOutput, StageOutput, check_requested_artifacts)
from contract.http import HTTPRolloutRequest
from deployments.config import GraphConfig
from deployments.metrics import StageMetrics
from rewards.combine import RewardCombiner, ScorerPolicy, policy_failure

# A stage replica died mid-call, or an object it owned (a rollout's latents) died with it.
_REPLICA_DIED = (ActorDiedError, ActorUnavailableError, RayActorError, ObjectLostError)


def replica_died(exc: BaseException) -> bool:
    """True when `exc` means a replica (or an object it owned) is gone. Serve raises a
    RayServeException caused by ActorDiedError when an upstream stage of a chained call died."""
    return (isinstance(exc, _REPLICA_DIED)
            or isinstance(exc, RayServeException) and isinstance(exc.__cause__, _REPLICA_DIED))


def replica_failed(stage: str, exc: BaseException, request_id: str) -> ReplicaFailedError:
    """The typed, retryable error for a request lost with a replica (or its objects)."""
    return ReplicaFailedError(f"a {stage} replica died before the request was answered; "
                              "retry the request", field=stage, actual=type(exc).__name__,
                              request_id=request_id)


def tensor_bytes(obj: Any) -> int:
    """Bytes of tensor data inside `obj` (dataclasses, mappings, sequences walked)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(tensor_bytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class RolloutGraph:
    def __init__(self, config: GraphConfig, encoder, rollout, decoders: Mapping[str, Any],
                 scorers: Mapping[str, Any]):
        self.config = config
        self.adapter = get_adapter(config.adapter)
        self.io_spec = self.adapter.io_spec
        self.encoder, self.rollout_stage = encoder, rollout
        self.decoders, self.scorers = dict(decoders), dict(scorers)
        self.scorer_specs = {s.name: s for s in config.scorers}
        self.combiner = RewardCombiner(config.reward_config) if config.scorers else None
        self._primaries: dict[str, str] | None = None
        self.metrics = StageMetrics("ingress")
        self.ingress_tensor_bytes = 0

    # ---------------------------------------------------------------- handle API
    async def rollout(self, requests: RolloutRequest | Sequence[RolloutRequest],
                      preview: bool = False) -> list[GraphResult]:
        batch = [requests] if isinstance(requests, RolloutRequest) else list(requests)
        if len(batch) > self.config.limits.max_prompts:
            raise LimitExceededError("too many requests in one call", field="requests",
                                     expected=f"<= {self.config.limits.max_prompts}",
                                     actual=len(batch))
        rows = sum(r.sampling.samples_per_prompt for r in batch)
        with self.metrics.track(rows):
            return list(await asyncio.gather(*(self._one(r, preview) for r in batch)))

    async def stats(self) -> dict[str, int]:
        return {"ingress_tensor_bytes": self.ingress_tensor_bytes}

    async def _await_small(self, response) -> Any:
        value = await response
        self.ingress_tensor_bytes += tensor_bytes(value)
        return value

    def _validate(self, request: RolloutRequest) -> tuple[tuple[str, ...], dict]:
        """Fail fast, before any stage runs: (requested artifact names, condition media)."""
        requested = check_requested_artifacts(request, self.io_spec.names)
        return requested, self.adapter.validate_request(request, self.config.limits)

    async def _one(self, request: RolloutRequest, preview: bool) -> GraphResult:
        requested, media = self._validate(request)
        rid = request.request_id
        cond = self.encoder.encode.remote([request.prompt])
        negative = None
        if request.sampling.guidance_scale != 1.0:
            ids = request.prompt.negative_token_ids
            bundle = (PromptBundle(token_ids=ids) if ids else self.adapter.null_prompt())
            negative = self.encoder.encode.remote([bundle])
        try:
            stage: StageOutput = await self._await_small(
                self.rollout_stage.rollout.remote(request, cond, requested, negative))
        except Exception as exc:
            if replica_died(exc):        # the rollout replica (or the encoder upstream) died
                raise replica_failed("rollout", exc, rid) from exc
            raise
        decoded_by_latent = self._decoded_plan(requested)
        responses = {latent: self.decoders[latent].decode.remote(stage, names, preview)
                     for latent, names in decoded_by_latent.items()}
        artifacts = {n: h for n, h in stage.artifacts.items() if n in requested}
        previews: dict[str, tuple[str, ...]] = {}
        for latent, response in responses.items():
            try:
                out: StageOutput = await self._await_small(response)
            except Exception as exc:
                if replica_died(exc):         # the decoder died, or the latent's owner did
                    raise replica_failed(f"decoder.{latent}", exc, rid) from exc
                raise
            artifacts.update({n: h for n, h in out.artifacts.items() if n in requested})
            previews.update({n: p for n, p in out.previews.items() if n in requested})
        rewards = await self._score(request, responses, media)
        return GraphResult(request_id=rid, artifacts=artifacts,
                           policy_version=stage.policy_version, seeds=stage.seeds,
                           stop_reason=stage.stop_reason, trajectory=stage.trajectory,
                           rewards=rewards, previews=previews, metrics=stage.metrics,
                           encoded_token_ids=stage.encoded_token_ids)

    def _decoded_plan(self, requested: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """Decoded names to produce, grouped by the latent they decode from; scorers' inputs
        count as requested so they can score (they are decoded once, never twice)."""
        wanted = set(requested)
        for spec in self.config.scorers:
            wanted.update(spec.inputs)
        plan: dict[str, list[str]] = {}
        for name in self.io_spec.names:
            spec = self.io_spec[name]
            if name in wanted and spec.representation == Representation.DECODED:
                plan.setdefault(spec.source, []).append(name)
        return {latent: tuple(names) for latent, names in plan.items()}

    async def _score(self, request, responses, media) -> RewardReport | None:
        """Call every scorer deployment (per request, so scoring overlaps other requests'
        rollouts) under its timeout; failures go through the required/optional policy."""
        if not self.scorers:
            return None
        n = request.sampling.samples_per_prompt
        prompts = (request.prompt.text or "",) * n
        conditions = {role.value: data for role, data in media.items()}
        # the prompt's own metadata (OCR target text, GenEval objects...) reaches every scorer
        metadata = tuple(dict(request.metadata, **conditions, seed=seed)
                         for seed in request.sampling.seeds)
        if self._primaries is None:
            names = list(self.scorers)
            got = await asyncio.gather(*(self.scorers[k].primary.remote() for k in names))
            self._primaries = dict(zip(names, got))
        calls = {}
        for name, handle in self.scorers.items():
            spec = self.scorer_specs[name]
            sources = sorted({self.io_spec[i].source for i in spec.inputs})
            calls[name] = asyncio.wait_for(
                self._await_small(handle.score.remote(
                    *(responses[s] for s in sources), prompts=prompts, metadata=metadata)),
                timeout=spec.reward.timeout_s)
        results = await asyncio.gather(*calls.values(), return_exceptions=True)
        outputs: dict[str, ScorerOutput] = {}
        for name, result in zip(calls, results):
            required = self.scorer_specs[name].reward.policy == ScorerPolicy.REQUIRED
            if required and isinstance(result, Exception) and replica_died(result):
                raise replica_failed(f"scorer.{name}", result, request.request_id) from result
            if isinstance(result, BaseException):
                reason = ("timed out" if isinstance(result, asyncio.TimeoutError)
                          else f"{type(result).__name__}: {result}")
                result = policy_failure(name, self.scorer_specs[name].reward, n, reason, result,
                                        request_id=request.request_id)
            outputs[name] = result
        return self.combiner(outputs, self._primaries)

    # ---------------------------------------------------------------- HTTP API
    async def __call__(self, http: Request) -> JSONResponse:
        path = http.url.path.rstrip("/").rsplit("/", 1)[-1]
        if http.method == "GET" and path == "healthz":
            return JSONResponse({"status": "ok", "adapter": self.config.adapter})
        if http.method != "POST" or path != "rollout":
            return _error(404, "NotFound", "path", f"{http.method} {http.url.path} is not served")
        try:
            body = await http.body()
            if len(body) > self.config.limits.max_body_bytes:
                raise LimitExceededError("request body too large", field="body",
                                         expected=f"<= {self.config.limits.max_body_bytes}",
                                         actual=len(body))
            payload = HTTPRolloutRequest.model_validate(json.loads(body))
            requests = self._from_http(payload)
            results = await self.rollout(requests, preview=payload.include_media)
            return JSONResponse({"results": [_result_json(p, r) for p, r in
                                             zip(payload.prompts, results)]})
        except json.JSONDecodeError as exc:
            return _error(400, "JSONDecodeError", "body", str(exc))
        except ValidationError as exc:
            first = exc.errors()[0]
            return _error(422, "ValidationError", ".".join(str(p) for p in first["loc"]),
                          first["msg"])
        except RolloutError as exc:
            return JSONResponse(exc.to_dict(), status_code=exc.http_status)

    def _from_http(self, payload: HTTPRolloutRequest) -> list[RolloutRequest]:
        limits = self.config.limits
        if len(payload.prompts) > limits.max_prompts:
            raise LimitExceededError("too many prompts", field="prompts",
                                     expected=f"<= {limits.max_prompts}",
                                     actual=len(payload.prompts))
        defaults = dict(self.adapter.sampling_defaults)
        task = payload.task or next(iter(self.adapter.tasks))
        bundles = self.adapter.tokenize(payload.prompts)
        n = payload.samples_per_prompt
        out = []
        for i, bundle in enumerate(bundles):
            sampling = SamplingSpec(
                sampler=payload.sampler, num_steps=payload.num_steps,
                noise_level=payload.noise_level, sde_window=payload.sde_window,
                guidance_scale=payload.guidance_scale,
                seeds=tuple(payload.seed + i * n + j for j in range(n)),
                height=payload.height or defaults.get("height", 32),
                width=payload.width or defaults.get("width", 32),
                num_frames=payload.num_frames or defaults.get("num_frames", 1))
            out.append(RolloutRequest(prompt=bundle, sampling=sampling, task=task,
                                      requested_artifacts=payload.artifacts,
                                      policy_version=payload.policy_version))
        return out


def _error(status: int, kind: str, field: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"type": kind, "field": field, "message": message}},
                        status_code=status)


def _result_json(prompt: str, result: GraphResult) -> dict[str, Any]:
    samples = []
    for i, seed in enumerate(result.seeds):
        sample: dict[str, Any] = {
            "seed": seed, "policy_version": result.policy_version,
            "artifacts": [h.summary() | {"shape": list(h.shape[1:])}
                          for h in result.artifacts.values()]}
        if result.rewards is not None:
            sample["reward"] = result.rewards.total[i]
            sample["scores"] = {name: {k: v[i] for k, v in out.scores.items()} |
                                {"status": out.status[i].value, "reason": out.reasons[i]}
                                for name, out in result.rewards.by_scorer.items()}
        if result.previews:
            sample["media"] = {name: urls[i] for name, urls in result.previews.items()}
        samples.append(sample)
    return {"prompt": prompt, "request_id": result.request_id,
            "stop_reason": result.stop_reason.value, "samples": samples}
