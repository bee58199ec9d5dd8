"""Encoder tensor parallelism (ETP): a BERT-family text encoder split over `etp` shard workers.

Megatron-style split (Shoeybi et al. 2019, "Megatron-LM", sec. 3, fig. 3), per layer:

    attention.self.{query,key,value}  column-parallel  W (H, D) -> rows [r*H/etp, (r+1)*H/etp)
    attention.output.dense            row-parallel     W (D, H) -> cols of the same slice, all-reduce
    intermediate.dense (fc1)          column-parallel  W (I, D) -> rows [r*I/etp, (r+1)*I/etp)
    output.dense (fc2)                row-parallel     W (D, I) -> cols of the same slice, all-reduce
    embeddings.word_embeddings        vocab-parallel   E (V, D) -> rows r of V (uneven split
                                                       allowed), out-of-range ids masked, all-reduce

Everything else (position / token-type embeddings, LayerNorms, row-parallel biases, pooler) is
replicated: a few hundred KiB.

Approach: PyTorch's own tensor-parallel API, `torch.distributed.tensor.parallel.parallelize_module`
with ColwiseParallel / RowwiseParallel on a 1-D DeviceMesh ("cpu" over gloo, "cuda" over nccl).
It was checked first and works here: gloo on CPU supports the all-reduces DTensor issues, and the
transformers BertSelfAttention reshapes its projections with `view(B, L, -1, head_dim)`, so each
shard sees heads/etp local heads without any patching (max abs diff vs. the unsharded MiniLM
~2e-6). ColwiseParallel / RowwiseParallel return plain local tensors (`use_local_output=True`),
so the transformers module code runs unchanged between the parallel linears. Hand-written
column/row-parallel layers were therefore not needed.

Memory: each worker loads the full encoder once, then `distribute_tensor` copies out its own
shard and the full weights are dropped; `param_bytes` counts the distinct storages the module
still holds, so a shard that kept a view into the full weight would be counted in full.
"""
from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from contract import ConfigError, PromptBundle

ROW_PARALLEL = ("attention.output.dense", "output.dense")
COLUMN_PARALLEL = ("attention.self.query", "attention.self.key", "attention.self.value",
                   "intermediate.dense")
VOCAB_PARALLEL = "embeddings.word_embeddings"


def valid_etp_values(num_heads: int) -> tuple[int, ...]:
    """Shard counts that split the attention heads evenly: the divisors of num_heads."""
    return tuple(d for d in range(1, num_heads + 1) if num_heads % d == 0)


def check_etp(etp: object, num_heads: int) -> int:
    """etp as an int, or ConfigError naming `etp` (must be a divisor of the head count)."""
    valid = valid_etp_values(num_heads)
    if isinstance(etp, bool) or not isinstance(etp, int) or etp not in valid:
        raise ConfigError(f"etp must divide the encoder's {num_heads} attention heads",
                          field="etp", expected=list(valid), actual=etp)
    return etp


def encoder_num_heads(encoder: nn.Module) -> int:
    """Attention head count of a transformers BERT-family encoder."""
    config = getattr(encoder, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(getattr(encoder, "encoder", None), "layer", None)
    if not isinstance(heads, int) or layers is None or not hasattr(encoder, "embeddings"):
        raise ConfigError("tensor parallelism supports transformers BERT-family encoders "
                          "(embeddings + encoder.layer[i] with BertSelfAttention)", field="etp",
                          expected="BertModel-like", actual=type(encoder).__name__)
    return heads


def tp_plan(encoder: nn.Module) -> dict[str, object]:
    """parallelize_module plan for a BertModel: module name -> ParallelStyle."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, object] = {VOCAB_PARALLEL: RowwiseParallel(input_layouts=Replicate())}
    for i in range(len(encoder.encoder.layer)):
        for name in COLUMN_PARALLEL:
            plan[f"encoder.layer.{i}.{name}"] = ColwiseParallel()
        for name in ROW_PARALLEL:
            plan[f"encoder.layer.{i}.{name}"] = RowwiseParallel()
    return plan


def shard_encoder(encoder: nn.Module, etp: int, device_type: str) -> nn.Module:
    """Split `encoder` in place over the default process group (world size == etp)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    check_etp(etp, encoder_num_heads(encoder))
    mesh = init_device_mesh(device_type, (etp,))
    return parallelize_module(encoder, mesh, tp_plan(encoder))


@dataclasses.dataclass(frozen=True)
class ParamBytes:
    """Parameter bytes one module holds. sharded: the split layers; replicated: the rest."""

    sharded: int
    replicated: int

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def param_bytes(module: nn.Module) -> ParamBytes:
    """Bytes of the distinct parameter storages (a DTensor counts its local shard's storage)."""
    from torch.distributed.tensor import DTensor

    split = (VOCAB_PARALLEL,) + COLUMN_PARALLEL + ROW_PARALLEL
    seen: dict[int, tuple[int, bool]] = {}
    for name, p in module.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p.data
        storage = local.untyped_storage()
        is_split = name.rsplit(".", 1)[0].endswith(split) and name.endswith(".weight")
        is_split = is_split or (name.endswith(".bias") and
                                name.rsplit(".", 1)[0].endswith(COLUMN_PARALLEL))
        seen[storage.data_ptr()] = (storage.nbytes(), is_split)
    return ParamBytes(sharded=sum(n for n, s in seen.values() if s),
                      replicated=sum(n for n, s in seen.values() if not s))


class ShardWorker:
    """One ETP rank (a Ray actor, owned by the TextEncoder replica that created it).

    Every rank runs the adapter's own `encode` on the same prompts; the collectives inside the
    sharded linears keep the ranks in lockstep; rank 0 returns the TextCondition.
    """

    def __init__(self, adapter: str, weights_path: str | None, rank: int, etp: int,
                 master: str, device: str):
        from deployments.encoder import load_text_encoder, place_inputs_on
        from adapters.registry import get_adapter

        self.rank, self.etp = rank, etp
        self.device_type = torch.device(device).type
        backend = "nccl" if self.device_type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{master}", rank=rank,
                                world_size=etp, timeout=timedelta(seconds=120))
        self.adapter = get_adapter(adapter)
        encoder = load_text_encoder(self.adapter, weights_path)
        self.full_bytes = param_bytes(encoder)
        if self.device_type == "cuda":       # Ray's CUDA_VISIBLE_DEVICES: this rank's GPU
            encoder = place_inputs_on(encoder.to("cuda"), torch.device("cuda"))
        self.encoder = shard_encoder(encoder, etp, self.device_type)

    def ready(self) -> dict[str, int]:
        import os
        return {"rank": self.rank, "pid": os.getpid()}

    def param_bytes(self) -> dict[str, int]:
        own = param_bytes(self.encoder)
        return {"rank": self.rank, "sharded": own.sharded, "replicated": own.replicated,
                "total": own.total, "full_sharded": self.full_bytes.sharded,
                "full_total": self.full_bytes.total}

    def encode(self, prompts: Sequence[PromptBundle]):
        from deployments.encoder import to_cpu
        cond = self.adapter.encode(self.encoder, prompts)
        return to_cpu(cond) if self.rank == 0 else None

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

