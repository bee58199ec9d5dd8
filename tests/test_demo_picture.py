"""`make demo`'s measure and picture from a run folder: the held-out gain and each attribute's
first / last window means (trainer.demo.summarize / heldout_attributes), and demo.png drawn from
the metrics and the gallery's step-0 and final samples of the same prompts and seeds."""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from trainer.demo import heldout_attributes, plot_demo, summarize

PROMPTS = [f"a red square at the top left on a {bg} background" for bg in ("black", "white",
                                                                           "gray")]
GROUP = 2


def write_run(run_dir, evaluations: int):
    rows = []
    for i in range(evaluations):
        color, shape = 0.5 + 0.01 * i, 0.2 + 0.02 * i
        rows.append({"step": i, "loss": 1.0})           # a training row: not an evaluation
        rows.append({"step": i, "eval_reward_mean": (color + shape) / 2,
                     "eval_image_attributes/color_mean": color,
                     "eval_image_attributes/shape_mean": shape,
                     "eval_image_attributes/total_mean": (color + shape) / 2})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    gallery = run_dir / "gallery"
    gallery.mkdir()
    n = len(PROMPTS) * GROUP
    for tag, value in (("step0", 40), ("now", 200)):
        torch.save({"images": torch.full((n, 3, 16, 16), value, dtype=torch.uint8),
                    "captions": [f"total 0.{k}00" for k in range(n)]}, gallery / f"{tag}.pt")


def test_measure_and_attribute_windows(tmp_path):
    write_run(tmp_path, 30)
    summary = summarize(tmp_path)
    # first 10 evaluations: i = 0..9, last 10: i = 20..29; reward rises 0.015 per evaluation
    assert summary["evaluations"] == 30 and summary["window"] == 10
    assert summary["heldout_gain"] == pytest.approx(20 * 0.015)
    attrs = heldout_attributes(tmp_path)
    assert attrs["image_attributes/color"] == pytest.approx({"first": 0.545, "last": 0.745})
    assert attrs["image_attributes/shape"] == pytest.approx({"first": 0.29, "last": 0.69})
    assert attrs["image_attributes/total"]["last"] - attrs["image_attributes/total"]["first"] \
        == pytest.approx(summary["heldout_gain"])


def test_picture_has_the_curves_over_the_before_and_after_grid(tmp_path):
    write_run(tmp_path, 12)
    path = plot_demo(tmp_path, PROMPTS, max_prompts=2)
    picture = Image.open(path).convert("RGB")
    curves = Image.open(tmp_path / "heldout_curves.png")
    assert picture.height > curves.height and picture.width >= curves.width
    grid = torch.tensor(list(picture.crop((0, curves.height, picture.width,
                                           picture.height)).getdata()))
    # the samples of step 0 (value 40) and of the end (value 200) are both in the grid
    assert (grid == 40).all(dim=1).sum() > 0 and (grid == 200).all(dim=1).sum() > 0
