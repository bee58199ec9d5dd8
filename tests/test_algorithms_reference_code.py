"""Training rules side by side with the reference implementations' own code on the same random
inputs: which rows an update trains (DiffusionNFT, flow_grpo, Diffusion-DPO / flow_grpo's DPO)
and the evaluation EMA (flow_grpo's and DiffusionNFT's EMAModuleWrapper, as their trainers call
it). Each excerpt is copied from the file and commit named above it, cut to the lines used.

Commits read: NVlabs/DiffusionNFT 24af5554898d85e93efa492f42b5e9cdf4156e9b,
yifan123/flow_grpo ac4c86e8cae021841f1fde853d340e0db67690dd (train_sd3_fast.py: 74db6919),
SalesforceAIResearch/DiffusionDPO 5233e75919f912f3f631958ee4ebb5b5204382d9.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from contract import Algorithm, Condition, ConfigError, SamplerKind, SamplingSpec, Trajectory
from trainer.algorithms import (REFERENCE_ZERO_ADVANTAGE, ZeroAdvantageRule, best_worst_pairs,
                                zero_advantage_rows)
from trainer.config import EMAConfig, TrainerConfig, load_trainer_config
from trainer.rollout_batch import Batch
from trainer.run_state import PolicyEMA
from trainer.updates import plan_update

GPU_RECIPE = "configs/train_sd35_gpu.yaml"


# ---- excerpts of the reference code -------------------------------------------------------
# PerPromptStatTracker.update, the group-relative branch: NVlabs/DiffusionNFT
# flow_grpo/stat_tracking.py lines 12-32 (yifan123/flow_grpo flow_grpo/stat_tracking.py, its
# type == 'grpo' branch, is the same computation).
def ref_stat_tracker_update(prompts, rewards, global_std=True):
    stats = {}
    prompts = np.array(prompts)
    rewards = np.array(rewards, dtype=np.float64)
    unique = np.unique(prompts)
    advantages = np.empty_like(rewards) * 0.0
    for prompt in unique:
        prompt_rewards = rewards[prompts == prompt]
        if prompt not in stats:
            stats[prompt] = []
        stats[prompt].extend(prompt_rewards)
    for prompt in unique:
        stats[prompt] = np.stack(stats[prompt])
        prompt_rewards = rewards[prompts == prompt]
        mean = np.mean(stats[prompt], axis=0, keepdims=True)
        if global_std:
            std = np.std(rewards, axis=0, keepdims=True) + 1e-4
        else:
            std = np.std(stats[prompt], axis=0, keepdims=True) + 1e-4
        advantages[prompts == prompt] = (prompt_rewards - mean) / std
    return advantages


# yifan123/flow_grpo flow_grpo/stat_tracking.py lines 38-52, the type == 'dpo' branch, per prompt
def ref_flow_grpo_dpo_advantages(prompt_rewards):
    prompt_advantages = torch.tensor(prompt_rewards)
    max_idx = torch.argmax(prompt_advantages)
    min_idx = torch.argmin(prompt_advantages)
    if max_idx == min_idx:
        min_idx = 0
        max_idx = 1
    result = torch.zeros_like(prompt_advantages).float()
    result[max_idx] = 1.0
    result[min_idx] = -1.0
    return result.numpy()


# EMAModuleWrapper: NVlabs/DiffusionNFT flow_grpo/ema.py lines 9-38 (get_current_decay line 25-26,
# step lines 29-38); yifan123/flow_grpo flow_grpo/ema.py lines 33-49 hold the same code.
class RefEMAModuleWrapper:
    def __init__(self, parameters, decay=0.9999, update_step_interval=1, device=None):
        parameters = list(parameters)
        self.ema_parameters = [p.clone().detach().to(device) for p in parameters]
        self.decay = decay
        self.update_step_interval = update_step_interval

    def get_current_decay(self, optimization_step) -> float:
        return min((1 + optimization_step) / (10 + optimization_step), self.decay)

    @torch.no_grad()
    def step(self, parameters, optimization_step):
        parameters = list(parameters)
        one_minus_decay = 1 - self.get_current_decay(optimization_step)
        if (optimization_step + 1) % self.update_step_interval == 0:
            for ema_parameter, parameter in zip(self.ema_parameters, parameters, strict=True):
                if parameter.requires_grad:
                    if ema_parameter.device == parameter.device:
                        ema_parameter.add_(one_minus_decay * (parameter - ema_parameter))


# ---- inputs ---------------------------------------------------------------------------------
def _rewards(seed: int, groups: int = 14, size: int = 3) -> tuple[list[float], list[str]]:
    """Discrete rewards in {0, 0.5, 1}, in random group order: half the groups tied, a quarter
    {0, 1, 0.5...} shuffled (rows exactly at their group's mean), the rest random."""
    rng = np.random.default_rng(seed)
    rewards = rng.integers(0, 3, size=(groups, size)) / 2.0
    order = rng.permutation(groups)
    tied, at_mean = order[:groups // 2], order[groups // 2:groups // 2 + groups // 4]
    rewards[tied] = rng.integers(0, 3, size=(len(tied), 1)) / 2.0
    for g in at_mean:
        rewards[g] = rng.permutation([0.0, 1.0] + [0.5] * (size - 2))
    return rewards.reshape(-1).tolist(), [f"p{g}" for g in range(groups) for _ in range(size)]


def _batch(rewards: list[float], groups: list[str], seed: int = 0) -> Batch:
    """A batch of random rows, one shared 1-step SDE window (what a FlowGRPO batch carries)."""
    gen = torch.Generator().manual_seed(seed)
    b = len(rewards)
    seeds = tuple(range(100, 100 + b))
    traj = Trajectory(latents=torch.randn(b, 2, 4, 2, 2, generator=gen),
                      sigmas=torch.tensor([1.0, 0.75, 0.4, 0.0]),
                      model_timesteps=torch.tensor([1000.0, 750.0, 400.0]),
                      log_probs=torch.randn(b, 1, generator=gen), window=(0, 1),
                      sampler=SamplerKind.SDE, noise_level=0.7, guidance_scale=1.0, seeds=seeds,
                      policy_version="v0")
    return Batch(x0=torch.randn(b, 4, 2, 2, generator=gen),
                 rewards=torch.tensor(rewards, dtype=torch.float32), group_ids=tuple(groups),
                 cond=Condition({"prompt_embeds": torch.randn(b, 3, generator=gen)}),
                 trajectory=traj, versions=("v0",) * b, scores={},
                 sampling=SamplingSpec(num_steps=3, seeds=(0,)),
                 window_groups=((torch.arange(b), traj),), seeds=seeds)


def _plan(algorithm: Algorithm, batch: Batch, cfg: TrainerConfig):
    return plan_update(algorithm, batch, cfg, torch.Generator().manual_seed(0))


def _rows_of(plan, batch: Batch) -> list[int]:
    """The batch rows a plan trains (x0 rows are distinct random tensors)."""
    return [int(torch.nonzero((batch.x0 == row).flatten(1).all(1)).item())
            for row in plan.batch.x0]


# ---- DiffusionNFT trains every row ----------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nft_trains_every_row_with_the_reference_optimality(seed):
    """NVlabs/DiffusionNFT scripts/train_nft_sd3.py line 793 `filtered_samples =
    collated_samples` (no filter), lines 910-929: r = clamp(clamp(A, -c, c) / c / 2 + 1/2, 0, 1)
    with c = adv_clip_max; the recipe's config (configs/train_sd35_gpu.yaml) keeps it."""
    rewards, groups = _rewards(seed)
    cfg = load_trainer_config(GPU_RECIPE)
    assert cfg.advantage.zero_advantage is None
    assert REFERENCE_ZERO_ADVANTAGE[Algorithm.NFT] is ZeroAdvantageRule.KEEP
    batch = _batch(rewards, groups, seed)
    advantages = torch.from_numpy(ref_stat_tracker_update(groups, rewards, global_std=True))
    c = cfg.nft.adv_clip_max
    advantages_clip = torch.clamp(advantages, -c, c)
    r = torch.clamp((advantages_clip / c) / 2.0 + 0.5, 0, 1)
    assert (r == 0.5).sum() >= len(rewards) // 2        # the tied groups' rows: r = 1/2
    plan = _plan(Algorithm.NFT, batch, cfg)
    assert not plan.skip and plan.total == len(rewards) and plan.batch.rows == len(rewards)
    assert _rows_of(plan, batch) == list(range(len(rewards)))
    torch.testing.assert_close(plan.values, r.float(), rtol=0, atol=1e-6)
    tied = _batch([0.5] * 6, ["a"] * 3 + ["b"] * 3)     # every group tied: DiffusionNFT steps
    plan = _plan(Algorithm.NFT, tied, cfg)
    assert not plan.skip and plan.total == 6 and torch.equal(plan.values, torch.full((6,), 0.5))


# ---- FlowGRPO drops every zero-advantage row ------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_flow_grpo_drops_the_rows_flow_grpo_drops(seed):
    """yifan123/flow_grpo scripts/train_sd3.py lines 797 and 817 (train_sd3_fast.py at 74db6919:
    the same two lines): mask = advantages.abs().sum(dim=1) != 0 per row (advantages repeated
    along the timesteps), samples = samples[mask]; policy_loss = torch.mean(...) over the kept
    rows (line 893). With num_batches_per_epoch = 1 its padding of the kept count is a no-op."""
    rewards, groups = _rewards(seed)
    cfg = TrainerConfig(algorithm=Algorithm.FLOW_GRPO)
    batch = _batch(rewards, groups, seed)
    num_train_timesteps = 2
    advantages = torch.as_tensor(ref_stat_tracker_update(groups, rewards, global_std=True))
    advantages = advantages.unsqueeze(1).repeat(1, num_train_timesteps)
    mask = (advantages.abs().sum(dim=1) != 0)
    kept = advantages[mask][:, 0]
    tied_groups = {g for g in groups if all(r == rewards[groups.index(g)]
                                            for r, h in zip(rewards, groups) if h == g)}
    at_mean = [i for i in torch.nonzero(~mask).flatten().tolist() if groups[i] not in tied_groups]
    assert tied_groups and at_mean            # rows dropped for both reasons in these inputs
    plan = _plan(Algorithm.FLOW_GRPO, batch, cfg)
    assert plan.total == int(mask.sum()) and not plan.skip
    assert _rows_of(plan, batch) == torch.nonzero(mask).flatten().tolist()
    clip = cfg.flow_grpo.adv_clip_max
    torch.testing.assert_close(plan.values, kept.clamp(-clip, clip).float(), rtol=1e-6, atol=1e-6)
    assert plan.metrics["trained_rows"] == float(mask.sum())
    tied = _batch([1.0] * 4 + [0.0] * 4, ["a"] * 4 + ["b"] * 4)     # mask all False: no step
    assert _plan(Algorithm.FLOW_GRPO, tied, cfg).skip


def test_zero_advantage_rules_are_options_whose_default_is_the_reference():
    adv = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, -1.0])
    groups = ["a"] * 3 + ["b"] * 3
    assert zero_advantage_rows(adv, groups, ZeroAdvantageRule.KEEP).tolist() == [False] * 6
    assert zero_advantage_rows(adv, groups, ZeroAdvantageRule.ROWS).tolist() == \
        [True, True, True, False, True, False]
    assert zero_advantage_rows(adv, groups, ZeroAdvantageRule.GROUPS).tolist() == \
        [True] * 3 + [False] * 3
    rewards, ids = [0.0, 0.5, 1.0, 1.0, 1.0, 1.0], ["a"] * 3 + ["b"] * 3
    batch = _batch(rewards, ids)
    grpo_groups = TrainerConfig(algorithm=Algorithm.FLOW_GRPO,
                                advantage={"zero_advantage": "groups"})
    assert _rows_of(_plan(Algorithm.FLOW_GRPO, batch, grpo_groups), batch) == [0, 1, 2]
    nft_rows = TrainerConfig(advantage={"zero_advantage": "rows"})
    assert _rows_of(_plan(Algorithm.NFT, batch, nft_rows), batch) == [0, 2]
    with pytest.raises(ConfigError, match="zero_advantage"):
        load_trainer_config({"algorithm": "dpo", "advantage": {"zero_advantage": "keep"}})


# ---- DPO: one (best, worst) pair per group; ties yield none ---------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_dpo_pairs_are_flow_grpos_and_ties_are_left_out_as_diffusion_dpo(seed):
    """yifan123/flow_grpo scripts/train_sd3_dpo.py lines 765-792 train, per prompt, the rows
    the 'dpo' advantages mark (+1 winner = argmax, -1 loser = argmin); for a tied group that
    code pairs rows 1 > 0 anyway. The project follows Diffusion-DPO there:
    SalesforceAIResearch/DiffusionDPO train.py lines 857-861 eliminate tied ('0.5-0.5')
    preferences, so a tied group yields no pair."""
    rewards, groups = _rewards(seed, groups=10, size=4)
    pairs = best_worst_pairs(torch.tensor(rewards), groups)
    got = dict(zip(pairs.groups, zip(pairs.winner.tolist(), pairs.loser.tolist())))
    for g in dict.fromkeys(groups):
        members = [i for i, h in enumerate(groups) if h == g]
        ref = ref_flow_grpo_dpo_advantages([rewards[i] for i in members])
        ref_pair = (members[int(np.argmax(ref == 1.0))], members[int(np.argmax(ref == -1.0))])
        if len({rewards[i] for i in members}) == 1:
            assert g not in got and ref_pair == (members[1], members[0])
        else:
            assert got[g] == ref_pair
    assert 0 < len(got) < len(set(groups))
    plan = _plan(Algorithm.DPO, _batch(rewards, groups), TrainerConfig(algorithm=Algorithm.DPO))
    assert plan.total == len(got) and not plan.skip


# ---- the evaluation EMA ---------------------------------------------------------------------
def _ema_runs(cfg: EMAConfig, ref_decay: float, ref_interval: int, steps: int, seed: int):
    """The reference EMA as DiffusionNFT's trainer calls it (scripts/train_nft_sd3.py: built at
    line 567 from the initial weights; after each optimizer step `global_step += 1` (line 1021)
    then `ema.step(params, global_step)` (line 1029)) beside PolicyEMA as trainer/loop.py calls
    it (initialised at step 0's evaluation; after each step `self.step += 1`, then
    `ema.update(self.step, ...)`). Yields (step, reference tensors, project tensors)."""
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=gen)),
              torch.nn.Parameter(torch.randn(7, generator=gen))]
    ref = RefEMAModuleWrapper(params, decay=ref_decay, update_step_interval=ref_interval)
    ema = PolicyEMA(cfg)
    ema.update(0, {str(i): p.detach() for i, p in enumerate(params)})
    global_step = 0
    for _ in range(steps):
        with torch.no_grad():                          # an optimizer step
            for p in params:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
        global_step += 1
        ref.step(params, global_step)
        ema.update(global_step, {str(i): p.detach() for i, p in enumerate(params)})
        yield global_step, ref.ema_parameters, [ema.tensors[str(i)] for i in range(len(params))]


@pytest.mark.parametrize("decay,every", [(0.9, 1), (0.9, 8), (0.99, 3)])
def test_ema_warmup_and_phase_equal_ema_module_wrapper(decay, every):
    """Warmup min(decay, (1 + s) / (10 + s)) at optimizer step s (1 = the first) and updates at
    the s with (s + 1) % every == 0 (flow_grpo's SD3 recipe: decay 0.9, every 8, train_sd3.py
    line 445)."""
    cfg = EMAConfig(enabled=True, decay=decay, every=every, warmup=True)
    changed, before = [], None
    for step, want, got in _ema_runs(cfg, decay, every, steps=60, seed=every):
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=f"step {step}")
        if before is not None and not torch.equal(before, got[0]):
            changed.append(step)
        before = got[0].clone()
    assert changed == [s for s in range(2, 61) if (s + 1) % every == 0]


def test_the_gpu_recipes_ema_is_diffusion_nfts():
    """configs/train_sd35_gpu.yaml (the project's DiffusionNFT recipe): DiffusionNFT's EMA,
    EMAModuleWrapper(decay=0.9, update_step_interval=1) (scripts/train_nft_sd3.py line 567),
    always warmed up, enabled (config/base.py line 92: train.ema = True)."""
    cfg = load_trainer_config(GPU_RECIPE)
    assert cfg.ema.enabled
    decays = []
    for step, want, got in _ema_runs(cfg.ema, 0.9, 1, steps=100, seed=3):
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=f"step {step}")
        decays.append(RefEMAModuleWrapper([], 0.9).get_current_decay(step))
    assert decays[0] == pytest.approx(2 / 11) and decays[-1] == 0.9   # 0.9 from step 80
