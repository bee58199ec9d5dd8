"""The trainer against a real local Ray graph: a few steps of each algorithm (async and serial),
checkpoint + resume, and the start-up checks failing on purpose (LoRA map broken, ids altered,
flip removed)."""
from __future__ import annotations

import pytest
import torch

from adapters.tiny_t2i import SHIPPED_WEIGHTS
from contract import Algorithm, StartupCheckError, TimeConvention
from trainer import checks
from tests.serve_utils import replica_actors, wait_until_ongoing
from tests.lora_utils import swap_qk
from tests.trainer_helpers import metric_rows, serve_graph, tiny_graph, train_steps
from trainer.config import load_trainer_config

pytestmark = pytest.mark.timeout(900)

APP = "trainer_t2i"


def graph_config():
    return tiny_graph(APP, "trainer_test_store")


def trainer_config(tmp_path, algorithm: Algorithm, mode: str = "async", **over):
    cfg = {"graph": graph_config(), "algorithm": algorithm.value, "steps": 2,
           "prompts_per_step": 2, "samples_per_prompt": 2,
           "sampler": {"sampler": "sde", "num_steps": 3, "noise_level": 0.7, "window": [0, 2]},
           "lora": {"rank": 4, "alpha": 8}, "nft": {"train_timesteps": 1},
           "dpo": {"draws_per_pair": 1},
           "pipeline": {"mode": mode, "max_staleness": 1},
           "eval": {"every": 2, "num_prompts": 2, "samples_per_prompt": 1, "num_steps": 3},
           "checks": {"time_convention": True},
           "run_dir": str(tmp_path / algorithm.value), "checkpoint_every": 1, "gallery": True}
    cfg.update(over)
    return load_trainer_config(cfg)


@pytest.fixture(scope="module")
def graph(ray_cluster):
    yield from serve_graph(graph_config())


@pytest.mark.parametrize("algorithm,mode", [(Algorithm.NFT, "async"),
                                            (Algorithm.FLOW_GRPO, "serial"),
                                            (Algorithm.DPO, "async")])
def test_short_loop(graph, tmp_path, algorithm, mode):
    from trainer.loop import Trainer
    torch.manual_seed(0)
    cfg = trainer_config(tmp_path, algorithm, mode)
    trainer = Trainer(cfg)
    history = trainer.run()
    assert len(history) == 2
    run = tmp_path / algorithm.value
    rows = metric_rows(run)
    steps = train_steps(rows)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["logprob_ratio_err_max"] <= 1e-4            # version parity, fp32
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["rows"] == 4
    assert any("check_lora_probe_max_diff" in r for r in rows)
    assert "eval_reward_mean" in rows[-1]
    assert (run / "reward_curve.png").is_file() and (run / "gallery" / "gallery.png").is_file()
    # the graph sampled with the trainer's published versions (old-* for NFT, v* otherwise)
    prefix = "old-" if algorithm is Algorithm.NFT else "v"
    assert all(v.split("/")[-1].startswith(prefix) for v in trainer.sampling_versions)


def test_resume_continues_from_checkpoint(graph, tmp_path):
    from trainer.loop import Trainer
    cfg = trainer_config(tmp_path, Algorithm.NFT, "serial", checks={"time_convention": False,
                                                                    "lora_map": False})
    first = Trainer(cfg)
    first.run()
    saved = first.learner.export()[0]
    resumed = Trainer(trainer_config(tmp_path, Algorithm.NFT, "serial", steps=3, resume=True,
                                     checks={"time_convention": False, "lora_map": False}))
    assert resumed.step == 0
    resumed.resume()
    assert resumed.step == 2
    assert all(torch.equal(saved[k], v) for k, v in resumed.learner.export()[0].items())


def test_startup_checks_fail_on_purpose(graph, tmp_path, monkeypatch):
    from trainer.loop import Trainer
    trainer = Trainer(trainer_config(tmp_path, Algorithm.FLOW_GRPO, "serial"))
    report = trainer.startup.lora_map()
    assert report["lora_probe_max_diff"] <= 1e-4

    with pytest.raises(StartupCheckError) as e:
        trainer.startup.lora_map(publish_transform=swap_qk)
    assert e.value.field == "lora_map"

    trainer.publish_sampling()
    pending = trainer.submit(0)
    outputs, _ = trainer.collect(pending)
    names = trainer.family.spec.encoder_names
    assert checks.check_token_ids(pending.prompts, outputs, names) == 2
    altered = [p.model_copy(update={"token_ids": p.token_ids[:-1] + (1999,)})
               for p in pending.prompts]
    with pytest.raises(StartupCheckError) as e:
        checks.check_token_ids(altered, outputs, names)
    assert e.value.field == "encoded_token_ids.minilm"

    assert SHIPPED_WEIGHTS.is_dir(), f"package data missing: {SHIPPED_WEIGHTS}"
    # the flip removed: declare the other convention
    monkeypatch.setattr(trainer.family.denoiser, "time_convention", TimeConvention.DATA_PROGRESS)
    with pytest.raises(StartupCheckError) as e:
        trainer.startup.run()
    assert e.value.field == "adapter.time_convention"


def _rollout_replica_actor() -> tuple[str, str]:
    [actor] = replica_actors(APP, "DiTRollout")
    return actor


def test_lost_rollout_is_resampled_with_the_same_requests(graph, tmp_path):
    """The rollout replica dies with the trainer's batch in flight: the trainer resubmits the
    same requests (ids, seeds, version), counts the retry and gets every output once."""
    import time

    import ray
    from ray import serve

    from trainer.loop import Pending, Trainer
    from trainer.prompts import make_requests
    trainer = Trainer(trainer_config(tmp_path, Algorithm.NFT, "serial",
                                     checks={"time_convention": False, "lora_map": False}))
    requests = make_requests(trainer.family, trainer.eval_prompts[:2], trainer.cfg.sampler,
                             group=8, seed=77, version=None, num_steps=20)
    # the one replica's engine paused, so the batch is surely in it (queued) when it dies
    name, namespace = _rollout_replica_actor()
    serve.get_deployment_handle("DiTRollout", app_name=APP).sleep.remote().result()
    pending = Pending(0, [], requests, trainer.client.submit(requests), time.perf_counter())
    wait_until_ongoing((name, namespace), len(requests))   # encoded, queued in the replica
    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
    outputs, _ = trainer.collect(pending)
    assert trainer.rollout_retries >= 1
    assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    assert [o.seeds for o in outputs] == [r.sampling.seeds for r in requests]
    assert all(len(o.rewards.total) == 8 for o in outputs)
    assert _rollout_replica_actor() != (name, namespace)                  # Serve replaced it


def test_publisher_keeps_the_published_snapshot(ray_cluster):
    """The trainer's copy of a version (used for log-prob parity) is what was published, not
    the caller's tensors, which the optimizer goes on to change in place."""
    import ray

    from trainer.sync import PolicyPublisher
    publisher = PolicyPublisher("publisher_test_store", "snap", keep=2)
    tensors = {"m.lora_A.weight": torch.ones(2, 3), "m.lora_B.weight": torch.ones(4, 2)}
    version, _ = publisher.publish("v1", 1, tensors, 1.0)
    for value in tensors.values():
        value.mul_(2.0)                                  # the next optimizer step
    held = publisher.tensors_of(version)
    assert all(torch.equal(held[k], torch.ones_like(v)) for k, v in tensors.items())
    stored = ray.get(ray.get(publisher.store.get.remote(version)).tensors[0]).unpack()
    assert all(torch.equal(stored[k], held[k]) for k in tensors)
    assert set(publisher.last_phases) == {"pack_s", "put_s", "register_s"}
    ray.kill(publisher.store, no_restart=True)
