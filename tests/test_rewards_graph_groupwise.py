"""The new rewards in the deployed tiny_t2i graph, through handles: PickScore_Rank ranks each
request's group in its scorer deployment, the pairwise judge (a real tiny VLM behind an
OpenAI-compatible server on 127.0.0.1) gives each group's win rates, GenEval reads each request's
GenEval metadata (tiny Mask2Former), the latent head reads the rollout's latent (equal to the head
applied to the returned latent); a one-sample group is refused before any stage, and a graph
whose only scorer reads the latent runs no decoder for a caller that asks for the latent only."""
from __future__ import annotations

import pytest
import torch

from contract import InvalidRequestError, RolloutRequest, SamplingSpec, Task

APP, LATENT_APP = "groupwise_graph", "latent_graph"


def _config(app: str, scorers: list[dict]) -> dict:
    return {"app_name": app, "rollout": {"adapter": "tiny_t2i"},
            "rollout_stage": {"num_cpus": 0.5}, "scorers": scorers,
            "limits": {"max_prompts": 4, "max_samples_per_prompt": 8, "max_steps": 8,
                       "max_height": 32, "max_width": 32},
            "policy_store": f"{app}_store"}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from safetensors.torch import save_file

    from testing import preference_snapshots as ps
    root = tmp_path_factory.mktemp("graph_groupwise")
    g = torch.Generator().manual_seed(0)
    head = {"proj.weight": torch.randn(6, 4, generator=g), "proj.bias": torch.randn(6, generator=g),
            "out.weight": torch.randn(1, 6, generator=g), "out.bias": torch.randn(1, generator=g)}
    save_file(head, str(root / "head.safetensors"))
    from testing.detector_snapshots import write_tiny_mask2former
    return {"clip": ps.write_hf_clip_dir(root / "clip"), "head": str(root / "head.safetensors"),
            "detector": write_tiny_mask2former(root / "m2f", ("circle", "square"))}


@pytest.fixture(scope="module")
def judge_url():
    from testing.http_servers import serve
    from tests.tiny_vlm_server import TinyVLMServer
    with serve(TinyVLMServer().app()) as url:
        yield url


def _latent_scorer(files) -> dict:
    return {"name": "latent", "scorer": {"kind": "latent_head",
                                         "params": {"head_path": files["head"]}},
            "inputs": ["image_latent"]}


def _deploy(ray_cluster, config):
    from ray import serve

    from graph import build_app, delete_graph
    handle = serve.run(build_app(config), name=config["app_name"], route_prefix=None)
    return handle, lambda: delete_graph(config)


@pytest.fixture(scope="module")
def graph(ray_cluster, files, judge_url):
    rank = {"name": "rank", "scorer": {"kind": "pickscore_rank",
                                       "params": {"model_dir": files["clip"]}},
            "inputs": ["image"]}
    pairwise = {"name": "pairwise", "inputs": ["image"], "scorer": {
        "kind": "vlm_pairwise", "params": {"base_url": f"{judge_url}/v1", "model": "tiny-llava"}}}
    geneval = {"name": "geneval", "inputs": ["image"], "scorer": {"kind": "geneval", "params": {
        "detector_dir": files["detector"], "clip_dir": files["clip"], "threshold": 0.0}}}
    handle, delete = _deploy(ray_cluster, _config(APP, [rank, _latent_scorer(files), pairwise,
                                                        geneval]))
    yield handle
    delete()


PROMPT = "a red circle at the top left"
GENEVAL = {"tag": "colors", "prompt": PROMPT,
           "include": [{"class": "circle", "count": 1, "color": "red"}]}


def _request(adapter, seeds, **kw) -> RolloutRequest:
    bundle = adapter.conditioner.tokenize([PROMPT])[0]
    return RolloutRequest(prompt=bundle, task=Task.T2I,
                          sampling=SamplingSpec(num_steps=4, seeds=seeds), **kw)


def _local_head(files, z: torch.Tensor) -> list[float]:
    from rewards.registry import ScorerSpec, build_scorer
    from contract import ArtifactSpec, MediaArtifact
    from rewards.base import ScoreRequest
    spec = ArtifactSpec("image_latent", "image", "latent", "latent:CHW")
    scorer = build_scorer(ScorerSpec(kind="latent_head", params={"head_path": files["head"]}))
    out = scorer.score(ScoreRequest({"image_latent": MediaArtifact(spec, z)}, ("p",) * len(z)))
    return list(out.scores["latent_reward"])


def test_new_rewards_score_each_group_through_handles(graph, files):
    from adapters.registry import get_family
    from deployments.client import RolloutClient
    adapter = get_family("tiny_t2i")
    client = RolloutClient(graph)
    reqs = [_request(adapter, (0, 1, 2, 3), requested_artifacts=("image_latent",),
                     metadata=GENEVAL),
            _request(adapter, (10, 11, 12), requested_artifacts=("image_latent",),
                     metadata=GENEVAL)]
    outs = client.rollout(reqs)
    for out, n in zip(outs, (4, 3)):
        assert set(out.artifacts) == {"image_latent"}
        ranks = out.rewards.by_scorer["rank"].scores["rank"]
        assert sorted(ranks) == pytest.approx([k / n for k in range(n)])   # its own group only
        head = out.rewards.by_scorer["latent"].scores["latent_reward"]
        assert head == pytest.approx(_local_head(files, out.artifacts["image_latent"].data),
                                     rel=1e-5)
        assert "decode_image_latent_s" in out.metrics          # decoded for the image scorers
        wins = out.rewards.by_scorer["pairwise"].scores["win_rate"]
        assert sum(wins) == pytest.approx(n / 2)                  # n(n-1)/2 wins over n - 1
        assert all(w * (n - 1) == pytest.approx(round(w * (n - 1))) for w in wins)
        assert set(out.rewards.by_scorer["geneval"].scores["correct"]) <= {0.0, 1.0}


def test_a_one_sample_group_is_refused_before_any_stage(graph):
    from adapters.registry import get_family
    from deployments.client import RolloutClient
    with pytest.raises(InvalidRequestError) as e:
        RolloutClient(graph).rollout([_request(get_family("tiny_t2i"), (5,), metadata=GENEVAL)])
    assert e.value.field == "sampling.seeds" and "rank" in e.value.message


def test_geneval_metadata_of_another_prompt_is_the_clients_error(graph):
    from adapters.registry import get_family
    from contract import UnscorableInputError
    from deployments.client import RolloutClient
    other = dict(GENEVAL, prompt="a photo of a square")
    with pytest.raises(UnscorableInputError) as e:
        RolloutClient(graph).rollout([_request(get_family("tiny_t2i"), (1, 2), metadata=other)])
    assert e.value.field == "metadata[0].prompt" and e.value.http_status == 422


def test_latent_only_graph_runs_no_decoder(ray_cluster, files):
    from adapters.registry import get_family
    from deployments.client import RolloutClient
    handle, delete = _deploy(ray_cluster, _config(LATENT_APP, [_latent_scorer(files)]))
    try:
        [out] = RolloutClient(handle).rollout([_request(get_family("tiny_t2i"), (0, 1),
                                                        requested_artifacts=("image_latent",))])
    finally:
        delete()
    assert set(out.artifacts) == {"image_latent"}
    assert not any(k.startswith("decode_") for k in out.metrics)      # no decoder ran
    assert out.rewards.by_scorer["latent"].scores["latent_reward"] == pytest.approx(
        _local_head(files, out.artifacts["image_latent"].data), rel=1e-5)
