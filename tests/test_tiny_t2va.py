"""tiny_t2va: shipped weights, artifacts, inference form, time convention, tokens, FL2VA, pretraining."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from adapters.registry import get_family
from adapters.sample import LocalModels, generate
from adapters.sample_clip import write_mp4
from adapters.tiny_t2va import SHIPPED_WEIGHTS, TinyT2VAFamily
from contract import (InvalidRequestError, MediaArtifact, MediaRole, SamplingSpec, TimeConvention,
                      collect_artifacts)
from diffusion.samplers import ode_step
from diffusion.step import Guidance, predict_velocity
from synthetic.clips import caption, render, sample_specs


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    family = TinyT2VAFamily()
    return family, LocalModels.load(family)


@pytest.fixture(scope="module")
def data(model):
    family, comp = model
    codec = family.codec
    specs = sample_specs(4, seed=123)
    clips = [render(s) for s in specs]
    video = torch.from_numpy(np.stack([c.video for c in clips]))
    audio = torch.from_numpy(np.stack([c.audio for c in clips]))
    with torch.no_grad():
        x0 = codec.pack(codec.encode_video(comp.decoders["video_latent"]["video_vae"], video),
                        codec.encode_audio(comp.decoders["audio_latent"]["audio_vae"], audio))
    return [caption(s) for s in specs], video, x0


def _cond(family, comp, prompts):
    return family.conditioner.encode(comp.encoders, family.conditioner.tokenize(prompts))


def test_registered_and_shipped_artifacts_pass_the_contract(model, data, tmp_path):
    family, comp = model
    assert isinstance(get_family("tiny_t2va"), TinyT2VAFamily)
    size = sum(p.stat().st_size for p in SHIPPED_WEIGHTS.rglob("*") if p.is_file())
    assert size < 8.5e6
    prompts, _, _ = data
    out = generate(family, comp, prompts[:2], [0, 1], num_steps=4)
    produced = [MediaArtifact(family.io_spec[name], out[name]) for name in family.io_spec.defaults]
    arts = collect_artifacts(family.io_spec, family.io_spec.defaults, produced)
    assert arts["video"].data.shape == (2, 8, 3, 32, 32) and arts["video"].data.dtype == torch.uint8
    assert arts["audio"].data.shape == (2, 1, 16000) and arts["audio"].fps is None
    assert arts["audio"].sample_rate == 16000 and arts["video"].fps == 8.0
    assert arts["video_latent"].data.shape == (2, 4, 8, 8, 8)
    path = tmp_path / "clip.mp4"
    write_mp4(path, out["video"][0].numpy(), 8.0, out["audio"][0].numpy(), 16000)
    import av
    with av.open(str(path)) as c:
        assert [s.type for s in c.streams] == ["video", "audio"]
        assert sum(1 for _ in c.decode(video=0)) == 8


def test_wrong_sampling_size_is_refused(model):
    family, _ = model
    with pytest.raises(InvalidRequestError) as err:
        family.codec.state_shape(SamplingSpec(seeds=(0,), num_frames=1))
    assert err.value.field == "sampling.num_frames"


def test_training_form_equals_inference_form(model, data):
    family, comp = model
    prompts, _, x0 = data
    transformer = comp.transformers["transformer"]
    infer = family.to_inference_form(transformer)
    from adapters.inference_form import ShardedLinear
    assert infer.blocks[0].attn.to_q is None and infer.blocks[0].attn.to_qkv is not None
    assert isinstance(infer.blocks[0].ff.net[0].proj, ShardedLinear)
    assert transformer.blocks[0].attn.to_q is not None      # the training form is untouched
    cond = _cond(family, comp, prompts)
    x = 0.5 * x0 + 0.5 * torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
    sigma = torch.full((x.shape[0],), 0.5)
    flags = {"frame_flags": family.codec.frame_flags([MediaRole.FIRST_FRAME,
                                                      MediaRole.LAST_FRAME]).expand(4, -1)}
    with torch.no_grad():
        for m in (None, flags):
            a = predict_velocity(family.denoiser, {"transformer": transformer}, x, sigma, cond,
                                 Guidance.none(4), m)
            b = predict_velocity(family.denoiser, {"transformer": infer}, x, sigma, cond,
                                 Guidance.none(4), m)
            assert (a - b).abs().max() <= 1e-5 and a.abs().mean() > 0.1


def test_time_convention_step_and_flip(model, data):
    family, comp = model
    denoiser = family.denoiser
    assert denoiser.time_convention == TimeConvention.DATA_PROGRESS
    prompts, _, x0 = data
    cond = _cond(family, comp, prompts)
    models = comp.transformers
    sigma, sigma_next = torch.full((4,), 0.6), torch.full((4,), 0.5)
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    x = (1 - 0.6) * x0 + 0.6 * eps

    class NoiseLevel:                   # the same model read in the wrong convention
        time_convention = TimeConvention.NOISE_LEVEL
        model_time_scale = 1000.0
        forward = staticmethod(denoiser.forward)

    with torch.no_grad():
        v = predict_velocity(denoiser, models, x, sigma, cond, Guidance.none(4))
        step = ode_step(x, v, sigma, sigma_next).prev_sample
        # independent definition: data-progress time t = 1000 (1 - sigma), output points to data
        raw = denoiser.forward(models, x, sigma, 1000.0 * (1.0 - sigma), cond, None, None)
        manual = x + (0.5 - 0.6) * (-raw)
        assert torch.allclose(step, manual, atol=1e-6)
        # without the flip (declaring NOISE_LEVEL) the step differs and denoising breaks
        v_wrong = predict_velocity(NoiseLevel(), models, x, sigma, cond, Guidance.none(4))
        wrong = ode_step(x, v_wrong, sigma, sigma_next).prev_sample
    assert (wrong - step).abs().mean() > 0.1
    err_right = ((x - 0.6 * v) - x0).pow(2).mean()          # x0 estimate = x - sigma v
    err_wrong = ((x - 0.6 * v_wrong) - x0).pow(2).mean()
    assert err_right < 0.5 * err_wrong, (err_right, err_wrong)


def test_token_ids_reach_the_encoder_unchanged(model, data):
    family, comp = model
    prompts, _, _ = data
    bundles = family.conditioner.tokenize(prompts)      # the dataset's ids, tokenized once
    seen = []
    hook = comp.encoders["minilm"].register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append((kwargs["input_ids"], kwargs["attention_mask"])),
        with_kwargs=True)
    try:
        family.conditioner.encode(comp.encoders, bundles)
    finally:
        hook.remove()
    ids, mask = seen[0]
    for i, bundle in enumerate(bundles):
        assert ids[i][mask[i].bool()].tolist() == list(bundle.token_ids)
    assert bundles[0].token_ids == tuple(family.conditioner.tokenizer(prompts[0])["input_ids"])


def test_fl2va_keeps_condition_latents(model, data):
    family, comp = model
    prompts, video, _ = data
    media = {MediaRole.FIRST_FRAME: video[:2, 0], MediaRole.LAST_FRAME: video[:2, -1]}
    sampling = SamplingSpec(seeds=(0, 1), num_frames=8)
    condition = family.codec.encode_media(comp.media, sampling, media)
    frames = family.codec.encode_frames(comp.media["video_vae"], media)
    out = generate(family, comp, prompts[:2], [0, 1], num_steps=4, media=media)
    lat = out["video_latent"]
    assert torch.equal(lat[:, :, 0], frames[MediaRole.FIRST_FRAME])
    assert torch.equal(lat[:, :, -1], frames[MediaRole.LAST_FRAME])
    assert not torch.equal(lat[:, :, 1], lat[:, :, 0])
    # the frozen entries are exactly the two condition frames of the video latent
    video_mask, audio_mask = family.codec.unpack(condition.frozen.mask.float())
    assert video_mask[0, :, [0, 7]].all() and not video_mask[0, :, 1:7].any()
    assert not audio_mask.any()
    assert condition.inputs["frame_flags"].tolist() == [[True] + [False] * 6 + [True]]
    with pytest.raises(InvalidRequestError):
        family.codec.encode_media(comp.media, sampling, {MediaRole.REFERENCE: video[:1, 0]})


def test_pretrain_runs_and_loss_goes_down(tmp_path):
    from scripts import pretrain_t2va
    report = pretrain_t2va.main(["--out", str(tmp_path), "--clips", "16",
                                 "--video-vae-steps", "20", "--audio-vae-steps", "20",
                                 "--dit-steps", "30", "--vae-batch", "4", "--dit-batch", "8",
                                 "--warmup", "5"])
    for stage in ("video_vae", "audio_vae", "dit"):
        assert report["final_loss"][stage] < report["first_loss"][stage], stage
    assert (tmp_path / "loss_curves.png").is_file()
    assert json.loads((tmp_path / "train_report.json").read_text())["args"]["dit_steps"] == 30
    reloaded = TinyT2VAFamily(tmp_path)       # what it wrote loads back
    reloaded.load_transformers()
    reloaded.load_decoder("audio_latent")
