"""THE denoising step: model forward + guidance + time convention + sampler step, in one place.

Every caller runs this: the embedded engine (rows of many requests in one call), the vLLM-Omni
pipeline, the learner (with autograd), the start-up checks, the sample scripts and the benches.

    guided = doubles_rows(rule, guidance_scale)      # the one guidance decision, by the
                                                     # family's declared GuidanceRule
    v      = predict_velocity(denoiser, models, x, sigma, cond, guidance, media)
                                                     # CFG combined as the denoiser's declared
                                                     # guidance_form (diffusion/guidance.py)
    out    = transition(sampler, x, v, sigma, sigma_next, noise_level, noise, frozen=frozen)

A `Denoiser` is a family's stateless forward: raw model output for a state in the model's own
time convention; this module converts time and velocity (diffusion/conventions.py), applies
guidance (diffusion/guidance.py) and steps the sampler (diffusion/samplers.py). Shapes: x, v
(B, *S); sigma (B,); the condition has B rows. Sampler math and guidance are fp32; the forward
runs in the models' dtype.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping, Protocol, Sequence

import torch

from contract.conditions import Condition
from contract.enums import GuidanceKind, SamplerKind, TimeConvention
from contract.errors import InvalidRequestError
from diffusion.conventions import model_time, to_sigma_velocity
from diffusion.guidance import STREAM_BOUNDS, VELOCITY_CFG, GuidanceForm, GuidanceRule
from diffusion.samplers import SolverHistory, StepOutput, log_density, sampler_step

Models = Mapping[str, torch.nn.Module]      # component name -> module (e.g. "transformer")


class Denoiser(Protocol):
    """A family's forward. `forward` gets the state in the models' dtype and returns the raw
    prediction (B, *S) in the model's convention; `guidance` is the (B,) embedded guidance scale
    for guidance-distilled families, else None. A denoiser may declare `guidance_form`
    (diffusion.guidance.GuidanceForm: how its pipeline combines the CFG branches); without one
    CFG is v_u + g (v_c - v_u). It may declare `rows_per_call` (int: the most rows of a forward
    one transformer call runs, e.g. 1 where each row's sequence runs alone); without one every
    row runs in one call (bench/memory_plan.py sizes live activations by it), and
    `sequence_tokens(sampling, text_tokens, keyframes)` (the rows of one transformer sequence,
    for a denoiser that packs modalities into one; the planner counts tokens by it)."""

    time_convention: TimeConvention
    model_time_scale: float

    def forward(self, models: Models, state: torch.Tensor, sigma: torch.Tensor,
                model_time: torch.Tensor, cond: Condition,
                media: Mapping[str, torch.Tensor] | None,
                guidance: torch.Tensor | None) -> torch.Tensor: ...


def doubles_rows(rule: GuidanceRule, guidance_scale: float,
                 field: str = "sampling.guidance_scale") -> bool:
    """Whether a request's rows run twice (conditional + unconditional), by the family's
    declared rule (its pipeline's). A family without guidance refuses any scale but 1."""
    if not isinstance(rule, GuidanceRule):
        raise TypeError(f"guidance is decided by a family's GuidanceRule, not {rule!r}")
    if rule.kind is GuidanceKind.NONE and guidance_scale != 1.0:
        raise InvalidRequestError("this model family takes no guidance", field=field,
                                  expected=1.0, actual=guidance_scale)
    return rule.guides(guidance_scale)


def applied_guidance_scale(rule: GuidanceRule, guidance_scale: float) -> float:
    """The scale rows run at, as recorded: 1 where the rule runs the conditional branch alone
    (v_u + 1 (v_c - v_u) = v_c), else the request's scale. doubles_rows(rule, applied) equals
    doubles_rows(rule, requested)."""
    guided = doubles_rows(rule, guidance_scale)
    return 1.0 if rule.kind is GuidanceKind.CFG and not guided else float(guidance_scale)


@dataclass(frozen=True)
class Guidance:
    """Guidance of B rows: kind, per-row scale (B,) and, when rows are doubled, the
    unconditional (negative or null prompt) condition of each row."""

    kind: GuidanceKind
    scale: torch.Tensor
    uncond: Condition | None = None

    @classmethod
    def of(cls, rule: GuidanceRule, scales: Sequence[float] | torch.Tensor,
           uncond: Condition | None = None) -> "Guidance":
        scale = torch.as_tensor(scales, dtype=torch.float32).reshape(-1)
        doubled = {doubles_rows(rule, float(s)) for s in scale.tolist()}
        if len(doubled) > 1:
            raise InvalidRequestError("rows of one forward must all use CFG or all not",
                                      field="guidance_scale", actual=scale.tolist())
        if doubled == {True} and uncond is None:
            raise InvalidRequestError("guided rows need the unconditional condition",
                                      field="negative", expected="Condition", actual=None)
        if doubled == {False} and uncond is not None:
            raise InvalidRequestError("an unconditional condition was given but these rows do "
                                      "not use CFG", field="negative", expected=None,
                                      actual="Condition")
        if uncond is not None and uncond.rows != scale.shape[0]:
            raise InvalidRequestError("one unconditional row per row", field="negative",
                                      expected=scale.shape[0], actual=uncond.rows)
        return cls(rule.kind, scale, uncond)

    @classmethod
    def conditional(cls, rule: GuidanceRule, rows: int) -> "Guidance":
        """The conditional branch alone at scale 1 (an embedded scale of 1), whatever the rule
        decides at 1: what a check comparing one raw forward with a reference runs."""
        if not isinstance(rule, GuidanceRule):
            raise TypeError(f"guidance is decided by a family's GuidanceRule, not {rule!r}")
        return cls(rule.kind, torch.ones(rows))

    @classmethod
    def none(cls, rows: int) -> "Guidance":
        return cls(GuidanceKind.NONE, torch.ones(rows))

    @property
    def doubled(self) -> bool:
        return self.uncond is not None

    @property
    def rows(self) -> int:
        return int(self.scale.shape[0])


def guidance_form(denoiser: Denoiser) -> GuidanceForm:
    """The denoiser's declared guidance form (velocity CFG when it declares none)."""
    form = getattr(denoiser, "guidance_form", VELOCITY_CFG)
    if not isinstance(form, GuidanceForm):
        raise InvalidRequestError("a denoiser's guidance_form is a GuidanceForm",
                                  field="denoiser.guidance_form", expected="GuidanceForm",
                                  actual=type(form).__name__)
    return form


def stream_bounds(media: Mapping[str, torch.Tensor] | None) -> torch.Tensor | None:
    """The rows' guidance stream offsets (media input STREAM_BOUNDS), one set for all rows."""
    bounds = (media or {}).get(STREAM_BOUNDS)
    if bounds is None:
        return None
    if not bool((bounds == bounds[:1]).all()):
        raise InvalidRequestError("rows of one forward must share their guidance streams",
                                  field=STREAM_BOUNDS, actual=bounds.tolist())
    return bounds[0]


def model_dtype(models: Models) -> torch.dtype:
    """The dtype the forward runs in: the first floating parameter of the first model."""
    for module in models.values():
        for p in module.parameters():
            if p.is_floating_point():
                return p.dtype
    return torch.float32


def model_device(models: Models) -> torch.device:
    for module in models.values():
        for p in module.parameters():
            return p.device
    return torch.device("cpu")


def predict_velocity(denoiser: Denoiser, models: Models, x: torch.Tensor, sigma: torch.Tensor,
                     cond: Condition, guidance: Guidance,
                     media: Mapping[str, torch.Tensor] | None = None) -> torch.Tensor:
    """Guided velocity v = eps - x0 (fp32, sigma convention) at (x, sigma). x: (B, *S)."""
    rows = x.shape[0]
    if tuple(sigma.shape) != (rows,) or cond.rows != rows or guidance.rows != rows:
        raise InvalidRequestError("x, sigma, condition and guidance must share the row count",
                                  field="rows", expected=rows,
                                  actual={"sigma": tuple(sigma.shape), "cond": cond.rows,
                                          "guidance": guidance.rows})
    dtype, device = model_dtype(models), model_device(models)
    time = model_time(sigma, denoiser.time_convention, denoiser.model_time_scale)
    if guidance.doubled:                 # [uncond rows; cond rows], as diffusers orders them
        x_in, sigma_in, time_in = (torch.cat([t, t]) for t in (x, sigma, time))
        cond_in = Condition.cat([guidance.uncond, cond])
        media_in = None if not media else {r: torch.cat([m, m]) for r, m in media.items()}
        embedded = None
    else:
        x_in, sigma_in, time_in, cond_in, media_in = x, sigma, time, cond, media or None
        embedded = guidance.scale if guidance.kind is GuidanceKind.EMBEDDED else None
    if media_in:
        media_in = {k: m.to(device, dtype) if m.is_floating_point() else m.to(device)
                    for k, m in media_in.items()}
    raw = denoiser.forward(models, x_in.to(device, dtype), sigma_in.to(device), time_in.to(device),
                           cond_in.to(device, dtype), media_in,
                           None if embedded is None else embedded.to(device))
    if raw.shape != x_in.shape:
        raise InvalidRequestError("the model output shape differs from the state",
                                  field="model_output", expected=tuple(x_in.shape),
                                  actual=tuple(raw.shape))
    v = to_sigma_velocity(raw.float(), denoiser.time_convention)
    if not guidance.doubled:
        return v
    v_uncond, v_cond = v[:rows], v[rows:]
    return guidance_form(denoiser).combine(x.to(v.device, torch.float32), sigma.to(v.device),
                                           v_uncond, v_cond, guidance.scale.to(v.device),
                                           stream_bounds(media))


@dataclass(frozen=True)
class FrozenLatents:
    """In-context conditions (first/last frames, a reference image): entries of the state where
    `mask` is True are held at `values` after every step and are not scored.
    mask: (1 or B, *S) bool; values: (1 or B, *S) fp32."""

    mask: torch.Tensor
    values: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(self.mask.to(x.device), self.values.to(x.device, x.dtype), x)

    def free(self, rows: int) -> torch.Tensor:
        """(B, *S) bool: the entries the sampler moves (and the log-prob counts)."""
        return ~self.mask.expand(rows, *self.mask.shape[1:])

    def index_select(self, rows: torch.Tensor) -> "FrozenLatents":
        pick = lambda t: t if t.shape[0] == 1 else t[rows]      # noqa: E731
        return FrozenLatents(pick(self.mask), pick(self.values))


def transition(sampler: SamplerKind, x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor,
               sigma_next: torch.Tensor, noise_level: float, noise: torch.Tensor | None = None,
               prev_sample: torch.Tensor | None = None,
               frozen: FrozenLatents | None = None,
               history: SolverHistory | None = None) -> StepOutput:
    """The sampler step from sigma to sigma_next (per row), with frozen entries held and left
    out of the log-prob. With `prev_sample` the step scores that sample (trainer recompute);
    `history`: the previous step's StepOutput.history for a multistep kind (DPM2)."""
    out = sampler_step(sampler, x, v, sigma, sigma_next, noise_level, noise, prev_sample,
                       history=history)
    if frozen is None:
        return out
    x_next = frozen.apply(out.prev_sample)
    log_prob = None
    if out.log_prob is not None:
        log_prob = log_density(sampler, x_next, out.mean, out.std, free=frozen.free(x.shape[0]))
    return dataclasses.replace(out, prev_sample=x_next, log_prob=log_prob)


def denoise_step(denoiser: Denoiser, models: Models, x: torch.Tensor, sigma: torch.Tensor,
                 sigma_next: torch.Tensor, cond: Condition, guidance: Guidance,
                 sampler: SamplerKind, noise_level: float, noise: torch.Tensor | None = None,
                 prev_sample: torch.Tensor | None = None,
                 media: Mapping[str, torch.Tensor] | None = None,
                 frozen: FrozenLatents | None = None,
                 history: SolverHistory | None = None) -> StepOutput:
    """predict_velocity + transition: one whole denoising step of B rows."""
    v = predict_velocity(denoiser, models, x, sigma, cond, guidance, media)
    return transition(sampler, x, v, sigma, sigma_next, noise_level, noise, prev_sample, frozen,
                      history)
