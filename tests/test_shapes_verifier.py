"""Synthetic shapes data and the rule-based image verifier, on data with known truth."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from contract import (ArtifactSpec, InvalidRequestError, Layout, MediaArtifact, MediaFormatError,
                      Modality, Representation, ScoreStatus)
from rewards.base import Scorer, ScoreRequest
from rewards.verifiers.image import ImageAttributeScorer, score_image
from synthetic.shapes import (ALL_COMBINATIONS, BACKGROUNDS, COLORS, POSITIONS, SHAPES,
                              Background, Color, ImageSpec, Position, Shape, Split, caption,
                              parse_caption, render, render_batch, sample_specs,
                              split_combinations)

IMAGE = ArtifactSpec("image", Modality.IMAGE, Representation.DECODED, Layout.CHW,
                     source="image_latent")
LATENT = ArtifactSpec("image_latent", Modality.IMAGE, Representation.LATENT, Layout.LATENT_CHW)


def _score(images: torch.Tensor, prompts: list[str]):
    request = ScoreRequest({"image": MediaArtifact(IMAGE, images)}, tuple(prompts))
    return ImageAttributeScorer().score(request)


def test_specs_are_seeded_and_splits_disjoint():
    assert sample_specs(20, 5) == sample_specs(20, 5)
    assert sample_specs(20, 5) != sample_specs(20, 6)
    train, held_out = set(split_combinations(Split.TRAIN)), set(split_combinations(Split.EVAL))
    assert not train & held_out and len(train | held_out) == len(ALL_COMBINATIONS) == 180
    assert {s.attributes for s in sample_specs(300, 1, Split.EVAL)} <= held_out
    assert {s.attributes for s in sample_specs(300, 1, Split.TRAIN)} <= train
    assert len(held_out) == 30


def test_held_out_split_covers_every_attribute_value():
    # The held-out prompts are a seeded permutation, not a stride over the product order (a
    # stride of 6 over 3 backgrounds gave every held-out prompt the same background).
    held_out = split_combinations(Split.EVAL)
    for k, values in enumerate((SHAPES, COLORS, POSITIONS, BACKGROUNDS)):
        assert {c[k] for c in held_out} == set(values), values
    # Train still sees every value too, and the split is a constant of the module.
    train = split_combinations(Split.TRAIN)
    for k, values in enumerate((SHAPES, COLORS, POSITIONS, BACKGROUNDS)):
        assert {c[k] for c in train} == set(values), values
    assert split_combinations(Split.EVAL) == held_out
    assert list(held_out) == [c for c in ALL_COMBINATIONS if c in set(held_out)]


def test_caption_round_trip_and_render():
    for spec in sample_specs(100, 2, Split.TRAIN) + sample_specs(50, 2, Split.EVAL):
        assert parse_caption(caption(spec)).attributes == spec.attributes
        image = render(spec)
        assert image.dtype == torch.uint8 and image.shape == (3, 32, 32)
        assert torch.equal(image, render(spec))
    assert caption(ImageSpec(Shape.CIRCLE, Color.RED, Position.TOP_LEFT, Background.BLACK)) == \
        "a red circle at the top left on a black background"
    assert render(ImageSpec(Shape.SQUARE, Color.RED, Position.CENTER, Background.GRAY),
                  64).shape == (3, 64, 64)


@pytest.mark.parametrize("text, part", [
    ("a purple circle in the center on a black background", "color"),
    ("a red hexagon in the center on a black background", "shape"),
    ("a red circle somewhere on a black background", "position"),
    ("a red circle in the center on a pink background", "background"),
])
def test_parse_caption_names_the_unparsed_part(text, part):
    with pytest.raises(InvalidRequestError) as err:
        parse_caption(text)
    assert err.value.field == f"caption.{part}"
    assert text.split(" ", 1)[1] in text and err.value.actual in text


def test_ground_truth_renders_score_one():
    specs = sample_specs(200, 11) + sample_specs(60, 12, Split.EVAL)
    out = _score(render_batch(specs), [caption(s) for s in specs])
    assert out.status == (ScoreStatus.OK,) * len(specs)
    for name in ("color", "shape", "position", "background", "total"):
        assert min(out.scores[name]) > 0.95, name


@pytest.mark.parametrize("attribute, values", [
    ("color", COLORS), ("shape", SHAPES), ("position", POSITIONS), ("background", BACKGROUNDS)])
def test_wrong_attribute_scores_zero_on_that_attribute_only(attribute, values):
    specs = sample_specs(60, 21)
    wrong = []
    for i, spec in enumerate(specs):
        others = [v for v in values if v != getattr(spec, attribute)]
        wrong.append(dataclasses.replace(spec, **{attribute: others[i % len(others)]}))
    out = _score(render_batch(wrong), [caption(s) for s in specs])
    assert max(out.scores[attribute]) < 0.05
    for name in {"color", "shape", "position", "background"} - {attribute}:
        assert min(out.scores[name]) > 0.95, name
    assert max(out.scores["total"]) < 0.8


def test_matching_caption_beats_shuffled_caption():
    specs = sample_specs(120, 31)
    gen = torch.Generator().manual_seed(0)
    noisy = (render_batch(specs).float() + 12 * torch.randn(120, 3, 32, 32, generator=gen))
    images = noisy.clamp(0, 255).to(torch.uint8)
    prompts = [caption(s) for s in specs]
    shuffled = [prompts[i] for i in torch.randperm(120, generator=gen).tolist()]
    matched, other = _score(images, prompts), _score(images, shuffled)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(matched.scores["total"]) > mean(other.scores["total"]) + 0.3
    assert mean(matched.scores["total"]) > 0.9


def test_empty_image_has_no_shape():
    spec = ImageSpec(Shape.CIRCLE, Color.RED, Position.CENTER, Background.WHITE)
    blank = torch.full((3, 32, 32), 255, dtype=torch.uint8)
    scores = score_image(blank, spec)
    assert scores["background"] > 0.95
    assert scores["color"] == scores["shape"] == scores["position"] == 0.0


def test_scorer_refuses_latents_and_bad_prompts():
    scorer = ImageAttributeScorer()
    assert isinstance(scorer, Scorer) and scorer.primary == "total"
    latent = MediaArtifact(LATENT, torch.zeros(2, 4, 8, 8))
    with pytest.raises(MediaFormatError) as err:
        scorer.score(ScoreRequest({"image": dataclasses.replace(latent, spec=dataclasses.replace(
            LATENT, name="image"))}, ("a", "b")))
    assert err.value.field.endswith("representation")
    images = render_batch(sample_specs(2, 0))
    with pytest.raises(InvalidRequestError) as err:
        _score(images, [caption(sample_specs(1, 0)[0]), "a dog on a sofa"])
    assert err.value.field.startswith("image_attributes.prompts[1]")
    with pytest.raises(InvalidRequestError):
        _score(images, ["a red circle in the center on a black background"])


def test_total_is_the_mean_of_the_targeted_attributes():
    """`attributes` picks what `total` (the reward) averages; every attribute is still reported.
    A wrong colour on a correct render: 0 on colour, ~1 elsewhere, so the total says which
    attributes it covers."""
    from contract import ConfigError
    from rewards.registry import ScorerSpec, build_scorer
    spec = ImageSpec(Shape.SQUARE, Color.RED, Position.CENTER, Background.WHITE)
    wrong_colour = dataclasses.replace(spec, color=Color.BLUE)
    images = render_batch([spec])
    request = ScoreRequest({"image": MediaArtifact(IMAGE, images)}, (caption(wrong_colour),))
    every = ImageAttributeScorer().score(request).scores
    targeted = build_scorer(ScorerSpec.model_validate(
        {"kind": "image_attributes", "params": {"attributes": ["color", "shape"]}})
    ).score(request).scores
    assert every["color"][0] < 0.01 and min(every[a][0] for a in ("shape", "position",
                                                                  "background")) > 0.95
    assert every["total"][0] == pytest.approx(sum(every[a][0] for a in (
        "color", "shape", "position", "background")) / 4)
    assert targeted["total"][0] == pytest.approx((every["color"][0] + every["shape"][0]) / 2)
    assert {k: v for k, v in targeted.items() if k != "total"} == \
        {k: v for k, v in every.items() if k != "total"}
    for bad in (["colour"], [], ["shape", "shape"], "shape"):
        with pytest.raises(ConfigError) as err:
            ImageAttributeScorer(attributes=bad)
        assert err.value.field == "image_attributes.params.attributes"
