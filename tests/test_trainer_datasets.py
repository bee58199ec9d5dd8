"""Prompt files (.txt, .jsonl with metadata and condition media, .parquet, GenEval metadata),
their typed errors naming file:line, and the seeded, resumable epoch order."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from contract import DatasetError, MediaRole, Modality
from trainer.datasets import DatasetFormat, PromptDataset, load_prompt_file, resolve_format


def _png(path, color=(200, 10, 10), size=(12, 10)):
    from PIL import Image
    Image.new("RGB", size, color).save(path)
    return path


def test_txt_skips_blank_lines_and_names_lines(tmp_path):
    f = tmp_path / "train.txt"
    f.write_text("a red circle\n\n   \na blue square  \n")
    records = load_prompt_file(f)
    assert [r.text for r in records] == ["a red circle", "a blue square"]
    assert records[1].source == f"{f}:4" and records[1].metadata == {}


def test_jsonl_fields_metadata_and_condition_media(tmp_path):
    _png(tmp_path / "first.png")
    _png(tmp_path / "last.png", color=(0, 0, 255))
    from adapters.sample_clip import write_mp4
    video = np.zeros((4, 16, 16, 3), dtype=np.uint8)
    video[:, 4:8] = 255
    write_mp4(tmp_path / "clip.mp4", video.transpose(0, 3, 1, 2), 8.0,
              np.zeros((1, 8000), dtype=np.float32), 16000)
    lines = [{"prompt": "a sign that says OPEN", "negative_prompt": "blurry",
              "metadata": {"ocr_text": "OPEN"}},
             {"prompt": "the ball bounces", "first_frame": "first.png",
              "last_frame": str(tmp_path / "last.png"), "video": "clip.mp4"}]
    f = tmp_path / "train.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    a, b = load_prompt_file(f)
    assert (a.text, a.negative, a.metadata) == ("a sign that says OPEN", "blurry",
                                                {"ocr_text": "OPEN"})
    assert a.media_inputs() is None
    media = {m.role: m for m in b.media_inputs()}
    first = media[MediaRole.FIRST_FRAME]
    assert first.modality is Modality.IMAGE and first.data.shape == (3, 10, 12)
    assert first.data.dtype == torch.uint8 and first.data[0].float().mean() == 200
    assert media[MediaRole.LAST_FRAME].data[2].float().mean() == 255
    clip = media[MediaRole.REFERENCE]
    assert clip.modality is Modality.VIDEO and clip.data.shape[1:] == (3, 16, 16)
    assert clip.data.shape[0] >= 1 and clip.data.dtype == torch.uint8


def test_parquet_and_geneval(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    table = pa.table({"prompt": ["one", "two"], "negative_prompt": [None, "ugly"],
                      "metadata": [json.dumps({"k": 1}), None]})
    pq.write_table(table, tmp_path / "p.parquet")
    one, two = load_prompt_file(tmp_path / "p.parquet")
    assert (one.text, one.negative, one.metadata) == ("one", None, {"k": 1})
    assert (two.negative, two.source) == ("ugly", f"{tmp_path / 'p.parquet'}:2")
    geneval = tmp_path / "test_metadata.jsonl"
    rec = {"tag": "counting", "include": [{"class": "apple", "count": 3}],
           "prompt": "a photo of three apples"}
    geneval.write_text(json.dumps(rec) + "\n")
    assert resolve_format(geneval, DatasetFormat.AUTO) is DatasetFormat.GENEVAL
    [r] = load_prompt_file(geneval)
    assert r.text == "a photo of three apples" and r.metadata == rec
    with pytest.raises(DatasetError, match="unknown keys"):     # GenEval keys are not JSONL's
        load_prompt_file(geneval, DatasetFormat.JSONL)


@pytest.mark.parametrize("content,match,line", [
    ('{"prompt": "ok"}\n{"negative_prompt": "x"}\n', "no prompt", 2),
    ('{"prompt": "ok"}\n\n{"prompt": ""}\n', "no prompt", 3),
    ('{"prompt": "ok"}\nnot json\n', "not JSON", 2),
    ('{"prompt": "ok", "image": "missing.png"}\n', "does not load", 1),
    ('{"prompt": "ok", "image": "bad.png"}\n', "does not load", 1),
    ('{"prompt": "ok", "video": "bad.png"}\n', "does not load", 1),
    ('{"prompt": "ok", "colour": "red"}\n', "unknown keys", 1),
])
def test_bad_records_name_file_and_line(tmp_path, content, match, line):
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    f = tmp_path / "train.jsonl"
    f.write_text(content)
    with pytest.raises(DatasetError, match=match) as e:
        load_prompt_file(f)
    assert e.value.field == f"{f}:{line}"


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DatasetError, match="not found") as e:
        load_prompt_file(tmp_path / "nope.txt")
    assert e.value.field == str(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("\n  \n")
    with pytest.raises(DatasetError, match="no prompts"):
        load_prompt_file(tmp_path / "empty.txt")
    (tmp_path / "p.csv").write_text("a\n")
    with pytest.raises(DatasetError, match="format"):
        load_prompt_file(tmp_path / "p.csv")


def test_epoch_order_is_a_seeded_permutation_and_resumes(tmp_path):
    f = tmp_path / "train.txt"
    f.write_text("\n".join(f"prompt {i}" for i in range(7)))
    records = load_prompt_file(f)
    data = PromptDataset(records, seed=3)
    drawn = [i for i, _ in data.take(21)]                       # three epochs exactly
    epochs = [drawn[0:7], drawn[7:14], drawn[14:21]]
    assert all(sorted(e) == list(range(7)) for e in epochs)     # each epoch visits all once
    assert len({tuple(e) for e in epochs}) == 3                  # and is reshuffled
    assert [i for i, _ in PromptDataset(records, seed=3).take(21)] == drawn      # seeded
    assert [i for i, _ in PromptDataset(records, seed=4).take(7)] != epochs[0]
    assert [i for i, _ in PromptDataset(records, shuffle=False).take(9)] == \
        list(range(7)) + [0, 1]
    # stop mid-epoch, save the position, resume in a new object: the same continuation
    first = PromptDataset(records, seed=3)
    head = [i for i, _ in first.take(10)]
    resumed = PromptDataset(records, seed=0)
    resumed.load_state(json.loads(json.dumps(first.state())))
    assert head + [i for i, _ in resumed.take(11)] == drawn
    assert resumed.epoch == 2 and resumed.progress == pytest.approx(3.0)
    with pytest.raises(DatasetError, match="changed"):
        PromptDataset(records[:5]).load_state(first.state())


def test_shipped_file_config_feeds_prompts_metadata_and_resumes():
    """configs/train_tiny_t2i_files.yaml validates and its files feed the loop's PromptFeed:
    training prompts in seeded epochs, held-out prompts with their metadata."""
    from contract import PromptBundle
    from trainer.config import load_trainer_config
    from trainer.run_state import PromptFeed
    cfg = load_trainer_config("configs/train_tiny_t2i_files.yaml")
    tokenize = lambda texts, negatives=None: [PromptBundle(token_ids=(1, len(t)), text=t)
                                              for t in texts]
    feed = PromptFeed(cfg, tokenize)
    assert len(feed.data) == 48 and len(feed.eval_bundles) == cfg.eval.num_prompts == 16
    metadata, media = feed.eval_extras()
    assert metadata[3] == {"split": "eval", "index": 3} and media is None
    steps = [feed.batch(k, 2) for k in range(30)]                     # 60 prompts: epoch 2
    assert feed.epoch == pytest.approx(60 / 48)
    again = PromptFeed(cfg, tokenize)
    again.restore(steps[25].data_state)                               # resume before step 25
    assert [b.text for b in again.batch(25, 2).bundles] == [b.text for b in steps[25].bundles]
    train_texts = {b.text for s in steps for b in s.bundles}
    assert not train_texts & {b.text for b in feed.eval_bundles}      # held out
