"""Tiny random checkpoints of the real diffusers families, in the real on-disk layout.

`build(family, root, seed)` writes `root/<family>/`: `model_index.json` naming the pipeline class
and every component as a real checkpoint names it (`T5TokenizerFast`, `GemmaTokenizerFast`, ...),
each component saved by its own `save_pretrained` (safetensors) in its subfolder, and
`scheduler/scheduler_config.json` with the family's real scheduler settings. A user's checkpoint
and these load through the same `from_pretrained(path, subfolder=..., local_files_only=True)`.

The architectures are the real classes at the toy sizes diffusers' own tests use, changed where a
test size would hide a mistake or break a real rule: VAEs with the real spatial / temporal
compression (8x for SD3 / FLUX / Wan, 32x and 8n+1 frames for LTX-2), CLIP-L and CLIP-G of
different widths and a T5 wider than both (SD3 pads, never truncates, the CLIP features), two Wan
2.2 experts with different weights, an LTX-2 vocoder whose `output_sampling_rate` is the rate it
really produces. Parameters left constant by their initialiser (norm weights, biases, zero inits,
latent mean / std buffers) get seeded noise, so a skipped tensor or a dropped condition changes
the output. Everything is fp32 and built on CPU; the same seed gives byte-identical files.

Which checkpoints exist, their pipeline class, builder and sized call: each family's entry in
adapters/families.py (`tiny_checkpoints`). The components of the existing ones:
testing/tiny_families.py. Facts about each pipeline that an adapter must reproduce:
docs/MODEL_FAMILIES.md.

    python -m testing.tiny_checkpoints --family sd3 --out DIR      # -> DIR/sd3
    python -m testing.tiny_checkpoints --family all --out DIR
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from adapters.families import TINY_CHECKPOINTS, SampleSize, TinyCheckpoint, resolve

# the tiny checkpoints the family table declares (Family("sd3"), Family.WAN21_I2V, ...)
Family = Enum("Family", [(name.upper(), name) for name in TINY_CHECKPOINTS], type=str)
SAMPLE_SIZES: dict[Family, SampleSize] = {f: TINY_CHECKPOINTS[f.value].sample_size
                                          for f in Family}
PIPELINE_CLASSES: dict[Family, str] = {f: TINY_CHECKPOINTS[f.value].pipeline_class
                                       for f in Family}


def tiny_entry(family: str | Family) -> TinyCheckpoint:
    return TINY_CHECKPOINTS[Family(family).value]


# Class names as the published checkpoints write them (transformers 5 saves the slow-class name).
REAL_TOKENIZER_CLASSES = {"T5Tokenizer": "T5TokenizerFast", "GemmaTokenizer": "GemmaTokenizerFast"}

# --------------------------------------------------------------------------- writing


def build(family: str | Family, root: Path, seed: int = 0) -> Path:
    """Write the tiny `family` checkpoint to `root/<family>` and return that directory.

    The directory is written next to its final place and renamed into it, so a reader never sees
    half a checkpoint; an existing directory is an error (never silently replaced)."""
    import diffusers

    family = Family(family)
    target = Path(root) / family.value
    if target.exists():
        raise FileExistsError(f"tiny checkpoint directory already exists: {target}")
    target.parent.mkdir(parents=True, exist_ok=True)
    entry = tiny_entry(family)
    staging = Path(tempfile.mkdtemp(prefix=f".{family.value}-", dir=target.parent))
    try:
        if entry.writer is not None:                 # a layout the writer writes itself
            with torch.random.fork_rng(devices=[]):
                written = Path(resolve(entry.writer)(staging, seed))
            if written != staging / family.value:
                raise FileNotFoundError(f"{entry.writer} wrote {written}, not "
                                        f"{staging / family.value}")
            written.rename(target)
            shutil.rmtree(staging)
            return target
        with torch.random.fork_rng(devices=[]):
            parts = resolve(entry.builder)(seed)     # testing.tiny_families.Parts
        pipeline = getattr(diffusers, entry.pipeline_class)(**parts.components, **parts.config)
        pipeline.save_pretrained(staging, safe_serialization=True)
        _write_real_tokenizer_forms(staging, parts.components)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _write_real_tokenizer_forms(directory: Path, components: dict[str, Any]) -> None:
    """Name tokenizers as published checkpoints do, and give CLIP tokenizers the vocab.json +
    merges.txt files those checkpoints ship (they have no tokenizer.json)."""
    index_path = directory / "model_index.json"
    index = json.loads(index_path.read_text())
    for name, component in components.items():
        class_name = type(component).__name__
        if class_name in REAL_TOKENIZER_CLASSES:
            index[name] = [index[name][0], REAL_TOKENIZER_CLASSES[class_name]]
        if class_name == "CLIPTokenizer":
            model = json.loads(component.backend_tokenizer.to_str())["model"]
            vocab = dict(sorted(model["vocab"].items(), key=lambda item: item[1]))
            (directory / name / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
            merges = [" ".join(pair) for pair in model["merges"]]
            (directory / name / "merges.txt").write_text(
                "#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", required=True, choices=[f.value for f in Family] + ["all"])
    parser.add_argument("--out", required=True, type=Path, help="parent directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    families = list(Family) if args.family == "all" else [Family(args.family)]
    for family in families:
        start = time.perf_counter()
        path = build(family, args.out, args.seed)
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        print(f"{family.value}: {path} ({size / 2**20:.2f} MiB, {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    from contract.cli import run_cli
    raise SystemExit(run_cli("python -m testing.tiny_checkpoints", main))
