"""Nothing non-finite leaves a stage, and no client is blamed for it; numbers a client writes are
strict JSON. In process: the decoder stage on the real tiny_t2i VAE, the scorer stage's
micro-batch with a scorer loaded by import path, the HTTP body's metadata numbers."""
from __future__ import annotations

import asyncio

import pytest
import torch

from contract import (InvalidRequestError, MediaArtifact, NonFiniteOutputError, RequestLimits,
                      SamplingSpec, ScorerOutput, ScoreStatus)
from contract.http import parse_rollout_body
from rewards.base import ScoreRequest

torch.set_num_threads(1)


class BrightnessLogScorer:
    """log of the mean pixel value (a reward some recipes use): -inf on an all-black image.
    Loaded by import path, as `external` scorers are."""

    name = "log_brightness"
    primary = "log_brightness"
    required_artifacts = ("image",)

    def score(self, request: ScoreRequest) -> ScorerOutput:
        mean = request.artifacts["image"].data.float().flatten(1).mean(dim=1)
        values = tuple(float(v) for v in torch.log(mean))
        return ScorerOutput(self.name, {"log_brightness": values},
                            (ScoreStatus.OK,) * len(values), (None,) * len(values))


def _image(value: int, rows: int = 2) -> MediaArtifact:
    from adapters.registry import get_family
    spec = get_family("tiny_t2i").io_spec["image"]
    return MediaArtifact(spec, torch.full((rows, 3, 32, 32), value, dtype=torch.uint8))


def test_scorer_stage_fails_only_the_request_with_a_non_finite_score():
    """Two requests scored in one micro-batch: the one whose score is -inf fails alone with a
    server-side NonFiniteOutputError (the ingress makes it ScorerFailedError, never a 4xx or a
    reward), the other gets its scores."""
    from deployments.config import ScorerStage
    from deployments.scorer import ScorerServer
    stage = ScorerStage(name="log_brightness", inputs=("image",),
                        scorer={"kind": "external", "params": {
                            "target": "tests.test_output_finite:BrightnessLogScorer"}})
    server = ScorerServer(stage)

    class Pending:
        def __init__(self, image):
            self.request = ScoreRequest(artifacts={"image": image}, prompts=("p", "p"),
                                        metadata=({}, {}))

    async def main():
        return await ScorerServer._score_batch.__wrapped__(
            server, [Pending(_image(128)), Pending(_image(0))])
    good, bad = asyncio.run(main())
    assert isinstance(good, ScorerOutput)
    assert good.scores["log_brightness"] == pytest.approx((torch.log(torch.tensor(128.)).item(),)
                                                          * 2)
    assert isinstance(bad, NonFiniteOutputError) and bad.http_status == 500
    assert bad.field == "scores.log_brightness[0]" and bad.actual == "-inf"


def test_decoder_stage_refuses_non_finite_media_before_quantising_it():
    """A finite latent the VAE overflows on (row 1) decodes to Inf / NaN: before, uint8
    quantisation turned it into an ordinary-looking image; now a NonFiniteOutputError names the
    component, the rows and the request. Row 0 alone decodes as always."""
    from deployments.decoder import DecoderServer
    decoder = DecoderServer("tiny_t2i", None, "image_latent", 4096)
    spec = decoder.family.io_spec["image_latent"]
    sampling = SamplingSpec(num_steps=2, seeds=(0, 1))
    latent = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    latent[1] = 3e38
    with pytest.raises(NonFiniteOutputError) as err:
        decoder._decode(MediaArtifact(spec, latent), decoder.outputs, "req-1", sampling)
    assert err.value.request_id == "req-1" and err.value.field.startswith("decoded.vae")
    assert err.value.actual == "rows [1]"
    [image] = decoder._decode(MediaArtifact(spec, latent[:1]), decoder.outputs, "req-2",
                              SamplingSpec(num_steps=2, seeds=(0,)))
    assert image.data.dtype == torch.uint8 and image.data.shape == (1, 3, 32, 32)
    assert not decoder.modules["vae"]._forward_hooks      # the checks are only on while decoding


@pytest.mark.parametrize("literal,actual", [("NaN", "nan"), ("Infinity", "inf"),
                                            ("-Infinity", "-inf"), ("1e400", "inf"),
                                            ("-1e400", "-inf"), (str(2**64), "65-bit integer"),
                                            (str(-2**63 - 1), "64-bit integer"),
                                            (str(10**400), "1329-bit integer")])
def test_metadata_numbers_are_strict_json(literal, actual):
    body = f'{{"prompts": ["a red circle"], "metadata": [{{"ocr_text": "OPEN", "n": {literal}}}]}}'
    with pytest.raises(InvalidRequestError) as err:
        parse_rollout_body(body.encode(), RequestLimits())
    assert (err.value.field, err.value.actual) == ("metadata[0].n", actual)
    assert err.value.http_status == 400


def test_metadata_numbers_at_the_edges_pass():
    body = (f'{{"prompts": ["a", "b"], "metadata": [{{"lo": {-2**63}, "hi": {2**63 - 1}}}, '
            f'{{"x": 1.7976931348623157e308, "t": true, "s": "NaN"}}]}}')
    payload = parse_rollout_body(body.encode(), RequestLimits())
    assert payload.metadata[0] == {"lo": -2**63, "hi": 2**63 - 1}
    assert payload.metadata[1] == {"x": 1.7976931348623157e308, "t": True, "s": "NaN"}
