"""Branch (tree) rollouts requested through the contract, in process (no Ray): a RolloutRequest
with a BranchSpec through the rollout strategy and the real embedded engine (tiny_t2i) returns
the tree its forks define -- checked against a tree written out here by hand and against the
recorded trajectories (rows sharing a node share their path bitwise, the prefix before the
first fork is the unbranched rollout's) -- and the same request over HTTP (deployments/http.py
as Serve calls it, the strategy behind it) answers the tree and each sample's node; factor,
depth, rows and fork steps beyond the graph's limits or the schedule are typed errors naming
field and value, raised before the engine sees the request."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch
from starlette.requests import Request

from contract import (BranchSpec, GraphResult, InvalidRequestError, LimitExceededError,
                      PromptBundle, RequestLimits, RolloutRequest, SamplingSpec, Task)
from deployments.http import HTTPFront
from diffusion.noise import NoiseStream, row_seed
from rollout.config import RolloutConfig, StrategyKind
from rollout.strategy import build_strategy

LIMITS = RequestLimits(max_samples_per_prompt=8, max_branch_factor=3, max_branch_depth=2,
                       max_steps=8)
BRANCH = BranchSpec(fork_steps=(1, 2), factor=2)
SEEDS = (11, 12)


@pytest.fixture(scope="module")
def strategy():
    torch.set_num_threads(1)
    s = build_strategy(RolloutConfig(strategy=StrategyKind.DIFFUSION), LIMITS)
    s.encoders = s.family.load_encoders()           # the encoder stage's job
    submitted = []
    submit = s.engine.submit
    s.engine.submit = lambda request: (submitted.append(request), submit(request))[1]
    s.submitted = submitted
    yield s
    asyncio.run(s.engine.shutdown())


def _request(strategy, branch=BRANCH, seeds=SEEDS, **sampling) -> RolloutRequest:
    prompt = strategy.family.conditioner.tokenize(["a red circle at the top left"])[0]
    spec = SamplingSpec(**{"num_steps": 4, "sde_window": (0, 3), "seeds": seeds, **sampling})
    return RolloutRequest(prompt=prompt, sampling=spec, task=Task.T2I, branch=branch,
                          requested_artifacts=("image_latent",))


async def _generate(strategy, request):
    cond = strategy.family.conditioner.encode(strategy.encoders, [request.prompt])
    return await strategy.generate(request, cond, None)


def _hand_tree(seeds, steps, factor):
    """The tree written out: roots, then each fork's children parent by parent, child i of a
    node seeded by the SplitMix64 hash of (its seed, the fork step, i + 1)."""
    node_seeds, parents, starts, alive = list(seeds), [-1] * len(seeds), [0] * len(seeds), \
        list(range(len(seeds)))
    for step in steps:
        nxt = []
        for node in alive:
            for i in range(factor):
                node_seeds.append(row_seed(row_seed(node_seeds[node], NoiseStream.STEP, step),
                                           NoiseStream.INITIAL, i + 1))
                parents.append(node)
                starts.append(step)
                nxt.append(len(node_seeds) - 1)
        alive = nxt
    return tuple(node_seeds), tuple(parents), tuple(starts), tuple(alive)


def _node_at(tree, row, step):
    node = tree.leaves[row]
    while tree.starts[node] > step:
        node = tree.parents[node]
    return node


def test_a_branch_request_returns_the_engine_tree_and_its_shared_paths(strategy):
    out = asyncio.run(_generate(strategy, _request(strategy)))
    seeds, parents, starts, leaves = _hand_tree(SEEDS, (1, 2), 2)
    assert (out.tree.seeds, out.tree.parents, out.tree.starts, out.tree.leaves) == \
        (seeds, parents, starts, leaves)
    assert parents[2:6] == (0, 0, 1, 1) and leaves == tuple(range(6, 14))
    assert out.seeds == tuple(seeds[n] for n in leaves) == out.trajectory.seeds
    latents = out.trajectory.latents                      # (8 leaves, W+1 = 4, *S)
    assert latents.shape[0] == 8 and out.artifacts["image_latent"].data.shape[0] == 8
    for j in range(latents.shape[1]):                     # the state before step j
        for a in range(8):
            for b in range(8):
                same = _node_at(out.tree, a, j - 1) == _node_at(out.tree, b, j - 1) if j else \
                    _node_at(out.tree, a, 0) == _node_at(out.tree, b, 0)
                assert torch.equal(latents[a, j], latents[b, j]) == same, (j, a, b)
    # the common prefix is the unbranched rollout's: same seeds, same first step
    plain = asyncio.run(_generate(strategy, _request(strategy, branch=None)))
    assert plain.tree is None and plain.seeds == SEEDS
    for a in range(8):
        root = _node_at(out.tree, a, 0)
        torch.testing.assert_close(latents[a, :2], plain.trajectory.latents[root, :2],
                                   rtol=0, atol=1e-6)
        torch.testing.assert_close(out.trajectory.log_probs[a, 0],
                                   plain.trajectory.log_probs[root, 0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("branch, sampling, error, field, actual", [
    (BranchSpec(fork_steps=(1,), factor=4), {}, LimitExceededError, "branch.factor", 4),
    (BranchSpec(fork_steps=(0, 1, 2)), {}, LimitExceededError, "branch.fork_steps", 3),
    (BranchSpec(fork_steps=(1, 2), factor=3), {}, LimitExceededError, "branch", 18),
    (BranchSpec(fork_steps=(1, 5)), {"sde_window": None}, InvalidRequestError,
     "branch.fork_steps[1]", 5),                                       # past the schedule
    (BranchSpec(fork_steps=(3,)), {}, InvalidRequestError, "branch.fork_steps[0]", 3),
    (BranchSpec(fork_steps=(1,)), {"sampler": "ode", "noise_level": 0.0}, InvalidRequestError,
     "branch.fork_steps[0]", 1),                                       # nothing to branch
])
def test_branch_bounds_are_typed_errors_before_the_engine(strategy, branch, sampling, error,
                                                          field, actual):
    before = len(strategy.submitted)
    with pytest.raises(error) as exc:
        asyncio.run(_generate(strategy, _request(strategy, branch=branch, **sampling)))
    assert exc.value.field == field and exc.value.actual == actual, exc.value
    assert type(exc.value) is error and len(strategy.submitted) == before


def test_a_branch_spec_is_strict():
    for bad in [{"fork_steps": ()}, {"fork_steps": (2, 1)}, {"fork_steps": (-1,)},
                {"fork_steps": (1,), "factor": 1}, {"fork_steps": (1,), "factor": "2"},
                {"fork_steps": (1,), "depth": 2}]:
        with pytest.raises(ValueError):
            BranchSpec(**bad)
    with pytest.raises(InvalidRequestError) as exc:
        RolloutRequest(prompt=PromptBundle(token_ids=(1,)), sampling=SamplingSpec(seeds=(1,)),
                       task=Task.T2I, branch={"fork_steps": [1]})
    assert exc.value.field == "branch"
    assert BranchSpec(fork_steps=(1, 2), factor=3).leaves(2) == 18


# ---- over HTTP: the front as Serve calls it, the strategy behind it ---------------------------
class StrategyFront(HTTPFront):
    """The HTTP face with the rollout strategy (real engine) where the stages would be: each
    request's output comes back as a GraphResult (no artifacts, no scorers)."""

    def __init__(self, strategy):
        from deployments.config import load_graph_config
        self.strategy, self.family = strategy, strategy.family
        self.config = load_graph_config({"rollout": {"adapter": "tiny_t2i"},
                                         "limits": LIMITS.model_dump()})
        self.reached: list = []

    async def rollout(self, requests, preview=False):
        self.reached.append(requests)
        outs = [await _generate(self.strategy, r) for r in requests]
        return [GraphResult(o.request_id, {}, o.policy_version, o.seeds, o.stop_reason, None,
                            None, tree=o.tree) for o in outs]

    async def release(self, request_ids) -> int:
        return 0


def _post(front, body) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    headers = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]
    scope = {"type": "http", "method": "POST", "path": "/graph/rollout", "root_path": "/graph",
             "headers": headers, "query_string": b"", "http_version": "1.1", "scheme": "http",
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000)}

    async def receive():
        return {"type": "http.request", "body": data, "more_body": False}
    response = asyncio.run(front(Request(scope, receive)))
    return response.status_code, json.loads(response.body)


BODY = {"prompts": ["a red circle", "a blue square"], "samples_per_prompt": 2, "seed": 11,
        "num_steps": 4, "sde_window": [0, 3], "artifacts": ["image_latent"],
        "branch": {"fork_steps": [1, 2], "factor": 2}}


def test_a_branch_request_over_http_answers_the_tree(strategy):
    front = StrategyFront(strategy)
    status, answer = _post(front, BODY)
    assert status == 200, answer
    [first, second] = front.reached[-1]
    assert first.branch == BRANCH and first.sampling.seeds == (11, 12)
    assert first.sampling.sde_window == (0, 3)
    assert second.sampling.seeds == (13, 14)
    for result, seeds in zip(answer["results"], [(11, 12), (13, 14)]):
        want = _hand_tree(seeds, (1, 2), 2)
        tree = result["tree"]
        assert (tuple(tree["seeds"]), tuple(tree["parents"]), tuple(tree["starts"]),
                tuple(tree["leaves"])) == want
        assert [s["node"] for s in result["samples"]] == list(want[3])
        assert [s["seed"] for s in result["samples"]] == [want[0][n] for n in want[3]]
    status, answer = _post(front, {k: v for k, v in BODY.items() if k != "branch"})
    assert status == 200 and all("tree" not in r and "node" not in r["samples"][0]
                                 for r in answer["results"])


@pytest.mark.parametrize("branch, status, field", [
    ({"fork_steps": [1], "factor": 5}, 413, "branch.factor"),
    ({"fork_steps": [0, 1, 2]}, 413, "branch.fork_steps"),
    ({"fork_steps": [1, 2], "factor": 3}, 413, "branch"),
    ({"fork_steps": [1, 4]}, 400, "branch.fork_steps[1]"),
    ({"fork_steps": [3]}, 400, "branch.fork_steps[0]"),
    ({"fork_steps": [1], "factor": "2"}, 422, "branch.factor"),
    ({"fork_steps": [2, 1]}, 422, "branch.fork_steps"),
    ({"fork_steps": [1], "width": 2}, 422, "branch.width"),
    ({"fork_steps": [2]}, 400, "branch.fork_steps[0]"),          # at the end of sde_window
])
def test_http_branch_bounds_are_refused_before_any_rollout(strategy, branch, status, field):
    front = StrategyFront(strategy)
    body = dict(BODY, branch=branch)
    if branch == {"fork_steps": [2]}:
        body["sde_window"] = [0, 2]
    got, answer = _post(front, body)
    assert got == status and answer["error"]["field"] == field, answer
    assert not front.reached
    if status != 422:                     # the value refused is named with the field
        actual = {"branch.factor": 5, "branch.fork_steps": 3, "branch": 18,
                  "branch.fork_steps[1]": 4,
                  "branch.fork_steps[0]": branch["fork_steps"][0]}[field]
        assert answer["error"]["actual"] == actual, answer


def test_tree_grpo_config_is_checked_against_the_graphs_limits():
    from contract import ConfigError
    from trainer.config import check_group_sizes, load_trainer_config
    base = {"graph": {"rollout": {"adapter": "tiny_t2i"}, "limits": LIMITS.model_dump()},
            "algorithm": "flow_grpo", "samples_per_prompt": 2,
            "sampler": {"num_steps": 4, "window": [0, 3]}}
    ok = load_trainer_config(dict(base, flow_grpo={"branch": {"fork_steps": [1, 2]}}))
    check_group_sizes(ok, ok.graph_config())                       # 8 rows: within the limit
    assert ok.flow_grpo.branch == BRANCH
    for branch, field, actual in [({"fork_steps": [1], "factor": 4}, "flow_grpo.branch.factor", 4),
                                  ({"fork_steps": [0, 1], "factor": 3}, "flow_grpo.branch", 18)]:
        cfg = load_trainer_config(dict(base, flow_grpo={"branch": branch}))
        with pytest.raises(ConfigError) as exc:
            check_group_sizes(cfg, cfg.graph_config())
        assert exc.value.field == field and exc.value.actual == actual
    for over, words in [({"algorithm": "nft"}, "algorithm must be flow_grpo"),
                        ({"flow_grpo": {"branch": {"fork_steps": [3]}}}, "fork_steps[0]=3"),
                        ({"sampler": {"num_steps": 4, "window_size": 1}}, "window_size")]:
        cfg = dict(base, flow_grpo={"branch": {"fork_steps": [1]}}) | over
        with pytest.raises(ConfigError) as exc:
            load_trainer_config(cfg)
        assert words in str(exc.value)


def test_the_shipped_tree_grpo_config_meets_its_graphs_limits():
    from trainer.config import check_group_sizes, load_trainer_config
    cfg = load_trainer_config("configs/train_tiny_t2i_tree.yaml")
    check_group_sizes(cfg, cfg.graph_config())
    branch, graph = cfg.flow_grpo.branch, cfg.graph_config()
    assert branch.leaves(cfg.samples_per_prompt) == 8 <= graph.limits.max_samples_per_prompt
    assert cfg.algorithm.value == "flow_grpo" and branch.fork_steps == (2, 4)
