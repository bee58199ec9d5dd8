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

# family -> the model_index.json `_class_name`s it accepts: every diffusers pipeline class that
# loads over the family's components (same component names and classes). Which tasks a folder
# serves is its components' business (the transformer's channels, an image encoder), never the
# class name's; components a family cannot serve are refused by the family, naming them.
PIPELINE_CLASSES: dict[str, tuple[str, ...]] = {
    "sd3": ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline",
            "StableDiffusion3InpaintPipeline", "StableDiffusion3PAGPipeline",
            "StableDiffusion3PAGImg2ImgPipeline"),
    "flux": ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxKontextPipeline",
             "FluxKontextInpaintPipeline", "FluxFillPipeline", "FluxControlPipeline",
             "FluxControlImg2ImgPipeline", "FluxControlInpaintPipeline", "VisualClozePipeline",
             "VisualClozeGenerationPipeline"),
    "ltx2": ("LTX2Pipeline", "LTX2ImageToVideoPipeline", "LTX2ConditionPipeline",
             "LTX2HDRPipeline", "LTX2InContextPipeline", "LTX2DFRPipeline"),
    "wan": ("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline",
            "LucyEditPipeline"),
}
# model_index.json `_class_name` -> family name (what `adapter: auto` resolves)
FAMILY_OF_PIPELINE: dict[str, str] = {cls: family for family, classes in PIPELINE_CLASSES.items()
                                      for cls in classes}


def pipeline_class_of(family: str, index: Mapping) -> str:
    """The checkpoint's pipeline class (model_index.json `_class_name`) if `family` accepts it,
    else ConfigError naming weights_path."""
    cls = index["_class_name"]
    if cls not in PIPELINE_CLASSES[family]:
        raise ConfigError(f"the checkpoint's pipeline class is not one {family} loads over its "
                          "components", field="weights_path",
                          expected=list(PIPELINE_CLASSES[family]), actual=cls)
    return cls

EMBEDDED = ("tiny_t2i", "tiny_t2va")     # families that ship their weights (path optional)


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

