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
"""
from __future__ import annotations

import copy
from typing import Callable, Mapping, Sequence

import torch

from contract import PromptBundle, RolloutOutput, SamplerKind, StartupCheckError, TimeConvention
from diffusion.conventions import model_time, to_sigma_velocity
from diffusion.noise import initial_noise
from diffusion.samplers import ode_step
from diffusion.schedule import flow_match_sigmas
from trainer.algorithms import recompute_step
from trainer.learner import Learner, repeat_rows
from trainer.lora import PolicyRole, lora_layers, use_policy

PROBE_SIGMAS = (0.5, 0.75)


# ---- (a) time convention ----------------------------------------------------------------------
def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


@torch.no_grad()
def check_time_convention(learner: Learner, x0: torch.Tensor, prompts: Sequence[PromptBundle],
                          min_cos: float = 0.3, seed: int = 0) -> dict[str, float]:
    """x0: (B, *S) clean latents of real media with their prompts. Returns cosines per sigma."""
    adapter = learner.adapter
    declared = TimeConvention(adapter.time_convention)
    other = next(c for c in TimeConvention if c != declared)
    cond = learner.encode(prompts)
    gen = torch.Generator().manual_seed(seed)
    eps = torch.randn(x0.shape, generator=gen)
    report: dict[str, float] = {}
    for s in PROBE_SIGMAS:
        sigma, sigma_next = torch.full((x0.shape[0],), s), torch.full((x0.shape[0],), s - 0.25)
        x = (1 - s) * x0 + s * eps                                     # forward process
        x_next_true = (1 - (s - 0.25)) * x0 + (s - 0.25) * eps         # sigma convention
        steps = {}
        for conv in (declared, other):
            with use_policy(learner.transformer, PolicyRole.REFERENCE):
                raw = adapter.model_forward(learner.transformer, x,
                                            model_time(sigma, conv, adapter.model_time_scale), cond)
            steps[conv] = ode_step(x, to_sigma_velocity(raw, conv), sigma, sigma_next).prev_sample
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
                scale: float) -> torch.nn.Module:
    """A copy of the training-form transformer with W += scale * B A merged into each target."""
    model = copy.deepcopy(learner.transformer)
    with torch.no_grad():
        for name, layer in lora_layers(model):
            a, b = tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"]
            layer.base_layer.weight.add_(scale * (b @ a))
    return model


@torch.no_grad()
def sample_local_ode(learner: Learner, model: torch.nn.Module, prompts: Sequence[PromptBundle],
                     seeds: Sequence[int], num_steps: int, sampling) -> torch.Tensor:
    """Local ODE rollout with the project's noise/schedule/convention code: (P*G, *S)."""
    adapter = learner.adapter
    group = len(seeds) // len(prompts)
    cond = repeat_rows(learner.encode(prompts), [group] * len(prompts))
    x = initial_noise(list(seeds), adapter.state_shape(sampling))
    sigmas = flow_match_sigmas(num_steps, adapter.schedule_shift)
    with use_policy(model, PolicyRole.REFERENCE):                   # merged base weights only
        for i in range(num_steps):
            sigma, sigma_next = sigmas[i].expand(x.shape[0]), sigmas[i + 1].expand(x.shape[0])
            raw = adapter.model_forward(model, x, model_time(sigma, adapter.time_convention,
                                                             adapter.model_time_scale), cond)
            x = ode_step(x, to_sigma_velocity(raw, adapter.time_convention), sigma,
                         sigma_next).prev_sample
    return x


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
def check_token_ids(held: Sequence[PromptBundle], outputs: Sequence[RolloutOutput]) -> int:
    """The ids each request's encoder saw (output metadata) must equal the held ids."""
    for bundle, out in zip(held, outputs):
        seen = out.metadata.get("encoded_token_ids")
        if seen is None:
            raise StartupCheckError("the graph did not report the token ids its encoder saw",
                                    field="encoded_token_ids", expected=list(bundle.token_ids),
                                    actual=None, request_id=out.request_id)
        if tuple(seen) != tuple(bundle.token_ids):
            raise StartupCheckError("the encoder saw other token ids than the trainer holds",
                                    field="encoded_token_ids", expected=list(bundle.token_ids),
                                    actual=list(seen), request_id=out.request_id)
    return len(held)


# ---- per step: log-prob parity ----------------------------------------------------------------
@torch.no_grad()
def logprob_mismatch(learner: Learner, trajectory, cond, version_tensors: Callable[[str], dict],
                     versions: Sequence[str], tol: float) -> dict[str, float]:
    """Recompute the first window step's log-prob with the sampled version's weights (held in the
    old adapter) on the stored fp32 trajectory; |ratio - 1| must be <= tol."""
    if trajectory is None or trajectory.window[1] <= trajectory.window[0]:
        return {}
    j = trajectory.window[0]
    sigma = trajectory.sigmas[j].expand(trajectory.latents.shape[0])
    lp = torch.empty(trajectory.latents.shape[0])
    for version in dict.fromkeys(versions):
        rows = torch.tensor([v == version for v in versions])
        with learner.as_old(version_tensors(version)):
            v = learner.velocity(trajectory.latents[rows, 0], sigma[rows], cond.index_select(
                rows.nonzero().flatten()), PolicyRole.OLD, trajectory.guidance_scale)
        sub = _rows(trajectory, rows)
        lp[rows] = recompute_step(sub, j, v).log_prob
    diff = (lp - trajectory.log_probs[:, 0]).abs()
    ratio_err = float((torch.exp(lp - trajectory.log_probs[:, 0]) - 1).abs().max())
    if ratio_err > tol:
        raise StartupCheckError("trainer and rollout log-probs differ at version parity",
                                field="log_prob", expected=f"|ratio - 1| <= {tol}",
                                actual=ratio_err)
    return {"logprob_absdiff_max": float(diff.max()), "logprob_absdiff_mean": float(diff.mean()),
            "logprob_ratio_err_max": ratio_err}


def _rows(trajectory, rows: torch.Tensor):
    import dataclasses
    return dataclasses.replace(trajectory, latents=trajectory.latents[rows],
                               log_probs=trajectory.log_probs[rows])
