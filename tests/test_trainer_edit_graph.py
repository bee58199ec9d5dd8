"""Training on the edit task through the deployed graph and Ray DeploymentHandles, on the tiny
FLUX.1 Kontext and Qwen-Image-Edit checkpoints: edit prompt files (a source image per record),
the encoder stage's conditions of prompt + source by reference to the learner (Qwen2.5-VL sees
the source), the source's latents re-encoded by the learner's VAE, clip_directional rewards
against each source, every start-up check on prompt + source (the scheduler time convention,
the LoRA map, the token ids) and the per-step log-prob parity; a DiffusionNFT and a FlowGRPO
step each; then the checks failing on purpose (integration tier: Ray). The in-process twin is
tests/test_trainer_edit.py."""
from __future__ import annotations

import json
import math

import pytest
import torch

from contract import (Algorithm, DatasetError, MediaArtifact, StartupCheckError,
                      TimeConvention)
from tests.lora_utils import swap_qk
from tests.test_trainer_edit import CASES, SIZE, edit_root
from tests.trainer_helpers import metric_rows, train_steps
from trainer.config import load_trainer_config

pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module", params=list(CASES))
def deployed(request, ray_cluster, tiny_checkpoint, tmp_path_factory):
    """(case, graph config, train / test prompt files, CLIP dir) with the case's graph up."""
    from ray import serve

    from graph import build_app, delete_graph
    from testing.edit_prompts import write_edit_prompts
    from testing.snapshots import write_clip_dir
    case = request.param
    name, _, options, side, negative, _ = CASES[case]
    root = edit_root(case, tiny_checkpoint, tmp_path_factory)
    clip = write_clip_dir(tmp_path_factory.mktemp("clip") / "clip")
    files = write_edit_prompts(tmp_path_factory.mktemp("edits"), size=side, train=2, test=1,
                               negative=negative)
    config = {"app_name": f"edit_{case}",
              "rollout": {"adapter": name, "weights_path": str(root),
                          "adapter_options": options},
              "rollout_stage": {"num_cpus": 0.5},
              "scorers": [{"name": "clip_directional",
                           "scorer": {"kind": "clip_directional", "params": {"model": clip}},
                           "inputs": ["image"], "reward": {"policy": "required"}}],
              "limits": {"max_prompts": 4, "max_samples_per_prompt": 4, "max_steps": 8,
                         "max_height": 1024, "max_width": 1024, "max_frames": 1,
                         "max_body_bytes": 8 << 20},
              "policy_store": f"edit_{case}_store"}
    serve.run(build_app(config), name=config["app_name"], route_prefix=None)
    yield case, config, files, clip
    delete_graph(config)


def trainer_config(tmp_path, deployed, algorithm: Algorithm, train=None):
    case, graph, (train_file, test_file), _ = deployed
    cfg = {"graph": graph, "algorithm": algorithm.value, "task": "edit",
           "data": {"train": str(train or train_file), "test": str(test_file)},
           "steps": 1, "prompts_per_step": 1, "samples_per_prompt": 2,
           "sampler": {"sampler": "sde", "num_steps": 2, "noise_level": 0.7, "window": [0, 1],
                       "guidance_scale": CASES[case][5], **SIZE},
           "lora": {"rank": 2, "alpha": 4}, "nft": {"train_timesteps": 1},
           "pipeline": {"mode": "serial", "max_staleness": 1},
           "eval": {"every": 1, "num_prompts": 1, "samples_per_prompt": 1, "num_steps": 2},
           "run_dir": str(tmp_path / algorithm.value), "checkpoint_every": 100,
           "gallery": False}
    return load_trainer_config(cfg)


@pytest.mark.parametrize("algorithm", [Algorithm.NFT, Algorithm.FLOW_GRPO])
def test_an_edit_trains_through_handles_with_every_check(deployed, tmp_path, algorithm):
    """One step of the algorithm on edit rollouts from the graph: the start-up checks pass on
    prompt + source, the step's loss is finite, the policy's weights move, its rewards are the
    clip_directional scorer's and (FlowGRPO) the log-probs agree at version parity."""
    from trainer.loop import Trainer
    torch.manual_seed(0)
    trainer = Trainer(trainer_config(tmp_path, deployed, algorithm))
    before = [p.detach().clone() for p in trainer.learner.params]
    history = trainer.run()
    assert len(history) == 1
    rows = metric_rows(tmp_path / algorithm.value)
    checks = next(r for r in rows if "check_scheduler_step_max_diff" in r)
    print(f"{deployed[0]} {algorithm.value}: checks {checks}")
    assert checks["check_scheduler_step_max_diff"] <= 1e-5
    assert checks["check_lora_probe_max_diff"] <= 1e-4 < checks["check_lora_probe_effect"]
    [step] = train_steps(rows)
    print(f"{deployed[0]} {algorithm.value}: step {step}")
    assert math.isfinite(step["loss"]) and step["grad_norm"] > 0
    assert step["rows"] == 2
    assert any(k.startswith("reward_clip_directional/") for k in step), sorted(step)
    assert math.isfinite(step["reward_mean"])
    if algorithm is Algorithm.FLOW_GRPO:
        assert step["logprob_ratio_err_max"] <= 1e-4
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(trainer.learner.params,
                                                                    before))
    assert moved > 0


def test_edit_startup_checks_fail_on_purpose(deployed, tmp_path, monkeypatch):
    """A broken LoRA map and a flipped time convention fail their checks on prompt + source
    (StartupCheckError naming the field); a prompt file whose record lacks its source is a
    DatasetError naming file:line and `image` before any model loads; the graph's reward of an
    edit is clip_directional's of the decoded sample against its source, recomputed here."""
    from rewards.base import ScoreRequest
    from rewards.registry import ScorerKind, ScorerSpec, build_scorer
    from trainer.loop import Trainer
    case, _, (train_file, _), clip = deployed
    lines = train_file.read_text().splitlines()
    bad = train_file.parent / "no_source.jsonl"        # beside the sources it names
    record = {k: v for k, v in json.loads(lines[1]).items() if k != "image"}
    bad.write_text(f"{lines[0]}\n{json.dumps(record)}\n")
    with pytest.raises(DatasetError) as err:
        Trainer(trainer_config(tmp_path, deployed, Algorithm.FLOW_GRPO, train=bad))
    assert err.value.field == f"{bad}:2 image"

    trainer = Trainer(trainer_config(tmp_path, deployed, Algorithm.FLOW_GRPO))
    with pytest.raises(StartupCheckError) as err:
        trainer.startup.lora_map(publish_transform=swap_qk)
    assert err.value.field == "lora_map"

    trainer.publish_sampling()
    pending = trainer.submit(0)
    outputs, _ = trainer.collect(pending)
    family = trainer.family
    scorer = build_scorer(ScorerSpec(kind=ScorerKind.CLIP_DIRECTIONAL, params={"model": clip}))
    decoder = family.load_decoder("image_latent")
    image = next(a for a in family.io_spec.artifacts if a.name == "image")
    for request, out in zip(pending.requests, outputs):
        pixels = family.codec.decode("image_latent", decoder,
                                     out.artifacts["image_latent"].data, request.sampling)
        meta = tuple({"image": request.media[0].data, **request.metadata}
                     for _ in out.seeds)
        ours = scorer.score(ScoreRequest({"image": MediaArtifact(image, pixels)},
                                         (request.prompt.text,) * len(out.seeds), meta))
        theirs = torch.tensor(out.rewards.total, dtype=torch.float64)
        mine = torch.tensor(ours.scores[scorer.primary], dtype=torch.float64)
        print(f"{case}: graph rewards {theirs.tolist()}, recomputed {mine.tolist()}")
        assert torch.allclose(theirs, mine, atol=1e-4), (theirs, mine)

    monkeypatch.setattr(family.denoiser, "time_convention", TimeConvention.DATA_PROGRESS)
    with pytest.raises(StartupCheckError) as err:
        trainer.startup.time_convention()
    assert err.value.field == "adapter.time_convention"
    trainer.learners.close()
