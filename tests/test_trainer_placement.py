"""The trainer at scale against a real local graph (shared test cluster):

* disaggregated: a 2-worker Ray Train learner group on its own fractional CPU bundles beside
  the rollout replica, full fine-tuning (FSDP2), FlowGRPO; every published version is the
  full weights, fetched from the policy store by the replica -- the log-prob parity check at
  the sampled version (|ratio - 1| <= 1e-4, run on the workers) shows the replica sampled
  with exactly them; the controller (this process) holds no model parameter during the run,
  the workers no text encoder (conditions come from the encoder stage by reference);
* colocated: the in-process learner steps while the rollout engine sleeps (serial pipeline).
"""
from __future__ import annotations

import pytest

from tests.trainer_helpers import metric_rows, serve_graph, tiny_graph, train_steps
from trainer.config import load_trainer_config

pytestmark = pytest.mark.timeout(900)

APP = "trainer_placement"


def graph_config():
    return tiny_graph(APP, "trainer_placement_store")


@pytest.fixture(scope="module")
def graph(ray_cluster):
    yield from serve_graph(graph_config())


def _config(tmp_path, **over):
    cfg = {"graph": graph_config(), "steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2,
           "sampler": {"sampler": "sde", "num_steps": 3, "noise_level": 0.7, "window": [0, 2]},
           "lora": {"rank": 4, "alpha": 8}, "nft": {"train_timesteps": 1},
           "eval": {"every": 2, "num_prompts": 2, "samples_per_prompt": 1, "num_steps": 3},
           "checks": {"time_convention": False, "lora_map": False},
           "run_dir": str(tmp_path), "checkpoint_every": 2, "gallery": False}
    cfg.update(over)
    return load_trainer_config(cfg)


class MeasuredTrainer:
    """A Trainer that reads this process's parameter bytes at every training step."""

    @staticmethod
    def make(cfg):
        from trainer.learner_worker import process_parameter_bytes
        from trainer.loop import Trainer

        class Measured(Trainer):
            def train_on(self, outputs, pending):
                self.parameter_bytes.append(process_parameter_bytes())
                return super().train_on(outputs, pending)

        trainer = Measured(cfg)
        trainer.parameter_bytes = []
        return trainer


def test_disaggregated_fsdp2_workers_publish_full_weight_versions(graph, tmp_path):
    import gc

    from trainer.learner_worker import process_parameter_bytes
    gc.collect()                                # earlier tests' unreachable modules go first
    before = process_parameter_bytes()          # what earlier tests left alive in this process
    cfg = _config(tmp_path, algorithm="flow_grpo", optimizer={"lr": 1e-4},
                  pipeline={"mode": "async", "max_staleness": 1},
                  checks={"time_convention": True, "lora_map": False},
                  learner={"fine_tune": "full", "workers": 2, "micro_batch_size": 1,
                           "resources_per_worker": {"CPU": 0.5}})
    trainer = MeasuredTrainer.make(cfg)
    assert [r.get("CPU") for r in trainer.learners.worker_resources] == [0.5, 0.5]
    for held in trainer.learners.worker_modules:        # the transformer only, on each worker
        assert held["transformers"] > 0 and held["text_encoders"] == 0
    assert trainer.learner is None
    history = trainer.run()
    assert len(history) == 2
    assert len(trainer.parameter_bytes) == 2
    # the run adds no parameter to this process (earlier tests' leftovers may only go)
    assert all(b <= before for b in trainer.parameter_bytes), (before, trainer.parameter_bytes)
    check = [r for r in metric_rows(tmp_path) if any(k.startswith("check_") for k in r)]
    assert check and check[0]["check_cos_declared@0.5"] > check[0]["check_cos_other@0.5"]
    for row in train_steps(metric_rows(tmp_path)):
        assert row["rows"] == 4 and row["grad_norm"] > 0
        assert row["logprob_ratio_err_max"] <= 1e-4     # sampled with the exact full weights
    assert trainer.publisher.kind.value == "full"
    version = trainer.sampling_versions[-1]
    tensors = trainer.publisher.tensors_of(version)
    assert len(tensors) == sum(1 for _ in trainer.family.load_transformers()["transformer"]
                               .parameters())
    from ray import serve
    rollout = serve.get_deployment_handle("DiTRollout", app_name=APP)
    assert version in rollout.ensure_version.remote(version).result()
    assert not trainer.learners._thread.is_alive()          # the worker group is gone


def test_colocated_learner_steps_while_the_rollout_engine_sleeps(graph, tmp_path):
    from trainer.loop import Trainer
    cfg = _config(tmp_path, algorithm="nft", pipeline={"mode": "serial", "max_staleness": 1},
                  learner={"placement": "colocated"})
    trainer = Trainer(cfg)
    history = trainer.run()
    assert len(history) == 2 and trainer.learners.colocation.cycles == 2
    assert all(r["grad_norm"] > 0 for r in train_steps(metric_rows(tmp_path)))
