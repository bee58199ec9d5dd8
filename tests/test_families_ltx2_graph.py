"""The tiny LTX-2 checkpoint through the whole system: the Serve graph of configs/ltx2_tiny.yaml
(checkpoint path and CLAP snapshot given at run time) answering HTTP with an MP4 (H.264 + AAC)
preview probed back, AV-sync / CLAP / ImageBind scoring real decoded video + audio, first-frame
and first/last-frame rollouts through handles keeping their condition latents, the object store
back at its baseline after a batch of video rollouts, and short DiffusionNFT and FlowGRPO runs
through handles on T2VA and FL2VA with every start-up check on."""
from __future__ import annotations

import base64
import io
import json
import re
import time

import httpx
import numpy as np
import pytest
import torch
import yaml

from contract import (Algorithm, MediaInput, MediaRole, Modality, RolloutRequest, SamplerKind,
                      SamplingSpec, ScoreStatus, Task)
from tests.trainer_helpers import checked_steps
from trainer.config import load_trainer_config

pytestmark = pytest.mark.timeout(1200)

GRAPH = "configs/ltx2_tiny.yaml"
APP = "ltx2_graph"
SIZE = {"height": 64, "width": 96, "num_frames": 9}            # 2 latent frames, 25 fps
SCORERS = ("av_sync", "clap", "imagebind")
_gen = torch.Generator().manual_seed(11)
FIRST = torch.randint(0, 256, (3, 64, 96), generator=_gen, dtype=torch.uint8)
LAST = torch.randint(0, 256, (3, 64, 96), generator=_gen, dtype=torch.uint8)


def graph_args(root, clap_dir) -> dict:
    with open(GRAPH) as f:
        args = yaml.safe_load(f)["applications"][0]["args"]
    for spec in args["scorers"]:
        if spec["name"] == "clap":
            spec["scorer"]["params"]["model_dir"] = str(clap_dir)
    args["rollout"]["weights_path"] = str(root)
    args.update(app_name=APP, policy_store=f"{APP}_store")
    return args


@pytest.fixture(scope="module")
def deployed(ray_cluster, tiny_checkpoint, tmp_path_factory):
    from ray import serve

    from graph import build_app, delete_graph
    from testing.snapshots import write_clap_dir
    root = tiny_checkpoint("ltx2")
    args = graph_args(root, write_clap_dir(tmp_path_factory.mktemp("clap_tiny")))
    handle = serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield {"handle": handle, "args": args, "root": root, "port": ray_cluster["http_port"]}
    delete_graph(args)


def probe_mp4(url: str) -> dict:
    import av
    assert url.startswith("data:video/mp4;base64,")
    with av.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        frames = sum(1 for _ in container.decode(video=0))
        return {"streams": len(container.streams), "video_codec": video.codec_context.name,
                "fps": float(video.average_rate), "frames": frames,
                "size": (video.codec_context.height, video.codec_context.width),
                "audio_codec": audio.codec_context.name, "rate": audio.codec_context.sample_rate,
                "channels": audio.codec_context.layout.nb_channels,
                "duration_s": container.duration / 1e6}


def check_scores(report, n: int) -> None:
    assert set(report.by_scorer) == set(SCORERS)
    for name, key in (("av_sync", "av_sync"), ("clap", "clap_score"),
                      ("imagebind", "audio_video")):
        scored = report.by_scorer[name]
        assert scored.status == (ScoreStatus.OK,) * n, (name, scored.reasons)
        assert all(np.isfinite(v) for v in scored.scores[key]), (name, scored.scores)


def test_http_rollout_with_mp4_previews_and_scores(deployed):
    url = f"http://127.0.0.1:{deployed['port']}/{APP}/rollout"
    body = {"prompts": ["a red ball bouncing with loud beeps"], "negative_prompts": ["blurry"],
            "samples_per_prompt": 2, "seed": 3, "num_steps": 3, "sampler": "ode",
            "noise_level": 0.0, "guidance_scale": 3.0, "include_media": True, **SIZE}
    reply = httpx.post(url, json=body, timeout=600)
    assert reply.status_code == 200, reply.text
    [result] = reply.json()["results"]
    for sample in result["samples"]:
        shapes = {a["name"]: a["shape"] for a in sample["artifacts"]}
        assert shapes["video"] == [9, 3, 64, 96] and shapes["audio"] == [2, 7920]
        assert shapes["video_latent"] == [4, 2, 2, 3] and shapes["audio_latent"] == [2, 9, 4]
        info = probe_mp4(sample["media"]["video"])
        assert info | {"duration_s": 0} == {
            "streams": 2, "video_codec": "h264", "fps": 25.0, "frames": 9, "size": (64, 96),
            "audio_codec": "aac", "rate": 24000, "channels": 2, "duration_s": 0}
        assert abs(info["duration_s"] - 9 / 25) < 0.05, info           # 0.36 s of clip
        assert sample["media"]["audio"].startswith("data:audio/wav;base64,")
        assert set(sample["scores"]) == set(SCORERS)
        assert all(s["status"] == "ok" for s in sample["scores"].values()), sample["scores"]
    for field, value in (("num_frames", 10), ("width", 80)):         # refused, never rounded
        bad = httpx.post(url, json=body | {field: value}, timeout=60)
        error = bad.json()["error"]
        assert bad.status_code == 400 and error["field"] == f"sampling.{field}", bad.text


def conditioned(family, task: Task, media, seeds=(5, 6)) -> RolloutRequest:
    bundle = family.conditioner.tokenize(["a blue cube sliding to the right"], ["blurry"])[0]
    return RolloutRequest(prompt=bundle, task=task, media=media,
                          sampling=SamplingSpec(sampler=SamplerKind.SDE, num_steps=3,
                                                noise_level=0.7, guidance_scale=3.0,
                                                seeds=seeds, **SIZE))


def store_usage() -> tuple[float, int]:
    """(MiB, objects) the object store holds, as `ray memory --stats-only` reports them."""
    import ray
    from ray._private.internal_api import memory_summary
    text = memory_summary(ray.get_runtime_context().gcs_address, stats_only=True)
    found = re.search(r"Plasma memory usage (\d+) MiB, (\d+) objects", text)
    assert found, text
    return float(found.group(1)), int(found.group(2))


def test_conditions_through_handles_and_the_store_back_at_baseline(deployed):
    import gc

    from adapters.registry import get_family
    from deployments.client import RolloutClient, materialize
    args, root = deployed["args"], deployed["root"]
    family = get_family("ltx2", root, args["rollout"]["adapter_options"])
    client = RolloutClient(deployed["handle"])
    frames = (MediaInput(Modality.IMAGE, MediaRole.FIRST_FRAME, FIRST),
              MediaInput(Modality.IMAGE, MediaRole.LAST_FRAME, LAST))
    client.rollout([conditioned(family, Task.T2VA, None)])           # warm every stage
    gc.collect()
    baseline = store_usage()
    i2va, fl2va = client.rollout([conditioned(family, Task.I2VA, frames[:1]),
                                  conditioned(family, Task.FL2VA, frames)])
    vae = family.load("vae")
    codec = family.codec
    sampling = conditioned(family, Task.I2VA, None).sampling
    first = codec.frame_latent(vae, FIRST, sampling, MediaRole.FIRST_FRAME, codec.image_crf)
    for out in (i2va, fl2va):                  # the first latent frame is the condition, held
        latent = out.artifacts["video_latent"].data
        torch.testing.assert_close(latent[:, :, :1], first.expand(2, -1, -1, -1, -1),
                                   rtol=0, atol=1e-5)
        assert not torch.allclose(latent[:, :, 1:2], first)
        check_scores(out.rewards, 2)
        mask = out.trajectory.frozen_mask                           # not scored by log-probs
        assert mask is not None and torch.isfinite(out.trajectory.log_probs).all()
    # FL2VA's state carries the keyframe tokens; the latent artifact has the video frames only
    assert fl2va.trajectory.latents.shape[-1] > i2va.trajectory.latents.shape[-1]
    assert fl2va.artifacts["video_latent"].data.shape == i2va.artifacts["video_latent"].data.shape
    # a batch of video rollouts: held while in flight, released once fetched
    batch = [conditioned(family, Task.T2VA, None, seeds=(20 + 2 * k, 21 + 2 * k))
             for k in range(6)]
    results = deployed["handle"].rollout.remote(batch).result()   # handles: the graph holds
    held = store_usage()
    assert held[1] >= baseline[1] + len(batch), (baseline, held)   # decoded video each at least
    outputs = [materialize(r) for r in results]                     # fetched by the caller...
    assert deployed["handle"].release.remote([r.request_id for r in results]).result() > 0
    del outputs, results, i2va, fl2va, out, latent, mask            # ...who then drops them
    gc.collect()
    deadline = time.monotonic() + 30
    while store_usage()[1] > baseline[1] and time.monotonic() < deadline:
        time.sleep(0.5)
    after = store_usage()
    if after[1] > baseline[1]:
        import ray
        from ray._private.internal_api import memory_summary
        print(memory_summary(ray.get_runtime_context().gcs_address, line_wrap=False))
    assert after[1] <= baseline[1] and after[0] <= baseline[0] + 1, (baseline, after)


def trainer_config(deployed, tmp_path, algorithm: Algorithm, task: Task | None, data=None):
    cfg = {"graph": deployed["args"], "algorithm": algorithm.value, "prompts": "clips",
           "steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2,
           "sampler": {"sampler": "sde", "num_steps": 3, "noise_level": 0.7, "window": [0, 2],
                       "guidance_scale": 3.0, **SIZE},
           "lora": {"rank": 2, "alpha": 4}, "nft": {"train_timesteps": 2},
           "pipeline": {"mode": "serial", "max_staleness": 1},
           "eval": {"every": 2, "num_prompts": 2, "samples_per_prompt": 1, "num_steps": 3},
           "run_dir": str(tmp_path / algorithm.value), "checkpoint_every": 10,
           "gallery": False}
    if task is not None:
        cfg["task"] = task.value
    if data is not None:
        cfg["data"] = data
    return load_trainer_config(cfg)


def frame_prompts(tmp_path) -> dict:
    """A .jsonl prompt file whose records carry first / last frame PNGs at the sampling size."""
    from PIL import Image
    lines = []
    for i, text in enumerate(["a red ball bouncing with beeps", "a green square with a hum",
                              "a blue cube sliding with clicks"]):
        paths = {}
        for role, frame in (("first_frame", FIRST), ("last_frame", LAST)):
            image = torch.roll(frame, shifts=7 * i, dims=2).permute(1, 2, 0).numpy()
            path = tmp_path / f"{role}_{i}.png"
            Image.fromarray(image).save(path)
            paths[role] = str(path)
        lines.append(json.dumps({"prompt": text, **paths}))
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    return {"train": str(tmp_path / "train.jsonl"), "test": str(tmp_path / "train.jsonl")}


@pytest.mark.parametrize("algorithm,task", [(Algorithm.NFT, Task.T2VA),
                                            (Algorithm.FLOW_GRPO, Task.T2VA),
                                            (Algorithm.NFT, Task.FL2VA),
                                            (Algorithm.FLOW_GRPO, Task.FL2VA)])
def test_short_runs_with_every_check(deployed, tmp_path, algorithm, task):
    from trainer.loop import Trainer
    torch.manual_seed(0)
    data = frame_prompts(tmp_path) if task is Task.FL2VA else None
    trainer = Trainer(trainer_config(deployed, tmp_path, algorithm, task, data))
    before = {k: v.clone() for k, v in trainer.learner.export()[0].items()}
    assert len(trainer.run()) == 2
    steps, checks = checked_steps(tmp_path / algorithm.value)
    print(f"ltx2 {task.value} {algorithm.value}: scheduler step diff "
          f"{checks['check_scheduler_step_max_diff']:.3g}, LoRA probe diff "
          f"{checks['check_lora_probe_max_diff']:.3g}, log-prob ratio err "
          f"{[r.get('logprob_ratio_err_max') for r in steps]}")
    for r in steps:
        assert r["rows"] == 4 and np.isfinite(r["reward_mean"])
        if "logprob_ratio_err_max" in r:     # the learner's log-probs equal the rollout's,
            assert r["logprob_ratio_err_max"] <= 1e-4    # condition entries left out of both
    after = trainer.learner.export()[0]
    assert any(not torch.equal(before[k], after[k]) for k in after)   # the LoRA was trained
