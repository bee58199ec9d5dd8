"""Exact resume against a real local graph: a run stopped after step 2 (right after its
checkpoint, with the next batch in flight) and resumed gives the same steps 3..5 metrics and
weights as the run that was never stopped, within 1e-6 on CPU: prompt-file position, generator,
optimizer, old policy, EMA and the in-flight batch's sampling version all come back. Resuming
under a changed config names the fields that differ."""
from __future__ import annotations

import json
import time

import pytest
import torch

from contract import ConfigError
from tests.trainer_helpers import metric_rows, serve_graph, tiny_graph, train_steps
from trainer.config import PromptSource, load_trainer_config
from trainer.prompts import captions

pytestmark = pytest.mark.timeout(900)

APP = "trainer_resume"
TIMING = ("_s", "samples_per_s")


def graph_config():
    # one request per forward (max_batch_rows = group size): the two runs must not differ in
    # which rows share a forward, which changes float summation order
    return tiny_graph(APP, "trainer_resume_store",
                      rollout={"adapter": "tiny_t2i", "limits": {"max_batch_rows": 2}})


@pytest.fixture(scope="module")
def graph(ray_cluster):
    yield from serve_graph(graph_config())


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("prompts")
    path = root / "train.jsonl"
    texts = captions(PromptSource.SHAPES, 5, 11)      # 5 prompts: an epoch ends mid-run
    path.write_text("".join(json.dumps({"prompt": t, "metadata": {"index": i}}) + "\n"
                            for i, t in enumerate(texts)))
    return path


CASES = {
    "nft_async": {"algorithm": "nft", "pipeline": {"mode": "async", "max_staleness": 1},
                  "nft": {"train_timesteps": 2, "timesteps": "permutation",
                          "old_refresh_every": 1}},
    "grpo_fast_async": {"algorithm": "flow_grpo",
                        "pipeline": {"mode": "async", "max_staleness": 1},
                        "sampler": {"sampler": "sde", "num_steps": 3, "noise_level": 0.7,
                                    "window_size": 1, "window_range": [0, 2]},
                        "flow_grpo": {"kl_beta": 0.01}},
}


def _config(run_dir, prompt_file, case, **over):
    cfg = {"graph": graph_config(), "steps": 5, "prompts_per_step": 2, "samples_per_prompt": 2,
           "sampler": {"sampler": "sde", "num_steps": 3, "noise_level": 0.7, "window": [0, 2]},
           "lora": {"rank": 4, "alpha": 8}, "optimizer": {"lr": 1e-2},
           "data": {"train": str(prompt_file)},
           "eval": {"every": 2, "num_prompts": 2, "samples_per_prompt": 1, "num_steps": 3},
           "ema": {"enabled": True, "decay": 0.5},
           "checks": {"time_convention": False, "lora_map": False},
           "run_dir": str(run_dir), "checkpoint_every": 2, "gallery": False}
    cfg.update(CASES[case])
    cfg.update(over)
    return load_trainer_config(cfg)


class Stop(Exception):
    pass


def _weights(trainer):
    from trainer.lora import OLD_ADAPTER, TRAIN_ADAPTER
    out = {f"{n}/{k}": v.clone() for n in (TRAIN_ADAPTER, OLD_ADAPTER)
           for k, v in trainer.learner.export(n)[0].items()}
    out.update({f"ema/{k}": v.clone() for k, v in (trainer.ema.tensors or {}).items()})
    return out


def _comparable(metrics):
    return {k: v for k, v in metrics.items() if not k.endswith(TIMING)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_after_step_2_equals_the_uninterrupted_run(graph, tmp_path, prompt_file, case):
    from trainer.loop import Trainer
    whole = Trainer(_config(tmp_path / "whole", prompt_file, case))
    history = whole.run()
    assert len(history) == 5 and whole.feed.data.epoch >= 1         # crossed an epoch
    stopped = Trainer(_config(tmp_path / "stopped", prompt_file, case))
    save = stopped.checkpoint

    def checkpoint_then_stop(pending=None):        # preempted right after the step-2 checkpoint
        path = save(pending)
        if stopped.step == 2:
            raise Stop
        return path
    stopped.checkpoint = checkpoint_then_stop
    with pytest.raises(Stop):
        stopped.run()
    assert len(stopped.history) == 2
    resumed = Trainer(_config(tmp_path / "stopped", prompt_file, case, resume=True))
    tail = resumed.run()
    assert resumed.step == 5 and len(tail) == 3
    for want, got in zip(history[2:], tail):
        want, got = _comparable(want), _comparable(got)
        assert set(want) == set(got)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-6), key
    assert any("eval_reward_mean" in m for m in tail)
    if CASES[case]["algorithm"] == "flow_grpo":    # parity checked per SDE window group
        assert all(m["logprob_ratio_err_max"] <= 1e-4 for m in history + tail)
    a, b = _weights(whole), _weights(resumed)
    assert set(a) == set(b) and any(k.startswith("ema/") for k in a)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-6)
    # the runs really trained: the weights moved since the step-2 checkpoint
    from trainer.logs import load_checkpoint
    tensors, _, state = load_checkpoint(tmp_path / "stopped")
    assert state["step"] == 5
    assert [r["step"] for r in train_steps(metric_rows(tmp_path / "stopped"))] == [1, 2, 3, 4, 5]


def test_resume_with_a_changed_config_names_the_fields(graph, tmp_path, prompt_file):
    from trainer.loop import Trainer
    first = Trainer(_config(tmp_path / "run", prompt_file, "nft_async", steps=1))
    first.run()
    changed = Trainer(_config(tmp_path / "run", prompt_file, "nft_async", steps=3, resume=True,
                              nft={"beta": 0.5, "train_timesteps": 2,
                                   "timesteps": "permutation", "old_refresh_every": 1},
                              optimizer={"lr": 1e-3}))
    with pytest.raises(ConfigError) as e:
        changed.resume()
    assert "nft.beta" in str(e.value) and "optimizer.lr" in str(e.value)
    assert e.value.expected == {"nft.beta": 1.0, "optimizer.lr": 0.01}
    assert e.value.actual == {"nft.beta": 0.5, "optimizer.lr": 0.001}
    longer = Trainer(_config(tmp_path / "run", prompt_file, "nft_async", steps=3, resume=True))
    longer.resume()                                  # a longer run is the same run
    assert longer.step == 1


def test_gallery_and_wandb_from_a_real_run(graph, tmp_path, prompt_file):
    """A short run with W&B offline: config, per-step metrics and the captioned gallery grid
    (held-out prompts, per-scorer rewards, step 0 beside now) land in the local W&B run."""
    from PIL import Image

    from trainer.loop import Trainer
    cfg = _config(tmp_path / "run", prompt_file, "nft_async", steps=2, gallery=True,
                  wandb={"enabled": True, "mode": "offline", "project": "omni-test"})
    Trainer(cfg).run()
    grid = Image.open(tmp_path / "run" / "gallery" / "gallery.png")
    assert grid.width > 4 * 32 and grid.height > 2 * 32     # 2 prompts x (step 0 | now)
    [run_dir] = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    record = next(run_dir.glob("run-*.wandb"))
    deadline = time.time() + 60            # wandb-core may still be writing on a loaded machine
    while b"left: step 0" not in record.read_bytes() and time.time() < deadline:
        time.sleep(0.5)
    data = record.read_bytes()
    for needle in (b"reward_mean", b"eval_reward_mean", b"loss", b"samples_per_prompt",
                   b"image_attributes", b"left: step 0"):
        assert needle in data, needle
    assert len(list((run_dir / "files" / "media").rglob("*.png"))) >= 2      # step 0 and 2
