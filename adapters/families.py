"""The family table: one `FamilyEntry` per model family, the only place a family is registered.

The registry (`get_family`, `adapter: auto`, adapters/registry.py), the checkpoint families'
shared constructor (adapters/family.py CheckpointFamily: pipeline class and options) and the
tiny-checkpoint script (testing/tiny_checkpoints.py) all read this table. Classes and builders
are named as "module:attribute" and imported only when that family is asked for, so reading
the table imports no model code.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Mapping

from contract import ConfigError


def resolve(ref: str) -> Any:
    """"package.module:attribute" -> the attribute (its module imported now)."""
    module, _, attribute = ref.partition(":")
    return getattr(importlib.import_module(module), attribute)


@dataclass(frozen=True)
class SampleSize:
    """The call a tiny checkpoint is sized for (tests and examples use these)."""
    height: int
    width: int
    num_frames: int | None = None
    frame_rate: float | None = None
    max_sequence_length: int | None = None

    def call_kwargs(self) -> dict[str, Any]:
        kwargs = {"height": self.height, "width": self.width}
        for name in ("num_frames", "frame_rate", "max_sequence_length"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return kwargs


@dataclass(frozen=True)
class TinyCheckpoint:
    """A tiny random checkpoint of a family in the published layout (for tests): its name
    (`testing.tiny_checkpoints --family NAME`), the pipeline class that saves it, the builder of
    its seeded components ("module:function", seed -> testing.tiny_families.Parts) and the
    call it is sized for. A layout no pipeline class's save_pretrained writes (a modular
    pipeline's) names a `writer` instead of a builder: "module:function", (root, seed) -> the
    folder root/NAME it wrote."""
    name: str
    pipeline_class: str
    builder: str | None
    sample_size: SampleSize
    writer: str | None = None

    @property
    def source_module(self) -> str:
        """The module that makes it (the builder's or the writer's)."""
        return (self.writer or self.builder or "").partition(":")[0]


@dataclass(frozen=True)
class FamilyEntry:
    """Everything registered about one family.

    name: the config's `rollout.adapter`; family: its ModelFamily class, built as
    `family(root, options)` ("module:Class"); options: its pydantic options model
    (`rollout.adapter_options`); pipeline_classes: the model_index.json `_class_name`s it loads
    (every diffusers pipeline class over its components; `auto` resolves them to this family);
    tiny_checkpoints: its tiny test checkpoints; embedded: it ships its own weights (the path is
    optional, `family(root)` takes no options).
    """
    name: str
    family: str
    options: str = "adapters.family:NoOptions"
    pipeline_classes: tuple[str, ...] = ()
    tiny_checkpoints: tuple[TinyCheckpoint, ...] = ()
    embedded: bool = False

    @property
    def family_class(self) -> type:
        return resolve(self.family)

    @property
    def options_model(self) -> type:
        return resolve(self.options)

    def pipeline_class_of(self, index: Mapping) -> str:
        """The checkpoint's pipeline class (model_index.json `_class_name`) if this family
        loads over it, else ConfigError naming weights_path."""
        cls = index.get("_class_name")
        if cls not in self.pipeline_classes:
            raise ConfigError(f"the checkpoint's pipeline class is not one {self.name} loads "
                              "over its components", field="weights_path",
                              expected=list(self.pipeline_classes), actual=cls)
        return cls


# Which tasks a folder serves is its components' business (the transformer's channels, an image
# encoder), never its class name's; components a family cannot serve are refused by the family.
FAMILIES: tuple[FamilyEntry, ...] = (
    FamilyEntry("tiny_t2i", "adapters.tiny_t2i:TinyT2IFamily", embedded=True),
    FamilyEntry("tiny_t2va", "adapters.tiny_t2va:TinyT2VAFamily", embedded=True),
    FamilyEntry(
        "sd3", "adapters.sd3:SD3Family", "adapters.sd3:SD3Options",
        ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline",
         "StableDiffusion3InpaintPipeline", "StableDiffusion3PAGPipeline",
         "StableDiffusion3PAGImg2ImgPipeline"),
        (TinyCheckpoint("sd3", "StableDiffusion3Pipeline", "testing.tiny_families:sd3_parts",
                        SampleSize(64, 96, max_sequence_length=32)),)),
    FamilyEntry(
        "flux", "adapters.flux:FluxFamily", "adapters.flux:FluxOptions",
        ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxKontextPipeline",
         "FluxKontextInpaintPipeline", "FluxFillPipeline", "FluxControlPipeline",
         "FluxControlImg2ImgPipeline", "FluxControlInpaintPipeline", "VisualClozePipeline",
         "VisualClozeGenerationPipeline"),
        (TinyCheckpoint("flux", "FluxPipeline", "testing.tiny_families:flux_parts",
                        SampleSize(64, 96, max_sequence_length=48)),
         # FLUX.1 Kontext ships FLUX.1-dev's component classes and configs: the same
         # components saved by FluxKontextPipeline (the folder edits, task edit)
         TinyCheckpoint("flux_kontext", "FluxKontextPipeline",
                        "testing.tiny_families:flux_parts",
                        SampleSize(64, 96, max_sequence_length=48)))),
    FamilyEntry(
        "wan", "adapters.wan:WanFamily", "adapters.wan:WanOptions",
        ("WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline",
         "LucyEditPipeline"),
        (TinyCheckpoint("wan21", "WanPipeline", "testing.tiny_families:wan21_parts",
                        SampleSize(32, 48, num_frames=9, max_sequence_length=16)),
         # the I2V transformer splits image tokens off the context at a text length of 512
         TinyCheckpoint("wan21_i2v", "WanImageToVideoPipeline",
                        "testing.tiny_families:wan21_i2v_parts",
                        SampleSize(32, 48, num_frames=9, max_sequence_length=512)),
         TinyCheckpoint("wan22", "WanPipeline", "testing.tiny_families:wan22_parts",
                        SampleSize(32, 48, num_frames=9, max_sequence_length=16)))),
    FamilyEntry(
        "ltx2", "adapters.ltx2:LTX2Family", "adapters.ltx2:LTX2Options",
        ("LTX2Pipeline", "LTX2ImageToVideoPipeline", "LTX2ConditionPipeline",
         "LTX2HDRPipeline", "LTX2InContextPipeline", "LTX2DFRPipeline"),
        (TinyCheckpoint("ltx2", "LTX2Pipeline", "testing.tiny_families:ltx2_parts",
                        SampleSize(64, 96, num_frames=9, frame_rate=25.0,
                                   max_sequence_length=16)),)),
    FamilyEntry(
        "minimax_h3", "adapters.minimax_h3:MiniMaxH3Family",
        "adapters.minimax_h3:MiniMaxH3Options", ("MiniMaxH3ModularPipeline",),
        # modular only: no DiffusionPipeline saves it, its writer writes the layout
        (TinyCheckpoint("minimax_h3", "MiniMaxH3ModularPipeline", None,
                        SampleSize(32, 64, num_frames=124, max_sequence_length=64),
                        writer="testing.tiny_minimax_h3:build"),)),
    FamilyEntry(
        "qwen_image", "adapters.qwen_image:QwenImageFamily",
        "adapters.qwen_image:QwenImageOptions",
        ("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline",
         "QwenImageEditPipeline", "QwenImageEditPlusPipeline"),
        (TinyCheckpoint("qwen_image", "QwenImagePipeline",
                        "testing.tiny_qwen_image:qwen_image_parts",
                        SampleSize(64, 96, max_sequence_length=32)),
         # a processor feeds the edit's source image to the vision tower: the folder edits
         TinyCheckpoint("qwen_image_edit", "QwenImageEditPipeline",
                        "testing.tiny_qwen_image:qwen_image_edit_parts",
                        SampleSize(64, 96, max_sequence_length=48)),
         # the same components saved by QwenImageEditPlusPipeline: 1 to 3 ordered sources,
         # each a "Picture i" vision block (a longer presentation: a larger window)
         TinyCheckpoint("qwen_image_edit_plus", "QwenImageEditPlusPipeline",
                        "testing.tiny_qwen_image:qwen_image_edit_plus_parts",
                        SampleSize(64, 96, max_sequence_length=80)))),
)

ENTRIES: dict[str, FamilyEntry] = {entry.name: entry for entry in FAMILIES}
# model_index.json `_class_name` -> family (what `adapter: auto` resolves)
FAMILY_OF_PIPELINE: dict[str, str] = {cls: entry.name for entry in FAMILIES
                                      for cls in entry.pipeline_classes}
TINY_CHECKPOINTS: dict[str, TinyCheckpoint] = {tiny.name: tiny for entry in FAMILIES
                                               for tiny in entry.tiny_checkpoints}


def family_entry(name: str) -> FamilyEntry:
    """The entry of family `name`, or ConfigError naming `adapter`."""
    if name not in ENTRIES:
        raise ConfigError(f"unknown adapter {name!r}", field="adapter",
                          expected=sorted(ENTRIES), actual=name)
    return ENTRIES[name]
