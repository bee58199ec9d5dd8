"""Tree GRPO through the deployed graph (tiny_t2i on a local Ray cluster): the trainer asks for
branch rollouts (flow_grpo.branch), the graph returns each request's tree with its leaves'
trajectories and rewards, and the trainer's step trains per-node advantages. Checked: the tree
equals the one the engine builds for the request (rollout.engine_api.build_tree, and written out
by hand), the recorded trajectories share exactly the tree's prefixes, and the plan's per-node
advantages and edge weights equal an independent computation (BranchGRPO's depth-wise z-scores
and TreeGRPO's leaf z-scores averaged up, written here with plain loops over the tree)."""
from __future__ import annotations

import statistics

import pytest
import torch

from contract import BranchSpec
from rollout.engine_api import build_tree, forks_of
from tests.trainer_helpers import serve_graph, tiny_graph
from trainer.config import load_trainer_config

pytestmark = pytest.mark.timeout(900)

APP = "trainer_tree"
BRANCH = {"fork_steps": [1], "factor": 2}


def graph_config():
    return tiny_graph(APP, "trainer_tree_store")


def trainer_config(tmp_path, estimator: str = "branch_depthwise"):
    return load_trainer_config({
        "graph": graph_config(), "algorithm": "flow_grpo", "steps": 1, "prompts_per_step": 2,
        "samples_per_prompt": 2,
        "sampler": {"sampler": "sde", "num_steps": 3, "noise_level": 0.7, "window": [0, 2]},
        "lora": {"rank": 4, "alpha": 8},
        "flow_grpo": {"clip_range": 0.2, "branch": BRANCH, "tree_advantage": estimator},
        "pipeline": {"mode": "serial", "max_staleness": 1},
        "checks": {"time_convention": False, "lora_map": False},
        "run_dir": str(tmp_path / "tree"), "gallery": False})


@pytest.fixture(scope="module")
def graph(ray_cluster):
    yield from serve_graph(graph_config())


def node_at(tree, row: int, step: int) -> int:
    node = tree.leaves[row]
    while tree.starts[node] > step:
        node = tree.parents[node]
    return node


def groups_by_node(tree, depth: int) -> dict[int, list[int]]:
    """Rows of one tree by the node they are at after `depth` steps (depth 0: the group)."""
    out: dict[int, list[int]] = {}
    for r in range(len(tree.leaves)):
        out.setdefault(-1 if depth == 0 else node_at(tree, r, depth - 1), []).append(r)
    return out


def branch_depthwise(tree, rewards: list[float], steps: int) -> torch.Tensor:
    adv = torch.zeros(len(rewards), steps + 1, dtype=torch.float64)
    for d in range(steps + 1):
        nodes = groups_by_node(tree, d)
        values = {n: sum(rewards[r] for r in rows) / len(rows) for n, rows in nodes.items()}
        if len(values) < 2 or statistics.stdev(values.values()) < 1e-6:
            continue
        mean, std = statistics.mean(values.values()), statistics.stdev(values.values())
        for n, rows in nodes.items():
            for r in rows:
                adv[r, d] = (values[n] - mean) / (std + 1e-8)
    return adv


def tree_backprop(tree, rewards: list[float], steps: int) -> torch.Tensor:
    adv = torch.zeros(len(rewards), steps + 1, dtype=torch.float64)
    mean, std = statistics.mean(rewards), statistics.pstdev(rewards)
    for r, value in enumerate(rewards):
        adv[r, steps] = (value - mean) / (std + 1e-4)
    for d in range(steps - 1, -1, -1):
        for rows in groups_by_node(tree, d).values():
            children = {node_at(tree, r, d): adv[r, d + 1] for r in rows}   # depth d + 1
            for r in rows:
                adv[r, d] = sum(children.values()) / len(children)
    return adv


def test_tree_grpo_trains_through_the_graph(graph, tmp_path):
    from trainer.loop import Trainer
    from trainer.rollout_batch import build_batch, canonical_media
    from trainer.updates import plan_update
    torch.manual_seed(0)
    cfg = trainer_config(tmp_path)
    trainer = Trainer(cfg)
    try:
        version, _ = trainer.publish_sampling()
        pending = trainer.submit(0)
        outputs, _ = trainer.collect(pending)
        steps = cfg.sampler.num_steps
        for request, out in zip(pending.requests, outputs):
            assert request.branch == BranchSpec(**BRANCH) and out.policy_version == version
            # the tree the engine builds for this request, and written out by hand
            assert out.tree == build_tree(request.sampling.seeds, forks_of(request.branch))
            assert out.tree.parents == (-1, -1, 0, 0, 1, 1)
            assert out.tree.starts == (0, 0, 1, 1, 1, 1) and out.tree.leaves == (2, 3, 4, 5)
            assert out.seeds == tuple(out.tree.seeds[n] for n in out.tree.leaves)
            assert out.tree.seeds[:2] == request.sampling.seeds
            assert len(out.rewards.total) == 4 and out.trajectory.latents.shape[0] == 4
            latents = out.trajectory.latents           # (4 leaves, 3 states, *S)
            for j in range(latents.shape[1]):          # the state before window step j
                for a in range(4):
                    for b in range(4):
                        same = node_at(out.tree, a, max(j - 1, 0)) == \
                            node_at(out.tree, b, max(j - 1, 0))
                        assert torch.equal(latents[a, j], latents[b, j]) == same, (j, a, b)
        batch = build_batch(trainer.conditions, pending.prompts, outputs,
                            [r.sampling for r in pending.requests],
                            canonical_media(pending.requests))
        assert batch.node_of is not None and batch.node_of.shape == (8, steps + 1)
        # each leaf's reward as the batch holds it (float32), the arithmetic here in float64
        rewards = [torch.tensor(o.rewards.total, dtype=torch.float32).double().tolist()
                   for o in outputs]
        assert torch.equal(batch.rewards.double(), torch.tensor(sum(rewards, [])))
        independent = {
            "branch_depthwise": torch.cat([branch_depthwise(o.tree, r, steps)
                                           for o, r in zip(outputs, rewards)]),
            "tree_backprop": torch.cat([tree_backprop(o.tree, r, steps)
                                        for o, r in zip(outputs, rewards)])}
        assert float(independent["branch_depthwise"].abs().max()) > 0
        weights = torch.tensor([[1 / 2, 1.0, 1.0]] * 8)      # step 0 shared by two leaves
        for estimator, want in independent.items():
            plan = plan_update(cfg.algorithm, batch, trainer_config(tmp_path, estimator),
                               torch.Generator().manual_seed(0), version)
            torch.testing.assert_close(plan.values.double(), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(plan.edge_weights, weights)
        # the trainer's own step on these outputs: per-node advantages, the adapter moves
        before = {k: v.clone() for k, v in trainer.learner.export()[0].items()}
        metrics = trainer.train_on(outputs, pending)
        assert metrics["tree_nodes"] == 2 * (2 + 4)            # distinct nodes of depth >= 1
        assert metrics["adv_abs_mean"] == pytest.approx(
            float(independent["branch_depthwise"][:, 1:].abs().mean()), rel=1e-5)
        assert metrics["rows"] == 8 and metrics["grad_norm"] > 0
        assert metrics["logprob_ratio_err_max"] <= 1e-4        # the leaves' paths at parity
        after = trainer.learner.export()[0]
        assert any(not torch.equal(before[k], after[k]) for k in before)
    finally:
        trainer.learners.close()
