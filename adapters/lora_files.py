"""LoRA files in the format diffusers' `load_lora_weights` reads, both ways.

    save_diffusers_lora(family, tensors, scale, rank, out_dir)   # -> pytorch_lora_weights.safetensors
    tensors, scale = load_diffusers_lora(family, path)           # a user's LoRA as the initial policy

Writing and reading go through the family pipeline's own LoRA loader mixin
(`<Pipeline>.save_lora_weights` / `<Pipeline>.lora_state_dict`), so the file is what diffusers
writes (keys `transformer.<module>.lora_A.weight`, the adapter's rank and alpha in the
safetensors metadata) and any format diffusers converts (kohya, ...) can be read. Inside the
project a LoRA is peft-named tensors relative to the transformer plus one scale alpha / r;
every tensor must land on one of the family's declared targets, or the load fails naming it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from adapters.family import ModelFamily
from contract import ConfigError, LoRAMapError, NonFiniteError

WEIGHT_NAME = "pytorch_lora_weights.safetensors"


def _pipeline_class(family: ModelFamily):
    """The family's text-to-media pipeline class: its LoRA loader reads and writes the
    transformer's LoRA, whichever accepted class saved the checkpoint folder."""
    import diffusers
    from adapters.families import ENTRIES
    entry = ENTRIES.get(family.name)
    classes = entry.pipeline_classes if entry is not None else ()
    cls = getattr(diffusers, classes[0], None) if classes else None
    if cls is None or not hasattr(cls, "save_lora_weights"):
        raise ConfigError(f"{family.name} has no diffusers pipeline with a LoRA loader",
                          field="adapter", expected="a diffusers checkpoint family",
                          actual=family.name)
    return cls


def _check_targets(family: ModelFamily, tensors: Mapping[str, torch.Tensor]) -> None:
    targets = {c: family.spec.lora_targets[c] for c in family.spec.transformers}
    for key in tensors:
        module = key.rsplit(".lora_", 1)[0]
        component, rest = (family.spec.transformers[0], module) if len(targets) == 1 else \
            module.split(".", 1)
        if component not in targets or not any(rest == s or rest.endswith("." + s)
                                               for s in targets[component]):
            raise LoRAMapError("the LoRA names a module outside the family's targets",
                               field=f"lora[{key}]", expected=list(targets.get(component, ())),
                               actual=rest)


LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def nonfinite_keys(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Names of the floating tensors holding NaN or Inf (a policy that cannot be served)."""
    return [k for k, t in tensors.items()
            if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def check_lora_tensors(tensors: Mapping[str, torch.Tensor], field: str) -> int:
    """Peft-named LoRA tensors: every key `<module>.lora_A.weight` / `.lora_B.weight`, both of
    each module, 2-D, A (r, in) and B (out, r) of one rank r, finite. Returns r."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        if not key.endswith(LORA_SUFFIXES):
            raise LoRAMapError("not a LoRA weight name", field=f"{field}[{key}]",
                               expected=[f"<module>{s}" for s in LORA_SUFFIXES], actual=key)
        if value.ndim != 2:
            raise LoRAMapError("a LoRA weight is a matrix", field=f"{field}[{key}]",
                               expected="2 dimensions", actual=tuple(value.shape))
        module, part = key[:-len(".weight")].rsplit(".", 1)
        modules.setdefault(module, {})[part] = value
    ranks = set()
    for module, parts in modules.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise LoRAMapError("a module needs both lora_A and lora_B", field=f"{field}[{module}]",
                               expected=["lora_A", "lora_B"], actual=sorted(parts))
        a, b = parts["lora_A"], parts["lora_B"]
        if a.shape[0] != b.shape[1]:
            raise LoRAMapError("lora_A (r, in) and lora_B (out, r) ranks disagree",
                               field=f"{field}[{module}.lora_B.weight]",
                               expected=f"(out, {a.shape[0]})", actual=tuple(b.shape))
        ranks.add(a.shape[0])
    if len(ranks) != 1:
        raise LoRAMapError("the LoRA's layers have different ranks", field=field,
                           actual=sorted(ranks))
    bad = nonfinite_keys(tensors)
    if bad:
        raise NonFiniteError("LoRA weights hold NaN or Inf", field=f"{field}[{bad[0]}]",
                             expected="finite values", actual=f"{len(bad)} tensors")
    return ranks.pop()


def save_diffusers_lora(family: ModelFamily, tensors: Mapping[str, torch.Tensor], scale: float,
                        rank: int, out_dir: str | Path) -> Path:
    """Write `tensors` (peft names, as Learner.export returns them) for diffusers."""
    check_lora_tensors(tensors, "lora")
    _check_targets(family, tensors)
    cls = _pipeline_class(family)
    if len(family.spec.transformers) != 1:
        raise ConfigError("diffusers' LoRA files hold one transformer", field="adapter",
                          expected="one transformer", actual=list(family.spec.transformers))
    layers = {k: v.detach().float().cpu().contiguous() for k, v in tensors.items()}
    # (save_lora_weights prefixes each key with "transformer.")
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in tensors})
    metadata = {"r": int(rank), "lora_alpha": float(scale * rank), "target_modules": modules}
    out_dir = Path(out_dir)
    cls.save_lora_weights(out_dir, transformer_lora_layers=layers, weight_name=WEIGHT_NAME,
                          transformer_lora_adapter_metadata=metadata)
    return out_dir / WEIGHT_NAME


def load_diffusers_lora(family: ModelFamily, path: str | Path
                        ) -> tuple[dict[str, torch.Tensor], float]:
    """A diffusers LoRA file (or a folder holding one) -> (peft-named tensors, scale)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError("LoRA file does not exist", field="lora.init_from", actual=str(path))
    cls = _pipeline_class(family)
    kwargs = {"weight_name": WEIGHT_NAME} if path.is_dir() else {}
    try:
        state, metadata = cls.lora_state_dict(str(path), return_lora_metadata=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"not a LoRA diffusers can read: {exc}"[:500],
                          field="lora.init_from", actual=str(path)) from None
    head = "transformer."
    foreign = sorted(k for k in state if not k.startswith(head))
    if foreign:
        raise LoRAMapError("the LoRA carries weights for other components than the "
                           "transformer", field="lora.init_from", actual=foreign[:5])
    tensors = {k[len(head):]: v.float() for k, v in state.items()}
    if not tensors:
        raise LoRAMapError("the LoRA file holds no transformer tensors", field="lora.init_from",
                           actual=str(path))
    rank = check_lora_tensors(tensors, "lora.init_from")
    _check_targets(family, tensors)
    meta = metadata or {}                     # diffusers flattens it: "transformer.lora_alpha"
    alpha = meta.get("transformer.lora_alpha", meta.get("lora_alpha", rank))
    return tensors, float(alpha) / rank
