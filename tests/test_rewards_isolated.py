"""A scorer deployment in its own Ray runtime_env: a package the graph's venv lacks is installed
for that replica only (pip, from the package index) and the scorer that needs it runs there."""
from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from contract import ArtifactHandle, ConfigError, StageOutput
from deployments.config import ScorerStage, ScorerStageOptions, load_graph_config
from tests.test_rewards_ocr import batch as text_images
from tests.test_rewards_ocr import meta

PACKAGE = "textdistance==4.6.3"


def test_stage_options_carry_runtime_env_and_resources():
    opts = ScorerStageOptions(runtime_env={"pip": [PACKAGE], "env_vars": {"OMP_NUM_THREADS": "1"}},
                              resources={"reward_node": 1}).deployment_options("Scorer_x")
    actor = opts["ray_actor_options"]
    assert actor["runtime_env"] == {"pip": {"packages": [PACKAGE], "pip_check": False},
                                    "env_vars": {"OMP_NUM_THREADS": "1"}}
    assert actor["resources"] == {"reward_node": 1} and actor["num_cpus"] == 0.25
    assert "runtime_env" not in ScorerStageOptions().deployment_options("s")["ray_actor_options"]
    base = {"name": "x", "scorer": {"kind": "ocr"}, "inputs": ["image"]}
    for bad in ({"runtime_env": {"pip": ["--index-url=http://evil"]}},
                {"runtime_env": {"pip": [""]}},
                {"runtime_env": {"conda": "env"}}):
        with pytest.raises(ConfigError):
            load_graph_config({"scorers": [dict(base, stage=bad)]})


def _index_reachable() -> bool:
    """The package index answers pip (CI and developer machines reach it)."""
    try:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE,
                        "-d", "/tmp/omni-pip-probe"], check=True, timeout=120,
                       capture_output=True)
        return True
    except (subprocess.SubprocessError, OSError):
        return False


@pytest.mark.network
def test_scorer_runs_in_its_own_runtime_env(ray_cluster):
    import ray
    from ray import serve

    from deployments.scorer import ScorerServer

    assert importlib.util.find_spec("textdistance") is None, "the main venv must lack it"
    if not _index_reachable():
        pytest.skip("package index not reachable: runtime_env pip cannot install")
    spec = ScorerStage(name="ocr_jaro", inputs=("image",),
                       scorer={"kind": "external",
                               "params": {
                                   "target": "tests.isolated_scorers.jaro_ocr:JaroOcrScorer"}},
                       stage={"num_cpus": 0.5, "runtime_env": {
                           "pip": [PACKAGE], "env_vars": {"OMNI_SCORER_ENV": "isolated"}}})
    app = serve.deployment(ScorerServer, **spec.stage.deployment_options("Scorer_ocr_jaro")
                           ).bind(spec)
    handle = serve.run(app, name="isolated_scorer", route_prefix=None)
    try:
        arts = text_images("OPEN", "HELLO WORLD")
        art = arts["image"]
        stage = StageOutput(request_id="r0", policy_version="base", seeds=(0, 1), artifacts={
            "image": ArtifactHandle(art.spec, tuple(art.data.shape), "uint8", ray.put(art))})
        # one request: its prompt and metadata (the OCR target), each sample with its seed
        [target] = meta("OPEN")
        out = handle.score.remote(stage, prompt="a", metadata=target,
                                  seeds=(0, 1)).result(timeout_s=300)
        assert out.metadata["textdistance"] == "4.6.3"
        assert out.metadata["env"] == "isolated"                   # the replica's env_vars
        right, wrong = out.scores["jaro_winkler"]
        assert right > 0.9 and wrong < 0.7, out.scores
    finally:
        serve.delete("isolated_scorer")
