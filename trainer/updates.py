"""One optimizer step per algorithm on a batch of rollouts (the glue between the graph's outputs
and the pure losses in trainer/algorithms).

    batch = build_batch(learner, prompts, outputs, sampling)
    metrics = UPDATES[Algorithm.NFT](learner, batch, cfg, generator)

Shapes: B = rows (prompts x group size), *S = sampler state, W = window steps.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

from contract import (Algorithm, Condition, InvalidRequestError, MediaRole, PromptBundle,
                      RolloutOutput, RolloutRequest, SamplingSpec, normalize_media,
                      Trajectory)
from trainer.algorithms import (StdScope, best_worst_pairs, dpo_loss, dpo_pair_inputs,
                                flow_grpo_loss, group_advantages, nft_loss, nft_timestep_indices,
                                optimality_probability, per_reward_advantages, recompute_step,
                                sample_pair_sigmas, trainable_step_indices, transition_kl,
                                velocity_kl, zero_advantage_groups, KLTarget)
from diffusion.step import doubles_rows
from trainer.config import TrainerConfig
from trainer.learner import Learner, state_from_latents
from trainer.lora import PolicyRole


@dataclass(frozen=True)
class Batch:
    """Rollouts of one step, flattened to rows."""

    x0: torch.Tensor                   # (B, *S) final clean sampler state
    rewards: torch.Tensor              # (B,) total reward
    group_ids: tuple[str, ...]         # B prompt/request ids
    cond: Condition                    # B rows: the trainer-side condition of each row
    trajectory: Trajectory | None      # all rows, when they share one window; else None
    versions: tuple[str, ...]          # B policy versions the rows were sampled with
    scores: dict[str, list[float]]     # '<scorer>/<score>' -> values of OK rows
    sampling: SamplingSpec             # of the first request (all share the settings)
    # per-scorer values that entered the total, (B,) each, NaN where MISSING; and their weights
    reward_values: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    reward_weights: dict[str, float] = dataclasses.field(default_factory=dict)
    # rows sharing one SDE window (Flow-GRPO-Fast draws one per prompt group): (rows (R,), the
    # rows' trajectories concatenated); empty for ODE rollouts
    window_groups: tuple[tuple[torch.Tensor, Trajectory], ...] = ()
    uncond: Condition | None = None    # B rows of CFG's unconditional branch; None without CFG
    inputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # the forward's
    # per-request inputs (condition media, position ids), (B, ...) each, as the rollout had them

    @property
    def rows(self) -> int:
        return int(self.x0.shape[0])

    def select(self, index: torch.Tensor) -> "Batch":
        """The rows `index` (ascending int64), every per-row field with them."""
        position = torch.full((self.rows,), -1, dtype=torch.long)
        position[index] = torch.arange(index.shape[0])
        groups = []
        for rows, traj in self.window_groups:
            keep = position[rows] >= 0
            if keep.any():
                groups.append((position[rows][keep], _traj_rows(traj, keep)))
        groups = tuple(groups)
        whole = groups[0][1] if len(groups) == 1 else None
        return dataclasses.replace(
            self, x0=self.x0[index], rewards=self.rewards[index],
            group_ids=tuple(self.group_ids[i] for i in index.tolist()),
            cond=self.cond.index_select(index), trajectory=whole,
            uncond=None if self.uncond is None else self.uncond.index_select(index),
            inputs={k: v[index] for k, v in self.inputs.items()},
            versions=tuple(self.versions[i] for i in index.tolist()),
            reward_values={k: v[index] for k, v in self.reward_values.items()},
            window_groups=groups)


def _traj_rows(traj: Trajectory, keep: torch.Tensor) -> Trajectory:
    return dataclasses.replace(traj, latents=traj.latents[keep], log_probs=traj.log_probs[keep],
                               seeds=tuple(s for s, k in zip(traj.seeds, keep.tolist()) if k))


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


def _window_groups(trajs: Sequence[Trajectory | None], repeats: Sequence[int]
                   ) -> tuple[tuple[torch.Tensor, Trajectory], ...]:
    """Rows grouped by their SDE window (first-seen order), trajectories concatenated."""
    if any(t is None for t in trajs):
        return ()
    starts = [sum(repeats[:i]) for i in range(len(repeats))]
    by_window: dict[tuple[int, int], list[int]] = {}
    for i, t in enumerate(trajs):
        by_window.setdefault(tuple(t.window), []).append(i)
    return tuple((torch.cat([torch.arange(starts[i], starts[i] + repeats[i]) for i in members]),
                  _cat_trajectories([trajs[i] for i in members]))
                 for members in by_window.values())


def canonical_media(requests: Sequence[RolloutRequest]) -> list[dict[MediaRole, torch.Tensor]]:
    """Each request's condition media under their canonical roles (as the graph reads them)."""
    return [{role: item.data for role, item in
             normalize_media(r.media, r.task, r.request_id).items()} for r in requests]


def build_batch(learner: Learner, prompts: Sequence[PromptBundle],
                outputs: Sequence[RolloutOutput], samplings: Sequence[SamplingSpec],
                media: Sequence[Mapping[MediaRole, torch.Tensor] | None] | None = None) -> Batch:
    """Flatten RolloutOutputs (one per prompt) into rows; the condition is re-encoded by the
    trainer from the same PromptBundles that were sent, the per-request forward inputs from
    the same condition media (`media[i]`, canonical roles) and sampling sizes."""
    family = learner.family
    states, rewards, groups, versions = [], [], [], []
    scores: dict[str, list[float]] = {}
    per_scorer: dict[str, list[float]] = {}
    for out, sampling in zip(outputs, samplings):
        if out.rewards is None:
            raise InvalidRequestError("rollout came back without rewards (no scorer configured)",
                                      field="rewards", request_id=out.request_id)
        latents = {n: a.data for n, a in out.artifacts.items() if a.spec.representation.value
                   == "latent"}
        states.append(state_from_latents(family, latents, sampling))
        rewards.extend(out.rewards.total)
        groups.extend([out.request_id] * len(out.seeds))
        versions.extend([out.policy_version] * len(out.seeds))
        for name, so in out.rewards.by_scorer.items():
            for key, values in so.scores.items():
                scores.setdefault(f"{name}/{key}", []).extend(v for v in values if v is not None)
        for name, vals in out.rewards.values.items():
            per_scorer.setdefault(name, []).extend(float("nan") if v is None else v for v in vals)
    repeats = [len(o.seeds) for o in outputs]
    cond = learner.encode(prompts).repeat_rows(repeats)
    uncond = None        # CFG rollouts: each row's unconditional branch, as the graph formed it
    if doubles_rows(family.spec.guidance, samplings[0].guidance_scale):
        uncond = learner.uncond(prompts).repeat_rows(repeats)
    windows = _window_groups([o.trajectory for o in outputs], repeats)
    weights = dict(outputs[0].rewards.weights)
    return Batch(torch.cat(states), torch.tensor(rewards, dtype=torch.float32), tuple(groups),
                 cond, windows[0][1] if len(windows) == 1 else None, tuple(versions),
                 scores, samplings[0],
                 {k: torch.tensor(v, dtype=torch.float64) for k, v in per_scorer.items()},
                 weights, windows, uncond,
                 learner.forward_inputs(samplings, media, repeats))


def advantages(batch: Batch, cfg: TrainerConfig, adv_clip_max: float
               ) -> tuple[Batch | None, torch.Tensor, dict[str, float]]:
    """Advantages as configured (`cfg.advantage`), clipped to +-adv_clip_max, and the batch
    without the groups whose advantages are all zero when `drop_zero_groups` (None when none is
    left). Returns (batch, (B',) advantages, metrics)."""
    a = cfg.advantage
    if a.per_reward:
        if not batch.reward_values:
            raise InvalidRequestError("per-reward advantages need the per-scorer values of the "
                                      "reward report", field="rewards.values")
        adv = per_reward_advantages(batch.reward_values, batch.reward_weights, batch.group_ids,
                                    ddof=a.ddof, eps=a.eps).clamp(-adv_clip_max, adv_clip_max)
    else:
        adv = group_advantages(batch.rewards, batch.group_ids,
                               global_std=a.std is StdScope.GLOBAL, ddof=a.ddof, eps=a.eps,
                               adv_clip_max=adv_clip_max)
    zero = zero_advantage_groups(adv, batch.group_ids)
    metrics = {"zero_adv_groups": float(len(set(g for g, z in zip(batch.group_ids, zero.tolist())
                                                 if z))),
               "adv_abs_mean": float(adv.abs().mean())}
    if not a.drop_zero_groups or not zero.any():
        return batch, adv, metrics | {"trained_rows": float(batch.rows)}
    keep = torch.nonzero(~zero).flatten()
    metrics["trained_rows"] = float(keep.shape[0])
    if keep.shape[0] == 0:
        return None, adv[keep], metrics
    return batch.select(keep), adv[keep], metrics


# ---- DiffusionNFT ---------------------------------------------------------------------------
def nft_update(learner: Learner, batch: Batch, cfg: TrainerConfig,
               gen: torch.Generator) -> dict[str, float]:
    """Forward-process NFT: fresh noise at schedule noise levels; v_theta / v_old / v_ref."""
    c = cfg.nft
    batch, adv, totals = advantages(batch, cfg, c.adv_clip_max)                         # (B,)
    if batch is None:       # every group tied: no signal, no step (counted, not faked)
        return totals | {"skipped_zero_advantage": 1.0}
    r = optimality_probability(adv, c.adv_clip_max, c.adv_mode)                            # (B,)
    sigmas = learner.family.sigmas(batch.sampling)[:-1]
    x0 = batch.x0
    order = nft_timestep_indices(batch.rows, len(sigmas), c.train_timesteps, c.timesteps, gen)
    for idx in order:                                                                 # (B,) each
        sigma = sigmas[idx]                                                               # (B,)
        eps = torch.randn(x0.shape, generator=gen)
        s = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
        x_sigma = (1 - s) * x0 + s * eps
        with torch.no_grad():
            v_old = learner.velocity(x_sigma, sigma, batch.cond, PolicyRole.OLD,
                                     media=batch.inputs)
            v_ref = (learner.velocity(x_sigma, sigma, batch.cond, PolicyRole.REFERENCE,
                                      media=batch.inputs) if c.ref_kl_coef > 0 else None)
        v_theta = learner.velocity(x_sigma, sigma, batch.cond, PolicyRole.CURRENT,
                                   media=batch.inputs)
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
    """Clipped surrogate on the stored fp32 window transitions (rollout log-probs are old).

    Rows are trained on their own window's steps (one window per prompt group under
    Flow-GRPO-Fast); each window group weighs by its share of the rows, so the loss is the mean
    over rows of the mean over that row's trained steps."""
    c = cfg.flow_grpo
    if not batch.window_groups:
        raise InvalidRequestError("flow_grpo needs stored trajectories", field="trajectory")
    batch, adv, totals = advantages(batch, cfg, c.adv_clip_max)
    if batch is None:
        return totals | {"skipped_zero_advantage": 1.0}
    trained_steps = 0.0
    for rows, traj in batch.window_groups:
        steps = trainable_step_indices(traj.sigmas, traj.window, c.max_train_steps)
        share = rows.shape[0] / batch.rows
        cond, a, start = batch.cond.index_select(rows), adv[rows], traj.window[0]
        uncond = None if batch.uncond is None else batch.uncond.index_select(rows)
        inputs = {k: v[rows] for k, v in batch.inputs.items()}
        trained_steps += share * len(steps)
        for j in steps:
            sigma = traj.sigmas[j].expand(rows.shape[0])
            x_j = traj.latents[:, j - start]
            v = learner.velocity(x_j, sigma, cond, PolicyRole.CURRENT, traj.guidance_scale,
                                 uncond, inputs)
            out = recompute_step(traj, j, v)
            kl = None
            if c.kl_beta > 0:
                with torch.no_grad():
                    v_ref = learner.velocity(x_j, sigma, cond, PolicyRole.REFERENCE,
                                             traj.guidance_scale, uncond, inputs)
                if c.kl_target is KLTarget.VELOCITY:
                    kl = velocity_kl(v, v_ref)
                else:
                    kl = transition_kl(out, recompute_step(traj, j, v_ref))
            loss = flow_grpo_loss(out.log_prob, traj.log_probs[:, j - start], a,
                                  clip_range=c.clip_range, adv_clip_max=c.adv_clip_max, kl=kl,
                                  kl_beta=c.kl_beta)
            (loss.loss * share / len(steps)).backward()
            for k, val in loss.metrics().items():
                totals[k] = totals.get(k, 0.0) + val * share / len(steps)
    totals["grad_norm"] = learner.step()
    totals["trained_window_steps"] = trained_steps
    totals["window_groups"] = float(len(batch.window_groups))
    return totals


# ---- Diffusion-DPO --------------------------------------------------------------------------
def dpo_update(learner: Learner, batch: Batch, cfg: TrainerConfig,
               gen: torch.Generator) -> dict[str, float]:
    """(best, worst) pair per prompt; shared eps and sigma per pair; reference = base model."""
    pairs = best_worst_pairs(batch.rewards, batch.group_ids)
    if pairs.num_pairs == 0:   # every group tied: no preference, no step (counted, not faked)
        return {"dpo_pairs": 0.0, "skipped_no_pairs": 1.0}
    x_w, x_l = batch.x0[pairs.winner], batch.x0[pairs.loser]
    pair_rows = torch.cat([pairs.winner, pairs.loser])
    cond = batch.cond.index_select(pair_rows)
    inputs = {k: v[pair_rows] for k, v in batch.inputs.items()}
    totals: dict[str, float] = {}
    draws = cfg.dpo.draws_per_pair
    for _ in range(draws):
        shift = learner.family.schedule_shift(batch.sampling)
        sigma = sample_pair_sigmas(pairs.num_pairs, shift=shift,
                                   generator=gen)                                         # (P,)
        noise = torch.randn(x_w.shape, generator=gen)
        inp = dpo_pair_inputs(x_w, x_l, noise, sigma)
        x_in, s_in = torch.cat([inp.x_winner, inp.x_loser]), torch.cat([sigma, sigma])
        v = learner.velocity(x_in, s_in, cond, PolicyRole.CURRENT, media=inputs)
        with torch.no_grad():
            v_ref = learner.velocity(x_in, s_in, cond, PolicyRole.REFERENCE, media=inputs)
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
