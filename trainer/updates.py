"""One optimizer step per algorithm on a batch of rollouts (the glue between the graph's outputs
and the pure losses in trainer/algorithms).

    batch = build_batch(learner, prompts, outputs, sampling)
    metrics = UPDATES[Algorithm.NFT](learner, batch, cfg, generator)

Shapes: B = rows (prompts x group size), *S = sampler state, W = window steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from adapters.base import TextCondition
from contract import (Algorithm, InvalidRequestError, PromptBundle, RolloutOutput, SamplingSpec,
                      Trajectory)
from diffusion.schedule import flow_match_sigmas
from trainer.algorithms import (best_worst_pairs, dpo_loss, dpo_pair_inputs, flow_grpo_loss,
                                group_advantages, nft_loss, optimality_probability,
                                recompute_step, sample_pair_sigmas, trainable_step_indices,
                                transition_kl, velocity_kl, KLTarget)
from trainer.config import TrainerConfig
from trainer.learner import Learner, repeat_rows, state_from_latents
from trainer.lora import PolicyRole


@dataclass(frozen=True)
class Batch:
    """Rollouts of one step, flattened to rows."""

    x0: torch.Tensor                   # (B, *S) final clean sampler state
    rewards: torch.Tensor              # (B,) total reward
    group_ids: tuple[str, ...]         # B prompt/request ids
    cond: TextCondition                # (B, L, D) trainer-side condition of each row
    trajectory: Trajectory | None      # rows concatenated; None for ODE rollouts
    versions: tuple[str, ...]          # B policy versions the rows were sampled with
    scores: dict[str, list[float]]     # '<scorer>/<score>' -> values of OK rows
    sampling: SamplingSpec             # of the first request (all share the settings)

    @property
    def rows(self) -> int:
        return int(self.x0.shape[0])


def _cat_trajectories(trajs: Sequence[Trajectory]) -> Trajectory | None:
    if any(t is None for t in trajs):
        return None
    head = trajs[0]
    for t in trajs[1:]:
        if t.window != head.window or not torch.equal(t.sigmas, head.sigmas):
            raise InvalidRequestError("rollouts of one batch use different windows/schedules",
                                      field="trajectory.window", expected=head.window,
                                      actual=t.window)
    return Trajectory(latents=torch.cat([t.latents for t in trajs]), sigmas=head.sigmas,
                      model_timesteps=head.model_timesteps,
                      log_probs=torch.cat([t.log_probs for t in trajs]), window=head.window,
                      sampler=head.sampler, noise_level=head.noise_level,
                      guidance_scale=head.guidance_scale,
                      seeds=tuple(s for t in trajs for s in t.seeds),
                      policy_version=head.policy_version)


def build_batch(learner: Learner, prompts: Sequence[PromptBundle],
                outputs: Sequence[RolloutOutput], samplings: Sequence[SamplingSpec]) -> Batch:
    """Flatten RolloutOutputs (one per prompt) into rows; the condition is re-encoded by the
    trainer from the same PromptBundles that were sent."""
    adapter = learner.adapter
    states, rewards, groups, versions = [], [], [], []
    scores: dict[str, list[float]] = {}
    for out, sampling in zip(outputs, samplings):
        if out.rewards is None:
            raise InvalidRequestError("rollout came back without rewards (no scorer configured)",
                                      field="rewards", request_id=out.request_id)
        latents = {n: a.data for n, a in out.artifacts.items() if a.spec.representation.value
                   == "latent"}
        states.append(state_from_latents(adapter, latents, sampling))
        rewards.extend(out.rewards.total)
        groups.extend([out.request_id] * len(out.seeds))
        versions.extend([out.policy_version] * len(out.seeds))
        for name, so in out.rewards.by_scorer.items():
            for key, values in so.scores.items():
                scores.setdefault(f"{name}/{key}", []).extend(v for v in values if v is not None)
    repeats = [len(o.seeds) for o in outputs]
    cond = repeat_rows(learner.encode(prompts), repeats)
    return Batch(torch.cat(states), torch.tensor(rewards, dtype=torch.float32), tuple(groups),
                 cond, _cat_trajectories([o.trajectory for o in outputs]), tuple(versions),
                 scores, samplings[0])


# ---- DiffusionNFT ---------------------------------------------------------------------------
def nft_update(learner: Learner, batch: Batch, cfg: TrainerConfig,
               gen: torch.Generator) -> dict[str, float]:
    """Forward-process NFT: fresh noise at schedule noise levels; v_theta / v_old / v_ref."""
    c = cfg.nft
    adv = group_advantages(batch.rewards, batch.group_ids, adv_clip_max=c.adv_clip_max)  # (B,)
    r = optimality_probability(adv, c.adv_clip_max, c.adv_mode)                            # (B,)
    sigmas = flow_match_sigmas(cfg.sampler.num_steps, learner.adapter.schedule_shift)[:-1]
    x0 = batch.x0
    totals: dict[str, float] = {}
    for _ in range(c.train_timesteps):
        idx = torch.randint(len(sigmas), (batch.rows,), generator=gen)
        sigma = sigmas[idx]                                                               # (B,)
        eps = torch.randn(x0.shape, generator=gen)
        s = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
        x_sigma = (1 - s) * x0 + s * eps
        with torch.no_grad():
            v_old = learner.velocity(x_sigma, sigma, batch.cond, PolicyRole.OLD)
            v_ref = (learner.velocity(x_sigma, sigma, batch.cond, PolicyRole.REFERENCE)
                     if c.ref_kl_coef > 0 else None)
        v_theta = learner.velocity(x_sigma, sigma, batch.cond, PolicyRole.CURRENT)
        out = nft_loss(v_theta, v_old, x_sigma, x0, sigma, r, beta=c.beta,
                       adv_clip_max=c.adv_clip_max, v_ref=v_ref, ref_kl_coef=c.ref_kl_coef)
        (out.loss / c.train_timesteps).backward()
        for k, v in out.metrics().items():
            totals[k] = totals.get(k, 0.0) + v / c.train_timesteps
    totals["grad_norm"] = learner.step()
    totals["nft_r_mean"] = float(r.mean())
    totals["nft_r_abs_dev"] = float((r - 0.5).abs().mean())
    return totals


# ---- FlowGRPO -------------------------------------------------------------------------------
def grpo_update(learner: Learner, batch: Batch, cfg: TrainerConfig,
                gen: torch.Generator) -> dict[str, float]:
    """Clipped surrogate on the stored fp32 window transitions (rollout log-probs are old)."""
    c, traj = cfg.flow_grpo, batch.trajectory
    if traj is None:
        raise InvalidRequestError("flow_grpo needs stored trajectories", field="trajectory")
    adv = group_advantages(batch.rewards, batch.group_ids, adv_clip_max=c.adv_clip_max)
    steps = trainable_step_indices(traj.sigmas, traj.window, c.max_train_steps)
    totals: dict[str, float] = {}
    start = traj.window[0]
    for j in steps:
        sigma = traj.sigmas[j].expand(batch.rows)
        x_j = traj.latents[:, j - start]
        v = learner.velocity(x_j, sigma, batch.cond, PolicyRole.CURRENT, traj.guidance_scale)
        out = recompute_step(traj, j, v)
        kl = None
        if c.kl_beta > 0:
            with torch.no_grad():
                v_ref = learner.velocity(x_j, sigma, batch.cond, PolicyRole.REFERENCE,
                                         traj.guidance_scale)
            if c.kl_target is KLTarget.VELOCITY:
                kl = velocity_kl(v, v_ref)
            else:
                ref = recompute_step(traj, j, v_ref)
                kl = transition_kl(out, ref)
        loss = flow_grpo_loss(out.log_prob, traj.log_probs[:, j - start], adv,
                              clip_range=c.clip_range, adv_clip_max=c.adv_clip_max, kl=kl,
                              kl_beta=c.kl_beta)
        (loss.loss / len(steps)).backward()
        for k, val in loss.metrics().items():
            totals[k] = totals.get(k, 0.0) + val / len(steps)
    totals["grad_norm"] = learner.step()
    totals["trained_window_steps"] = float(len(steps))
    return totals


# ---- Diffusion-DPO --------------------------------------------------------------------------
def dpo_update(learner: Learner, batch: Batch, cfg: TrainerConfig,
               gen: torch.Generator) -> dict[str, float]:
    """(best, worst) pair per prompt; shared eps and sigma per pair; reference = base model."""
    pairs = best_worst_pairs(batch.rewards, batch.group_ids)
    if pairs.num_pairs == 0:   # every group tied: no preference, no step (counted, not faked)
        return {"dpo_pairs": 0.0, "skipped_no_pairs": 1.0}
    x_w, x_l = batch.x0[pairs.winner], batch.x0[pairs.loser]
    cond = batch.cond.index_select(torch.cat([pairs.winner, pairs.loser]))
    totals: dict[str, float] = {}
    draws = cfg.dpo.draws_per_pair
    for _ in range(draws):
        sigma = sample_pair_sigmas(pairs.num_pairs, shift=learner.adapter.schedule_shift,
                                   generator=gen)                                         # (P,)
        noise = torch.randn(x_w.shape, generator=gen)
        inp = dpo_pair_inputs(x_w, x_l, noise, sigma)
        x_in, s_in = torch.cat([inp.x_winner, inp.x_loser]), torch.cat([sigma, sigma])
        v = learner.velocity(x_in, s_in, cond, PolicyRole.CURRENT)
        with torch.no_grad():
            v_ref = learner.velocity(x_in, s_in, cond, PolicyRole.REFERENCE)
        p = pairs.num_pairs
        out = dpo_loss(v[:p], v[p:], v_ref[:p], v_ref[p:], inp.target_winner, inp.target_loser,
                       beta=cfg.dpo.beta)
        (out.loss / draws).backward()
        for k, val in out.metrics().items():
            totals[k] = totals.get(k, 0.0) + val / draws
    totals["grad_norm"] = learner.step()
    totals["dpo_pairs"] = float(pairs.num_pairs)
    return totals


UPDATES: dict[Algorithm, Callable[[Learner, Batch, TrainerConfig, torch.Generator],
                                  dict[str, float]]] = {
    Algorithm.NFT: nft_update,
    Algorithm.FLOW_GRPO: grpo_update,
    Algorithm.DPO: dpo_update,
}
