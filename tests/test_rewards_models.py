"""CLIP / CLAP / ImageBind scorers on tiny real architectures loaded through their real loaders."""
from __future__ import annotations

import math

import pytest
import torch

from contract import (ArtifactSpec, ConfigError, InvalidRequestError, MediaArtifact,
                      MediaFormatError, ScoreStatus)
from rewards.base import Scorer, ScoreRequest
from rewards.fbank import kaldi_fbank, mel_filterbank

torch.set_num_threads(1)

IMAGE = ArtifactSpec("image", "image", "decoded", "CHW", source="image_latent")
VIDEO = ArtifactSpec("video", "video", "decoded", "TCHW", source="video_latent", fps=8.0)
AUDIO = ArtifactSpec("audio", "audio", "decoded", "CT", source="audio_latent", sample_rate=16000)
LATENT = ArtifactSpec("image", "image", "latent", "latent:CHW")

TINY_IMAGEBIND = dict(video_frames=2, kernel_size=(2, 14, 14), out_embed_dim=32,
                      vision_embed_dim=32, vision_num_blocks=1, vision_num_heads=2,
                      audio_embed_dim=32, audio_num_blocks=1, audio_num_heads=2,
                      audio_num_mel_bins=128, audio_target_len=204,
                      text_embed_dim=32, text_num_blocks=1, text_num_heads=2,
                      depth_embed_dim=16, depth_num_blocks=1, depth_num_heads=2,
                      thermal_embed_dim=16, thermal_num_blocks=1, thermal_num_heads=2,
                      imu_embed_dim=16, imu_num_blocks=1, imu_num_heads=2)
PROMPTS = ("a red square", "a dog barking", "a green circle")


def _media(seed: int = 0, batch: int = 3):
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(16000 * 2) / 16000.0
    tones = torch.stack([torch.sin(2 * math.pi * f * t) for f in (220.0, 440.0, 880.0)][:batch])
    return {
        "image": MediaArtifact(IMAGE, torch.randint(0, 256, (batch, 3, 48, 80), generator=g,
                                                    dtype=torch.uint8)),
        "video": MediaArtifact(VIDEO, torch.randint(0, 256, (batch, 8, 3, 32, 32), generator=g,
                                                    dtype=torch.uint8)),
        "audio": MediaArtifact(AUDIO, (0.5 * tones[:, None] + 0.05 * torch.randn(
            batch, 2, t.numel(), generator=g)).float()),
    }


def _slice(arts, i):
    return {k: MediaArtifact(a.spec, a.data[i:i + 1], a.metadata) for k, a in arts.items()}


@pytest.fixture(scope="module")
def clip_image(tmp_path_factory):
    from rewards.clip import ClipScorer, ClipScorerConfig
    from testing.snapshots import write_clip_dir
    model = write_clip_dir(tmp_path_factory.mktemp("clip"))
    return ClipScorer(ClipScorerConfig(model=model))


@pytest.fixture(scope="module")
def clip_video(clip_image):
    from rewards.clip import ClipScorer, ClipScorerConfig
    return ClipScorer(ClipScorerConfig(name="clip_video", model=clip_image.config.model,
                                       artifact="video", modality="video", num_frames=4))


@pytest.fixture(scope="module")
def clap(tmp_path_factory):
    from rewards.clap import ClapScorer, ClapScorerConfig
    from testing.snapshots import write_clap_dir
    return ClapScorer(ClapScorerConfig(model_dir=write_clap_dir(tmp_path_factory.mktemp("clap"))))


@pytest.fixture(scope="module")
def imagebind():
    pytest.importorskip("einops", reason="ImageBind extra not installed: " + _hint())
    from rewards.imagebind import ImageBindScorer, ImageBindScorerConfig
    try:
        return ImageBindScorer(ImageBindScorerConfig(
            pairs=("audio_video", "text_video", "text_audio"), random_init=True,
            dims=TINY_IMAGEBIND))
    except ConfigError as e:
        if e.field == "imagebind.package":
            pytest.skip(f"ImageBind extra not installed: {e.message}")
        raise


def _hint():
    from rewards.imagebind import INSTALL_HINT
    return INSTALL_HINT


SCORERS = ["clip_image", "clip_video", "clap", "imagebind"]


@pytest.mark.parametrize("fixture", SCORERS)
def test_shapes_range_and_protocol(fixture, request):
    scorer = request.getfixturevalue(fixture)
    assert isinstance(scorer, Scorer)
    out = scorer.score(ScoreRequest(_media(), PROMPTS))
    assert out.scorer == scorer.name and out.batch_size == 3
    assert out.status == (ScoreStatus.OK,) * 3 and out.reasons == (None,) * 3
    assert scorer.primary in out.scores
    for key, vals in out.scores.items():
        assert len(vals) == 3 and all(math.isfinite(v) for v in vals)
        lo = -1.0 if key.endswith("cosine") else 0.0
        assert all(lo - 1e-6 <= v <= 1.0 + 1e-6 for v in vals), (key, vals)
    # unit score is the documented map of the cosine
    cos_key = "cosine" if "cosine" in out.scores else f"{scorer.primary}_cosine"
    for c, u in zip(out.scores[cos_key], out.scores[scorer.primary]):
        assert u == pytest.approx((c + 1) / 2, abs=1e-6)
    # distinct inputs give distinct scores (the model actually reads the media)
    assert len({round(v, 6) for v in out.scores[scorer.primary]}) == 3


@pytest.mark.parametrize("fixture", SCORERS)
def test_deterministic_and_batch_equals_single(fixture, request):
    scorer = request.getfixturevalue(fixture)
    arts = _media()
    a = scorer.score(ScoreRequest(arts, PROMPTS))
    b = scorer.score(ScoreRequest(arts, PROMPTS))
    assert a.scores == b.scores
    for i in range(3):
        single = scorer.score(ScoreRequest(_slice(arts, i), PROMPTS[i:i + 1]))
        for key, vals in a.scores.items():
            assert single.scores[key][0] == pytest.approx(vals[i], abs=1e-5), key


def test_clip_prompt_changes_score(clip_image):
    arts = _media()
    a = clip_image.score(ScoreRequest(arts, PROMPTS)).scores["cosine"]
    b = clip_image.score(ScoreRequest(arts, ("a purple hexagon",) * 3)).scores["cosine"]
    assert a != b


@pytest.mark.parametrize("fixture,name", [("clip_image", "image"), ("clip_video", "video"),
                                          ("clap", "audio"), ("imagebind", "video")])
def test_refuses_latent(fixture, name, request):
    scorer = request.getfixturevalue(fixture)
    arts = _media()
    spec = ArtifactSpec(name, arts[name].spec.modality, "latent",
                        {"image": "latent:CHW", "video": "latent:CTHW", "audio": "latent:CL"}[name])
    arts[name] = MediaArtifact(spec, torch.randn(3, 4, 8, 8) if name != "audio"
                               else torch.randn(3, 4, 8))
    if name == "video":
        arts[name] = MediaArtifact(spec, torch.randn(3, 4, 2, 8, 8))
    with pytest.raises(MediaFormatError) as e:
        scorer.score(ScoreRequest(arts, PROMPTS))
    assert e.value.field == f"{scorer.name}.artifacts.{name}.representation"
    assert e.value.actual == "latent"


@pytest.mark.parametrize("fixture", ["clip_video", "imagebind"])
def test_refuses_video_without_fps(fixture, request):
    scorer = request.getfixturevalue(fixture)
    arts = _media()
    spec = ArtifactSpec("video", "video", "decoded", "TCHW", source="video_latent")
    arts["video"] = MediaArtifact(spec, arts["video"].data)
    with pytest.raises(MediaFormatError) as e:
        scorer.score(ScoreRequest(arts, PROMPTS))
    assert e.value.field == "artifacts.video.fps"


@pytest.mark.parametrize("fixture", ["clap", "imagebind"])
def test_refuses_audio_without_sample_rate(fixture, request):
    scorer = request.getfixturevalue(fixture)
    arts = _media()
    spec = ArtifactSpec("audio", "audio", "decoded", "CT", source="audio_latent")
    arts["audio"] = MediaArtifact(spec, arts["audio"].data)
    with pytest.raises(MediaFormatError) as e:
        scorer.score(ScoreRequest(arts, PROMPTS))
    assert e.value.field == "artifacts.audio.sample_rate"


def test_refuses_wrong_modality_and_rank(clip_image):
    arts = _media()
    arts["image"] = MediaArtifact(VIDEO, arts["video"].data)       # video under the image name
    with pytest.raises(MediaFormatError) as e:
        clip_image.score(ScoreRequest(arts, PROMPTS))
    assert e.value.field == "clip.artifacts.image.modality" and e.value.actual == "video"
    arts["image"] = MediaArtifact(IMAGE, _media()["video"].data)  # TCHW data in a CHW artifact
    with pytest.raises(MediaFormatError) as e:
        clip_image.score(ScoreRequest(arts, PROMPTS))
    assert e.value.field == "artifacts.image.shape"
    arts["image"] = MediaArtifact(IMAGE, torch.rand(3, 3, 8, 8))  # float pixels
    with pytest.raises(MediaFormatError) as e:
        clip_image.score(ScoreRequest(arts, PROMPTS))
    assert e.value.field == "artifacts.image.dtype"


def test_prompt_count_mismatch(clap):
    with pytest.raises(InvalidRequestError) as e:
        clap.score(ScoreRequest(_media(), PROMPTS[:2]))
    assert e.value.field == "clap.prompts" and e.value.expected == 3 and e.value.actual == 2


def test_clip_config_refuses_silent_random_weights(tmp_path):
    from pydantic import ValidationError

    from rewards.clip import ClipScorer, ClipScorerConfig
    with pytest.raises(ValidationError, match="exactly one of pretrained"):
        ClipScorerConfig(model="ViT-B-32")
    with pytest.raises(ValidationError, match="extra"):
        ClipScorerConfig(model="ViT-B-32", random_init=True, bogus=1)
    (tmp_path / "open_clip_config.json").write_text("{}")
    with pytest.raises(ConfigError) as e:                      # config but no weights file
        ClipScorer(ClipScorerConfig(model=f"local-dir:{tmp_path}"))
    assert e.value.field == "clip.model"
    with pytest.raises(ConfigError) as e:
        ClipScorer(ClipScorerConfig(pretrained=str(tmp_path / "none.bin")))
    assert e.value.field == "clip.pretrained"


def test_clap_missing_dir_is_config_error(tmp_path):
    from rewards.clap import ClapScorer, ClapScorerConfig
    with pytest.raises(ConfigError) as e:
        ClapScorer(ClapScorerConfig(model_dir=str(tmp_path)))
    assert e.value.field == "clap.model_dir"


def test_imagebind_missing_package_is_config_error(monkeypatch):
    import sys

    from rewards.imagebind import ImageBindScorer, ImageBindScorerConfig
    for mod in [m for m in sys.modules if m == "imagebind" or m.startswith("imagebind.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError) as e:
        ImageBindScorer(ImageBindScorerConfig(random_init=True, dims=TINY_IMAGEBIND))
    assert e.value.field == "imagebind.package" and "imagebind-unofficial" in e.value.expected


def test_imagebind_checkpoint_roundtrip(imagebind, tmp_path):
    from rewards.imagebind import ImageBindScorer, ImageBindScorerConfig
    path = tmp_path / "tiny.pth"
    torch.save(imagebind._model.state_dict(), path)
    loaded = ImageBindScorer(ImageBindScorerConfig(
        pairs=imagebind.config.pairs, checkpoint=str(path), dims=TINY_IMAGEBIND, seed=123))
    arts = _media()
    assert loaded.score(ScoreRequest(arts, PROMPTS)).scores == \
        imagebind.score(ScoreRequest(arts, PROMPTS)).scores
    bad = dict(TINY_IMAGEBIND, out_embed_dim=16)
    with pytest.raises(ConfigError) as e:
        ImageBindScorer(ImageBindScorerConfig(checkpoint=str(path), dims=bad))
    assert e.value.field == "imagebind.checkpoint"


def test_fbank_tone_peaks_at_its_mel_bin():
    sr, f0 = 16000, 1000.0
    t = torch.arange(sr) / sr
    feats = kaldi_fbank(torch.sin(2 * math.pi * f0 * t), sr, num_mel_bins=64)
    assert feats.shape == (1 + (sr - 400) // 160, 64)
    fb = mel_filterbank(64, 512, sr)
    expected = int(fb[:, round(f0 / (sr / 512))].argmax())
    assert int(feats.mean(0).argmax()) == expected
    with pytest.raises(ValueError, match="at least 400 samples"):
        kaldi_fbank(torch.zeros(100), sr)
