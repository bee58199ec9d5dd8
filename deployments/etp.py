"""Encoder tensor parallelism (ETP): a family's text encoders split over `etp` shard workers.

Megatron-style split (Shoeybi et al. 2019, "Megatron-LM", sec. 3, fig. 3), per layer, as each
encoder's `adapters.family.ETPPlan` declares it (BERT: query/key/value + intermediate.dense
column-parallel, attention.output.dense + output.dense row-parallel; T5 / CLIP / Gemma the same
roles under their own names):

    column-parallel  W (H, D) -> rows [r*H/etp, (r+1)*H/etp)        (q, k, v, fc1)
    row-parallel     W (D, H) -> cols of the same slice, all-reduce  (out-proj, fc2)
    vocab-parallel   E (V, D) -> rows r of V (uneven split allowed), out-of-range ids masked,
                     all-reduce                                     (token embedding)

Everything else (norms, position embeddings, row-parallel biases, pooler, projection heads)
is replicated, and an encoder without a plan runs whole on every rank.

Approach: PyTorch's own tensor-parallel API, `torch.distributed.tensor.parallel.parallelize_module`
with ColwiseParallel / RowwiseParallel on a 1-D DeviceMesh ("cpu" over gloo, "cuda" over nccl).
gloo on CPU supports the all-reduces DTensor issues; attention code that reshapes its
projections with `view(B, L, -1, head_dim)` sees heads/etp local heads without patching, and
a plan's `local_heads` names the attributes an attention stores a head count in (T5's n_heads,
inner_dim), divided by etp on each shard. ColwiseParallel / RowwiseParallel return plain local
tensors, so the model code runs unchanged between the parallel linears.

Memory: each worker loads the full encoders once, then `distribute_tensor` copies out its own
shard and the full weights are dropped; `param_bytes` counts the distinct storages the modules
still hold, so a shard that kept a view into the full weight would be counted in full.
"""
from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from adapters.family import ETPPlan, ModelFamily
from contract import ConfigError, PromptBundle
from deployments.encoding import encode_prompts, encoder_version, load_encoders


def valid_etp_values(num_heads: int) -> tuple[int, ...]:
    """Shard counts that split the attention heads evenly: the divisors of num_heads."""
    return tuple(d for d in range(1, num_heads + 1) if num_heads % d == 0)


def check_etp(etp: object, num_heads: int, field: str = "etp") -> int:
    """etp as an int, or ConfigError naming `etp` (must be a divisor of the head count)."""
    valid = valid_etp_values(num_heads)
    if isinstance(etp, bool) or not isinstance(etp, int) or etp not in valid:
        raise ConfigError(f"etp must divide the encoder's {num_heads} attention heads",
                          field=field, expected=list(valid), actual=etp)
    return etp


def plan_heads(family: ModelFamily, name: str, plan: ETPPlan) -> int:
    """The head count of encoder `name` from its checkpoint config (no weights loaded)."""
    from adapters.checkpoint import read_json
    component = family.spec.encoder(name).component
    config_dir = family.root / component
    if (config_dir / "config.json").is_file():
        config = read_json(family.root, component, "config.json")
    else:                                  # an encoder that is not a checkpoint subfolder
        config = family.load(component).config.to_dict()
    config = config.get("text_config", config)
    heads = config.get(plan.heads)
    if not isinstance(heads, int):
        raise ConfigError("the encoder config has no head count for its ETP plan",
                          field=f"encoder.{name}.etp", expected=plan.heads,
                          actual=sorted(config)[:12])
    return heads


def check_family_etp(family: ModelFamily, etp: object) -> int:
    """etp must divide the heads of every encoder that has a plan; a family without any plan
    cannot shard."""
    planned = [(e.name, e.etp) for e in family.spec.encoders if e.etp is not None]
    if etp != 1 and not planned:
        raise ConfigError(f"{family.name} declares no ETP plan for its encoders", field="etp",
                          expected=1, actual=etp)
    for name, plan in planned:
        check_etp(etp, plan_heads(family, name, plan), field="etp")
    return int(etp)


def _layers(encoder: nn.Module, plan: ETPPlan) -> nn.ModuleList:
    try:
        layers = encoder.get_submodule(plan.layers)
    except AttributeError:
        raise ConfigError("the ETP plan's layer list is not in this encoder",
                          field="etp.layers", expected=plan.layers,
                          actual=type(encoder).__name__) from None
    return layers


def tp_plan(encoder: nn.Module, plan: ETPPlan, etp: int = 1) -> dict[str, object]:
    """parallelize_module plan: module name -> ParallelStyle, every named module checked (it
    exists, and the width it splits divides by etp: Megatron splits evenly)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out: dict[str, object] = {}
    if plan.vocab is not None:
        out[plan.vocab] = RowwiseParallel(input_layouts=Replicate())
    for i, layer in enumerate(_layers(encoder, plan)):
        names = dict(layer.named_modules())
        for kind, style in (("column", ColwiseParallel), ("row", RowwiseParallel)):
            for name in getattr(plan, kind):
                if name not in names:
                    if name.endswith("relative_attention_bias"):   # only some layers carry it
                        continue
                    raise ConfigError("the ETP plan names a module the encoder layer lacks",
                                      field=f"etp.{kind}", expected=name,
                                      actual=sorted(n for n in names if n)[:8])
                module = names[name]
                width = module.out_features if kind == "column" and hasattr(
                    module, "out_features") else getattr(module, "in_features", None)
                if kind == "column" and isinstance(module, nn.Embedding):
                    width = module.embedding_dim
                if width is not None and width % etp:
                    raise ConfigError("a split layer's width does not divide by etp",
                                      field="etp", expected=f"a divisor of {width} "
                                      f"({plan.layers}.{i}.{name})", actual=etp)
                out[f"{plan.layers}.{i}.{name}"] = style()
    return out


def _tied_embeddings(encoder: nn.Module, vocab: str) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every other embedding module holding the vocab embedding's very
    weight (tied, e.g. T5's `encoder.embed_tokens` and `shared`): after sharding they must run
    the sharded module, or the forward uses a full copy the shard keeps alive."""
    target = encoder.get_submodule(vocab)
    out = []
    for name, module in encoder.named_modules(remove_duplicate=False):
        if module is not target and type(module) is type(target) and \
                getattr(module, "weight", None) is target.weight:
            parent, _, attr = name.rpartition(".")
            out.append((encoder.get_submodule(parent) if parent else encoder, attr))
    return out


def shard_encoder(encoder: nn.Module, plan: ETPPlan, etp: int, device_type: str) -> nn.Module:
    """Split `encoder` in place over the default process group (world size == etp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh(device_type, (etp,))
    tied = [] if plan.vocab is None else _tied_embeddings(encoder, plan.vocab)
    encoder = parallelize_module(encoder, mesh, tp_plan(encoder, plan, etp))
    for owner, attr in tied:           # T5's encoder.embed_tokens runs the sharded `shared`
        setattr(owner, attr, encoder.get_submodule(plan.vocab))
    for layer in _layers(encoder, plan):
        for dotted in plan.local_heads:
            owner_name, _, attr = dotted.rpartition(".")
            owner = layer.get_submodule(owner_name) if owner_name else layer
            value = getattr(owner, attr)
            if value % etp:
                raise ConfigError("a per-layer head count does not divide by etp",
                                  field="etp", expected=f"divisor of {value}", actual=etp)
            setattr(owner, attr, value // etp)
    return encoder


@dataclasses.dataclass(frozen=True)
class ParamBytes:
    """Parameter bytes some modules hold. sharded: the split layers; replicated: the rest."""

    sharded: int
    replicated: int

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def param_bytes(encoders: dict[str, nn.Module], family: ModelFamily) -> ParamBytes:
    """Bytes of the distinct parameter storages of the encoders (a DTensor counts its local
    shard's storage); `sharded` = parameters of the modules the ETP plans split."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, tuple[int, bool]] = {}
    for name, module in encoders.items():
        plan = family.spec.encoder(name).etp
        split = () if plan is None else tuple(list(plan.column) + list(plan.row))
        for pname, p in module.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p.data
            storage = local.untyped_storage()
            owner = pname.rsplit(".", 1)[0]
            # a module of the plan's layer list (not another tower's of the same name, e.g.
            # Qwen2.5-VL's vision blocks' mlp.gate_proj), or the vocab embedding
            in_plan = plan is not None and (owner == plan.vocab or (
                owner.startswith(f"{plan.layers}.") and owner.endswith(split)))
            is_split = in_plan and (pname.endswith(".weight") or owner.endswith(plan.column))
            seen[storage.data_ptr()] = (storage.nbytes(), is_split)
    return ParamBytes(sharded=sum(n for n, s in seen.values() if s),
                      replicated=sum(n for n, s in seen.values() if not s))


class ShardWorker:
    """One ETP rank (a Ray actor, owned by the TextEncoder replica that created it).

    Every rank runs the family's conditioner on the same prompts; the collectives inside the
    sharded linears keep the ranks in lockstep; rank 0 returns the Condition.
    """

    def __init__(self, adapter: str, weights_path: str | None, rank: int, etp: int,
                 master: str, device: str, dtype: str = "float32",
                 options: dict | None = None, memory_bytes: float | None = None):
        from adapters.registry import get_family
        from deployments.memory import MemoryGuard

        self.rank, self.etp = rank, etp
        # its bundle's memory, guarded as a replica's is: over it, the worker ends itself
        self.memory_guard = None if not memory_bytes else \
            MemoryGuard(int(memory_bytes), f"TextEncoder shard {rank}").start()
        self.device_type = torch.device(device).type
        backend = "nccl" if self.device_type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank,
                                world_size=etp, timeout=timedelta(seconds=120))
        self.family = get_family(adapter, weights_path, options)
        device = "cuda" if self.device_type == "cuda" else "cpu"   # Ray's visible GPU
        encoders = load_encoders(self.family, device, dtype)
        self.full_bytes = param_bytes(encoders, self.family)
        # rank 0 names the version from the full weights (the replica's cache stamps entries)
        self.version = encoder_version(self.family, encoders, dtype) if rank == 0 else None
        self.encoders = {}
        for name, module in encoders.items():
            plan = self.family.spec.encoder(name).etp
            self.encoders[name] = module if plan is None else \
                shard_encoder(module, plan, etp, self.device_type)

    def ready(self) -> dict[str, int | str | None]:
        import os
        limit = 0 if self.memory_guard is None else self.memory_guard.limit_bytes
        return {"rank": self.rank, "pid": os.getpid(), "memory_limit_bytes": limit,
                "encoder_version": self.version}

    def param_bytes(self) -> dict[str, int]:
        own = param_bytes(self.encoders, self.family)
        return {"rank": self.rank, "sharded": own.sharded, "replicated": own.replicated,
                "total": own.total, "full_sharded": self.full_bytes.sharded,
                "full_total": self.full_bytes.total}

    def encode(self, prompts: Sequence[PromptBundle], media=None):
        cond = encode_prompts(self.family, self.encoders, prompts, media)
        return cond if self.rank == 0 else None

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
