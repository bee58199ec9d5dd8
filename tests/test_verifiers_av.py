"""AV verifiers against synthetic clips with known truth."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from contract import (ArtifactSpec, InvalidRequestError, Layout, MediaArtifact, MediaFormatError,
                      MissingArtifactError, Modality, Representation, ScoreStatus)
from rewards.base import Scorer, ScoreRequest
from rewards.verifiers.av import (AVSyncScorer, ConditionFrameScorer, PitchColorScorer,
                                  bounce_frames, dominant_pitch)
from synthetic.clips import (PITCH_HZ, Color, caption, parse_caption, render, sample_specs)

VIDEO = ArtifactSpec("video", Modality.VIDEO, Representation.DECODED, Layout.TCHW, fps=8.0,
                     source="video_latent")
AUDIO = ArtifactSpec("audio", Modality.AUDIO, Representation.DECODED, Layout.CT,
                     sample_rate=16000, source="audio_latent")


def _batch(clips, audio=None):
    v = torch.from_numpy(np.stack([c.video for c in clips]))
    a = torch.from_numpy(np.stack([c.audio for c in clips])) if audio is None else audio
    return {"video": MediaArtifact(VIDEO, v), "audio": MediaArtifact(AUDIO, a)}


def _shift(audio: torch.Tensor, frames: int, sr: int = 16000, fps: float = 8.0) -> torch.Tensor:
    n = int(frames * sr / fps)
    out = torch.zeros_like(audio)
    out[..., n:] = audio[..., :-n]
    return out


@pytest.fixture(scope="module")
def clips():
    specs = sample_specs(24, seed=3)
    return specs, [render(s) for s in specs]


def test_clip_ground_truth(clips):
    specs, rendered = clips
    for spec, clip in zip(specs, rendered):
        assert clip.video.shape == (8, 3, 32, 32) and clip.video.dtype == np.uint8
        assert clip.audio.shape == (1, 16000) and clip.audio.dtype == np.float32
        assert 1 <= len(clip.bounce_frames) <= 2
        assert list(clip.bounce_frames) == bounce_frames(clip.video)
        assert abs(dominant_pitch(clip.audio, 16000) - spec.pitch_hz) < 10
        assert parse_caption(caption(spec)).color == spec.color
    assert sample_specs(3, 7) == sample_specs(3, 7) != sample_specs(3, 8)


def test_parse_caption_names_unparsed_part():
    with pytest.raises(InvalidRequestError) as err:
        parse_caption("a red square bouncing sideways with low beeps")
    assert err.value.field == "caption.motion" and "sideways" in str(err.value.actual)


def test_av_sync_perfect_vs_shifted(clips):
    specs, rendered = clips
    scorer = AVSyncScorer()
    assert isinstance(scorer, Scorer)
    prompts = tuple(caption(s) for s in specs)
    good = scorer.score(ScoreRequest(_batch(rendered), prompts))
    assert good.status == (ScoreStatus.OK,) * len(specs)
    assert min(good.scores["av_sync"]) == 1.0
    audio = torch.from_numpy(np.stack([c.audio for c in rendered]))
    bad = scorer.score(ScoreRequest(_batch(rendered, _shift(audio, 3)), prompts))
    assert np.mean(bad.scores["av_sync"]) < 0.35
    assert all(0.0 <= s <= 1.0 for s in bad.scores["av_sync"])


def test_pitch_color(clips):
    specs, rendered = clips
    scorer = PitchColorScorer()
    prompts = tuple(caption(s) for s in specs)
    good = scorer.score(ScoreRequest(_batch(rendered), prompts))
    assert min(good.scores["pitch_color"]) > 0.9
    # the same clips under prompts asking for a different colour: the pitch is wrong
    other = {Color.RED: Color.BLUE, Color.GREEN: Color.YELLOW, Color.BLUE: Color.RED,
             Color.YELLOW: Color.GREEN}
    wrong = tuple(p.replace(s.color.value, other[s.color].value)
                  .replace(caption(s).split(" with ")[1], caption(
                      type(s)(other[s.color], s.motion, s.pos0, s.speed, s.cross)).split(" with ")[1])
                  for p, s in zip(prompts, specs))
    bad = scorer.score(ScoreRequest(_batch(rendered), wrong))
    assert max(bad.scores["pitch_caption"]) < 0.05
    assert min(bad.scores["pitch_video"]) > 0.9          # audio still matches the seen colour
    # a pure tone of the wrong pitch for the seen colour
    sr, t = 16000, np.arange(16000) / 16000
    tones = torch.tensor(np.stack([[0.3 * np.sin(2 * np.pi * PITCH_HZ[other[s.color]] * t)]
                                   for s in specs]), dtype=torch.float32)
    off = scorer.score(ScoreRequest(_batch(rendered, tones), prompts))
    assert max(off.scores["pitch_color"]) < 0.05


def test_condition_frames(clips):
    specs, rendered = clips
    scorer = ConditionFrameScorer()
    meta = tuple({"first_frame": torch.from_numpy(c.video[0]),
                  "last_frame": torch.from_numpy(c.video[-1])} for c in rendered)
    arts = _batch(rendered)
    good = scorer.score(ScoreRequest(arts, (), meta))
    assert min(good.scores["condition_frames"]) == 1.0
    shuffled = meta[1:] + meta[:1]
    bad = scorer.score(ScoreRequest(arts, (), shuffled))
    assert np.mean(bad.scores["condition_frames"]) < 0.25
    with pytest.raises(InvalidRequestError) as err:
        scorer.score(ScoreRequest(arts, (), ({"first_frame": meta[0]["first_frame"]},) + meta[1:]))
    assert err.value.field == "condition_frames.metadata[0].last_frame"


def test_refuses_latents_and_missing_rates(clips):
    _, rendered = clips
    arts = _batch(rendered[:2])
    latent = ArtifactSpec("video", Modality.VIDEO, Representation.LATENT, Layout.LATENT_CTHW)
    with pytest.raises(MediaFormatError) as err:
        AVSyncScorer().score(ScoreRequest({**arts, "video": MediaArtifact(
            latent, torch.randn(2, 4, 8, 8, 8))}, ("",) * 2))
    assert err.value.field.endswith("representation")
    no_fps = ArtifactSpec("video", Modality.VIDEO, Representation.DECODED, Layout.TCHW,
                          source="video_latent")
    with pytest.raises(MediaFormatError) as err:
        AVSyncScorer().score(ScoreRequest({**arts, "video": MediaArtifact(
            no_fps, arts["video"].data)}, ("",) * 2))
    assert "fps" in err.value.field
    no_sr = ArtifactSpec("audio", Modality.AUDIO, Representation.DECODED, Layout.CT,
                         source="audio_latent")
    with pytest.raises(MediaFormatError) as err:
        PitchColorScorer().score(ScoreRequest({**arts, "audio": MediaArtifact(
            no_sr, arts["audio"].data)}, ("",) * 2))
    assert "sample_rate" in err.value.field
    with pytest.raises(MissingArtifactError):
        AVSyncScorer().score(ScoreRequest({"video": arts["video"]}, ("",) * 2))
