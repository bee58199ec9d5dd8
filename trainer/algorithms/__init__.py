"""Pure, typed RL losses for flow-matching models: FlowGRPO (+ GRPO-Guard), DiffusionNFT,
Diffusion-DPO, AWM; per-node advantages of branched rollouts (TreeGRPO / BranchGRPO)."""
from contract.enums import Algorithm
from trainer.algorithms.advantages import (REFERENCE_ZERO_ADVANTAGE, AdvantageMode,
                                           PreferencePairs, StdScope, ZeroAdvantageRule,
                                           best_worst_pairs, group_advantages, group_index,
                                           optimality_probability, per_reward_advantages,
                                           zero_advantage_groups, zero_advantage_rows)
from trainer.algorithms.awm import AWMWeighting, awm_log_prob, awm_loss
from trainer.algorithms.dpo import (DPOLoss, DPOPairInputs, dpo_loss, dpo_pair_inputs,
                                    sample_pair_sigmas)
from trainer.algorithms.flow_grpo import (FlowGRPOLoss, KLTarget, OldLogProbs, WindowStep,
                                          flow_grpo_loss, recompute_step, reusable_rows,
                                          rollout_old_log_probs, sde_mean_kl,
                                          trainable_step_indices, transition_kl, velocity_kl,
                                          window_step)
from trainer.algorithms.grpo_guard import PolicyRatio, grpo_guard_loss, guard_ratio
from trainer.algorithms.tree import (TreeAdvantage, branch_depthwise_advantages, edge_weights,
                                     node_rewards, tree_advantages, tree_backprop_advantages,
                                     tree_node_ids)
from trainer.algorithms.nft import (NFTLoss, OldPolicySchedule, TimestepOrder, ema_update,
                                  nft_loss, nft_timestep_indices, old_decay)

__all__ = [
    "Algorithm", "AdvantageMode", "PreferencePairs", "StdScope", "best_worst_pairs",
    "group_advantages", "group_index", "optimality_probability", "per_reward_advantages",
    "zero_advantage_groups", "zero_advantage_rows", "ZeroAdvantageRule",
    "REFERENCE_ZERO_ADVANTAGE", "AWMWeighting", "awm_log_prob", "awm_loss", "DPOLoss",
    "DPOPairInputs", "dpo_loss",
    "dpo_pair_inputs", "sample_pair_sigmas", "FlowGRPOLoss", "KLTarget", "OldLogProbs",
    "reusable_rows", "rollout_old_log_probs", "WindowStep",
    "flow_grpo_loss", "recompute_step", "sde_mean_kl", "trainable_step_indices",
    "transition_kl", "velocity_kl",
    "window_step", "PolicyRatio", "grpo_guard_loss", "guard_ratio",
    "NFTLoss", "OldPolicySchedule", "TimestepOrder", "ema_update", "nft_loss",
    "nft_timestep_indices", "old_decay", "TreeAdvantage", "branch_depthwise_advantages",
    "edge_weights", "node_rewards", "tree_advantages", "tree_backprop_advantages", "tree_node_ids",
]
