"""Reading a local diffusers checkpoint: model_index.json, one component at a time.

A diffusers checkpoint is a folder with `model_index.json` (component -> [library, class]) and one
subfolder per component (`transformer/`, `vae/`, `text_encoder_3/`, `tokenizer/`, `scheduler/`).
Each stage loads only the components it uses, exactly as `DiffusionPipeline.from_pretrained`
would load that one component: the class named in model_index.json, `from_pretrained(root,
subfolder=..., local_files_only=True)`, in the requested dtype on the requested device.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from contract import ConfigError

MODEL_INDEX = "model_index.json"
LIBRARIES = ("diffusers", "transformers")        # the libraries a component class may come from

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device,
                  field: str = "dtype") -> torch.dtype:
    """A dtype the device can run, or ConfigError naming the field and the value."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError("unknown dtype", field=field, expected=sorted(DTYPES), actual=dtype)
        dtype = DTYPES[dtype]
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device cuda is not available on this machine", field="device",
                              expected="cpu", actual=str(device))
        if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ConfigError("this GPU cannot run bfloat16", field=field,
                              expected=["float32", "float16"], actual="bfloat16")
    elif device.type == "cpu" and dtype == torch.float16:
        raise ConfigError("float16 kernels are not supported on the CPU (use float32 or "
                          "bfloat16)", field=field, expected=["float32", "bfloat16"],
                          actual="float16")
    elif device.type not in ("cpu", "cuda"):
        raise ConfigError("unsupported device", field="device", expected=["cpu", "cuda"],
                          actual=str(device))
    return dtype


def read_model_index(root: str | Path) -> dict[str, Any]:
    """model_index.json of a diffusers checkpoint, or ConfigError naming the path."""
    root = Path(root)
    path = root / MODEL_INDEX
    if not root.is_dir():
        raise ConfigError("checkpoint path is not a directory", field="weights_path",
                          expected="a local diffusers checkpoint folder", actual=str(root))
    if not path.is_file():
        raise ConfigError("not a diffusers checkpoint: model_index.json is missing",
                          field="weights_path", expected=str(path), actual=str(root))
    try:
        index = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"model_index.json is not JSON: {exc}", field="weights_path",
                          actual=str(path)) from None
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise ConfigError("model_index.json has no _class_name", field="weights_path",
                          expected="_class_name", actual=str(path))
    return index


def read_json(root: str | Path, subfolder: str, name: str) -> dict[str, Any]:
    """A component's JSON config (e.g. transformer/config.json) without loading weights."""
    path = Path(root) / subfolder / name
    if not path.is_file():
        raise ConfigError("checkpoint component config is missing", field="weights_path",
                          expected=str(path), actual=str(Path(root)))
    return json.loads(path.read_text())


def component_class(index: dict[str, Any], component: str, root: Path) -> type:
    """The class model_index.json names for `component`: from diffusers, transformers or a
    diffusers pipeline package (as DiffusionPipeline.from_pretrained resolves it)."""
    entry = index.get(component)
    if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)):
        raise ConfigError("model_index.json does not declare this component",
                          field=f"weights_path.{component}",
                          expected="[library, class]", actual=entry)
    library, name = entry
    if library in LIBRARIES:
        module = importlib.import_module(library)
    else:       # a class a diffusers pipeline package defines (LTX-2: ["ltx2", "LTX2Vocoder"]),
        import diffusers.pipelines as pipelines      # resolved as DiffusionPipeline does
        module = getattr(pipelines, library, None)
        if module is None:
            raise ConfigError("component library is not one this project loads",
                              field=f"weights_path.{component}",
                              expected=[*LIBRARIES, "a diffusers pipeline package"],
                              actual=library)
    cls = getattr(module, name, None)
    if cls is None:
        raise ConfigError(f"{library} has no class {name}", field=f"weights_path.{component}",
                          actual=name)
    if not (root / component).is_dir():
        raise ConfigError("checkpoint subfolder is missing", field=f"weights_path.{component}",
                          expected=str(root / component), actual=str(root))
    return cls


def load_component(root: str | Path, component: str, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> Any:
    """One component as DiffusionPipeline.from_pretrained loads it; modules are eval, frozen."""
    root = Path(root)
    cls = component_class(read_model_index(root), component, root)
    kwargs: dict[str, Any] = {"subfolder": component, "local_files_only": True}
    if issubclass(cls, nn.Module):
        kwargs["dtype"] = dtype          # diffusers 0.42 / transformers 5 spelling
    try:
        obj = cls.from_pretrained(root, **kwargs)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot load {component}: {exc}"[:600],
                          field=f"weights_path.{component}", actual=str(root / component)) from exc
    if isinstance(obj, nn.Module):
        obj = obj.to(device).eval().requires_grad_(False)
    return obj
