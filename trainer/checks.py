"""Start-up checks (before step 1) and the per-step log-prob parity check.

(a) time convention: one Euler step from x_sigma = (1 - sigma) x0 + sigma eps (x0: real media
    encoded by the VAE) through the adapter's DECLARED convention must agree with the step the
    sigma convention prescribes, x_next = (1 - sigma') x0 + sigma' eps, i.e. the velocity must
    point along eps - x0 (cosine > min_cos and better than the opposite convention).
(b) LoRA map: a random probe LoRA published as "<run>/probe" must change the graph's ODE rollout
    exactly as merging it into the training-form weights (W += scale B A) and sampling locally
    does (fixed seeds, max |diff| <= atol), and it must change the output at all.
(c) token ids: the ids the graph's encoder saw equal the ids the trainer holds and encodes.
Each failure raises StartupCheckError naming what differed.
A task whose condition media condition the model without being held in the state (an edit's
source image: shown to the conditioner, its latents appended as a forward input) runs (a) and
(b) with the held-out prompts' media (`media`: per prompt, role -> tensor): the conditions are
the encoder stage's of prompt + source, the forward inputs the codec's of the same source.
"""
from __future__ import annotations

import copy
import dataclasses
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator, Mapping, Sequence

import torch

from contract import (GuidanceKind, PromptBundle, RolloutOutput, SamplerKind, StartupCheckError,
                      TimeConvention)
from diffusion.noise import initial_noise
from diffusion.step import Guidance, denoise_step, doubles_rows, model_dtype
from trainer.algorithms import recompute_step
from trainer.learner import Learner, encode_media_conditions, request_inputs
from trainer.lora import PolicyRole, lora_layers, use_policy

PROBE_SIGMAS = (0.5, 0.75)


# ---- (a) time convention ----------------------------------------------------------------------
def forward_media(learner: Learner, sampling, media: Sequence[Mapping] | None,
                  repeats: Sequence[int]) -> dict[str, torch.Tensor] | None:
    """The per-row forward inputs (rows = sum(repeats)) of each prompt's condition media as the
    rollout encodes them (`media` None: the codec's inputs without media), on the learner's
    device. Media the state would hold (keyframes) are refused: these checks start every row
    from noise."""
    conditions = encode_media_conditions(learner.family, learner.media_modules,
                                         [sampling] * len(repeats), media)
    for i, c in enumerate(conditions):
        if c.frozen is not None or c.state_shape is not None:
            raise StartupCheckError("the start-up checks run condition media that condition the "
                                    "model, not entries held in the sampler state",
                                    field=f"media[{i}]", expected="no held state entries",
                                    actual=sorted(str(getattr(r, "value", r))
                                                  for r in (media[i] or {})))
    inputs = request_inputs(conditions, repeats)
    return {k: v.to(learner.device) for k, v in inputs.items()} or None


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


@dataclasses.dataclass(frozen=True)
class _Convention:
    """The family's denoiser read in another time convention (what a wrong declaration does)."""

    denoiser: object
    time_convention: TimeConvention

    @property
    def model_time_scale(self) -> float:
        return self.denoiser.model_time_scale

    def forward(self, *args, **kwargs):
        return self.denoiser.forward(*args, **kwargs)


def prompt_conditions(learner: Learner, prompts: Sequence[PromptBundle],
                      handles: Sequence | None = None, unconditional: bool = False,
                      media: Sequence[Mapping] | None = None):
    """The prompts' conditions: the encoder stage's (`handles`, one ConditionHandle per prompt,
    fetched here and checked against the learner's signature), else the learner's own text
    encoders on the same ids (with each prompt's `media` the conditioner reads itself)."""
    if handles is None:
        return learner.uncond(prompts, media) if unconditional else learner.encode(prompts, media)
    from trainer.rollout_batch import ConditionRows
    return ConditionRows(tuple(handles), tuple(range(len(handles)))).fetch(
        learner.condition_signature)


@torch.no_grad()
def check_time_convention(learner: Learner, x0: torch.Tensor, prompts: Sequence[PromptBundle],
                          min_cos: float = 0.3, seed: int = 0,
                          handles: Sequence | None = None) -> dict[str, float]:
    """x0: (B, *S) clean latents of real media with their prompts (their conditions: `handles`
    from the encoder stage, else encoded here). Returns cosines per sigma."""
    denoiser = learner.family.denoiser
    declared = TimeConvention(denoiser.time_convention)
    other = next(c for c in TimeConvention if c != declared)
    cond = prompt_conditions(learner, prompts, handles)
    gen = torch.Generator().manual_seed(seed)
    eps = torch.randn(x0.shape, generator=gen).to(learner.device)      # on the learner's device
    x0 = x0.to(learner.device)
    rows = x0.shape[0]
    report: dict[str, float] = {}
    for s in PROBE_SIGMAS:
        sigma = torch.full((rows,), s, device=learner.device)
        x = (1 - s) * x0 + s * eps                                     # forward process
        x_next_true = (1 - (s - 0.25)) * x0 + (s - 0.25) * eps         # sigma convention
        steps = {}
        for conv in (declared, other):
            with learner.policy(PolicyRole.REFERENCE) as models:
                out = denoise_step(_Convention(denoiser, conv), models, x, sigma,
                                   sigma - 0.25, cond, Guidance.none(rows), SamplerKind.ODE, 0.0)
            steps[conv] = out.prev_sample
        cos_d = _cos(steps[declared] - x, x_next_true - x)
        cos_o = _cos(steps[other] - x, x_next_true - x)
        report[f"cos_declared@{s}"], report[f"cos_other@{s}"] = cos_d, cos_o
        if not (cos_d > min_cos and cos_d > cos_o):
            raise StartupCheckError(
                f"time convention: a step through the declared convention "
                f"({declared.value}) does not follow the sigma-convention step at sigma={s} "
                f"(cosine {cos_d:.3f}; the other convention gives {cos_o:.3f})",
                field="adapter.time_convention", expected=f"cosine > {min_cos} and > other",
                actual=declared.value)
    return report


@torch.no_grad()
def check_time_convention_scheduler(learner: Learner, prompts: Sequence[PromptBundle],
                                    sampling, seed: int = 0, atol: float = 1e-5,
                                    handles: Sequence | None = None,
                                    media: Sequence[Mapping] | None = None) -> dict[str, float]:
    """For a checkpoint family: every step of the project's denoising step (declared time
    convention -> model time, velocity sign, Euler step) must equal the checkpoint's own
    diffusers scheduler stepping the model's raw output at the pipeline's timestep. Valid for
    any weights (a random checkpoint too); a flipped declaration fails it. `media`: each
    prompt's condition media (an edit's source), in its condition and forward inputs."""
    family = learner.family
    denoiser = family.denoiser
    scheduler = family.pipeline_scheduler(sampling)
    device = learner.device
    sigmas = family.sigmas(sampling).to(device)
    rows = len(prompts)
    cond = prompt_conditions(learner, prompts, handles, media=media)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((rows, *family.codec.state_shape(sampling)), generator=gen).to(device)
    media = forward_media(learner, sampling, media, [1] * rows)
    guidance = Guidance.conditional(family.spec.guidance, rows)   # one raw forward per step
    worst_time = worst_step = 0.0
    with learner.policy(PolicyRole.REFERENCE) as models:
        for i in range(sampling.num_steps):
            sigma, sigma_next = sigmas[i].expand(rows), sigmas[i + 1].expand(rows)
            ours = denoise_step(denoiser, models, x, sigma, sigma_next, cond, guidance,
                                SamplerKind.ODE, 0.0, media=media).prev_sample
            t = scheduler.timesteps[i]
            time = denoiser.model_time_scale * (sigma if denoiser.time_convention ==
                                                TimeConvention.NOISE_LEVEL else 1 - sigma)
            embedded = guidance.scale if guidance.kind is GuidanceKind.EMBEDDED else None
            dtype = model_dtype(models)
            raw = denoiser.forward(models, x.to(dtype), sigma, t.expand(rows).to(device),
                                   cond.to(device, dtype), media and {
                                       k: m.to(dtype) if m.is_floating_point() else m
                                       for k, m in media.items()},
                                   None if embedded is None else embedded.to(device))
            theirs = scheduler.step(raw.float(), t, x, return_dict=False)[0]
            worst_time = max(worst_time, float((time - t).abs().max()))
            worst_step = max(worst_step, float((ours - theirs).abs().max()))
            x = theirs
    report = {"scheduler_time_max_diff": worst_time, "scheduler_step_max_diff": worst_step}
    if worst_time > atol * denoiser.model_time_scale or worst_step > atol:
        raise StartupCheckError(
            "time convention: the declared convention does not step as the checkpoint's own "
            f"scheduler does (time diff {worst_time:.3g}, step diff {worst_step:.3g})",
            field="adapter.time_convention", expected=f"<= {atol}",
            actual=TimeConvention(denoiser.time_convention).value)
    return report


# ---- (b) LoRA map -------------------------------------------------------------------------------
def probe_lora(learner: Learner, seed: int = 0, std_b: float = 0.05
               ) -> tuple[dict[str, torch.Tensor], float]:
    """Random A and B (B nonzero, unlike an init) on every declared target, exported names."""
    tensors, scale = learner.export()
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        std = (1.0 / t.shape[0]) ** 0.5 if ".lora_A." in name else std_b
        out[name] = torch.randn(t.shape, generator=gen) * std
    return out, scale


def merged_copy(learner: Learner, tensors: Mapping[str, torch.Tensor],
                scale: float) -> dict[str, torch.nn.Module]:
    """Copies of the training-form transformer(s) with W += scale * B A merged into each target
    (tensor names as Learner.export writes them)."""
    out = {}
    for component, model in learner.models.items():
        prefix = "" if len(learner.models) == 1 else f"{component}."
        merged = copy.deepcopy(model)
        with torch.no_grad():
            for name, layer in lora_layers(merged):
                a = tensors[f"{prefix}{name}.lora_A.weight"]
                b = tensors[f"{prefix}{name}.lora_B.weight"]
                layer.base_layer.weight.add_(scale * (b @ a))
        out[component] = merged
    return out


@torch.no_grad()
def sample_local_ode(learner: Learner, models: Mapping[str, torch.nn.Module],
                     prompts: Sequence[PromptBundle], seeds: Sequence[int], num_steps: int,
                     sampling, handles: Sequence | None = None,
                     uncond_handles: Sequence | None = None,
                     media: Sequence[Mapping] | None = None) -> torch.Tensor:
    """Local ODE rollout with the project's noise, schedule and step function: (P*G, *S).
    handles / uncond_handles: the prompts' conditions from the encoder stage; `media`: each
    prompt's condition media (an edit's source), as the graph's requests carried them."""
    family = learner.family
    group = len(seeds) // len(prompts)
    repeats = [group] * len(prompts)
    cond = prompt_conditions(learner, prompts, handles, media=media).repeat_rows(repeats)
    device = learner.device
    x = initial_noise(list(seeds), family.codec.state_shape(sampling)).to(device)
    sigmas = family.sigmas(sampling.model_copy(update={"num_steps": num_steps})).to(device)
    uncond = None                                   # guided as the graph's requests were
    if doubles_rows(family.spec.guidance, sampling.guidance_scale):
        uncond = prompt_conditions(learner, prompts, uncond_handles, True,
                                   media).repeat_rows(repeats)
    guidance = learner.guidance(x.shape[0], sampling.guidance_scale, uncond)
    media = forward_media(learner, sampling, media, repeats)
    with _reference(models):                                       # merged base weights only
        for i in range(num_steps):
            sigma, sigma_next = sigmas[i].expand(x.shape[0]), sigmas[i + 1].expand(x.shape[0])
            x = denoise_step(family.denoiser, models, x, sigma, sigma_next, cond, guidance,
                             SamplerKind.ODE, 0.0, media=media).prev_sample
    return x.cpu()


def local_ode_with_probe(learner: Learner, tensors_ref, scale: float,
                         prompts: Sequence[PromptBundle], seeds: Sequence[int], num_steps: int,
                         sampling, handles: Sequence | None = None,
                         uncond_handles: Sequence | None = None,
                         media: Sequence[Mapping] | None = None) -> torch.Tensor:
    """The LoRA map check's local side on the learner: its transformer(s) with the probe
    adapter (an object ref, or the tensors) merged in, sampled by `sample_local_ode`."""
    import ray
    tensors = ray.get(tensors_ref).unpack() if isinstance(tensors_ref, ray.ObjectRef) \
        else tensors_ref
    return sample_local_ode(learner, merged_copy(learner, tensors, scale), prompts, seeds,
                            num_steps, sampling, handles, uncond_handles, media)


def probe_lora_ref(learner: Learner, seed: int = 0) -> tuple[object, float]:
    """`probe_lora` put into the object store (the controller publishes the reference)."""
    import ray
    from contract import PackedTensors
    tensors, scale = probe_lora(learner, seed)
    return ray.put(PackedTensors.pack(tensors)), scale


@contextmanager
def _reference(models: Mapping[str, torch.nn.Module]) -> Iterator[None]:
    """Adapters disabled on every model (the base weights, here with a LoRA merged in)."""
    with ExitStack() as stack:
        for model in models.values():
            if lora_layers(model):        # an expert the adapter leaves out has no LoRA
                stack.enter_context(use_policy(model, PolicyRole.REFERENCE))
        yield


def check_lora_map(graph_states: torch.Tensor, base_states: torch.Tensor,
                   local_states: torch.Tensor, atol: float) -> dict[str, float]:
    """Compare the graph's probe rollout with the local merged rollout (all (B, *S))."""
    diff = float((graph_states - local_states).abs().max())
    effect = float((graph_states - base_states).abs().max())
    report = {"lora_probe_max_diff": diff, "lora_probe_effect": effect}
    if effect <= 10 * atol:
        raise StartupCheckError("the probe LoRA did not change the graph's rollout: the map "
                                "matched nothing", field="lora_map",
                                expected=f"effect > {10 * atol}", actual=effect)
    if diff > atol:
        raise StartupCheckError("the graph applies the probe LoRA differently from merging it "
                                "into the training-form weights", field="lora_map",
                                expected=f"max |diff| <= {atol}", actual=diff)
    return report


# ---- (c) token ids -------------------------------------------------------------------------------
def check_token_ids(held: Sequence[PromptBundle], outputs: Sequence[RolloutOutput],
                    encoders: tuple[str, ...] | None = None) -> int:
    """The ids each request's encoders saw (output metadata, per encoder) must equal the ids
    the trainer holds for every encoder; `encoders`: the family's encoder names (None = the
    names the graph reported)."""
    for bundle, out in zip(held, outputs):
        seen = out.metadata.get("encoded_token_ids")
        names = encoders or tuple(k for k in (seen or {}) if not k.startswith("negative/"))
        if not seen or not names:
            raise StartupCheckError("the graph did not report the token ids its encoder saw",
                                    field="encoded_token_ids", expected=list(bundle.token_ids),
                                    actual=None, request_id=out.request_id)
        for name, ids in bundle.ids_by_encoder(names).items():
            if tuple(seen.get(name, ())) != tuple(ids):
                raise StartupCheckError("the encoder saw other token ids than the trainer holds",
                                        field=f"encoded_token_ids.{name}", expected=list(ids),
                                        actual=list(seen.get(name, ())),
                                        request_id=out.request_id)
        if bundle.negative is not None and any(k.startswith("negative/") for k in seen):
            for name, ids in bundle.negative.ids_by_encoder(names).items():
                if tuple(seen.get(f"negative/{name}", ())) != tuple(ids):
                    raise StartupCheckError("the encoder saw other negative-prompt ids than the "
                                            "trainer holds", field=f"encoded_token_ids."
                                            f"negative/{name}", expected=list(ids),
                                            actual=list(seen.get(f"negative/{name}", ())),
                                            request_id=out.request_id)
    return len(held)


# ---- per step: log-prob parity ----------------------------------------------------------------
@torch.no_grad()
def logprob_mismatch(learner: Learner, trajectory, cond, version_tensors: Callable[[str], dict],
                     versions: Sequence[str], tol: float, uncond=None,
                     media: Mapping[str, torch.Tensor] | None = None) -> dict[str, float]:
    """Recompute the first window step's log-prob with the sampled version's weights (held in the
    old adapter) on the stored fp32 trajectory; |ratio - 1| must be <= tol."""
    if trajectory is None or trajectory.window[1] <= trajectory.window[0]:
        return {}
    j = trajectory.window[0]
    sigma = trajectory.sigmas[j].expand(trajectory.latents.shape[0])
    lp = torch.empty(trajectory.latents.shape[0])
    from trainer.rollout_batch import ConditionRows
    if isinstance(cond, ConditionRows):          # the encoder stage's, fetched here
        cond = cond.fetch(learner.condition_signature)
        uncond = None if uncond is None else uncond.fetch(learner.condition_signature)
    for version in dict.fromkeys(versions):
        rows = torch.tensor([v == version for v in versions])
        with learner.as_old(version_tensors(version)):
            index = rows.nonzero().flatten()
            v = learner.velocity(trajectory.latents[rows, 0], sigma[rows],
                                 cond.index_select(index), PolicyRole.OLD,
                                 trajectory.guidance_scale,
                                 None if uncond is None else uncond.index_select(index),
                                 {k: v[index] for k, v in (media or {}).items()} or None)
        sub = _rows(trajectory, rows)
        lp[rows] = recompute_step(sub, j, v.cpu()).log_prob     # on the stored CPU trajectory
    diff = (lp - trajectory.log_probs[:, 0]).abs()
    ratio_err = float((torch.exp(lp - trajectory.log_probs[:, 0]) - 1).abs().max())
    if ratio_err > tol:
        raise StartupCheckError("trainer and rollout log-probs differ at version parity",
                                field="log_prob", expected=f"|ratio - 1| <= {tol}",
                                actual=ratio_err)
    return {"logprob_absdiff_max": float(diff.max()), "logprob_absdiff_mean": float(diff.mean()),
            "logprob_ratio_err_max": ratio_err}


def logprob_mismatch_by_ref(learner: Learner, trajectory, cond, version_refs: Mapping,
                            versions: Sequence[str], tol: float, uncond=None,
                            media: Mapping[str, torch.Tensor] | None = None) -> dict[str, float]:
    """`logprob_mismatch` on a learner worker: each sampled version's tensors fetched from the
    object store by reference (version -> ObjectRef[PackedTensors])."""
    import ray
    return logprob_mismatch(learner, trajectory, cond,
                            lambda version: ray.get(version_refs[version]).unpack(), versions,
                            tol, uncond, media)


def _rows(trajectory, rows: torch.Tensor):
    return dataclasses.replace(trajectory, latents=trajectory.latents[rows],
                               log_probs=trajectory.log_probs[rows])
