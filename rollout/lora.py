"""Versioned LoRA slots on the packed inference-form transformer.

A trainer sends peft-format tensors with training-form names
(`transformer_blocks.0.attn.to_q.lora_A.weight`, `...lora_B.weight`) and one scale = alpha / r.
The adapter's explicit `LoRATargetMap` says where each training target lands:

* q / k / v -> one output slice of the packed `to_qkv` (slice_index of num_slices),
* fc1       -> `fc1_shards` shard modules; shard i holds logical output slice fc1_shard_order[i],
* anything else one-to-one.

Each target Linear of the inference model gets one forward hook that adds, for the version active
in the current forward, `scale * B_v (A_v x)` on its output slice (LoRA, Hu et al. 2021, eq. 3:
h = W0 x + (alpha/r) B A x). The base weights are never touched, so several versions stay resident
and the version "base" is the plain model. A tensor that names an unknown target, maps to no
module, or has the wrong shape raises `LoRAMapError` naming it at load — never a silent no-op.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import torch
from torch import nn

from adapters.lora_files import nonfinite_keys
from adapters.lora_targets import LoRATargetMap
from contract import LoRAMapError, PolicyVersionError

BASE_VERSION = "base"

# peft names: optional "base_model.model." prefix, optional adapter name before ".weight".
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])"
                       r"(?:\.(?P<adapter>[A-Za-z0-9_]+))?\.weight$")


@dataclass(frozen=True)
class LoRADelta:
    """One low-rank update on output rows [start, stop) of an inference Linear.

    a: (r, in_features); b: (stop - start, r); y[..., start:stop] += scale * (x @ a.T) @ b.T
    """

    a: torch.Tensor
    b: torch.Tensor
    scale: float
    start: int
    stop: int
    source: str          # training-form module name the delta came from


def _split_key(key: str) -> tuple[str, str]:
    match = _PEFT_KEY.match(key)
    if match is None:
        raise LoRAMapError("tensor name is not a peft LoRA weight (<module>.lora_A/B.weight)",
                           field=f"lora[{key}]", expected="<module>.lora_A.weight", actual=key)
    return match.group("module"), match.group("ab")


def _resolve(lora_map: LoRATargetMap, module: str) -> list[tuple[str, int, int, bool]]:
    """Training module name -> [(inference module, logical slice, num slices, is_fc1_shard)].

    A packed slice lives inside a wider module (q of to_qkv); an fc1 shard *is* the module.
    """
    def with_suffix(suffix: str) -> str | None:
        if module == suffix:
            return ""
        if module.endswith("." + suffix):
            return module[: -len(suffix)]
        return None

    for target in lora_map.targets:
        prefix = with_suffix(target.train_suffix)
        if prefix is not None:
            return [(prefix + target.infer_suffix, target.slice_index, target.num_slices, False)]
    if lora_map.fc1_train_suffix is not None:
        prefix = with_suffix(lora_map.fc1_train_suffix)
        if prefix is not None:
            base = prefix + (lora_map.fc1_infer_suffix or lora_map.fc1_train_suffix)
            # shard i holds logical slice fc1_shard_order[i] of fc1_shards equal slices
            return [(f"{base}.shards.{i}", logical, lora_map.fc1_shards, True)
                    for i, logical in enumerate(lora_map.fc1_shard_order)]
    raise LoRAMapError("LoRA tensor names a module that is not a declared target",
                       field=f"lora[{module}]", expected=lora_map.train_target_modules,
                       actual=module)


def map_lora_tensors(model: nn.Module, lora_map: LoRATargetMap,
                     tensors: Mapping[str, torch.Tensor], scale: float,
                     copy: bool = True) -> dict[str, list[LoRADelta]]:
    """peft tensors -> {inference module name: [LoRADelta]}. Raises LoRAMapError on any mismatch.

    copy=False keeps views of `tensors` where dtype and device already match (the caller owns
    them and never writes to them again, e.g. tensors fetched from the object store); the
    default copies, so a trainer's in-place optimizer steps cannot reach a resident version.
    """
    if not tensors:
        raise LoRAMapError("LoRA has no tensors (zero matched modules)", field="lora",
                           expected="lora_A/lora_B pairs", actual=0)
    pairs: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, value in tensors.items():
        module, ab = _split_key(key)
        pairs.setdefault(module, {})[ab] = (key, value)
    modules = dict(model.named_modules())
    deltas: dict[str, list[LoRADelta]] = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            missing = "lora_B" if "A" in ab else "lora_A"
            raise LoRAMapError(f"{missing} is missing for this module", field=f"lora[{module}]",
                               expected="lora_A and lora_B", actual=sorted(ab))
        (key_a, a), (key_b, b) = ab["A"], ab["B"]
        bad = nonfinite_keys({key_a: a, key_b: b})
        if bad:                      # never served: every request on it would fail late
            raise PolicyVersionError("the version's LoRA weights hold NaN or Inf",
                                     field=f"lora[{bad[0]}]", expected="finite values")
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoRAMapError("lora_A (r, in) and lora_B (out, r) ranks disagree",
                               field=f"lora[{key_b}]", expected=f"(out, {a.shape[0]})",
                               actual=tuple(b.shape))
        for infer_name, logical, num_slices, is_shard in _resolve(lora_map, module):
            target = modules.get(infer_name)
            if not isinstance(target, nn.Linear):
                raise LoRAMapError("mapped inference module does not exist (or is not Linear)",
                                   field=f"lora[{key_a}]", expected=infer_name,
                                   actual=type(target).__name__ if target is not None else None)
            if a.shape[1] != target.in_features:
                raise LoRAMapError("lora_A input width does not match the target module",
                                   field=f"lora[{key_a}]",
                                   expected=f"(r, {target.in_features}) for {infer_name}",
                                   actual=tuple(a.shape))
            if is_shard:                     # fc1 shard: the shard is one logical slice of B
                shard_rows = target.out_features
                if b.shape[0] != target.out_features * num_slices:
                    raise LoRAMapError("lora_B output rows do not match the fc1 shards",
                                       field=f"lora[{key_b}]",
                                       expected=f"({target.out_features * num_slices}, r)",
                                       actual=tuple(b.shape))
                rows = b[logical * shard_rows:(logical + 1) * shard_rows]
                start, stop = 0, target.out_features
            else:                            # packed slice (q/k/v) or one-to-one
                width, rem = divmod(target.out_features, num_slices)
                if rem or b.shape[0] != width:
                    raise LoRAMapError("lora_B output rows do not match the target slice",
                                       field=f"lora[{key_b}]",
                                       expected=f"({width}, r) = slice {logical}/{num_slices} of "
                                                f"{infer_name}", actual=tuple(b.shape))
                rows, start, stop = b, logical * width, (logical + 1) * width
            param = target.weight
            a_in = a.detach().to(param.device, param.dtype)
            b_in = rows.detach().to(param.device, param.dtype)
            deltas.setdefault(infer_name, []).append(LoRADelta(
                a_in.clone() if copy else a_in, b_in.clone() if copy else b_in,
                float(scale), start, stop, module))
    if not deltas:
        raise LoRAMapError("LoRA matched zero modules", field="lora", actual=sorted(pairs))
    return deltas


def check_resident(versions: tuple[str, ...], version: str, request_id: str | None) -> None:
    if version not in versions:
        raise PolicyVersionError("policy version is not resident on this replica",
                                 field="policy_version", expected=list(versions),
                                 actual=version, request_id=request_id)


def check_loadable(version: str, pinned: frozenset[str]) -> None:
    """Refuse loading over "base" or over a version running requests use."""
    if version == BASE_VERSION:
        raise PolicyVersionError("'base' is the model without LoRA and cannot be loaded",
                                 field="version", actual=version)
    if version in pinned:
        raise PolicyVersionError("version is in use by running requests; load it under a "
                                 "new name", field="version", actual=version)


def lru_victim(versions: Iterable[str], pinned: frozenset[str], max_versions: int) -> str:
    """The least recently used unpinned version (`versions` in LRU order), to evict."""
    resident = list(versions)
    victim = next((v for v in resident if v not in pinned), None)
    if victim is None:
        raise PolicyVersionError("every resident version is in use; cannot evict",
                                 field="version", expected=f"<= {max_versions} resident",
                                 actual=resident)
    return victim


class LoRASlots:
    """Resident LoRA versions on one inference-form model, applied per forward by version.

    Thread-safety: `load`/`unload` and `active(...)` forwards serialise on one lock, so a load
    lands between two engine steps, never inside a forward.
    """

    def __init__(self, model: nn.Module, lora_map: LoRATargetMap, max_versions: int = 3):
        self.model = model
        self.lora_map = lora_map
        self.max_versions = max_versions
        self.lock = threading.RLock()
        self._versions: OrderedDict[str, dict[str, list[LoRADelta]]] = OrderedDict()
        self._active: dict[str, list[LoRADelta]] | None = None
        self._active_name = BASE_VERSION
        self._hooks: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._latest = BASE_VERSION

    # ---- versions -------------------------------------------------------------------------
    def versions(self) -> tuple[str, ...]:
        return (BASE_VERSION, *self._versions)

    @property
    def latest(self) -> str:
        """The most recently loaded version still resident ("base" if none)."""
        return self._latest if self._latest in self.versions() else BASE_VERSION

    def check(self, version: str, request_id: str | None = None) -> None:
        check_resident(self.versions(), version, request_id)

    def load(self, version: str, tensors: Mapping[str, torch.Tensor], scale: float = 1.0,
             pinned: frozenset[str] = frozenset(), copy: bool = True) -> None:
        """Map and store `tensors` as `version`; evicts the LRU unpinned version when full.
        copy: see map_lora_tensors."""
        check_loadable(version, pinned)
        deltas = map_lora_tensors(self.model, self.lora_map, tensors, scale, copy=copy)
        with self.lock:
            self._versions.pop(version, None)
            while len(self._versions) >= self.max_versions:
                self._drop(lru_victim(self._versions, pinned, self.max_versions))
            self._versions[version] = deltas
            self._latest = version
            for name in deltas:
                if name not in self._hooks:
                    module = self.model.get_submodule(name)
                    self._hooks[name] = module.register_forward_hook(self._hook_for(name))

    def unload(self, version: str, pinned: frozenset[str] = frozenset()) -> None:
        if version == BASE_VERSION:
            raise PolicyVersionError("'base' cannot be unloaded", field="version", actual=version)
        if version in pinned:
            raise PolicyVersionError("version is in use by running requests", field="version",
                                     actual=version)
        with self.lock:
            if version not in self._versions:
                raise PolicyVersionError("version is not resident", field="version",
                                         expected=list(self.versions()), actual=version)
            self._drop(version)

    def _drop(self, version: str) -> None:
        del self._versions[version]
        used = {name for deltas in self._versions.values() for name in deltas}
        for name in list(self._hooks):
            if name not in used:
                self._hooks.pop(name).remove()

    # ---- forward ---------------------------------------------------------------------------
    @contextmanager
    def active(self, version: str) -> Iterator[None]:
        """Run forwards inside this block with `version` applied (marks it recently used)."""
        with self.lock:
            self.check(version)
            if version != BASE_VERSION:
                self._versions.move_to_end(version)
            self._active = self._versions.get(version)
            self._active_name = version
            try:
                yield
            finally:
                self._active, self._active_name = None, BASE_VERSION

    def _hook_for(self, name: str):
        def hook(module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor):
            deltas = None if self._active is None else self._active.get(name)
            if not deltas:
                return None
            x = args[0]
            out = out.clone()
            for d in deltas:
                # (..., in) @ (in, r) @ (r, rows) -> (..., rows)
                out[..., d.start:d.stop] += d.scale * ((x @ d.a.T) @ d.b.T)
            return out
        return hook


def split_by_component(tensors: Mapping[str, torch.Tensor],
                       components: tuple[str, ...]) -> dict[str, dict[str, torch.Tensor]]:
    """One family transformer: the tensors as they are. Several (Wan 2.2's two experts): every
    name starts with its component ("transformer_2.blocks.0...."), stripped here."""
    if len(components) == 1:
        return {components[0]: dict(tensors)}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        component, _, rest = key.partition(".")
        if component not in components or not rest:
            raise LoRAMapError("with several transformers a LoRA tensor name starts with its "
                               "component", field=f"lora[{key}]",
                               expected=[f"{c}.<module>.lora_A.weight" for c in components],
                               actual=key)
        out.setdefault(component, {})[rest] = value
    return out


class LoRASlotGroup:
    """LoRASlots on each transformer of a family, versioned together: a version may train one
    expert or all (an expert the version does not name runs with its base weights)."""

    def __init__(self, models: Mapping[str, nn.Module], maps: Mapping[str, LoRATargetMap],
                 max_versions: int = 3):
        self.components = tuple(models)
        self.slots = {name: LoRASlots(models[name], maps[name], max_versions) for name in models}
        self.lock = threading.RLock()
        self._versions: OrderedDict[str, tuple[str, ...]] = OrderedDict()   # version -> parts
        self.max_versions = max_versions

    def versions(self) -> tuple[str, ...]:
        return (BASE_VERSION, *self._versions)

    @property
    def latest(self) -> str:
        return next(reversed(self._versions), BASE_VERSION)

    def check(self, version: str, request_id: str | None = None) -> None:
        check_resident(self.versions(), version, request_id)

    def load(self, version: str, tensors: Mapping[str, torch.Tensor], scale: float = 1.0,
             pinned: frozenset[str] = frozenset(), copy: bool = True) -> None:
        check_loadable(version, pinned)
        parts = split_by_component(tensors, self.components)
        if not parts:
            raise LoRAMapError("LoRA has no tensors (zero matched modules)", field="lora",
                               expected="lora_A/lora_B pairs", actual=0)
        with self.lock:
            if version in self._versions:
                self.unload(version, pinned)
            while len(self._versions) >= self.max_versions:
                self.unload(lru_victim(self._versions, pinned, self.max_versions), pinned)
            done: list[str] = []
            try:
                for name, part in parts.items():
                    self.slots[name].load(version, part, scale, pinned, copy)
                    done.append(name)
            except Exception:
                for name in done:                 # all parts or none
                    self.slots[name].unload(version, pinned)
                raise
            self._versions[version] = tuple(parts)

    def unload(self, version: str, pinned: frozenset[str] = frozenset()) -> None:
        with self.lock:
            if version not in self._versions:
                raise PolicyVersionError("version is not resident", field="version",
                                         expected=list(self.versions()), actual=version)
            for name in self._versions.pop(version):
                self.slots[name].unload(version, pinned)

    @contextmanager
    def active(self, version: str) -> Iterator[None]:
        """Forwards inside this block run `version` on every transformer that carries it."""
        from contextlib import ExitStack
        with self.lock:
            self.check(version)
            if version != BASE_VERSION:
                self._versions.move_to_end(version)
            parts = self._versions.get(version, ())
            with ExitStack() as stack:
                for name in parts:
                    stack.enter_context(self.slots[name].active(version))
                yield
