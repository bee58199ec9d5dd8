"""One optimizer step per algorithm on a batch of rollouts (the glue between the graph's outputs
and the pure losses in trainer/algorithms).

    batch = build_batch(learner, prompts, outputs, sampling)        # trainer/rollout_batch.py
    metrics = UPDATES[Algorithm.NFT](learner, batch, cfg, generator)
    # = run_update(learner, plan_update(Algorithm.NFT, batch, cfg, generator), cfg)

`plan_update` decides what the whole batch defines (advantages, dropped zero-advantage rows,
the loss's normaliser, the noise seed); `run_update` accumulates the gradient over micro-batches
of rows (`learner.micro_batch_size`) and over trained timesteps, each term pre-divided by the whole
batch's count, so micro-batches and data-parallel shards (`shard_plan`) sum to the same step.
Shapes: B = rows (prompts x group size), *S = sampler state, W = window steps.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch

from contract import Algorithm, InvalidRequestError, PolicyVersionError
from trainer.algorithms import (StdScope, awm_log_prob, awm_loss, best_worst_pairs, dpo_loss,
                                dpo_pair_inputs,
                                flow_grpo_loss, group_advantages, nft_loss,
                                optimality_probability, per_reward_advantages, recompute_step,
                                trainable_step_indices, transition_kl, velocity_kl,
                                zero_advantage_groups, zero_advantage_rows, KLTarget,
                                REFERENCE_ZERO_ADVANTAGE, PolicyRatio, grpo_guard_loss,
                                reusable_rows, rollout_old_log_probs)
from trainer.algorithms.modality import stream_advantages, stream_masks
from trainer.algorithms.nft import TimestepOrder
from trainer.algorithms.tree import edge_weights, tree_advantages, tree_node_ids  # noqa: F401
from trainer.config import TrainerConfig
from trainer.learner import Learner
from trainer.lora import PolicyRole
from trainer.reporting import group_shares, ratio_report
from trainer.rollout_batch import Batch
from trainer.train_noise import Draw, pair_sigmas, row_randn, row_timesteps


def advantages(algorithm: Algorithm, batch: Batch, cfg: TrainerConfig, adv_clip_max: float
               ) -> tuple[Batch | None, torch.Tensor, dict[str, float]]:
    """Advantages as configured (`cfg.advantage`), clipped to +-adv_clip_max, and the batch
    without the zero-advantage rows `advantage.zero_advantage` leaves out (default: what the
    algorithm's reference code does, REFERENCE_ZERO_ADVANTAGE; None when no row is left).
    Returns (batch, (B',) advantages, metrics)."""
    a = cfg.advantage
    rule = a.zero_advantage or REFERENCE_ZERO_ADVANTAGE[algorithm]
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
    tied = zero_advantage_groups(adv, batch.group_ids)
    metrics = {"zero_adv_groups": float(len(set(g for g, z in zip(batch.group_ids, tied.tolist())
                                                 if z))),
               "zero_adv_rows": float((adv == 0).sum()),
               "adv_abs_mean": float(adv.abs().mean())}
    drop = zero_advantage_rows(adv, batch.group_ids, rule)
    metrics |= group_shares(batch.group_ids, tied, drop)
    if not drop.any():
        return batch, adv, metrics | {"trained_rows": float(batch.rows)}
    keep = torch.nonzero(~drop).flatten()
    metrics["trained_rows"] = float(keep.shape[0])
    if keep.shape[0] == 0:
        return None, adv[keep], metrics
    return batch.select(keep), adv[keep], metrics


# ---- one step: planned over the whole batch, accumulated per shard and micro-batch ----------
@dataclass(frozen=True)
class UpdatePlan:
    """One optimizer step as the whole batch defines it, computed once (by the controller):
    the rows to train (without the zero-advantage rows its rule leaves out), each row's loss
    input, the count the loss averages over, the seed of the rows' training draws and the
    step-wide metrics.

    A data-parallel worker runs `shard_plan(plan, rank, world)`; every loss term is divided by
    the global `total`, so the sum of the workers' gradients (and metric sums) is the whole
    batch's, for any worker count and any micro-batch size."""

    algorithm: Algorithm
    batch: Batch | None            # the rows to train here; None: none (here, or at all: skip)
    values: torch.Tensor | None    # (B,) NFT: optimality r; FlowGRPO: advantages; DPO: None
    total: int                     # rows (NFT, FlowGRPO) or pairs (DPO) of the whole batch
    noise_seed: int                # the rows' training draws (trainer/train_noise.py)
    metrics: dict[str, float]      # step-wide metrics (identical on every worker)
    skip: bool = False             # nothing to train anywhere: no optimizer step
    pad_units: int = 0             # zero-weight micro-batches after its own, so every worker
    pad: Batch | None = None       # runs the same forwards (FSDP); rows for them if it has none
    old_version: str | None = None  # FlowGRPO: the version of the learner's policy before this
    # step (its old policy): rows it sampled may keep their rollout log-probs (OldLogProbs)
    edge_weights: torch.Tensor | None = None  # branched rollouts: (B, N) weight of row b's step
    # j (a transition shared by k rows weighs 1/k each); values then (B, N+1) per-node advantages


def plan_update(algorithm: Algorithm, batch: Batch, cfg: TrainerConfig,
                gen: torch.Generator, old_version: str | None = None) -> UpdatePlan:
    """Advantages / pairs over the whole batch and one noise seed from `gen`. old_version: the
    version the learner's current (pre-step) weights were published as; None = the batch's
    one sampling version (a batch the learner sampled itself; several versions need it)."""
    algorithm = Algorithm(algorithm)
    if batch.node_of is not None:           # branch rollouts: per-node advantages (Tree GRPO)
        if algorithm is not Algorithm.FLOW_GRPO:
            raise InvalidRequestError("branch rollouts train with flow_grpo's per-node "
                                      "advantages", field="algorithm",
                                      expected=Algorithm.FLOW_GRPO.value,
                                      actual=algorithm.value)
        return plan_tree_update(batch, cfg, gen, batch.node_of, old_version)
    noise_seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    if algorithm is Algorithm.DPO:
        pairs = best_worst_pairs(batch.rewards, batch.group_ids)
        if pairs.num_pairs == 0:   # every group tied: no preference, no step (counted)
            return UpdatePlan(algorithm, None, None, 0, noise_seed,
                              {"dpo_pairs": 0.0, "skipped_no_pairs": 1.0}, skip=True)
        return UpdatePlan(algorithm, batch, None, pairs.num_pairs, noise_seed,
                          {"dpo_pairs": float(pairs.num_pairs)})
    if algorithm is Algorithm.FLOW_GRPO and not batch.window_groups:
        raise InvalidRequestError("flow_grpo needs stored trajectories", field="trajectory")
    clip = {Algorithm.NFT: cfg.nft.adv_clip_max, Algorithm.AWM: cfg.awm.adv_clip_max}.get(
        algorithm, cfg.flow_grpo.adv_clip_max)
    kept, adv, metrics = advantages(algorithm, batch, cfg, clip)                       # (B,)
    if kept is None:        # every row left out: no signal, no step (counted, not faked)
        return UpdatePlan(algorithm, None, None, 0, noise_seed,
                          metrics | {"skipped_zero_advantage": 1.0}, skip=True)
    if algorithm is Algorithm.NFT and cfg.advantage.streams:        # per-modality (B, k)
        a = cfg.advantage
        per_stream = stream_advantages(batch.reward_values, batch.reward_weights, a.streams,
                                       batch.group_ids, global_std=a.std is StdScope.GLOBAL,
                                       ddof=a.ddof, eps=a.eps, adv_clip_max=clip)
        values = torch.stack([optimality_probability(per_stream[s], cfg.nft.adv_clip_max,
                                                     cfg.nft.adv_mode) for s in a.streams], 1)
        metrics |= {f"adv_abs_mean_{s}": float(v.abs().mean()) for s, v in per_stream.items()}
    elif algorithm is Algorithm.NFT:
        values = optimality_probability(adv, cfg.nft.adv_clip_max, cfg.nft.adv_mode)    # (B,)
    if algorithm is Algorithm.NFT:
        metrics |= {"nft_r_mean": float(values.mean()),
                    "nft_r_abs_dev": float((values - 0.5).abs().mean())}
    elif algorithm is Algorithm.AWM:
        values = adv
    else:
        values = adv
        metrics["window_groups"] = float(len(kept.window_groups))
        old_version = _old_version(batch, old_version)
        reused = reusable_rows(cfg.flow_grpo.old_log_probs, kept.versions, old_version)
        metrics["old_logprob_reused_rows"] = float(reused.sum())
        return UpdatePlan(algorithm, kept, values, kept.rows, noise_seed, metrics,
                          old_version=old_version)
    return UpdatePlan(algorithm, kept, values, kept.rows, noise_seed, metrics)


def plan_tree_update(batch: Batch, cfg: TrainerConfig, gen: torch.Generator,
                     node_of: torch.Tensor, old_version: str | None = None) -> UpdatePlan:
    """FlowGRPO on branched rollouts (TreeGRPO / BranchGRPO): every row's step j trains with
    the advantage of the node it enters (`flow_grpo.tree_advantage`, trainer/algorithms/tree.py),
    clipped to +-adv_clip_max and weighted by 1 / (rows sharing that transition), so a shared
    prefix counts once. node_of: (B, N+1) the node of row b after j steps (`tree_node_ids`)."""
    if not batch.window_groups:
        raise InvalidRequestError("tree advantages train stored trajectories", field="trajectory")
    num_steps = int(batch.window_groups[0][1].sigmas.shape[0]) - 1
    if node_of.shape != (batch.rows, num_steps + 1):
        raise InvalidRequestError("one node id per row and depth", field="node_of",
                                  expected=(batch.rows, num_steps + 1),
                                  actual=tuple(node_of.shape))
    noise_seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    values = tree_advantages(node_of, batch.rewards, cfg.flow_grpo.tree_advantage)  # (B, N+1)
    weights = edge_weights(node_of)                                              # (B, N)
    old_version = _old_version(batch, old_version)
    reused = reusable_rows(cfg.flow_grpo.old_log_probs, batch.versions, old_version)
    metrics = {"tree_nodes": float(torch.unique(node_of[:, 1:]).numel()),
               "tree_edge_share": float(weights.sum() / weights.numel()),
               "adv_abs_mean": float(values[:, 1:].abs().mean()),
               "trained_rows": float(batch.rows), "window_groups": float(len(batch.window_groups)),
               "old_logprob_reused_rows": float(reused.sum())}
    return UpdatePlan(Algorithm.FLOW_GRPO, batch, values, batch.rows, noise_seed, metrics,
                      old_version=old_version, edge_weights=weights)


def _old_version(batch: Batch, old_version: str | None) -> str:
    if old_version is not None:
        return old_version
    versions = sorted(set(batch.versions))
    if len(versions) != 1:
        raise PolicyVersionError("a batch of several sampling versions needs the learner's old "
                                 "policy version stated", field="old_version",
                                 expected="one of " + ", ".join(versions), actual=None)
    return versions[0]


def shard_plan(plan: UpdatePlan, rank: int, world: int, micro_batch_size: int | None = None,
               balance: bool = False) -> UpdatePlan:
    """Worker `rank`'s part of the plan: its contiguous share of the prompt groups (as even as
    the groups left allow). balance: pad with zero-weight micro-batches up to the busiest
    worker's count (FSDP2 gathers weights in every forward, so all workers run the same)."""
    if plan.skip or world == 1:
        return plan
    groups = list(dict.fromkeys(plan.batch.group_ids))
    sizes = [len(groups) // world + (r < len(groups) % world) for r in range(world)]
    starts = [sum(sizes[:r]) for r in range(world)]
    parts = []
    for r in range(world):
        mine = set(groups[starts[r]:starts[r] + sizes[r]])
        index = torch.tensor([i for i, g in enumerate(plan.batch.group_ids) if g in mine],
                             dtype=torch.long)
        parts.append(index)
    index = parts[rank]
    batch = plan.batch.select(index) if index.numel() else None
    values = None if plan.values is None or batch is None else plan.values[index]
    weights = None if plan.edge_weights is None or batch is None else plan.edge_weights[index]
    pad_units, pad = 0, None
    if balance:
        counts = [0 if p.numel() == 0 else
                  len(UNITS[plan.algorithm](plan.batch.select(p), micro_batch_size))
                  for p in parts]
        pad_units = max(counts) - counts[rank]
        if pad_units and batch is None:      # no rows of its own: the first group's, weight 0
            pad = plan.batch.select(parts[counts.index(max(counts))])
    return dataclasses.replace(plan, batch=batch, values=values, pad_units=pad_units, pad=pad,
                               edge_weights=weights)


def run_update(learner: Learner, plan: UpdatePlan, cfg: TrainerConfig) -> dict[str, float]:
    """Accumulate this plan's gradients micro-batch by micro-batch, sum them (and the metric
    sums) over the workers, optimizer step. Metrics: step-wide ones + loss terms + grad_norm."""
    if plan.skip:
        return dict(plan.metrics)
    m = cfg.learner.micro_batch_size
    sums: dict[str, float] = {}
    units = UNITS[plan.algorithm](plan.batch, m) if plan.batch is not None else []
    work = [(plan.batch, plan.values, u, len(_unit_rows(u)) / plan.total) for u in units]
    if plan.pad_units:
        source = plan.batch if plan.batch is not None else plan.pad
        first = UNITS[plan.algorithm](source, m)[0]
        values = plan.values if plan.batch is not None else None if plan.values is None else \
            torch.zeros((source.rows,) + tuple(plan.values.shape[1:]))
        work += [(source, values, first, 0.0)] * plan.pad_units
    for batch, values, unit, weight in work:
        RUNS[plan.algorithm](learner, batch, values, unit, weight, plan, cfg, sums)
    metrics = dict(plan.metrics) | learner.reduce_sums(sums)
    metrics |= ratio_report(plan.algorithm, metrics)
    metrics["grad_norm"] = learner.step()
    return metrics


def _chunks(index: torch.Tensor, size: int | None) -> list[torch.Tensor]:
    return [index] if size is None else list(torch.split(index, size))


def _unit_rows(unit) -> torch.Tensor:
    return unit[-1] if isinstance(unit, tuple) else unit


def _add(sums: dict[str, float], metrics: Mapping[str, float], weight: float) -> None:
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0.0) + v * weight


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device, non_blocking=True)


# ---- DiffusionNFT ---------------------------------------------------------------------------
def _nft_units(batch: Batch, size: int | None) -> list[torch.Tensor]:
    return _chunks(torch.arange(batch.rows), size)


def _forward_draws(learner: Learner, batch: Batch, sub: Batch, x0: torch.Tensor,
                   plan: UpdatePlan, draws: int, order: TimestepOrder, timestep_stream: Draw,
                   noise_stream: Draw
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per draw k, the forward process at one of the rollout's schedule steps per row (from the
    row's `timestep_stream`) with fresh noise (its `noise_stream`): (sigma (b,), eps, x_sigma),
    the condition entries of a frozen mask kept clean as in the rollout. NFT and AWM train on it."""
    dev = learner.device
    sigmas = learner.family.sigmas(batch.sampling) if batch.sigmas is None else batch.sigmas
    sigmas = sigmas[:-1]
    held = None if batch.frozen_mask is None else _on(batch.frozen_mask, dev)
    steps = row_timesteps(plan.noise_seed, sub.seeds, len(sigmas), draws, order,
                          timestep_stream)                                             # (T, b)
    for k in range(draws):
        sigma = _on(sigmas[steps[k]], dev)                                                # (b,)
        eps = row_randn(plan.noise_seed, sub.seeds, noise_stream, k, x0.shape[1:], dev)
        s = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
        x_sigma = (1 - s) * x0 + s * eps
        if held is not None:             # condition entries stay clean, as in the rollout
            x_sigma = torch.where(held, x0, x_sigma)
        yield sigma, eps, x_sigma


def _nft_run(learner: Learner, batch: Batch, r_all: torch.Tensor, rows: torch.Tensor,
             weight: float, plan: UpdatePlan, cfg: TrainerConfig, sums: dict) -> None:
    """Forward-process NFT on `rows`: fresh noise at schedule noise levels; v_theta / v_old /
    v_ref; loss weight rows / total per draw / train_timesteps."""
    c, dev = cfg.nft, learner.device
    sub = batch.select(rows)
    x0, r = _on(sub.x0, dev), _on(r_all[rows], dev)                                    # (b,)
    for sigma, _, x_sigma in _forward_draws(learner, batch, sub, x0, plan, c.train_timesteps,
                                            c.timesteps, Draw.NFT_TIMESTEPS, Draw.NFT_NOISE):
        with torch.no_grad():
            v_old = learner.velocity(x_sigma, sigma, sub.cond, PolicyRole.OLD, media=sub.inputs)
            v_ref = (learner.velocity(x_sigma, sigma, sub.cond, PolicyRole.REFERENCE,
                                      media=sub.inputs) if c.ref_kl_coef > 0 else None)
        v_theta = learner.velocity(x_sigma, sigma, sub.cond, PolicyRole.CURRENT, media=sub.inputs)
        loss = 0.0
        for mask, share, r_s in _streams(learner, batch, cfg, r, x0.shape[1:]):
            pick = (lambda t: t) if mask is None else (lambda t: t[:, mask])  # noqa: E731
            out = nft_loss(pick(v_theta), pick(v_old), pick(x_sigma), pick(x0), sigma, r_s,
                           beta=c.beta, adv_clip_max=c.adv_clip_max,
                           v_ref=None if v_ref is None else pick(v_ref),
                           ref_kl_coef=c.ref_kl_coef)
            loss = loss + out.loss * share
            _add(sums, out.metrics(), share * weight / c.train_timesteps)
        (loss * (weight / c.train_timesteps)).backward()


def _streams(learner: Learner, batch: Batch, cfg: TrainerConfig, r: torch.Tensor,
             state_shape) -> list[tuple[torch.Tensor | None, float, torch.Tensor]]:
    """(entries, loss share, optimality) per trained stream: the whole state with r (B,), or
    under per-modality advantages (r: (b, streams)) each stream's entries with its own r,
    weighted by its share of the streams' entries."""
    if r.ndim == 1:
        return [(None, 1.0, r)]
    names = list(cfg.advantage.streams)
    numel = int(torch.tensor(state_shape).prod())
    index = torch.arange(numel, dtype=torch.float64).reshape(1, *state_shape)
    parts = learner.family.codec.split_state(index, batch.sampling)
    masks = stream_masks(parts, state_shape, names)
    total = sum(int(m.sum()) for m in masks.values())
    return [(masks[n].to(r.device), int(masks[n].sum()) / total, r[:, k])
            for k, n in enumerate(names)]


def nft_update(learner: Learner, batch: Batch, cfg: TrainerConfig,
               gen: torch.Generator) -> dict[str, float]:
    """DiffusionNFT: advantages -> optimality r, forward-process loss, one optimizer step."""
    return run_update(learner, plan_update(Algorithm.NFT, batch, cfg, gen), cfg)


# ---- FlowGRPO -------------------------------------------------------------------------------
def _grpo_units(batch: Batch, size: int | None) -> list[tuple[int, torch.Tensor]]:
    """(window group, its positions) per micro-batch: a forward never mixes windows."""
    return [(g, part) for g, (rows, _) in enumerate(batch.window_groups)
            for part in _chunks(torch.arange(rows.shape[0]), size)]


def _grpo_run(learner: Learner, batch: Batch, adv: torch.Tensor, unit: tuple[int, torch.Tensor],
              weight: float, plan: UpdatePlan, cfg: TrainerConfig, sums: dict) -> None:
    """Clipped surrogate on the stored fp32 window transitions of one micro-batch of a window
    group (old log-probs as `OldLogProbs` says, the ratio as `PolicyRatio` says); each row weighs
    1 / total spread over its own window's trained steps, so the loss is the mean over rows of the
    mean over that row's steps."""
    c, dev = cfg.flow_grpo, learner.device
    group, part = unit
    group_rows, traj = batch.window_groups[group]
    rows = group_rows[part]
    traj = dataclasses.replace(traj, latents=_on(traj.latents[part], dev),
                               log_probs=_on(traj.log_probs[part], dev),
                               seeds=tuple(traj.seeds[i] for i in part.tolist()))
    steps = trainable_step_indices(traj.sigmas, traj.window, c.max_train_steps)
    cond, a_rows, start = batch.cond.index_select(rows), _on(adv[rows], dev), traj.window[0]
    if plan.edge_weights is not None and plan.edge_weights.shape[0] != adv.shape[0]:
        raise InvalidRequestError("edge weights are one row per advantage row",
                                  field="edge_weights", expected=adv.shape[0],
                                  actual=plan.edge_weights.shape[0])
    uncond = None if batch.uncond is None else batch.uncond.index_select(rows)
    inputs = {k: v[rows] for k, v in batch.inputs.items()}
    versions = [batch.versions[i] for i in rows.tolist()]
    reuse = reusable_rows(c.old_log_probs, versions, plan.old_version).to(dev)
    guard = c.ratio is PolicyRatio.GRPO_GUARD   # needs the old policy's mean: one more forward
    sums["trained_window_steps"] = sums.get("trained_window_steps", 0.0) + weight * len(steps)
    for j in steps:
        a = a_rows if a_rows.ndim == 1 else \
            _on(plan.edge_weights[rows, j], dev) * a_rows[:, j + 1].clamp(-c.adv_clip_max,
                                                                         c.adv_clip_max)
        sigma = _on(traj.sigmas[j].expand(rows.shape[0]), dev)
        x_j = traj.latents[:, j - start]
        old, old_mean = traj.log_probs[:, j - start], None
        if reuse.all() and not guard:
            old = rollout_old_log_probs(old, versions, plan.old_version)
        else:                 # the pre-step weights are the old policy: run_update steps last
            with torch.no_grad():
                v_old = learner.velocity(x_j, sigma, cond, PolicyRole.CURRENT,
                                         traj.guidance_scale, uncond, inputs)
            old_step = recompute_step(traj, j, v_old)
            old, old_mean = torch.where(reuse, old, old_step.log_prob), old_step.mean
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
        if guard:
            loss = grpo_guard_loss(out.log_prob, old, out.mean, old_mean, a, out.std_dev_t,
                                   out.sqrt_dt, clip_range=c.clip_range,
                                   adv_clip_max=c.adv_clip_max, reweight=c.guard_reweight,
                                   kl=kl, kl_beta=c.kl_beta)
        else:
            loss = flow_grpo_loss(out.log_prob, old, a,
                                  clip_range=c.clip_range, adv_clip_max=c.adv_clip_max, kl=kl,
                                  kl_beta=c.kl_beta)
        (loss.loss * (weight / len(steps))).backward()
        _add(sums, loss.metrics(), weight / len(steps))


def grpo_update(learner: Learner, batch: Batch, cfg: TrainerConfig,
                gen: torch.Generator) -> dict[str, float]:
    """FlowGRPO: advantages, the clipped surrogate per row on its window's steps (one window
    per prompt group under Flow-GRPO-Fast), one optimizer step."""
    return run_update(learner, plan_update(Algorithm.FLOW_GRPO, batch, cfg, gen), cfg)


# ---- AWM ------------------------------------------------------------------------------------
def _awm_run(learner: Learner, batch: Batch, adv_all: torch.Tensor, rows: torch.Tensor,
             weight: float, plan: UpdatePlan, cfg: TrainerConfig, sums: dict) -> None:
    """Advantage-weighted matching on `rows`: per draw k, sigma at a schedule step and fresh
    eps from each row's stream; log p_old by the pre-step weights (no grad), log p and the
    clipped surrogate by the current ones; loss weight rows / total per draw / train_timesteps."""
    c, dev = cfg.awm, learner.device
    sub = batch.select(rows)
    x0, a = _on(sub.x0, dev), _on(adv_all[rows], dev)                                 # (b,)
    for sigma, eps, x_sigma in _forward_draws(learner, batch, sub, x0, plan, c.train_timesteps,
                                              c.timesteps, Draw.AWM_TIMESTEPS, Draw.AWM_NOISE):
        with torch.no_grad():            # the pre-step weights are the old policy
            v_old = learner.velocity(x_sigma, sigma, sub.cond, PolicyRole.CURRENT,
                                     media=sub.inputs)
            old = awm_log_prob(v_old, x0, eps, sigma, c.weighting, c.ghuber_power)
            v_ref = (learner.velocity(x_sigma, sigma, sub.cond, PolicyRole.REFERENCE,
                                      media=sub.inputs) if c.kl_beta > 0 else None)
        v = learner.velocity(x_sigma, sigma, sub.cond, PolicyRole.CURRENT, media=sub.inputs)
        out = awm_loss(v, old, x0, eps, sigma, a, clip_range=c.clip_range,
                       adv_clip_max=c.adv_clip_max, weighting=c.weighting,
                       ghuber_power=c.ghuber_power,
                       kl=None if v_ref is None else velocity_kl(v, v_ref), kl_beta=c.kl_beta)
        (out.loss * (weight / c.train_timesteps)).backward()
        _add(sums, out.metrics(), weight / c.train_timesteps)


def awm_update(learner: Learner, batch: Batch, cfg: TrainerConfig,
               gen: torch.Generator) -> dict[str, float]:
    """AWM: advantages, the weighted matching error of fresh forward-process draws in the
    clipped surrogate, one optimizer step."""
    return run_update(learner, plan_update(Algorithm.AWM, batch, cfg, gen), cfg)


# ---- Diffusion-DPO --------------------------------------------------------------------------
def _dpo_units(batch: Batch, size: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(winner rows, loser rows) per micro-batch of pairs (size rows = size // 2 pairs)."""
    pairs = best_worst_pairs(batch.rewards, batch.group_ids)
    chunks = _chunks(torch.arange(pairs.num_pairs), None if size is None else max(1, size // 2))
    return [(pairs.winner[c], pairs.loser[c]) for c in chunks]


def _dpo_run(learner: Learner, batch: Batch, _values, unit: tuple[torch.Tensor, torch.Tensor],
             weight: float, plan: UpdatePlan, cfg: TrainerConfig, sums: dict) -> None:
    """(best, worst) pairs of one micro-batch; eps and sigma per pair from the winner's stream;
    reference = base model."""
    dev, draws = learner.device, cfg.dpo.draws_per_pair
    winner, loser = unit
    p = winner.shape[0]
    x_w, x_l = _on(batch.x0[winner], dev), _on(batch.x0[loser], dev)
    pair_rows = torch.cat([winner, loser])
    cond = batch.cond.index_select(pair_rows)
    inputs = {k: v[pair_rows] for k, v in batch.inputs.items()}
    seeds = [batch.seeds[i] for i in winner.tolist()]
    shift = learner.family.schedule_shift(batch.sampling)
    for d in range(draws):
        sigma = _on(pair_sigmas(plan.noise_seed, seeds, d, shift), dev)                  # (p,)
        noise = row_randn(plan.noise_seed, seeds, Draw.DPO_NOISE, d, x_w.shape[1:], dev)
        inp = dpo_pair_inputs(x_w, x_l, noise, sigma)
        x_in, s_in = torch.cat([inp.x_winner, inp.x_loser]), torch.cat([sigma, sigma])
        if batch.frozen_mask is not None:    # condition entries stay clean, as in the rollout
            x_in = torch.where(_on(batch.frozen_mask, dev), torch.cat([x_w, x_l]), x_in)
        v = learner.velocity(x_in, s_in, cond, PolicyRole.CURRENT, media=inputs)
        with torch.no_grad():
            v_ref = learner.velocity(x_in, s_in, cond, PolicyRole.REFERENCE, media=inputs)
        out = dpo_loss(v[:p], v[p:], v_ref[:p], v_ref[p:], inp.target_winner, inp.target_loser,
                       beta=cfg.dpo.beta)
        (out.loss * (weight / draws)).backward()
        _add(sums, out.metrics(), weight / draws)


def dpo_update(learner: Learner, batch: Batch, cfg: TrainerConfig,
               gen: torch.Generator) -> dict[str, float]:
    """Diffusion-DPO: (best, worst) pair per prompt, shared eps and sigma per pair."""
    return run_update(learner, plan_update(Algorithm.DPO, batch, cfg, gen), cfg)


UNITS: dict[Algorithm, Callable[[Batch, int | None], list]] = {
    Algorithm.NFT: _nft_units, Algorithm.FLOW_GRPO: _grpo_units, Algorithm.DPO: _dpo_units,
    Algorithm.AWM: _nft_units}
RUNS = {Algorithm.NFT: _nft_run, Algorithm.FLOW_GRPO: _grpo_run, Algorithm.DPO: _dpo_run,
        Algorithm.AWM: _awm_run}

UPDATES: dict[Algorithm, Callable[[Learner, Batch, TrainerConfig, torch.Generator],
                                  dict[str, float]]] = {
    Algorithm.NFT: nft_update,
    Algorithm.FLOW_GRPO: grpo_update,
    Algorithm.DPO: dpo_update,
    Algorithm.AWM: awm_update,
}
