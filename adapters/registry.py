"""The explicit family registry: name -> family class; `auto` reads the checkpoint's
model_index.json `_class_name` (no import-time registration)."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

from adapters.checkpoint import read_model_index
from adapters.family import ModelFamily, NoOptions, parse_options
from contract import ConfigError

AUTO = "auto"


def _tiny_t2i(root, options):
    from adapters.tiny_t2i import TinyT2IFamily
    parse_options(NoOptions, options, "tiny_t2i")
    return TinyT2IFamily(root)


def _tiny_t2va(root, options):
    from adapters.tiny_t2va import TinyT2VAFamily
    parse_options(NoOptions, options, "tiny_t2va")
    return TinyT2VAFamily(root)


def _sd3(root, options):
    from adapters.sd3 import SD3Family
    return SD3Family(root, options)


def _flux(root, options):
    from adapters.flux import FluxFamily
    return FluxFamily(root, options)


def _wan(root, options):
    from adapters.wan import WanFamily
    return WanFamily(root, options)


def _ltx2(root, options):
    from adapters.ltx2 import LTX2Family
    return LTX2Family(root, options)


# each builder imports its family module only when that family is asked for
FAMILIES: dict[str, Callable[[str | Path | None, Mapping | None], ModelFamily]] = {
    "tiny_t2i": _tiny_t2i,
    "tiny_t2va": _tiny_t2va,
    "sd3": _sd3,
    "flux": _flux,
    "ltx2": _ltx2,
    "wan": _wan,
}

# model_index.json `_class_name` -> family name (what `adapter: auto` resolves)
PIPELINE_CLASSES: dict[str, str] = {
    "StableDiffusion3Pipeline": "sd3",
    "FluxPipeline": "flux",
    "LTX2Pipeline": "ltx2",
    "WanPipeline": "wan",
    "WanImageToVideoPipeline": "wan",
}

EMBEDDED = ("tiny_t2i", "tiny_t2va")     # families that ship their weights (path optional)


def family_name(name: str, path: str | Path | None) -> str:
    """Resolve `auto` from the checkpoint; check an explicit name against the registry."""
    if name == AUTO:
        if path is None:
            raise ConfigError("adapter 'auto' needs a checkpoint path", field="weights_path",
                              expected="a local diffusers checkpoint", actual=None)
        cls = read_model_index(path)["_class_name"]
        if cls not in PIPELINE_CLASSES:
            raise ConfigError("no family serves this checkpoint's pipeline class",
                              field="weights_path", expected=sorted(PIPELINE_CLASSES),
                              actual=cls)
        return PIPELINE_CLASSES[cls]
    if name not in FAMILIES:
        raise ConfigError(f"unknown adapter {name!r}", field="adapter",
                          expected=sorted([*FAMILIES, AUTO]), actual=name)
    if path is None and name not in EMBEDDED:
        raise ConfigError(f"{name} loads a local checkpoint: weights_path is required",
                          field="weights_path", expected="a local diffusers checkpoint",
                          actual=None)
    return name


def get_family(name: str, path: str | Path | None = None,
               options: Mapping | None = None) -> ModelFamily:
    """A family bound to its checkpoint folder (reads JSON configs only, loads no weights);
    `options`: the family's own settings (config `rollout.adapter_options`)."""
    return FAMILIES[family_name(name, path)](path, options)

