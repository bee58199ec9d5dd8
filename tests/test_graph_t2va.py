"""tiny_t2va through the graph (configs/tiny_t2va.yaml) with AV-sync (required), CLAP (tiny local
snapshot) and ImageBind (tiny, random init) scoring together: T2VA and FL2VA requests, artifacts
as the contract declares them, rewards per scorer with statuses, FL2VA condition frames kept."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from contract import (MediaInput, MediaRole, Modality, Representation, RolloutRequest,
                      SamplingSpec, ScoreStatus, Task)

pytestmark = pytest.mark.timeout(600)

APP = "graph_t2va"
SCORERS = ("av_sync", "clap", "imagebind")
ARTIFACTS = ("video_latent", "audio_latent", "video", "audio")


def t2va_config(clap_dir: str) -> dict:
    """The shipped config's args, with the three scorers of this test and a local CLAP dir."""
    with open("configs/tiny_t2va.yaml") as f:
        args = yaml.safe_load(f)["applications"][0]["args"]
    scorers = []
    for spec in args["scorers"]:
        if spec["name"] not in SCORERS:
            continue
        if spec["name"] == "clap":
            spec["scorer"]["params"]["model_dir"] = clap_dir
        scorers.append(spec)
    args.update(app_name=APP, scorers=scorers, policy_store="graph_t2va_store",
                rollout_stage={"num_cpus": 0.5})
    return args


@pytest.fixture(scope="module")
def t2va_graph(ray_cluster, tmp_path_factory):
    from ray import serve

    from graph import build_app, delete_graph
    from testing.snapshots import write_clap_dir
    clap_dir = write_clap_dir(tmp_path_factory.mktemp("clap_tiny"))
    config = t2va_config(str(clap_dir))
    handle = serve.run(build_app(config), name=APP, route_prefix=None)
    yield handle
    delete_graph(config)


@pytest.fixture(scope="module")
def model():
    from adapters.registry import get_family
    family = get_family("tiny_t2va")
    return family, family.load_decoder("video_latent")


@pytest.fixture(scope="module")
def clip():
    """A synthetic clip (caption + rendered frames) from the data the model was trained on."""
    from synthetic.clips import caption, render, sample_specs
    spec = sample_specs(1, seed=7)[0]
    return caption(spec), torch.from_numpy(np.asarray(render(spec).video))


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = ((a.float() - b.float()) ** 2).mean().item()
    return 10.0 * np.log10(255.0 ** 2 / max(mse, 1e-10))


def t2va_request(adapter, text: str, task: Task, media=None) -> RolloutRequest:
    return RolloutRequest(prompt=adapter.conditioner.tokenize([text])[0], task=task, media=media,
                          requested_artifacts=ARTIFACTS,
                          sampling=SamplingSpec(num_steps=6, seeds=(3, 4), num_frames=8))


def check_rewards(out) -> None:
    report = out.rewards
    assert set(report.by_scorer) == set(SCORERS)
    primaries = {"av_sync": "av_sync", "clap": "clap_score", "imagebind": "audio_video"}
    weighted = [0.0, 0.0]
    for name, key in primaries.items():
        scored = report.by_scorer[name]
        assert scored.status == (ScoreStatus.OK, ScoreStatus.OK), (name, scored.reasons)
        assert all(np.isfinite(v) for v in scored.scores[key]), (name, scored.scores)
        for i in range(2):
            weighted[i] += report.weights[name] * scored.scores[key][i]
    assert report.weights == {"av_sync": 1.0, "clap": 0.05, "imagebind": 0.05}
    assert report.total == pytest.approx([w / 1.1 for w in weighted])


def test_t2va_and_fl2va_through_the_graph_with_three_scorers(t2va_graph, model, clip):
    from adapters.tiny_t2i import vae_encode
    from deployments.client import RolloutClient
    adapter, components = model
    text, video = clip                                                 # video: uint8 (T, 3, H, W)
    first, last = video[0].contiguous(), video[-1].contiguous()
    media = (MediaInput(Modality.IMAGE, MediaRole.FIRST_FRAME, first),
             MediaInput(Modality.IMAGE, MediaRole.LAST_FRAME, last))
    t2va, fl2va = RolloutClient(t2va_graph).rollout([
        t2va_request(adapter, text, Task.T2VA),
        t2va_request(adapter, text, Task.FL2VA, media=media)])

    for out in (t2va, fl2va):
        assert set(out.artifacts) == set(ARTIFACTS) and out.seeds == (3, 4)
        vid, aud = out.artifacts["video"], out.artifacts["audio"]
        assert vid.spec.representation == Representation.DECODED and vid.data.dtype == torch.uint8
        assert tuple(vid.data.shape) == (2, 8, 3, 32, 32) and vid.fps == 8.0      # B T C H W
        assert aud.data.dtype == torch.float32 and tuple(aud.data.shape) == (2, 1, 16000)  # B C T
        assert aud.sample_rate == 16000 and aud.data.abs().max() <= 1.0
        assert tuple(out.artifacts["video_latent"].data.shape) == (2, 4, 8, 8, 8)
        assert tuple(out.artifacts["audio_latent"].data.shape) == (2, 8, 100)
        assert out.artifacts["video_latent"].spec.representation == Representation.LATENT
        assert out.trajectory.latents.dtype == torch.float32
        check_rewards(out)

    # FL2VA: the first/last latent frames are the VAE latents of the condition frames (frozen)
    cond = vae_encode(components["video_vae"], torch.stack([first, last]))
    latent = fl2va.artifacts["video_latent"].data                      # (B, C, T, h, w)
    for b in range(2):
        torch.testing.assert_close(latent[b, :, 0], cond[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(latent[b, :, -1], cond[1], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(latent[:, :, 1], latent[:, :, 0])       # the rest is generated
    # ...so the decoded end frames match the conditions far better than the unconditioned clip's
    fl_video, t_video = fl2va.artifacts["video"].data, t2va.artifacts["video"].data
    for b in range(2):
        fl_first, fl_last = psnr(fl_video[b, 0], first), psnr(fl_video[b, -1], last)
        assert fl_first > 20.0 and fl_last > 20.0, (fl_first, fl_last)
        assert fl_first > psnr(t_video[b, 0], first) + 3.0
