"""The family registry: name -> a family bound to its checkpoint; `auto` reads the checkpoint's
model_index.json `_class_name`. Every family is one entry of adapters/families.py FAMILIES
(no import-time registration)."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from adapters.checkpoint import read_model_index
from adapters.families import ENTRIES, FAMILY_OF_PIPELINE, family_entry
from adapters.family import ModelFamily, parse_options
from contract import ConfigError

AUTO = "auto"


def family_name(name: str, path: str | Path | None) -> str:
    """Resolve `auto` from the checkpoint; check an explicit name against the registry."""
    if name == AUTO:
        if path is None:
            raise ConfigError("adapter 'auto' needs a checkpoint path", field="weights_path",
                              expected="a local diffusers checkpoint", actual=None)
        cls = read_model_index(path)["_class_name"]
        if cls not in FAMILY_OF_PIPELINE:
            raise ConfigError("no family serves this checkpoint's pipeline class",
                              field="weights_path", expected=sorted(FAMILY_OF_PIPELINE),
                              actual=cls)
        return FAMILY_OF_PIPELINE[cls]
    if name not in ENTRIES:
        raise ConfigError(f"unknown adapter {name!r}", field="adapter",
                          expected=sorted([*ENTRIES, AUTO]), actual=name)
    if path is None and not ENTRIES[name].embedded:
        raise ConfigError(f"{name} loads a local checkpoint: weights_path is required",
                          field="weights_path", expected="a local diffusers checkpoint",
                          actual=None)
    return name


def get_family(name: str, path: str | Path | None = None,
               options: Mapping | None = None) -> ModelFamily:
    """A family bound to its checkpoint folder (reads JSON configs only, loads no weights);
    `options`: the family's own settings (config `rollout.adapter_options`)."""
    entry = family_entry(family_name(name, path))
    if entry.embedded:                      # the project's own models: no options
        parse_options(entry.options_model, options, entry.name)
        return entry.family_class(path)
    return entry.family_class(path, options)

