"""The learner worker of a Ray Train group (trainer.distributed.RayTrainLearners): the job
channel between the controller and the workers, and `learner_worker`, Ray Train's
train_loop_per_worker -- it builds the learner (FSDP2-sharded for full fine-tuning, the adapter
broadcast from rank 0 for LoRA) and serves jobs until STOP: a plan shard in (its conditions by
reference, fetched here), metrics + rank 0's exported weights (one PackedTensors object in the
object store) out; a function to run on the learner (start-up checks, log-prob parity) in, its
result out.

What a worker loads: the transformer(s) with the policy (LoRA adapters or full weights) and the
optimizer. No text encoder: every algorithm trains on the encoder stage's conditions, and the
checks run on conditions the graph encoded. The VAE encoder only for a task with condition
media (fl2va, i2v, i2va), whose held state entries and forward inputs the learner re-encodes
from the request's media with the rollout's codec. No VAE decoder: no algorithm decodes.
"""
from __future__ import annotations

import asyncio
import time
import traceback
from enum import Enum
from typing import Mapping

import ray
import torch

from adapters.family import ModelFamily
from adapters.lora_files import nonfinite_keys
from contract import (ConditionHandle, ConditionSignature, ConfigError, NonFiniteError,
                      PackedTensors, PolicyKind, Task)
from trainer.learner import Learner
from trainer.learner_config import LearnerConfig
from trainer.lora import OLD_ADAPTER, TRAIN_ADAPTER
from trainer.rollout_batch import ConditionRows, condition_signature, fetch_conditions
from trainer.updates import UpdatePlan, run_update

CONDITIONED_TASKS = (Task.FL2VA, Task.L2VA, Task.I2V, Task.I2VA, Task.EDIT,
                     Task.REF2VA)                   # requests carry condition media


def probe_signature(family: ModelFamily, probe: ConditionHandle) -> ConditionSignature:
    """The signature every condition of the run must match, from one encoding of the encoder
    stage (fetched here, by the learner)."""
    return condition_signature(family, probe, ray.get(probe.ref))


def with_conditions(plan: UpdatePlan, learner: Learner) -> UpdatePlan:
    """The plan with its rows' conditions fetched from the object store (this learner's shard
    only), each checked against the learner's ConditionSignature."""
    refs = [b for b in (plan.batch, plan.pad)
            if b is not None and isinstance(b.cond, ConditionRows)]
    if not refs:
        return plan
    signature = getattr(learner, "condition_signature", None)
    if signature is None:
        raise ConfigError("conditions by reference need the learner's condition signature "
                          "(the encoder stage's probe at start)", field="condition_signature",
                          expected="ConditionSignature", actual=None)
    import dataclasses
    return dataclasses.replace(plan, batch=fetch_conditions(plan.batch, signature),
                               pad=fetch_conditions(plan.pad, signature))


def process_parameter_bytes() -> int:
    """Parameter + buffer bytes of every torch module alive in this process (each storage
    once): what a process holds of any model."""
    import gc
    modules = {str(i): m for i, m in enumerate(o for o in gc.get_objects()
                                               if isinstance(o, torch.nn.Module))}
    return sum(parameter_bytes(modules, dedupe_across=True).values())


# ---- the evaluation EMA, kept beside the policy it averages (functions for on_learner) ---------
def ema_update(learner: Learner, ema_cfg, step: int) -> int:
    """PolicyEMA.update with the learner's current trained tensors; the EMA's update count."""
    from trainer.run_state import PolicyEMA
    if getattr(learner, "ema", None) is None:
        learner.ema = PolicyEMA(ema_cfg)
    learner.ema.update(step, learner.export(TRAIN_ADAPTER)[0])
    return learner.ema.updates


def ema_export(learner: Learner) -> list | None:
    """The EMA's tensors in the object store (one PackedTensors), None before its first
    update."""
    ema = getattr(learner, "ema", None)
    if ema is None or ema.tensors is None:
        return None
    return [ray.put(PackedTensors.pack(ema.tensors))]


def ema_restore(learner: Learner, ema_cfg, tensors: Mapping[str, torch.Tensor],
                updates: int) -> None:
    from trainer.run_state import PolicyEMA
    learner.ema = PolicyEMA(ema_cfg)
    learner.ema.tensors = {k: v.clone() for k, v in tensors.items()}
    learner.ema.updates = int(updates)


def parameter_bytes(modules: Mapping[str, torch.nn.Module],
                    dedupe_across: bool = False) -> dict[str, int]:
    """Parameter + buffer bytes per module (each tensor storage once)."""
    out, shared = {}, set()
    for name, module in modules.items():
        seen, total = shared if dedupe_across else set(), 0
        for t in [*module.parameters(), *module.buffers()]:
            local = getattr(t, "_local_tensor", t)           # an FSDP2 shard: its own part
            key = local.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += local.untyped_storage().nbytes()
        out[name] = total
    return out


# ---- the channel: jobs from the controller, replies back ----------------------------------------
class Job(str, Enum):
    START = "start"        # probe -> rank 0: exports of "default" and "old"
    UPDATE = "update"      # plan shard -> metrics; rank 0: export of "default"
    REFRESH = "refresh"    # decay -> rank 0: export of "old"
    STATE = "state"        # -> rank 0: the optimizer state (gathered under FSDP)
    LOAD = "load"          # adapters + optimizer state -> every worker
    RUN = "run"            # (fn, args) -> fn(learner, *args) (None: this rank sits it out)
    STOP = "stop"


@ray.remote(num_cpus=0)
class LearnerChannel:
    """Jobs from the controller to each worker and their replies back (small metadata and
    object refs; tensors travel through the object store)."""

    def __init__(self, world: int):
        self.jobs = [asyncio.Queue() for _ in range(world)]
        self.replies: dict[str, dict[int, tuple]] = {}
        self.changed = asyncio.Event()

    async def post(self, job_id: str, kind: str, payloads: list) -> None:
        for rank, payload in enumerate(payloads):
            self.jobs[rank].put_nowait((job_id, kind, payload))

    async def keep(self, value) -> list:
        """`value` put into the object store by this actor, which owns it: a worker's export
        outlives the worker group (published versions stay fetchable while the controller
        that holds this channel lives). One element list: the reference is not resolved."""
        return [ray.put(value)]

    async def take(self, rank: int) -> tuple:
        return await self.jobs[rank].get()

    async def reply(self, job_id: str, rank: int, reply: tuple) -> None:
        self.replies.setdefault(job_id, {})[rank] = reply
        self.changed.set()

    async def wait(self, job_id: str, world: int, timeout_s: float) -> dict[int, tuple] | None:
        """Every rank's reply, or as soon as one failed; None on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.replies.get(job_id, {})
            if len(got) == world or any(r[0] == "error" for r in got.values()):
                return self.replies.pop(job_id)
            self.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                await asyncio.wait_for(self.changed.wait(), min(left, 5.0))
            except asyncio.TimeoutError:
                pass


# ---- inside each worker -------------------------------------------------------------------------
class TorchCollective:
    """The worker's sums over the process group (trainer.learner.Collective)."""

    def __init__(self, sharded: bool):
        self.sharded = sharded       # FSDP2 reduce-scatters summed gradients in backward

    def sum_gradients(self, params: list[torch.nn.Parameter]) -> None:
        import torch.distributed as dist
        if self.sharded:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])         # one all-reduce, one bucket
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p, g in zip(params, grads):
            p.grad = flat[offset:offset + g.numel()].view_as(g).clone()
            offset += g.numel()

    def sum_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        import torch.distributed as dist
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, sums)
        out: dict[str, float] = {}
        for part in parts:                  # rank order: the same float sums on every worker
            for key, value in part.items():
                out[key] = out.get(key, 0.0) + value
        return out


def _shard_full(learner: Learner) -> None:
    """FSDP2 over every transformer block and the whole model, for the trained modules and
    their frozen old / reference copies (sums, not means, of the gradients)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    mp = None
    if learner.dtype != torch.float32:
        mp = MixedPrecisionPolicy(param_dtype=learner.dtype, reduce_dtype=torch.float32)
    for models in learner.weights.roles.values():
        for model in models.values():
            blocks = [m for name, m in model.named_children()
                      if isinstance(m, torch.nn.ModuleList)]
            for block_list in blocks:
                for block in block_list:
                    fully_shard(block, **({"mp_policy": mp} if mp else {}))
            fully_shard(model, **({"mp_policy": mp} if mp else {}))
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)
    learner.weights.use_autocast = False      # MixedPrecisionPolicy casts the forwards
    learner.reset_optimizer()                 # over the sharded (DTensor) parameters


def _packed_ref(packed: PackedTensors, owner=None) -> list:
    """One export in the object store, checked finite first (the controller publishes the
    reference without fetching it). owner: the job channel (LearnerChannel.keep), which lives
    as long as the controller, so published versions outlive the worker group (the rollout
    replicas fetch them by reference); None: this worker owns it."""
    bad = nonfinite_keys(packed.unpack())
    if bad:
        raise NonFiniteError("the policy holds NaN or Inf; not exported",
                             field=f"policy[{bad[0]}]", expected="finite values",
                             actual=f"{len(bad)} tensors")
    return [ray.put(packed)] if owner is None else ray.get(owner.keep.remote(packed))


def learner_worker(config: dict) -> None:
    """Ray Train's train_loop_per_worker: build the learner, then serve jobs until STOP."""
    import torch.distributed as dist
    from adapters.registry import get_family
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    cfg, graph, channel = config["cfg"], config["graph"], config["channel"]
    s: LearnerConfig = cfg.learner
    torch.set_num_threads(max(1, int(s.resources_per_worker.get("CPU", 1))))
    device = str(ray.train.torch.get_device()) if s.device.startswith("cuda") else "cpu"
    learner = None
    while True:
        job_id, kind, payload = ray.get(channel.take.remote(rank))
        kind = Job(kind)
        try:
            if kind is Job.STOP:
                ray.get(channel.reply.remote(job_id, rank, ("ok", None)))
                return
            if kind is Job.START:
                family = get_family(graph.adapter, graph.weights_path, graph.adapter_options)
                learner = Learner.load(family, cfg.lora, cfg.optimizer, cfg.seed, s, device,
                                       text_encoders=False,
                                       media_encoders=cfg.task in CONDITIONED_TASKS)
                learner.condition_signature = (None if payload is None else
                                               probe_signature(family, payload))
                if learner.kind is PolicyKind.FULL and world > 1:
                    _shard_full(learner)
                elif world > 1:      # every replica of the adapter starts from rank 0's
                    with torch.no_grad():
                        for p in learner.weights.trainable() + _old_params(learner):
                            dist.broadcast(p.data, src=0)
                learner.collective = TorchCollective(learner.kind is PolicyKind.FULL)
                out = {name: learner.export_packed(name) for name in (TRAIN_ADAPTER, OLD_ADAPTER)}
                resources = {k: v for k, v in ray.get_runtime_context()
                             .get_assigned_resources().items() if not k.startswith("bundle")}
                result = {"resources": resources, "modules": {
                    "transformers": sum(parameter_bytes(learner.models).values()),
                    "text_encoders": sum(parameter_bytes(learner.encoders).values()),
                    "media_encoders": sum(parameter_bytes(learner.media_modules).values())},
                    "exports": {k: (_packed_ref(p, channel), scale)
                                for k, (p, scale) in out.items()}
                    if rank == 0 else None}
            elif kind is Job.UPDATE:
                t0 = time.perf_counter()
                plan = with_conditions(ray.get(payload[0]), learner)
                t1 = time.perf_counter()
                metrics = run_update(learner, plan, cfg)
                # rank 0's own seconds: its shard's conditions fetched, its update run
                timing = {"condition_fetch_s": t1 - t0,
                          "learner_update_s": time.perf_counter() - t1}
                packed = _export(learner, TRAIN_ADAPTER, rank, channel)
                result = {"metrics": metrics, "export": packed, "timing": timing} \
                    if rank == 0 else None
            elif kind is Job.REFRESH:
                learner.refresh_old(float(payload))
                result = _export(learner, OLD_ADAPTER, rank, channel)
            elif kind is Job.STATE:
                state = _optimizer_state(learner)
                result = [ray.put(state)] if rank == 0 else None
            elif kind is Job.LOAD:
                adapters, optimizer = ray.get(payload[0])
                for name, tensors in adapters.items():
                    learner.load_adapter(name, tensors)
                _load_optimizer_state(learner, optimizer)
                result = None
            elif kind is Job.RUN:
                result = None if payload is None else payload[0](learner, *payload[1])
            reply = ("ok", result)
        except Exception as exc:  # noqa: BLE001 - the controller re-raises it, typed
            reply = ("error", exc, traceback.format_exc())
        try:
            ray.get(channel.reply.remote(job_id, rank, reply))
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            ray.get(channel.reply.remote(job_id, rank, (
                "error", RuntimeError(f"{type(reply[1]).__name__}: {reply[1]}"), reply[2])))
        if reply[0] == "error" and kind is Job.START:
            raise reply[1]


def _old_params(learner: Learner) -> list[torch.Tensor]:
    from trainer.lora import lora_layers
    return [getattr(layer, part)[OLD_ADAPTER].weight for m in learner.models.values()
            for _, layer in lora_layers(m) for part in ("lora_A", "lora_B")]


def _export(learner: Learner, adapter: str, rank: int, owner=None) -> tuple | None:
    """Rank 0's export as one object (under FSDP every rank joins the gather)."""
    if learner.kind is PolicyKind.FULL or rank == 0:
        packed, scale = learner.export_packed(adapter)
        if rank == 0:
            return (_packed_ref(packed, owner), scale)
    return None


def _optimizer_state(learner: Learner) -> dict:
    if learner.kind is PolicyKind.FULL and torch.distributed.get_world_size() > 1:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_optimizer_state_dict)
        return get_optimizer_state_dict(
            torch.nn.ModuleDict(learner.models), learner.optimizer,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return learner.optimizer.state_dict()


def _load_optimizer_state(learner: Learner, state: Mapping) -> None:
    if learner.kind is PolicyKind.FULL and torch.distributed.get_world_size() > 1:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             set_optimizer_state_dict)
        set_optimizer_state_dict(torch.nn.ModuleDict(learner.models), learner.optimizer,
                                 dict(state), options=StateDictOptions(full_state_dict=True))
        return
    learner.optimizer.load_state_dict(dict(state))
