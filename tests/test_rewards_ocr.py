"""OCR scorer with the real PP-OCRv4 weights shipped in rapidocr-onnxruntime, on rendered text."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from contract import (ArtifactSpec, ConfigError, InvalidRequestError, MediaArtifact,
                      MediaFormatError, ScorerFailedError, ScoreStatus)
from rewards.base import Scorer, ScoreRequest
from rewards.ocr import levenshtein, normalise_text, ocr_reward

IMAGE = ArtifactSpec("image", "image", "decoded", "CHW", source="image_latent")


def render(text: str, size=(256, 96)) -> torch.Tensor:
    """(3, H, W) uint8: black text on white, Pillow's bundled font (no system fonts needed)."""
    im = Image.new("RGB", size, "white")
    if text:
        ImageDraw.Draw(im).text((10, 25), text, fill="black", font=ImageFont.load_default(size=36))
    return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1)


def batch(*texts: str) -> dict[str, MediaArtifact]:
    return {"image": MediaArtifact(IMAGE, torch.stack([render(t) for t in texts]))}


def meta(*targets):
    return tuple({"ocr_text": t} for t in targets)


@pytest.fixture(scope="module")
def ocr():
    from rewards.registry import ScorerSpec, build_scorer
    return build_scorer(ScorerSpec(kind="ocr"))


def _levenshtein_reference(a: str, b: str) -> int:
    """Independent: the minimum over all alignments, by recursion with memo (tiny strings)."""
    from functools import lru_cache

    @lru_cache(maxsize=None)
    def d(i: int, j: int) -> int:
        if i == 0 or j == 0:
            return i + j
        return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))
    return d(len(a), len(b))


def test_edit_distance_and_formula():
    for a, b in itertools.product(["", "a", "kitten", "sitting", "flaw", "lawn", "abcabc"],
                                  repeat=2):
        assert levenshtein(a, b) == _levenshtein_reference(a, b)
    assert levenshtein("kitten", "sitting") == 3
    assert normalise_text("Hello World") == "helloworld"
    assert ocr_reward("HELLO WORLD", "hello world") == (1.0, 0)
    assert ocr_reward("a sign: OPEN now", "open") == (1.0, 0)           # substring -> 0
    assert ocr_reward("OPEM", "OPEN") == (0.75, 1)
    assert ocr_reward("", "OPEN") == (0.0, 4)                         # nothing read: d = len
    assert ocr_reward("xxxxxxxxxxxx", "OPEN") == (0.0, 4)             # clipped at len(target)
    with pytest.raises(ValueError):
        ocr_reward("abc", "  ")


def test_real_weights_read_rendered_text(ocr):
    assert isinstance(ocr, Scorer) and ocr.primary == "ocr"
    texts = ("HELLO WORLD", "OPEN", "Cat", "")
    out = ocr.score(ScoreRequest(batch(*texts), texts[:3] + ("blank",),
                                 meta("Hello World", "OPEN", "cat", "OPEN")))
    right = out.scores["ocr"]
    assert out.status == (ScoreStatus.OK,) * 4
    assert min(right[:3]) > 0.9, right
    assert right[3] == pytest.approx(0.0, abs=1e-9)                  # blank image
    wrong = ocr.score(ScoreRequest(batch("HELLO WORLD", "OPEN"), ("a", "b"),
                                   meta("zebra quilt", "BANK")))
    assert max(wrong.scores["ocr"]) < 0.3, wrong.scores
    # one sample alone scores as in the batch (no cross-sample state)
    single = ocr.score(ScoreRequest(batch("OPEN"), ("x",), meta("OPEN")))
    assert single.scores["ocr"][0] == right[1]


def test_missing_target_is_typed_error_or_missing(ocr):
    arts = batch("OPEN", "OPEN")
    with pytest.raises(InvalidRequestError) as e:
        ocr.score(ScoreRequest(arts, ("a", "b")))                     # no metadata at all
    assert e.value.field == "ocr.metadata"
    with pytest.raises(InvalidRequestError) as e:
        ocr.score(ScoreRequest(arts, ("a", "b"), ({"ocr_text": "OPEN"}, {"seed": 3})))
    assert e.value.field == "metadata[1].ocr_text" and e.value.actual is None
    with pytest.raises(InvalidRequestError) as e:
        ocr.score(ScoreRequest(arts, ("a", "b"), meta("OPEN", "   ")))
    assert e.value.field == "metadata[1].ocr_text"
    # under the reward policy: optional -> MISSING with the reason, required -> typed failure
    from rewards.combine import RewardConfig, ScorerWeight, run_scorers
    request = ScoreRequest(arts, ("a", "b"), ({"ocr_text": "OPEN"}, {}))
    optional = RewardConfig(scorers={"ocr": ScorerWeight(policy="optional"),
                                     "other": ScorerWeight()})
    report = run_scorers([ocr, _Constant()], request, optional)
    assert report.by_scorer["ocr"].status == (ScoreStatus.MISSING,) * 2
    assert "metadata[1].ocr_text" in report.by_scorer["ocr"].reasons[0]
    assert report.total == (0.5, 0.5)                                  # the other scorer only
    with pytest.raises(ScorerFailedError):
        run_scorers([ocr], request, RewardConfig(scorers={"ocr": ScorerWeight()}))


def test_refuses_bad_media_and_bad_model_files(ocr, tmp_path):
    from rewards.ocr import OcrScorer, OcrScorerConfig
    bad = {"image": MediaArtifact(IMAGE, torch.rand(1, 3, 32, 32))}
    with pytest.raises(MediaFormatError) as e:
        ocr.score(ScoreRequest(bad, ("a",), meta("OPEN")))
    assert e.value.field == "artifacts.image.dtype"
    hwc = {"image": MediaArtifact(IMAGE, render("OPEN").permute(1, 2, 0)[None].contiguous())}
    with pytest.raises(MediaFormatError):                              # HWC data, 4 channels wide
        ocr.score(ScoreRequest(hwc, ("a",), meta("OPEN")))
    with pytest.raises(ConfigError) as e:
        OcrScorer(OcrScorerConfig(det_model_path=str(tmp_path / "none.onnx")))
    assert e.value.field == "ocr.det_model_path"
    junk = tmp_path / "det.onnx"
    junk.write_bytes(b"not an onnx model")
    with pytest.raises(ConfigError) as e:
        OcrScorer(OcrScorerConfig(det_model_path=str(junk)))
    assert e.value.field == "ocr.models"


class _Constant:
    """A second scorer for the policy test (a verifier-like constant reward of 0.5)."""

    name, primary, required_artifacts = "other", "value", ("image",)

    def score(self, request):
        from contract import ScorerOutput
        n = len(request.prompts)
        return ScorerOutput("other", {"value": (0.5,) * n}, (ScoreStatus.OK,) * n, (None,) * n)
