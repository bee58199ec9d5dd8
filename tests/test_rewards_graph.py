"""Reward scorers inside the rollout graph: a prompt's metadata (OCR target text) reaches the
scorer from the handle API and from HTTP; a prompt without it is the client's 4xx, never a 0;
image scorers on video frames report the frames they used."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from contract import RolloutRequest, SamplingSpec, ScoreStatus, Task, UnscorableInputError

pytestmark = pytest.mark.timeout(600)
APP, PREFIX = "graph_rewards", "/graph_rewards"


@pytest.fixture(scope="module")
def graph(ray_cluster):
    from ray import serve

    from graph import build_app, delete_graph
    cfg = {"app_name": APP, "rollout": {"adapter": "tiny_t2i"},
           "rollout_stage": {"num_cpus": 0.5},
           "scorers": [{"name": "ocr", "scorer": {"kind": "ocr"}, "inputs": ["image"],
                        "reward": {"policy": "required", "timeout_s": 120}}],
           "limits": {"max_prompts": 4, "max_samples_per_prompt": 4, "max_steps": 8,
                      "max_height": 32, "max_width": 32, "max_frames": 1},
           "policy_store": "graph_rewards_store"}
    handle = serve.run(build_app(cfg), name=APP, route_prefix=PREFIX)
    yield handle
    delete_graph(cfg)


def _post(port, body):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{PREFIX}/rollout",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_metadata_reaches_the_ocr_scorer(graph, ray_cluster):
    from adapters.registry import get_family
    from deployments.client import RolloutClient
    bundle = get_family("tiny_t2i").conditioner.tokenize(['a sign that says "OPEN"'])[0]
    req = RolloutRequest(prompt=bundle, task=Task.T2I, metadata={"ocr_text": "OPEN"},
                         sampling=SamplingSpec(num_steps=3, seeds=(0, 1)))
    [out] = RolloutClient(graph).rollout([req])
    ocr = out.rewards.by_scorer["ocr"]
    assert ocr.status == (ScoreStatus.OK, ScoreStatus.OK)
    assert all(0.0 <= v <= 1.0 for v in ocr.scores["ocr"])        # shapes model: ~0, a real 0
    assert out.rewards.total == ocr.scores["ocr"]
    status, body = _post(ray_cluster["http_port"], {
        "prompts": ['a sign that says "OPEN"'], "samples_per_prompt": 2, "num_steps": 3,
        "metadata": [{"ocr_text": "OPEN"}]})
    assert status == 200, body
    sample = body["results"][0]["samples"][0]
    assert sample["scores"]["ocr"]["status"] == "ok" and "edit_distance" in sample["scores"]["ocr"]


def test_prompt_without_target_text_is_a_client_error(graph, ray_cluster):
    status, body = _post(ray_cluster["http_port"], {"prompts": ['a sign that says "OPEN"'],
                                                   "num_steps": 3})
    assert status == 422 and body["error"]["type"] == UnscorableInputError.__name__, body
    assert "ocr_text" in body["error"]["field"] + body["error"]["message"]
    status, body = _post(ray_cluster["http_port"], {"prompts": ["a", "b"], "num_steps": 3,
                                                   "metadata": [{"ocr_text": "OPEN"}]})
    assert status == 400 and body["error"]["field"] == "metadata", body
