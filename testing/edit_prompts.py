"""Edit prompt files of synthetic shapes (the task `edit`): each record a source image (a shape
picture rendered by synthetic/shapes.py), the instruction as the edited picture's caption (the
same shape recoloured; the clip_directional scorer reads the prompt as the edit's caption) and
the source's own caption in the metadata (`source_caption`).

    python -m testing.edit_prompts configs/prompts/edit --size 1024 --train 6 --test 2
    python -m testing.edit_prompts configs/prompts/edit_kontext --size 64 --no-negative

writes train.jsonl / test.jsonl and sources/*.png (size x size: Qwen-Image-Edit takes a square
source at 1024 x 1024, the size its pipeline resizes to; FLUX.1 Kontext any multiple of 16).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

COLORS = ("red", "green", "blue", "yellow")


def edit_records(n: int, seed: int, held_out: bool) -> list[tuple[object, object]]:
    """n (source spec, edited spec) pairs: the edited one the source recoloured (the next colour
    in COLORS), held-out pairs from the shapes' eval split."""
    from synthetic import shapes
    split = shapes.Split.EVAL if held_out else shapes.Split.TRAIN
    out = []
    for spec in shapes.sample_specs(n, seed, split):
        color = shapes.Color(COLORS[(COLORS.index(spec.color.value) + 1) % len(COLORS)])
        out.append((spec, dataclasses.replace(spec, color=color)))
    return out


def write_edit_prompts(out: str | Path, size: int = 1024, train: int = 6, test: int = 2,
                       seed: int = 0, negative: str | None = " ") -> tuple[Path, Path]:
    """train.jsonl and test.jsonl under `out`, their sources in out/sources (relative paths);
    `negative`: each record's negative prompt (Qwen-Image's true CFG needs one, " "; None for
    FLUX.1 Kontext, which takes none)."""
    from PIL import Image

    from synthetic import shapes
    out = Path(out)
    (out / "sources").mkdir(parents=True, exist_ok=True)
    files = []
    for name, n, held_out in (("train", train, False), ("test", test, True)):
        lines = []
        for i, (source, edited) in enumerate(edit_records(n, seed, held_out)):
            path = Path("sources") / f"{name}_{i}.png"
            pixels = shapes.render(source, size).permute(1, 2, 0).numpy()
            Image.fromarray(pixels).save(out / path, optimize=True)
            record = {"prompt": shapes.caption(edited), "image": str(path),
                      "metadata": {"source_caption": shapes.caption(source)}}
            if negative is not None:
                record["negative_prompt"] = negative
            lines.append(json.dumps(record))
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        files.append(out / f"{name}.jsonl")
    return files[0], files[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--train", type=int, default=6)
    parser.add_argument("--test", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-negative", action="store_true",
                        help="records without a negative prompt (FLUX.1 Kontext)")
    args = parser.parse_args(argv)
    for path in write_edit_prompts(args.out, args.size, args.train, args.test, args.seed,
                                   None if args.no_negative else " "):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
