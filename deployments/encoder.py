"""TextEncoder stage: token ids in (per encoder), Condition out; optionally tensor-parallel (ETP).

etp == 1: the replica runs the family's text encoders in-process (deployments/encoding.py).
etp  > 1: the replica owns a placement group (bundle 0 = the replica, bundles 1..etp = one shard
          worker each, STRICT_PACK so loopback rendezvous is valid) and starts one `ShardWorker`
          actor per bundle; the workers form a gloo (CPU) / nccl (GPU) group on 127.0.0.1 and
          run the encoders split by their families' ETP plans (deployments/etp.py). The
          workers are owned by the replica, so Ray ends them when the replica ends.

Users state `etp`; `TextEncoderServer.deployment_options` derives the placement options from it.
Token ids are encoded exactly as received (the conditioner pads them; nothing re-tokenizes), and
the returned Condition carries them, per encoder, in `token_ids` for the trainer's token check.

Prompt-embedding cache (`encoder.prompt_cache_mib`): the replica keeps each prompt's encoding,
keyed by its ids per encoder and stamped with the encoders' version (a digest of their weights,
`encoding.encoder_version`); a group's requests, its null / negative prompt and every later
epoch over the same prompts are encoded once. Hits and misses are Serve counters
(`omni_encoder_cache_{hits,misses}`) and `cache_stats()`.

Micro-batching (`encoder.max_batch_size`, `encoder.batch_wait_timeout_s`): the prompts that miss
the cache in concurrent calls -- several requests' prompts and their CFG negatives, which the
ingress sends at once -- run in one forward (`@serve.batch`; `encoding.encode_together`, each
distinct prompt once); a joint forward that raises is redone call by call, so a failing call
fails alone (`deployments/microbatch.py`). Calls with condition media (MiniMax-H3's keyframes,
Qwen-Image-Edit's source) run one at a time. `cache_stats()` counts forwards and their rows.
"""
from __future__ import annotations

import asyncio
import os
import socket
from typing import Any, Mapping, Sequence

import torch
from ray import serve

from adapters.registry import get_family
from contract import (ORDERED_MEDIA, Condition, ConfigError, InvalidRequestError, MediaRole,
                      NonFiniteOutputError, PromptBundle, ReplicaFailedError, RolloutError)
from deployments.encoding import (PromptEmbeddingCache, encode_cached, encode_prompts,
                                  encode_together, encoder_version, load_encoders)
from deployments.etp import ShardWorker, check_family_etp, param_bytes
from deployments.memory import guard_replica_memory
from deployments.metrics import CacheMetrics, StageMetrics
from deployments.microbatch import in_serve_replica, run_isolated
from rollout.recorder import check_finite

SHARD_ENV = {"GLOO_SOCKET_IFNAME": "lo"}   # gloo over loopback (all bundles on one node)


def _check_shard_gpus(device: str, gpus_per_shard: Sequence[float]) -> None:
    """nccl needs one whole GPU per rank; CPU shards (gloo) need none."""
    if torch.device(device).type == "cuda" and any(g < 1 for g in gpus_per_shard):
        raise ConfigError("ETP on cuda needs one GPU per shard worker (nccl ranks cannot share "
                          "a GPU)", field="num_gpus_per_shard", expected=1.0,
                          actual=min(gpus_per_shard))


def _finite_or_error(cond: Condition) -> Condition | NonFiniteOutputError:
    """One call's encoding, or the error that fails that call alone when a row of it is NaN /
    Inf (the encoder's fault: never handed to a rollout)."""
    try:
        for name, tensor in cond.tensors.items():
            if tensor.is_floating_point():
                check_finite(tensor, f"condition.{name}", None)
    except NonFiniteOutputError as exc:
        return exc
    return cond


def _free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TextEncoderServer:
    """Ray Serve deployment body (decorated by graph.build_encoder with options from config)."""

    @classmethod
    def deployment_options(cls, etp: int, num_cpus_per_shard: float, num_cpus: float = 0.25,
                           num_gpus: float = 0.0, num_gpus_per_shard: float = 0.0,
                           device: str = "cpu", memory_bytes: int | None = None,
                           shard_memory_bytes: int | None = None) -> dict[str, Any]:
        """Serve options derived from `etp`: nothing extra at etp 1, else the placement group.

        Bundle 0 holds the replica itself (its num_cpus / num_gpus / memory), bundles 1..etp one
        shard worker each. The head-count check happens in the replica, which knows the encoder.
        """
        if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1:
            raise ConfigError("etp must be a positive integer", field="etp", expected=">= 1",
                              actual=etp)
        if num_cpus_per_shard <= 0:
            raise ConfigError("each shard worker needs CPUs", field="num_cpus_per_shard",
                              expected="> 0", actual=num_cpus_per_shard)
        if etp == 1:
            return {}
        _check_shard_gpus(device, [num_gpus_per_shard] * etp)

        def bundle(cpus: float, gpus: float, memory: int | None) -> dict[str, float]:
            return {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {}),
                    **({} if memory is None else {"memory": memory})}
        replica = bundle(num_cpus, num_gpus, memory_bytes)
        shard = bundle(num_cpus_per_shard, num_gpus_per_shard, shard_memory_bytes)
        return {"placement_group_bundles": [replica] + [shard] * etp,
                "placement_group_strategy": "STRICT_PACK"}

    def __init__(self, adapter: str, weights_path: str | None = None, etp: int = 1,
                 device: str = "cpu", dtype: str = "float32", options: dict | None = None,
                 prompt_cache_bytes: int = 0, max_batch_size: int = 16,
                 batch_wait_timeout_s: float = 0.0):
        self.memory_guard = guard_replica_memory("TextEncoder")
        self.cache = PromptEmbeddingCache(prompt_cache_bytes)
        self.family = get_family(adapter, weights_path, options)
        self.options = dict(options or {})
        self.etp = etp
        self.device = torch.device(device)
        self._lock = asyncio.Lock()
        self.workers: list[Any] = []
        self.worker_info: list[dict[str, int]] = []
        self._failed: str | None = None
        self.metrics: StageMetrics | None = None
        self.cache_metrics: CacheMetrics | None = None
        self.forwards = self.forward_rows = 0      # encoder forwards run, prompts in them
        if etp == 1:
            self.encoders = load_encoders(self.family, self.device, dtype)
            self.version = encoder_version(self.family, self.encoders, dtype)
        else:
            self.encoders = None
            check_family_etp(self.family, etp)         # before any worker starts
            self._start_workers(adapter, weights_path, device, dtype)
            self.version = self.worker_info[0]["encoder_version"]
        import ray
        if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
            self.metrics, self.cache_metrics = StageMetrics("encoder"), CacheMetrics("encoder")
        self._in_replica = in_serve_replica()   # serve.batch needs one; in-process: no batching
        if self._in_replica:
            self._encode_batch.set_max_batch_size(max_batch_size)
            self._encode_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

    def _start_workers(self, adapter: str, weights_path: str | None, device: str,
                       dtype: str) -> None:
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = get_current_placement_group() if ray.is_initialized() else None
        bundles = None if pg is None else pg.bundle_specs
        if bundles is None or len(bundles) != self.etp + 1:
            raise ConfigError("etp > 1 needs the replica's placement group from "
                              "TextEncoderServer.deployment_options(etp, ...)", field="etp",
                              expected=f"{self.etp + 1} placement-group bundles",
                              actual=None if bundles is None else len(bundles))
        _check_shard_gpus(device, [b.get("GPU", 0) for b in bundles[1:]])
        master = f"127.0.0.1:{_free_loopback_port()}"
        remote_cls = ray.remote(ShardWorker)
        self.workers = [
            remote_cls.options(
                num_cpus=bundles[i + 1].get("CPU", 0), num_gpus=bundles[i + 1].get("GPU", 0),
                **({"memory": bundles[i + 1]["memory"]} if "memory" in bundles[i + 1] else {}),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=i + 1),
                runtime_env={"env_vars": SHARD_ENV},
            ).remote(adapter, weights_path, i, self.etp, master, device, dtype, self.options,
                     bundles[i + 1].get("memory"))
            for i in range(self.etp)]
        self.worker_info = ray.get([w.ready.remote() for w in self.workers])

    # ---- requests ---------------------------------------------------------------------
    async def encode(self, prompts: Sequence[PromptBundle],
                     media: Sequence[Mapping[MediaRole, torch.Tensor]] | None = None
                     ) -> Condition:
        """Encode the prompts' token ids exactly as given; `token_ids` records them. `media`:
        one mapping per prompt of the condition media the family's conditioner reads itself
        (`Conditioner.media_roles`: MiniMax-H3's keyframes), encoded with the prompt and not
        cached (the encoding depends on the pixels)."""
        prompts = self._check(prompts)
        if media is not None:
            return await self._encode_uncached(prompts, self._check_media(prompts, media))
        before = (self.cache.hits, self.cache.misses)
        cond = await encode_cached(self.family, self.cache, self.version, prompts,
                                   self._encode_uncached)
        if self.cache_metrics is not None:
            self.cache_metrics.record(self.cache.hits - before[0], self.cache.misses - before[1],
                                      self.cache.nbytes)
        return cond

    async def _encode_uncached(self, prompts: list[PromptBundle], media=None) -> Condition:
        """Prompts the cache did not hold: with concurrent calls' in one forward (media calls
        alone); this call's rows, or the error that fails this call alone."""
        if media is not None:
            return await self._forward(prompts, media)
        if self._in_replica:
            result = await self._encode_batch(prompts)
        else:
            [result] = await self._encode_calls([prompts])
        if isinstance(result, BaseException):
            raise result
        return result

    @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.0)   # set from the config
    async def _encode_batch(self, calls: list[list[PromptBundle]]) -> list[Condition | Exception]:
        return await self._encode_calls(calls)

    async def _encode_calls(self, calls: Sequence[Sequence[PromptBundle]]
                            ) -> list[Condition | Exception]:
        """Concurrent calls' prompts in one forward (each distinct prompt once); a forward that
        raises is redone call by call, each failing call getting its own error."""
        async def run(group: list[Sequence[PromptBundle]]) -> list[Condition | Exception]:
            conds = await encode_together(self.family, group, self._forward)
            return [_finite_or_error(cond) for cond in conds]
        return await run_isolated(list(calls), lambda call: None, run)

    async def _forward(self, prompts: list[PromptBundle], media=None) -> Condition:
        self.forwards += 1
        self.forward_rows += len(prompts)
        if self.metrics is None:
            return await self._run_encoders(prompts, media)
        with self.metrics.track(len(prompts)):
            return await self._run_encoders(prompts, media)

    async def _run_encoders(self, prompts: list[PromptBundle], media=None) -> Condition:
        if self.etp == 1:      # in a thread: calls arriving meanwhile form the next batch
            return await asyncio.to_thread(encode_prompts, self.family, self.encoders, prompts,
                                           media)
        return (await self._on_all_ranks("encode", prompts, media))[0]

    def _check_media(self, prompts: list[PromptBundle], media) -> list[dict]:
        """One mapping per prompt, of roles the conditioner reads, uint8 tensors: else typed."""
        roles = self.family.conditioner.media_roles
        if not isinstance(media, (list, tuple)) or len(media) != len(prompts):
            raise InvalidRequestError("encode takes one condition-media mapping per prompt",
                                      field="media", expected=len(prompts),
                                      actual=len(media) if isinstance(media, (list, tuple))
                                      else type(media).__name__)
        out = []
        ordered = {role for _, role in ORDERED_MEDIA.values()}    # a tuple each (ref2va)
        uint8 = lambda t: isinstance(t, torch.Tensor) and t.dtype == torch.uint8   # noqa: E731
        for i, item in enumerate(media):
            if not isinstance(item, Mapping) or any(r not in roles for r in item) or not all(
                    (isinstance(t, tuple) and len(t) > 0 and all(map(uint8, t))) if r in ordered
                    else uint8(t) for r, t in item.items()):
                raise InvalidRequestError("condition media the text encoders read: uint8 tensors "
                                          "by role (a tuple of them for an ordered role)",
                                          field=f"media[{i}]",
                                          expected=[r.value for r in roles],
                                          actual=sorted(str(getattr(r, "value", r))
                                                        for r in item) if isinstance(item, Mapping)
                                          else type(item).__name__)
            out.append(dict(item))
        return out

    async def encoder_version(self) -> str:
        """The version its encodings are stamped with (deployments/encoding.encoder_version)."""
        return self.version

    async def cache_stats(self) -> dict[str, int | str]:
        """The prompt-embedding cache's hits, misses, evictions, entries and bytes (of its
        bound), the encoder forwards run and their rows (prompts), and the encoder version its
        entries are stamped with."""
        return {**self.cache.stats(), "forwards": self.forwards,
                "forward_rows": self.forward_rows, "encoder_version": self.version}

    async def _on_all_ranks(self, method: str, *args) -> list[Any]:
        """Call `method` on every shard worker; a dead worker fails the replica (typed)."""
        from ray.exceptions import RayActorError, RayTaskError
        async with self._lock:          # one collective sequence at a time across the ranks
            try:
                return list(await asyncio.gather(
                    *(getattr(w, method).remote(*args) for w in self.workers)))
            except RolloutError:        # typed input errors (all ranks raise before any collective)
                raise
            except (RayActorError, RayTaskError) as exc:   # a rank died or the group broke
                self._failed = f"{type(exc).__name__}: {exc}"[:500]
                raise ReplicaFailedError("an ETP shard worker died; this encoder replica is "
                                         "being replaced", field="etp_shard_worker",
                                         actual=type(exc).__name__) from None

    async def check_health(self) -> None:
        """Serve health check: every shard worker must answer; else Serve restarts the replica
        (and with it the whole shard group)."""
        if self._failed is not None:
            raise ReplicaFailedError("an ETP shard worker died", field="etp_shard_worker",
                                     actual=self._failed)
        if self.workers:
            await asyncio.wait_for(self._on_all_ranks("ready"), timeout=60)

    @staticmethod
    def _check(prompts: Sequence[PromptBundle]) -> list[PromptBundle]:
        if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
            raise InvalidRequestError("encode takes a non-empty list of PromptBundle",
                                      field="prompts", actual=type(prompts).__name__)
        for i, p in enumerate(prompts):
            if not isinstance(p, PromptBundle):
                raise InvalidRequestError("prompts must be PromptBundle", field=f"prompts[{i}]",
                                          expected="PromptBundle", actual=type(p).__name__)
        return list(prompts)

    # ---- introspection (tests, dashboards) ---------------------------------------------
    async def shard_param_bytes(self) -> list[dict[str, int]]:
        """Per-rank parameter bytes (etp 1: the in-process encoder as rank 0)."""
        if self.etp == 1:
            own = param_bytes(self.encoders, self.family)
            return [{"rank": 0, "sharded": own.sharded, "replicated": own.replicated,
                     "total": own.total, "full_sharded": own.sharded, "full_total": own.total}]
        return await self._on_all_ranks("param_bytes")

    async def shard_workers(self) -> list[dict[str, Any]]:
        """Replica pid plus each shard worker's rank, pid, actor id and memory bound (0: none)."""
        return [{"rank": info["rank"], "pid": info["pid"], "actor_id": w._actor_id.hex(),
                 "memory_limit_bytes": info["memory_limit_bytes"], "replica_pid": os.getpid()}
                for info, w in zip(self.worker_info, self.workers)]
