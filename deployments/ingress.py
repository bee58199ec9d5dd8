"""RolloutGraph, the ingress: validate, chain stages by DeploymentResponse, fan out per artifact.

encoder -> rollout -> decoders (one per requested latent kind) -> scorers. Every hop passes a
DeploymentResponse as a top-level argument, so Serve resolves it inside the receiving replica;
stage outputs are `StageOutput`s holding object refs, so this class only ever awaits small
metadata and never deserializes a tensor (`ingress_tensor_bytes` counts any that would arrive).

Every request is checked whole before any stage runs, the same way over HTTP and the handle API:
the graph's RequestLimits, the adapter's request checks, and the prompt check of each required
scorer that declares one. The HTTP face (POST /rollout, GET /healthz) is deployments/http.py:
bodies parsed and bounded by contract/http.py before anything proportional to them is built,
every answer JSON, a typed error object for any failure. Each result's metrics carry the
ingress's wall seconds per hop (`ingress_*_s`) beside the stages' own compute seconds.
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import threading
import time
from typing import Any, Mapping, Sequence

import ray
import torch

from adapters.registry import get_family
from contract import (ConditionHandle, GraphResult, InvalidRequestError, LimitExceededError,
                      MediaRole, Modality, NonFiniteOutputError, PromptBundle, Representation,
                      RewardReport, RolloutError, RolloutRequest, ScorerFailedError,
                      ScorerOutput, StageOutput, StageUnavailableError, UnscorableInputError, check_requested_artifacts)
from deployments.config import GraphConfig
from deployments.failures import replica_died, replica_failed
from deployments.http import HTTPFront, stage_error
from deployments.memory import guard_replica_memory, process_memory, reset_peak_rss
from deployments.metrics import StageMetrics
from deployments.objects import HolderShards
from diffusion.step import doubles_rows
from rewards.combine import RewardCombiner, ScorerPolicy, policy_failure

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


class RolloutGraph(HTTPFront):
    def __init__(self, config: GraphConfig, encoder, rollout, decoders: Mapping[str, Any],
                 scorers: Mapping[str, Any]):
        self.memory_guard = guard_replica_memory("RolloutGraph")
        self.config = config
        self.family = get_family(config.adapter, config.weights_path, config.adapter_options)
        self.io_spec = self.family.io_spec
        self.encoder, self.rollout_stage = encoder, rollout
        self.decoders, self.scorers = dict(decoders), dict(scorers)
        self._stage_handles = {"encoder": encoder, "rollout": rollout,
                               **{f"decoder.{k}": h for k, h in self.decoders.items()},
                               **{f"scorer.{k}": h for k, h in self.scorers.items()}}
        self.scorer_specs = {s.name: s for s in config.scorers}
        self.combiner = RewardCombiner(config.reward_config) if config.scorers else None
        self._combine_lock = threading.Lock()
        self._primaries: dict[str, str] | None = None
        self._prompt_checkers: tuple[str, ...] | None = None   # required scorers with a check
        self.metrics = StageMetrics("ingress")
        self.ingress_tensor_bytes = 0
        self.objects = HolderShards(config.object_holder)   # the stages' outputs
        self._encoder_version: str | None = None   # stamped on the conditions it hands out

    # ---------------------------------------------------------------- handle API
    async def rollout(self, requests: RolloutRequest | Sequence[RolloutRequest],
                      preview: bool = False) -> list[GraphResult]:
        batch = self._batch(requests)
        checked = [self._validate(r) for r in batch]        # every request, before any stage
        t0 = time.perf_counter()
        await self._check_prompts(batch)
        check_s = time.perf_counter() - t0
        rows = sum(r.output_rows for r in batch)
        with self.metrics.track(rows):
            results = await asyncio.gather(*(self._one(r, names, media, preview, check_s)
                                             for r, (names, media) in zip(batch, checked)),
                                           return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:   # the call fails whole: no caller will fetch or release any of its outputs
            await self.release([r.request_id for r in batch])
            raise failed[0]
        return list(results)

    async def conditions(self, prompts: Sequence[PromptBundle], unconditional: bool = False,
                         media: Sequence[Mapping[MediaRole, torch.Tensor]] | None = None
                         ) -> list[ConditionHandle]:
        """The encoder stage's encoding of each prompt (or of its unconditional branch) by
        reference, as a rollout hands them out: what a learner without text encoders runs its
        checks on. `media`: per prompt, its canonical condition media (role -> tensor); those
        the family's conditioner reads itself (an edit's source image) are encoded with the
        prompt, as `_one` encodes a request's."""
        if media is not None and len(media) != len(prompts):
            raise InvalidRequestError("conditions takes one condition-media mapping per prompt",
                                      field="media", expected=len(prompts), actual=len(media))
        conditioner = self.family.conditioner
        handles = []
        for i, prompt in enumerate(prompts):
            prompt = conditioner.unconditional(prompt) if unconditional else prompt
            ref = await self._taken("encoder", self.encoder.encode.remote(
                [prompt], self._encoder_media(dict(media[i]) if media else {})), "conditions")
            handles.append(ConditionHandle("uncond" if unconditional else "cond",
                                           await self._encoder_version_of(), ref))
        return handles

    async def _encoder_version_of(self) -> str:
        if self._encoder_version is None:
            self._encoder_version = await self.encoder.encoder_version.remote()
        return self._encoder_version

    async def release(self, request_ids: Sequence[str]) -> int:
        """The caller has fetched these requests' outputs: the stages' object-store copies go
        (their owner's references; a caller's own fetched copies stay its own)."""
        return await self.objects.release(list(request_ids))

    async def stats(self, reset_peak: bool = False) -> dict[str, int]:
        """Tensor bytes that reached the ingress (0 by design), its pid, resident memory in bytes
        (rss, rss_anon, peak_rss since start or the last `reset_peak`) and its memory bound."""
        if reset_peak:
            reset_peak_rss()
        limit = self.memory_guard.limit_bytes if self.memory_guard is not None else 0
        return {"ingress_tensor_bytes": self.ingress_tensor_bytes, "pid": os.getpid(),
                "memory_limit_bytes": limit, **process_memory()}

    def _batch(self, requests: Any) -> list[RolloutRequest]:
        if isinstance(requests, RolloutRequest):
            return [requests]
        if not isinstance(requests, (list, tuple)):
            raise InvalidRequestError("rollout takes a RolloutRequest or a list of them",
                                      field="requests", expected="list[RolloutRequest]",
                                      actual=type(requests).__name__)
        bound = self.config.limits.max_prompts
        if len(requests) > bound:
            raise LimitExceededError("too many requests in one call", field="requests",
                                     expected=f"<= {bound}", actual=len(requests))
        for i, request in enumerate(requests):
            if not isinstance(request, RolloutRequest):
                raise InvalidRequestError("not a RolloutRequest", field=f"requests[{i}]",
                                          expected="RolloutRequest",
                                          actual=type(request).__name__)
        return list(requests)

    async def _await_small(self, response) -> Any:
        value = await response
        self.ingress_tensor_bytes += tensor_bytes(value)
        return value

    async def _taken(self, stage: str, response, request_id: str):
        """The ObjectRef of a stage call once a replica has taken it. Each `stage_wait_s` the
        call has waited, the stage's replicas are counted: running ones that are all busy are
        waited for (backpressure, not a fault); none running (its node is lost, it is
        restarting) cancels the call -- it never runs later -- and fails the request as
        StageUnavailableError."""
        wait_s = self.config.stage_wait_s
        taken = asyncio.ensure_future(response._to_object_ref())
        while True:
            done, _ = await asyncio.wait({taken}, timeout=wait_s)
            if done:
                return taken.result()
            if await self._running_replicas(stage) == 0:
                taken.cancel()
                response.cancel()
                raise StageUnavailableError(f"no {stage} replica is running (its node is lost "
                                            "or it is restarting); retry later", field=stage,
                                            expected=f"a replica within {wait_s} s",
                                            request_id=request_id)

    async def _running_replicas(self, stage: str) -> int:
        """RUNNING replicas of a stage's deployment, from the Serve controller."""
        from ray import serve
        handle = self._stage_handles[stage]
        app = serve.get_replica_context().app_name

        def count() -> int:
            status = serve.status().applications.get(app)
            deployment = status.deployments.get(handle.deployment_name) if status else None
            return deployment.replica_states.get("RUNNING", 0) if deployment else 0
        return await asyncio.to_thread(count)

    async def _stage_result(self, stage: str, response, request_id: str) -> Any:
        """A stage call's small result (`response` once taken, or its ObjectRef); a retryable
        error from upstream gets the request id."""
        try:
            ref = (response if isinstance(response, ray.ObjectRef)
                   else await self._taken(stage, response, request_id))
            return await self._await_small(ref)
        except RolloutError as exc:
            raise _with_request_id(stage_error(exc), request_id) from None

    def _validate(self, request: RolloutRequest) -> tuple[tuple[str, ...], dict]:
        """Fail fast, before any stage runs: (requested artifact names, condition media)."""
        requested = check_requested_artifacts(request, self.io_spec.names)
        n = request.output_rows            # a branch rollout's group: its leaves
        for spec in self.config.scorers:     # a group of one cannot be compared within itself
            if spec.scorer.groupwise and n < 2:
                raise InvalidRequestError(f"scorer {spec.name!r} compares the samples of a "
                                          "prompt group; this request's group holds one",
                                          field="sampling.seeds", expected=">= 2 samples",
                                          actual=n, request_id=request.request_id)
        return requested, self.family.validate_request(request, self.config.limits)

    async def _check_prompts(self, batch: Sequence[RolloutRequest]) -> None:
        """Each required scorer that declares a prompt check (rewards.base.ChecksPrompts) reads
        every prompt first: one it cannot score is the client's 422 before any stage runs."""
        if not batch:
            return
        if self._prompt_checkers is None:
            required = [n for n, s in self.scorer_specs.items()
                        if s.reward.policy == ScorerPolicy.REQUIRED]
            flags = await asyncio.gather(*(self.scorers[n].checks_prompts.remote()
                                           for n in required), return_exceptions=True)
            for name, flag in zip(required, flags):
                if isinstance(flag, BaseException):
                    self._raise_required_failure(name, flag, len(batch), batch[0].request_id)
            self._prompt_checkers = tuple(n for n, has in zip(required, flags) if has)
        if not self._prompt_checkers:
            return
        texts = [r.prompt.text or "" for r in batch]
        ids = [r.request_id for r in batch]
        names = self._prompt_checkers
        results = await asyncio.gather(*(asyncio.wait_for(
            self.scorers[n].check_prompts.remote(texts, ids),
            timeout=self.scorer_specs[n].reward.timeout_s) for n in names),
            return_exceptions=True)
        for name, result in zip(names, results):
            if isinstance(result, BaseException):
                self._raise_required_failure(name, result, len(batch), ids[0], checked=True)

    def _raise_required_failure(self, name: str, exc: BaseException, n: int, request_id: str,
                                checked: bool = False) -> None:
        """A required scorer's call raised. The client's fault (4xx) only when the scorer says
        the input it could not read was the client's (UnscorableInputError); its replica dying
        is a retryable 503; anything else -- a timeout, generated media it cannot read, its own
        bug -- is the server's ScorerFailedError (502). `checked`: raised by the scorer stage's
        prompt check, whose error already names the scorer, the prompt and its request."""
        cause = stage_error(exc)
        if isinstance(cause, RolloutError) and cause.retryable:   # unavailable: retry later
            raise _with_request_id(cause, request_id) from None
        if isinstance(cause, UnscorableInputError):
            if checked:
                raise cause
            raise UnscorableInputError(f"required scorer {name!r} cannot read the client's "
                                       f"input: {cause.message}", field=cause.field,
                                       expected=cause.expected, actual=cause.actual,
                                       request_id=request_id) from None
        if replica_died(exc):
            raise replica_failed(f"scorer.{name}", exc, request_id) from exc
        reason = ("timed out" if isinstance(exc, asyncio.TimeoutError)
                  else f"{type(cause).__name__}: {cause}")
        policy_failure(name, self.scorer_specs[name].reward, n, reason, cause,
                       request_id=request_id)        # raises ScorerFailedError: it is required
        raise ScorerFailedError(reason, field=f"rewards.{name}", request_id=request_id)

    def _encoder_media(self, media: dict) -> list[dict] | None:
        """The request's condition media its family's text encoders read (MiniMax-H3 shows its
        keyframes to the Qwen3-VL conditioner), as the encoder stage takes them; else None."""
        roles = self.family.conditioner.media_roles
        picked = {role: data for role, data in media.items() if role in roles}
        return [picked] if picked else None

    async def _one(self, request: RolloutRequest, requested: tuple[str, ...], media: dict,
                   preview: bool, check_s: float = 0.0) -> GraphResult:
        """One request through the stages. Its metrics add the ingress's wall seconds per hop
        (`ingress_*_s`: prompt check, encode + rollout, decoders, scorers, release) beside the
        stages' own compute seconds, so the graph's fixed cost per request is their difference."""
        rid = request.request_id
        t_start = time.perf_counter()
        encoder_media = self._encoder_media(media)
        calls = [self.encoder.encode.remote([request.prompt], encoder_media)]
        if doubles_rows(self.family.spec.guidance, request.sampling.guidance_scale):
            # the negative with the same condition media (Qwen-Image-Edit shows it the source),
            # sent with the prompt: the encoder stage runs both (and other requests') in one
            # forward
            uncond = self.family.conditioner.unconditional(request.prompt)
            calls.append(self.encoder.encode.remote([uncond], encoder_media))
        try:
            cond, *rest = [await self._taken("encoder", call, rid) for call in calls]
        except BaseException:
            for call in calls:
                call.cancel()
            raise
        negative = rest[0] if rest else None
        conditions = {"cond": ConditionHandle("cond", await self._encoder_version_of(), cond)}
        if negative is not None:
            conditions["uncond"] = ConditionHandle("uncond", conditions["cond"].encoder_version,
                                                   negative)
        try:
            stage: StageOutput = await self._stage_result(
                "rollout", self.rollout_stage.rollout.remote(request, cond, requested, negative),
                rid)
        except Exception as exc:
            if replica_died(exc):        # the rollout replica (or the encoder upstream) died
                raise replica_failed("rollout", exc, rid) from exc
            raise
        t_rollout = time.perf_counter()
        decoded_by_latent = self._decoded_plan(requested)
        # previewed video with decoded audio: its decoder muxes an MP4 once the audio is decoded
        muxed = self._muxed_video(decoded_by_latent) if preview else {}
        responses = {latent: self.decoders[latent].decode.remote(stage, names, preview)
                     for latent, names in decoded_by_latent.items() if latent not in muxed}
        unread = dict(responses)   # decoder calls not awaited yet
        try:
            result = await self._decode_and_score(request, requested, media, preview, stage,
                                                  responses, unread, muxed, decoded_by_latent,
                                                  t_start, t_rollout, check_s)
            return dataclasses.replace(result, conditions=conditions)
        except BaseException:
            # decoders still running would put outputs after the caller releases this request:
            # let them finish first, so the release finds (and drops) everything they made
            await asyncio.gather(*unread.values(), return_exceptions=True)
            raise

    async def _decode_and_score(self, request, requested, media, preview, stage, responses,
                                unread, muxed, decoded_by_latent, t_start, t_rollout,
                                check_s) -> GraphResult:
        """`_one` from the rollout stage's output on; `unread`: the decoder calls it has not
        awaited yet (each removed as it is awaited)."""
        rid = request.request_id
        artifacts = {n: h for n, h in stage.artifacts.items() if n in requested}
        previews: dict[str, tuple[str, ...]] = {}
        refs = {}                  # decoded outputs, taken: what the scorers read
        outs: dict[str, StageOutput] = {}
        for latent in [*responses, *muxed]:
            try:
                response = responses[latent] if latent in responses else \
                    self.decoders[latent].decode.remote(stage, decoded_by_latent[latent],
                                                        preview, outs[muxed[latent]])
                unread.pop(latent, None)
                refs[latent] = await self._taken(f"decoder.{latent}", response, rid)
                out: StageOutput = await self._stage_result(f"decoder.{latent}", refs[latent],
                                                            rid)
            except Exception as exc:
                if replica_died(exc):         # the decoder died, or the latent's owner did
                    raise replica_failed(f"decoder.{latent}", exc, rid) from exc
                raise
            outs[latent] = out
            artifacts.update({n: h for n, h in out.artifacts.items() if n in requested})
            previews.update({n: p for n, p in out.previews.items() if n in requested})
        t_score = time.perf_counter()
        rewards = await self._score(request, refs, media, stage)
        t_release = time.perf_counter()
        internal = {*stage.artifacts, *(n for o in outs.values() for n in o.artifacts)} - \
            set(requested)            # read by the graph's own stages only, all of them done
        if internal:
            await self.objects.release([rid], sorted(internal))
        t_end = time.perf_counter()
        metrics = dict(stage.metrics)
        for out in outs.values():     # the decoders' own compute seconds
            metrics.update(out.metrics)
        if rewards is not None:       # wall time from decoded media to the combined rewards
            metrics["score_s"] = t_release - t_score
        metrics.update(ingress_check_s=check_s, ingress_rollout_s=t_rollout - t_start,
                       ingress_decode_s=t_score - t_rollout, ingress_release_s=t_end - t_release,
                       ingress_total_s=t_end - t_start + check_s)
        return GraphResult(request_id=rid, artifacts=artifacts,
                           policy_version=stage.policy_version, seeds=stage.seeds,
                           stop_reason=stage.stop_reason, trajectory=stage.trajectory,
                           rewards=rewards, previews=previews, metrics=metrics,
                           encoded_token_ids=stage.encoded_token_ids, tree=stage.tree)

    def _muxed_video(self, plan: Mapping[str, Sequence[str]]) -> dict[str, str]:
        """{video latent: audio latent} when one decode produces a decoded video and another a
        decoded audio (a joint audio-video family): the video is previewed with that audio."""
        def latents_of(modality: Modality) -> list[str]:
            return [latent for latent, names in plan.items()
                    if any(self.io_spec[n].modality == modality for n in names)]
        video, audio = latents_of(Modality.VIDEO), latents_of(Modality.AUDIO)
        if len(audio) != 1:
            return {}
        return {latent: audio[0] for latent in video if latent != audio[0]}

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

    async def _score(self, request, responses, media, stage) -> RewardReport | None:
        """Call every scorer deployment (per request, so scoring overlaps other requests'
        rollouts) under its timeout; failures go through the required/optional policy. A scorer
        reading a latent gets the rollout stage's output (no decode planned for it)."""
        if not self.scorers:
            return None
        n = len(stage.seeds)             # the rows out: a branch rollout's leaves
        # the prompt's own metadata (OCR target text, GenEval objects...) and its condition
        # media reach every scorer, which gives each sample its copy with its seed
        metadata = dict(request.metadata, **{role.value: data for role, data in media.items()})
        if self._primaries is None:
            names = list(self.scorers)
            got = await asyncio.gather(*(self.scorers[k].primary.remote() for k in names))
            self._primaries = dict(zip(names, got))
        calls = {}
        for name, handle in self.scorers.items():
            spec = self.scorer_specs[name]
            sources = sorted({self.io_spec[i].source or "" for i in spec.inputs})  # "": latent
            calls[name] = asyncio.wait_for(
                self._stage_result(f"scorer.{name}", handle.score.remote(
                    *(responses[s] if s else stage for s in sources),
                    prompt=request.prompt.text or "", metadata=metadata,
                    seeds=stage.seeds),
                    request.request_id),
                timeout=spec.reward.timeout_s)
        results = await asyncio.gather(*calls.values(), return_exceptions=True)
        outputs: dict[str, ScorerOutput] = {}
        for name, result in zip(calls, results):
            required = self.scorer_specs[name].reward.policy == ScorerPolicy.REQUIRED
            if required and isinstance(result, BaseException):
                self._raise_required_failure(name, result, n, request.request_id)
            if isinstance(result, BaseException):
                reason = ("timed out" if isinstance(result, asyncio.TimeoutError)
                          else f"{type(result).__name__}: {result}")
                result = policy_failure(name, self.scorer_specs[name].reward, n, reason, result,
                                        request_id=request.request_id)
            outputs[name] = result
        # the per-sample weighted sums run in a worker thread, not on the event loop (one at a
        # time: running-z normalisation updates the combiner's moments)
        report = await asyncio.to_thread(self._combine, outputs)
        bad = [] if math.isfinite(sum(report.total)) else \
            [i for i, total in enumerate(report.total) if not math.isfinite(total)]
        if bad:     # finite scores whose weighted sum overflows: no reward leaves non-finite
            raise NonFiniteOutputError("the combined reward is not finite", field="rewards.total",
                                       expected="finite", actual=f"samples {bad[:8]}",
                                       request_id=request.request_id)
        return report

    def _combine(self, outputs: Mapping[str, ScorerOutput]) -> RewardReport:
        with self._combine_lock:
            return self.combiner(outputs, self._primaries)

    # ---------------------------------------------------------------- HTTP API


def _with_request_id(exc: BaseException, request_id: str) -> BaseException:
    """A retryable stage error that does not know the request (the encoder's, the policy
    store's) gets the request id, so the caller can retry exactly that request."""
    if isinstance(exc, RolloutError) and exc.retryable and exc.request_id is None:
        return type(exc)(exc.message, field=exc.field, expected=exc.expected,
                         actual=exc.actual, request_id=request_id)
    return exc
