"""Full-weight policy versions on the served transformer(s), beside the LoRA slots.

A full fine-tune publishes every transformer weight per version (trainer `learner.fine_tune:
full`). The engine keeps its base weights and at most `max_versions` full versions resident
(tensors as fetched: views into the version's one buffer when dtype and device already match);
a forward with a full version swaps each parameter's storage to the version's tensor and back
afterwards (a pointer swap per parameter, no copy), so the base model and the LoRA versions on
top of it keep serving in between. Names are `Learner.export` names (`<module>.weight`,
prefixed by the component with several transformers); a version must cover every parameter
with its exact shape -- anything else is a LoRAMapError naming the tensor.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from contextlib import contextmanager
from typing import Iterator, Mapping

import torch
from torch import nn

from contract import LoRAMapError, PolicyVersionError
from rollout.lora import BASE_VERSION, LoRASlotGroup


class FullWeightVersions:
    def __init__(self, models: Mapping[str, nn.Module], max_versions: int = 1):
        self.models = dict(models)
        self.max_versions = max_versions
        prefix = (lambda c: "") if len(self.models) == 1 else (lambda c: f"{c}.")
        self.params: dict[str, nn.Parameter] = {
            prefix(c) + name: p for c, m in self.models.items() for name, p in m.named_parameters()}
        self._versions: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()

    def versions(self) -> tuple[str, ...]:
        return tuple(self._versions)

    def _mapped(self, tensors: Mapping[str, torch.Tensor], copy: bool) -> dict[str, torch.Tensor]:
        missing = sorted(set(self.params) - set(tensors))
        extra = sorted(set(tensors) - set(self.params))
        if missing or extra:
            raise LoRAMapError("full weights must name every parameter of the served model "
                               "exactly once", field=f"weights[{(missing or extra)[0]}]",
                               expected=f"{len(self.params)} parameters",
                               actual={"missing": missing[:3], "unknown": extra[:3]})
        out = {}
        for name, param in self.params.items():
            value = tensors[name]
            if tuple(value.shape) != tuple(param.shape):
                raise LoRAMapError("a full-weight tensor has the wrong shape",
                                   field=f"weights[{name}]", expected=tuple(param.shape),
                                   actual=tuple(value.shape))
            value = value.detach().to(param.device, param.dtype)     # a view when they match
            out[name] = value.clone() if copy and value.data_ptr() == tensors[name].data_ptr() \
                else value
        return out

    def load(self, version: str, tensors: Mapping[str, torch.Tensor],
             pinned: frozenset[str] = frozenset(), copy: bool = True) -> None:
        """Check and keep `tensors` as `version`; evicts the least recently used unpinned full
        version when `max_versions` are resident (PolicyVersionError if all are pinned)."""
        mapped = self._mapped(tensors, copy)
        self._versions.pop(version, None)
        while len(self._versions) >= self.max_versions:
            victim = next((v for v in self._versions if v not in pinned), None)
            if victim is None:
                raise PolicyVersionError("every resident full-weight version is in use",
                                         field="version", expected=f"<= {self.max_versions} "
                                         "resident", actual=list(self._versions))
            del self._versions[victim]
        self._versions[version] = mapped

    def unload(self, version: str) -> None:
        del self._versions[version]

    @contextmanager
    def active(self, version: str) -> Iterator[None]:
        weights = self._versions[version]
        self._versions.move_to_end(version)
        base = {name: p.data for name, p in self.params.items()}
        try:
            for name, p in self.params.items():
                p.data = weights[name]
            yield
        finally:
            for name, p in self.params.items():
                p.data = base[name]


class PolicySlots:
    """The engine's policy versions: LoRA versions (rollout/lora.py) and full-weight versions,
    one namespace, 'base' = the loaded weights. Same interface as LoRASlotGroup + load_full."""

    def __init__(self, lora: LoRASlotGroup, models: Mapping[str, nn.Module],
                 max_full_versions: int = 1):
        self.lora = lora
        self.full = FullWeightVersions(models, max_full_versions)
        self.lock = threading.RLock()
        self._latest = BASE_VERSION

    def versions(self) -> tuple[str, ...]:
        return (*self.lora.versions(), *self.full.versions())

    @property
    def latest(self) -> str:
        return self._latest if self._latest in self.versions() else self.lora.latest

    def check(self, version: str, request_id: str | None = None) -> None:
        if version not in self.versions():
            raise PolicyVersionError("policy version is not resident on this replica",
                                     field="policy_version", expected=list(self.versions()),
                                     actual=version, request_id=request_id)

    def _check_new(self, version: str, kind: str) -> None:
        other = self.full.versions() if kind == "lora" else self.lora.versions()[1:]
        if version == BASE_VERSION or version in other:
            raise PolicyVersionError("a version name is either LoRA or full weights, once",
                                     field="version", actual=version)

    def load(self, version: str, tensors: Mapping[str, torch.Tensor], scale: float = 1.0,
             pinned: frozenset[str] = frozenset(), copy: bool = True) -> None:
        with self.lock:
            self._check_new(version, "lora")
            self.lora.load(version, tensors, scale, pinned, copy)
            self._latest = version

    def load_full(self, version: str, tensors: Mapping[str, torch.Tensor],
                  pinned: frozenset[str] = frozenset(), copy: bool = True) -> None:
        with self.lock:
            self._check_new(version, "full")
            self.full.load(version, tensors, pinned, copy)
            self._latest = version

    def unload(self, version: str, pinned: frozenset[str] = frozenset()) -> None:
        with self.lock:
            if version in self.full.versions():
                if version in pinned:
                    raise PolicyVersionError("version is in use by running requests",
                                             field="version", actual=version)
                self.full.unload(version)
            else:
                self.lora.unload(version, pinned)

    @contextmanager
    def active(self, version: str) -> Iterator[None]:
        with self.lock:
            self.check(version)
            if version in self.full.versions():
                with self.full.active(version):
                    yield
            else:
                with self.lora.active(version):
                    yield
