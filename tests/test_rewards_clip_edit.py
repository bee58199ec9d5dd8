"""CLIP directional similarity of an edit (rewards/clip_edit.py) on a tiny local open_clip model:
equal to the formula computed from the CLIP model's own embeddings, built by kind from config,
its declared inputs (the edit, the source image the ingress hands scorers as condition media,
the source caption) each a typed error naming it when missing."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from contract import InvalidRequestError, MediaArtifact, MediaFormatError
from rewards.base import ScoreRequest
from rewards.registry import ScorerKind, ScorerSpec, build_scorer
from tests.test_rewards_models import IMAGE

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    from testing.snapshots import write_clip_dir
    model = write_clip_dir(tmp_path_factory.mktemp("clip"))
    return build_scorer(ScorerSpec(kind=ScorerKind.CLIP_DIRECTIONAL, params={"model": model}))


def _images(seed, batch=3, h=48, w=80):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, 3, h, w), generator=g, dtype=torch.uint8)


def test_directional_similarity_is_the_formula(scorer):
    edited, source = _images(0), _images(1, h=64, w=64)        # sources of their own size
    prompts = ("a red square", "a blue circle on grass", "two cats")
    captions = ("a gray square", "a blue circle", "one cat")
    meta = tuple({"image": source[i], "source_caption": captions[i], "seed": i}
                 for i in range(3))
    out = scorer.score(ScoreRequest({"image": MediaArtifact(IMAGE, edited)}, prompts, meta))
    e_edit = scorer._encode_images(edited)
    e_src = torch.cat([scorer._encode_images(s[None]) for s in source])
    d_img = e_edit - e_src
    d_txt = scorer._encode_text(list(prompts)) - scorer._encode_text(list(captions))
    expected = F.cosine_similarity(d_img, d_txt, dim=-1)
    torch.testing.assert_close(torch.tensor(out.scores["directional"]), expected,
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(out.scores["image_similarity"]),
                               F.cosine_similarity(e_edit, e_src, dim=-1), rtol=1e-5, atol=1e-6)
    assert scorer.primary == "directional_score"
    torch.testing.assert_close(torch.tensor(out.scores["directional_score"]),
                               (expected + 1) / 2, rtol=1e-5, atol=1e-6)
    same = scorer.score(ScoreRequest({"image": MediaArtifact(IMAGE, edited)}, prompts, tuple(
        {"image": edited[i], "source_caption": captions[i]} for i in range(3))))
    assert min(same.scores["image_similarity"]) > 0.9999      # no edit: the source itself


def test_declared_inputs_missing_are_typed_errors_naming_them(scorer):
    edited = _images(0, batch=1)
    assert scorer.roles == ("image",) and scorer.required_artifacts == ("image",)
    assert scorer.metadata_keys == ("image", "source_caption")
    art = {"image": MediaArtifact(IMAGE, edited)}
    with pytest.raises(InvalidRequestError) as err:           # no source image (no edit)
        scorer.score(ScoreRequest(art, ("a cat",), ({"source_caption": "a dog"},)))
    assert err.value.field == "clip_directional.metadata[0].image"
    with pytest.raises(InvalidRequestError) as err:
        scorer.score(ScoreRequest(art, ("a cat",), ({"image": edited[0]},)))
    assert err.value.field == "clip_directional.metadata[0].source_caption"
    with pytest.raises(MediaFormatError) as err:              # a float image is not a picture
        scorer.score(ScoreRequest(art, ("a cat",), ({"image": edited[0].float(),
                                                      "source_caption": "a dog"},)))
    assert err.value.field == "clip_directional.metadata[0].image"
