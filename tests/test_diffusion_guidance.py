"""Declared guidance forms (diffusion/guidance.py) and their one application point
(diffusion/step.py): velocity CFG unchanged, LTX-2's per-stream x0 guidance with rescale equal to
the pipeline's own arithmetic (diffusers' rescale_noise_cfg), typed errors for bad streams."""
from __future__ import annotations

import pytest
import torch

from contract import Condition, ConfigError, GuidanceKind, InvalidRequestError, TimeConvention
from diffusion.guidance import (STREAM_BOUNDS, VELOCITY_CFG, CFGRule, GuidanceForm, GuidanceRule,
                                GuidanceSpace, GuidanceStream, cfg_velocity, cfg_x0)
from diffusion.step import Guidance, applied_guidance_scale, doubles_rows, predict_velocity

torch.set_num_threads(1)


def _branches(rows=3, video=24, audio=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, video + audio, generator=g)
    return x, torch.randn(x.shape, generator=g), torch.randn(x.shape, generator=g)


def ltx2_reference(x, sigma, v_u, v_c, video_scale, audio_scale, rescale, audio_rescale, split):
    """LTX2Pipeline.__call__'s guidance on packed tensors, transcribed from
    pipeline_ltx2.py:1441-1593 (deltas on x0, diffusers' own rescale_noise_cfg, back to v)."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg
    out = []
    for (a, b), scale, phi in (((0, split), video_scale, rescale),
                               ((split, x.shape[1]), audio_scale, audio_rescale)):
        xs, s = x[:, a:b].reshape(x.shape[0], -1, 2), sigma[:, None, None]
        x0_c = xs - v_c[:, a:b].reshape(xs.shape) * s
        x0_u = xs - v_u[:, a:b].reshape(xs.shape) * s
        delta = (scale - 1) * (x0_c - x0_u)
        x0 = rescale_noise_cfg(x0_c + delta, x0_c, guidance_rescale=phi) if phi > 0 else \
            x0_c + delta
        out.append(((xs - x0) / s).reshape(x.shape[0], -1))
    return torch.cat(out, dim=1)


def test_velocity_form_is_plain_cfg():
    x, vu, vc = _branches()
    scale = torch.tensor([1.5, 3.0, 7.0])
    assert torch.equal(VELOCITY_CFG.combine(x, torch.full((3,), 0.5), vu, vc, scale),
                       cfg_velocity(vu, vc, scale))


def test_one_x0_stream_without_rescale_is_cfg_x0():
    x, vu, vc = _branches()
    sigma = torch.tensor([0.9, 0.5, 0.2])
    form = GuidanceForm(GuidanceSpace.X0, (GuidanceStream("state"),))
    got = form.combine(x, sigma, vu, vc, torch.full((3,), 4.0))
    torch.testing.assert_close(got, cfg_x0(x, sigma, vu, vc, 4.0), rtol=0, atol=1e-5)


def test_two_streams_with_rescale_equal_the_ltx2_pipeline():
    x, vu, vc = _branches()
    sigma = torch.tensor([0.9, 0.5, 0.2])
    form = GuidanceForm(GuidanceSpace.X0, (GuidanceStream("video", None, 0.7),
                                           GuidanceStream("audio", 7.0, 0.5)))
    got = form.combine(x, sigma, vu, vc, torch.full((3,), 3.0), torch.tensor([0, 24, 34]))
    want = ltx2_reference(x, sigma, vu, vc, 3.0, 7.0, 0.7, 0.5, 24)
    assert float((got - want).abs().max()) <= 1e-5
    plain = cfg_velocity(vu, vc, 3.0)                         # rescale really changes it
    assert float((got[:, :24] - plain[:, :24]).abs().max()) > 1e-2


def test_bad_streams_are_typed_errors():
    x, vu, vc = _branches()
    sigma, scale = torch.full((3,), 0.5), torch.full((3,), 3.0)
    form = GuidanceForm(GuidanceSpace.X0, (GuidanceStream("video"), GuidanceStream("audio")))
    with pytest.raises(InvalidRequestError) as err:
        form.combine(x, sigma, vu, vc, scale)
    assert err.value.field == STREAM_BOUNDS
    with pytest.raises(InvalidRequestError) as err:
        form.combine(x, sigma, vu, vc, scale, torch.tensor([0, 40, 34]))
    assert err.value.field == STREAM_BOUNDS
    with pytest.raises(InvalidRequestError) as err:
        form.combine(x, torch.tensor([0.5, 0.0, 0.5]), vu, vc, scale, torch.tensor([0, 24, 34]))
    assert err.value.field == "sigma"
    with pytest.raises(ConfigError) as err:
        GuidanceStream("audio", rescale=1.5)
    assert err.value.field == "guidance.audio.rescale"
    with pytest.raises(ConfigError):
        GuidanceForm(GuidanceSpace.VELOCITY, (GuidanceStream("video", 2.0),))


class _FixedDenoiser:
    """Returns v_u on the unconditional rows and v_c on the conditional ones (CFG order)."""

    time_convention = TimeConvention.NOISE_LEVEL
    model_time_scale = 1000.0

    def __init__(self, v_u, v_c, form):
        self.v_u, self.v_c, self.guidance_form = v_u, v_c, form

    def forward(self, models, state, sigma, model_time, cond, media, guidance):
        return torch.cat([self.v_u, self.v_c])


def test_the_step_applies_the_denoisers_declared_form():
    x, vu, vc = _branches()
    sigma = torch.tensor([0.9, 0.5, 0.2])
    form = GuidanceForm(GuidanceSpace.X0, (GuidanceStream("video", None, 0.7),
                                           GuidanceStream("audio", 7.0, 0.7)))
    bounds = torch.tensor([[0, 24, 34]]).expand(3, -1)
    cond = Condition({"h": torch.zeros(3, 2)})
    guidance = Guidance.of(GuidanceRule(GuidanceKind.CFG), [3.0] * 3,
                           Condition({"h": torch.ones(3, 2)}))
    models = {"transformer": torch.nn.Linear(1, 1)}
    got = predict_velocity(_FixedDenoiser(vu, vc, form), models, x, sigma, cond, guidance,
                           {STREAM_BOUNDS: bounds})
    assert torch.equal(got, form.combine(x, sigma, vu, vc, torch.full((3,), 3.0), bounds[0]))
    plain = predict_velocity(_FixedDenoiser(vu, vc, VELOCITY_CFG), models, x, sigma, cond,
                             guidance)
    assert torch.equal(plain, cfg_velocity(vu, vc, torch.full((3,), 3.0)))
    with pytest.raises(InvalidRequestError) as err:           # rows must share their streams
        predict_velocity(_FixedDenoiser(vu, vc, form), models, x, sigma, cond, guidance,
                         {STREAM_BOUNDS: torch.tensor([[0, 24, 34], [0, 20, 34], [0, 24, 34]])})
    assert err.value.field == STREAM_BOUNDS


@pytest.mark.parametrize("rule,table", [
    # (scale -> doubled, recorded scale) for each declared rule
    (GuidanceRule(GuidanceKind.CFG, CFGRule.ABOVE_ONE),
     {0.0: (False, 1.0), 0.5: (False, 1.0), 1.0: (False, 1.0), 1.5: (True, 1.5)}),
    (GuidanceRule(GuidanceKind.CFG, CFGRule.ABOVE_ONE, (7.0,)),
     {0.5: (True, 0.5), 1.0: (True, 1.0), 4.0: (True, 4.0)}),
    (GuidanceRule(GuidanceKind.CFG, CFGRule.ABOVE_ONE, (0.5,)),
     {0.5: (False, 1.0), 1.0: (False, 1.0), 4.0: (True, 4.0)}),
    (GuidanceRule(GuidanceKind.CFG, CFGRule.NOT_ONE),
     {0.0: (True, 0.0), 0.5: (True, 0.5), 1.0: (False, 1.0), 3.0: (True, 3.0)}),
    (GuidanceRule(GuidanceKind.EMBEDDED),
     {0.5: (False, 0.5), 1.0: (False, 1.0), 3.5: (False, 3.5)}),
    (GuidanceRule(GuidanceKind.NONE), {1.0: (False, 1.0)}),
])
def test_the_declared_rule_decides_guidance_and_the_recorded_scale(rule, table):
    for scale, (doubled, recorded) in table.items():
        assert doubles_rows(rule, scale) is doubled, scale
        assert applied_guidance_scale(rule, scale) == recorded, scale
        assert doubles_rows(rule, recorded) is doubled     # the record decides as the request
        uncond = Condition({"h": torch.ones(2, 2)}) if doubled else None
        assert Guidance.of(rule, [scale, scale], uncond).doubled is doubled


def test_a_rule_refuses_what_its_family_refuses():
    for scale in (0.5, 2.0):
        with pytest.raises(InvalidRequestError) as err:
            doubles_rows(GuidanceRule(GuidanceKind.NONE), scale)
        assert (err.value.field, err.value.actual) == ("sampling.guidance_scale", scale)
    with pytest.raises(TypeError):             # a bare kind decides nothing
        doubles_rows(GuidanceKind.CFG, 2.0)
    with pytest.raises(ConfigError):
        GuidanceRule(GuidanceKind.EMBEDDED, stream_scales=(7.0,))
    with pytest.raises(InvalidRequestError) as err:     # guided rows without their branch
        Guidance.of(GuidanceRule(GuidanceKind.CFG), [2.0], None)
    assert err.value.field == "negative"
