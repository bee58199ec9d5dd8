"""Architecture descriptions of the real models, and where a family's declarations come from.

Each folder here is a published diffusers checkpoint's layout without its weights and tokenizers:
model_index.json, every model component's config.json and the scheduler's
scheduler_config.json, values as published (SOURCES.md says where each came from). A graph
config names one (`rollout.architecture: sd3.5-medium`) so that what a family declares -- its
artifacts, decoders, ETP plans, component configs -- is known on a machine that does not hold
the checkpoint: the config check, the capacity planner and the manifest renderer run on a
laptop; the weights are read only by the stages that load them, on the nodes that hold them.

    source = config_source(weights_path, architecture)   # the checkpoint's JSON, or a description
    declared = declare("sd3", weights_path, options, architecture)
    declared.spec, declared.component_config("transformer"), declared.source.note
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

from contract import ConfigError

ROOT = Path(__file__).resolve().parent
MODEL_INDEX = "model_index.json"
FIELD = "rollout.architecture"
# keys of a component config that say how a file was saved, not what the model is
SAVE_METADATA = frozenset({"architectures", "torch_dtype", "dtype", "transformers_version"})
# a transformers config (it has a model_type) gains and loses save-time keys across library
# versions: only the values that shape the model are compared
TRANSFORMERS_SHAPE = frozenset({
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "projection_dim", "d_model", "d_ff", "d_kv",
    "num_layers", "num_heads"})


def names() -> tuple[str, ...]:
    """The shipped descriptions, sorted."""
    return tuple(sorted(p.name for p in ROOT.iterdir() if (p / MODEL_INDEX).is_file()))


def architecture_root(name: str) -> Path:
    """The folder describing `name`, or ConfigError naming the field and the shipped names."""
    if name not in names():
        raise ConfigError("no shipped architecture of this name", field=FIELD,
                          expected=list(names()), actual=name)
    return ROOT / name


class ConfigOrigin(str, Enum):
    """Where a family's declarations were read."""

    CHECKPOINT = "checkpoint"        # the checkpoint's own JSON files, on this machine
    ARCHITECTURE = "architecture"    # a shipped description: the checkpoint is not on this machine
    SHIPPED = "shipped"              # a family that ships its weights (no checkpoint path)


@dataclass(frozen=True)
class ConfigSource:
    """The folder a family's JSON configs are read from, and what it stands for."""

    origin: ConfigOrigin
    root: Path | None                # None: a family that ships its weights
    weights_path: str | None
    architecture: str | None = None

    @property
    def note(self) -> str:
        """'' when the checkpoint was read here; else what was not checked, for the user."""
        if self.origin is not ConfigOrigin.ARCHITECTURE:
            return ""
        return (f"weights_path {self.weights_path} is not on this machine and was not checked "
                f"here: declarations from the shipped architecture {self.architecture}; the "
                "stages that load the weights check the path on their nodes")


def _checkpoint_here(weights_path: str | None) -> bool:
    return weights_path is not None and (Path(weights_path) / MODEL_INDEX).is_file()


def config_source(weights_path: str | None, architecture: str | None) -> ConfigSource:
    """The checkpoint itself when its model_index.json is on this machine (checked against the
    named architecture, if any), else the named architecture's description; a missing
    checkpoint with no architecture is the checkpoint's own ConfigError."""
    described = None if architecture is None else architecture_root(architecture)
    if weights_path is None:
        if described is not None:
            raise ConfigError("an architecture describes a checkpoint: set weights_path to where "
                              "the nodes hold it", field="rollout.weights_path",
                              expected="a checkpoint path", actual=None)
        return ConfigSource(ConfigOrigin.SHIPPED, None, None)
    if _checkpoint_here(weights_path):
        if described is not None:
            check_description(Path(weights_path), described, architecture)
        return ConfigSource(ConfigOrigin.CHECKPOINT, Path(weights_path), weights_path,
                            architecture)
    if described is None:
        raise ConfigError("the checkpoint is not on this machine (no model_index.json); to "
                          "check and plan the graph without it, name its architecture "
                          f"({FIELD}: one of {', '.join(names())})", field="weights_path",
                          expected="a local diffusers checkpoint folder", actual=weights_path)
    return ConfigSource(ConfigOrigin.ARCHITECTURE, described, weights_path, architecture)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"cannot read {path.name}: {exc}", field="weights_path",
                          actual=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path.name} is not a JSON object", field="weights_path",
                          actual=str(path))
    return data


def _described_files(described: Path) -> list[Path]:
    return sorted(p.relative_to(described) for p in described.rglob("*.json"))


def check_description(checkpoint: Path, described: Path, architecture: str) -> None:
    """The named architecture describes this checkpoint: the same pipeline class and, for every
    value both hold, the same component configs (save metadata aside; of a transformers config
    the values that shape the model). A plan from a description that is not the deployed model
    would be a plan for another model."""
    for rel in _described_files(described):
        theirs = checkpoint / rel
        if not theirs.is_file():
            continue                              # a component the checkpoint leaves out
        ours, held = _read(described / rel), _read(theirs)
        for key in sorted(set(ours) & set(held)):
            if key.startswith("_") and key != "_class_name" or key in SAVE_METADATA:
                continue
            if "model_type" in ours and key not in TRANSFORMERS_SHAPE:
                continue
            if ours[key] != held[key]:
                where = rel.parent.as_posix() if rel.parent != Path(".") else rel.stem
                raise ConfigError(f"the architecture does not describe the checkpoint at "
                                  f"{checkpoint}: {rel.as_posix()} {key} differs", field=FIELD,
                                  expected=f"{where}.{key} = {held[key]!r} (the checkpoint's)",
                                  actual=f"{architecture}: {ours[key]!r}")


@dataclass(frozen=True)
class Declaration:
    """What a family declares, without its weights: its name, spec and component configs, read
    from `source`. Nothing here loads a weight; the stages build their own families."""

    family: str
    spec: Any                        # adapters.family.FamilySpec
    source: ConfigSource

    def component_config(self, component: str) -> dict[str, Any]:
        """A component's config.json (scheduler: scheduler_config.json) as the source holds it."""
        if self.source.root is None:
            raise ConfigError(f"{self.family} ships its weights; it has no checkpoint configs",
                              field="rollout.weights_path", actual=None)
        name = "scheduler_config.json" if component == "scheduler" else "config.json"
        path = self.source.root / component / name
        if not path.is_file():
            raise ConfigError("the family's source has no config for this component",
                              field=f"weights_path.{component}", expected=str(path),
                              actual=str(self.source.root))
        return _read(path)


def declare(adapter: str, weights_path: str | None, options: Mapping | None = None,
            architecture: str | None = None) -> Declaration:
    """The family's declarations from its checkpoint's JSON files on this machine, or from the
    named architecture's description when the checkpoint is elsewhere (config_source)."""
    from adapters.registry import family_name, get_family
    source = config_source(weights_path, architecture)
    root = None if source.root is None else str(source.root)
    family = get_family(adapter, root, options)
    return Declaration(family_name(adapter, root), family.spec, source)
