"""MiniMax-H3 (tiny checkpoint) through the deployed graph, and per-modality advantages on it.

The graph (configs/minimax_h3_tiny.yaml with `ref2va` on and two latent-head scorers, one on
each stream) rolls out l2va (the last keyframe alone) and ref2va (two ordered references) through
handles, returning video + audio latents and decoded media equal to the same requests run in
process (tests/test_families_minimax_h3.py compares that path with the diffusers pipeline), and
over HTTP (`media` by role; a reference off its size is a 400 naming it).

Per-modality advantages (`advantage.streams`, trainer/algorithms/modality.py): a DiffusionNFT
step whose video stream is judged by the video scorer and whose audio stream by the audio one;
each stream's optimality probability is checked against an independent computation from the
scores (numpy: group mean, population std over the batch, clip, r = A / c / 2 + 1/2). In process
(embedded engine, the scorers called directly: default tier) and through the graph's handles
(integration tier)."""
from __future__ import annotations

import asyncio
import copy

import numpy as np
import pytest
import torch

from adapters.minimax_h3 import MiniMaxH3Family
from contract import (Algorithm, MediaRole, RewardReport, RolloutOutput, SamplerKind,
                      ScoreStatus, Task)
from tests.test_families_minimax_h3 import (LAST, REFERENCES, SIZE, contract_request,
                                            engine_rollout)

torch.set_num_threads(1)

APP = "minimax_h3_graph"
GRAPH = "configs/minimax_h3_tiny.yaml"
OPTIONS = {"max_sequence_length": 64, "ref2va": True, "reference_image_short_edge": 32}
STREAMS = {"video_latent": ["video_head"], "audio_latent": ["audio_head"]}
HIDDEN = 6


@pytest.fixture(scope="module")
def minimax_root(tiny_checkpoint):
    return tiny_checkpoint("minimax_h3")


@pytest.fixture(scope="module")
def family(minimax_root):
    return MiniMaxH3Family(minimax_root, OPTIONS)


@pytest.fixture(scope="module")
def models(family):
    from adapters.sample import LocalModels
    return LocalModels.load(family)


def write_head(path, channels: int, seed: int) -> str:
    """A latent head (rewards/latent.py) reading `channels` latent channels, seeded weights."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    save_file({"proj.weight": torch.randn(HIDDEN, channels, generator=g),
               "proj.bias": torch.randn(HIDDEN, generator=g),
               "out.weight": torch.randn(1, HIDDEN, generator=g),
               "out.bias": torch.zeros(1)}, str(path))
    return str(path)


def head_params(family, tmp_dir) -> dict[str, dict]:
    """scorer name -> its LatentHeadScorer params: video head over the video latent's C
    channels, audio head over the audio rows (2L of them, each Ca wide)."""
    layout = family.codec.layout(_sampling())
    return {"video_head": {"name": "video_head", "artifact": "video_latent",
                           "head_path": write_head(tmp_dir / "video.safetensors",
                                                   family.dims.latent_channels, 1)},
            "audio_head": {"name": "audio_head", "artifact": "audio_latent",
                           "head_path": write_head(tmp_dir / "audio.safetensors",
                                                   layout.audio_rows, 2)}}


def _sampling():
    from contract import SamplingSpec
    return SamplingSpec(sampler=SamplerKind.ODE, num_steps=3, noise_level=0.0,
                        guidance_scale=1.0, seeds=(0,), **SIZE)


def nft_settings():
    from trainer.config import SamplerSettings
    return SamplerSettings(sampler=SamplerKind.ODE, num_steps=3, noise_level=0.0,
                           guidance_scale=1.0, **SIZE)


def nft_config():
    from trainer.config import TrainerConfig
    return TrainerConfig(algorithm="nft", task="t2va", samples_per_prompt=3, prompts_per_step=2,
                         sampler=nft_settings(), lora={"rank": 4, "alpha": 8},
                         nft={"train_timesteps": 1, "adv_clip_max": 1.0},
                         advantage={"streams": STREAMS, "std": "global", "ddof": 0,
                                    "eps": 1e-4})


def expected_stream_values(scores: list[list[float]], eps: float, clip: float) -> np.ndarray:
    """Independent of trainer/algorithms: per prompt group the scores' deviation from the group
    mean over the population std of the whole batch (+ eps), clipped to +-clip, then DiffusionNFT's
    optimality probability A / clip / 2 + 1/2. scores: one list per group."""
    flat = np.array([s for group in scores for s in group], dtype=np.float64)
    std = flat.std()
    adv = np.concatenate([(np.array(g) - np.mean(g)) / (std + eps) for g in scores])
    return np.clip(adv, -clip, clip) / clip / 2 + 0.5


def check_stream_step(family, models, outputs, prompts, samplings, scores):
    """build_batch -> plan_update: each stream's values equal the independent computation from
    its own scorer's scores; then the NFT step runs and moves the adapter."""
    from trainer.learner import Learner
    from trainer.rollout_batch import build_batch
    from trainer.updates import UPDATES, plan_update
    cfg = nft_config()
    learner = Learner(family, copy.deepcopy(models.transformers), models.encoders, cfg.lora,
                      cfg.optimizer)
    batch = build_batch(learner, prompts, outputs, samplings)
    plan = plan_update(Algorithm.NFT, batch, cfg, torch.Generator().manual_seed(0))
    assert plan.values.shape == (6, 2)
    for k, (stream, [scorer]) in enumerate(STREAMS.items()):
        want = expected_stream_values(scores[scorer], cfg.advantage.eps, cfg.nft.adv_clip_max)
        np.testing.assert_allclose(plan.values[:, k].double().numpy(), want, rtol=0, atol=1e-5)
        assert np.abs(want - 0.5).max() > 0.05, (stream, want)      # a real signal
    # the two streams' advantages differ (two scorers, not one reward copied)
    assert not torch.allclose(plan.values[:, 0], plan.values[:, 1], atol=1e-3)
    before = [p.detach().clone() for p in learner.params]
    metrics = UPDATES[Algorithm.NFT](learner, batch, cfg, torch.Generator().manual_seed(0))
    assert metrics["grad_norm"] > 0 and np.isfinite(metrics["loss"]), metrics
    for stream, [scorer] in STREAMS.items():
        want = expected_stream_values(scores[scorer], cfg.advantage.eps, cfg.nft.adv_clip_max)
        adv = (want - 0.5) * 2 * cfg.nft.adv_clip_max                  # the clipped advantage
        assert metrics[f"adv_abs_mean_{stream}"] == pytest.approx(np.abs(adv).mean(), abs=1e-5)
    assert any(not torch.equal(a, b) for a, b in zip(before, learner.params))


def test_per_modality_nft_step_in_process(family, models, tmp_path):
    """Rollouts from the embedded engine, each stream scored by its own latent head called in
    process (the scorer the graph deploys), one DiffusionNFT step with separate streams."""
    from rewards.base import ScoreRequest
    from rewards.latent import LatentHeadScorer, LatentHeadScorerConfig
    from rollout.engine import EmbeddedEngine
    from rollout.engine_api import EngineRequest
    from rollout.lora import BASE_VERSION
    from trainer.config import PromptSource
    from trainer.prompts import captions, make_requests
    heads = {name: LatentHeadScorer(LatentHeadScorerConfig(**p))
             for name, p in head_params(family, tmp_path).items()}
    cfg = nft_config()
    prompts = family.conditioner.tokenize(captions(PromptSource.CLIPS, 2, 0))
    requests = make_requests(family, prompts, cfg.sampler, 3, 0, BASE_VERSION, task=Task.T2VA)
    engine = EmbeddedEngine(family, copy.deepcopy(models.transformers), models.media)

    async def go():
        return [await engine.generate(EngineRequest(
            r, family.conditioner.encode(models.encoders, [p]), None,
            ("video_latent", "audio_latent"), {}, BASE_VERSION))
            for r, p in zip(requests, prompts)]
    try:
        results = asyncio.run(go())
    finally:
        asyncio.run(engine.shutdown())
    outputs, scores = [], {name: [] for name in heads}
    for r, e in zip(requests, results):
        by_scorer, values = {}, {}
        for name, head in heads.items():
            out = head.score(ScoreRequest(artifacts=dict(e.latents), prompts=(r.prompt.text,) * 3,
                                          metadata=({},) * 3))
            by_scorer[name] = out
            values[name] = tuple(float(v) for v in out.scores["latent_reward"])
            scores[name].append(list(values[name]))
        total = tuple(sum(v) / 2 for v in zip(*values.values()))
        report = RewardReport(by_scorer, total, {n: 1.0 for n in heads}, values)
        outputs.append(RolloutOutput(r.request_id, dict(e.latents), e.trajectory,
                                     e.policy_version, r.sampling.seeds, rewards=report))
    check_stream_step(family, models, outputs, prompts, [r.sampling for r in requests], scores)


# ---- through the deployed graph (integration tier) ---------------------------------------------

@pytest.fixture(scope="module")
def deployed(ray_cluster, minimax_root, family, tmp_path_factory):
    import yaml
    from ray import serve

    from graph import build_app, delete_graph
    with open(GRAPH) as f:
        args = yaml.safe_load(f)["applications"][0]["args"]
    params = head_params(family, tmp_path_factory.mktemp("heads"))
    args["rollout"].update(weights_path=str(minimax_root), adapter_options=dict(OPTIONS))
    args["scorers"] = [{"name": name, "scorer": {"kind": "latent_head", "params": p},
                        "inputs": [p["artifact"]],
                        "reward": {"weight": 1.0, "policy": "required", "timeout_s": 300},
                        "stage": {"num_cpus": 0.125}} for name, p in params.items()]
    args.update(app_name=APP, policy_store=f"{APP}_store")
    handle = serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield {"handle": handle, "port": ray_cluster["http_port"]}
    delete_graph(args)


def test_l2va_and_ref2va_roll_out_through_handles(deployed, family, models):
    """Both new tasks through the graph return video + audio (latents and decoded media) equal to
    the same contract requests run in process, scored by both stream scorers."""
    from dataclasses import replace

    from deployments.client import RolloutClient
    wanted = ("video_latent", "audio_latent", "video", "audio")
    requests = [replace(contract_request(family, Task.L2VA, [(MediaRole.LAST_FRAME, LAST)],
                                         seeds=(5, 6)), request_id="l2va", requested_artifacts=wanted),
                replace(contract_request(family, Task.REF2VA,
                                         [(MediaRole.REFERENCE, r) for r in REFERENCES],
                                         seeds=(5, 6)), request_id="ref2va",
                        requested_artifacts=wanted)]
    outputs = RolloutClient(deployed["handle"]).rollout(requests)
    for request, out in zip(requests, outputs):
        art = {k: v.data for k, v in out.artifacts.items()}
        assert art["video"].shape == (2, 124, 3, 32, 64) and art["video"].dtype == torch.uint8
        assert art["audio"].shape == (2, 2, 165600) and art["audio"].dtype == torch.float32
        _, ours = engine_rollout(family, models, request)
        for name in ("video_latent", "audio_latent"):
            diff = (art[name] - ours[name]).abs().max().item()
            assert diff <= 1e-5, (request.task, name, diff)
        for name in STREAMS.values():
            assert out.rewards.by_scorer[name[0]].status == (ScoreStatus.OK,) * 2
    assert not torch.allclose(outputs[0].artifacts["video_latent"].data,
                              outputs[1].artifacts["video_latent"].data)


def test_per_modality_nft_step_through_handles(deployed, family, models):
    """t2va rollouts scored by the graph's two stream scorers, fetched through handles; one
    DiffusionNFT step with per-stream advantages, each equal to the independent computation
    from the scores the graph returned."""
    from deployments.client import RolloutClient
    from rollout.lora import BASE_VERSION
    from trainer.config import PromptSource
    from trainer.prompts import captions, make_requests
    cfg = nft_config()
    prompts = family.conditioner.tokenize(captions(PromptSource.CLIPS, 2, 0))
    requests = make_requests(family, prompts, cfg.sampler, 3, 0, None, task=Task.T2VA)
    outputs = RolloutClient(deployed["handle"]).rollout(requests)
    scores = {name: [list(o.rewards.by_scorer[name].scores["latent_reward"]) for o in outputs]
              for [name] in STREAMS.values()}
    assert all(o.policy_version == BASE_VERSION for o in outputs)
    check_stream_step(family, models, outputs, prompts, [r.sampling for r in requests], scores)


def test_ref2va_and_l2va_over_http(deployed):
    """POST /rollout with `media` by role: ref2va's references in order and l2va's last keyframe
    answer 200 with both streams; a reference off the configured size is a 400 naming it,
    before any stage runs."""
    import httpx

    from tests.test_families_minimax_h3 import _b64_png
    url = f"http://127.0.0.1:{deployed['port']}/{APP}/rollout"
    base = {"prompts": ["a red ball bounces"], "samples_per_prompt": 1, "seed": 3,
            "num_steps": 3, "sampler": "ode", "noise_level": 0.0, "guidance_scale": 1.0,
            "artifacts": ["video_latent", "audio_latent"], **SIZE}
    refs = [_b64_png(r) for r in REFERENCES]
    for extra in ({"task": "ref2va", "media": [{"reference": refs}]},
                  {"task": "l2va", "media": [{"last_frame": _b64_png(LAST)}]}):
        reply = httpx.post(url, json=base | extra, timeout=600)
        assert reply.status_code == 200, reply.text
        [sample] = reply.json()["results"][0]["samples"]
        shapes = {a["name"]: a["shape"] for a in sample["artifacts"]}
        assert shapes == {"video_latent": [8, 37, 2, 4], "audio_latent": [414, 8]}, shapes
    bad = _b64_png(torch.zeros(3, 32, 40, dtype=torch.uint8))
    reply = httpx.post(url, json=base | {"task": "ref2va", "media": [{"reference": [refs[0], bad]}]},
                       timeout=60)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["field"] == "media.reference[1]", reply.text
