"""Per-node advantages of branched rollouts (rows that fork mid-denoise and share their prefix).

A batch of branched rollouts is a forest: one tree per prompt group, every row a leaf. It is
given as `node_of` (B, D+1) int64: node_of[b, d] names the node row b is at after d steps (depth
d); rows with equal ids at depth d share their whole path up to it (the same latent), so
node_of[:, 0] is one root per tree and node_of[:, D] one leaf per row. Step j (x_j -> x_{j+1}) is
the edge into depth j + 1, and every row under that node holds the same transition, so a loss
over rows counts each shared edge once with `edge_weights`.

Estimators (`TreeAdvantage`):
  BRANCH_DEPTHWISE  BranchGRPO (Li et al. 2025, arXiv 2509.06040; Fredreic1849/BranchGRPO
                    compute_node_rewards_from_leaves / compute_hierarchical_advantages_by_depth):
                    a node's reward is the mean of its leaf descendants' rewards, and the nodes of
                    one depth of one tree are standardised together, (R - mean) / (std + 1e-8)
                    with the sample std; a depth with one node, or std < 1e-6, has advantage 0.
  TREE_BACKPROP     TreeGRPO (Ding & Ye 2025, arXiv 2512.08153): leaves are standardised within
                    their tree as GRPO does, and the advantage is propagated up: a node's
                    advantage is the mean of its children's (no public code: the definition is
                    derived from the paper and tested on closed forms).
The edge into depth d trains with the advantage of the node it enters.
"""
from __future__ import annotations

from enum import Enum
from typing import Sequence

import torch

from contract import InvalidRequestError, NonFiniteError, RolloutTree


class TreeAdvantage(str, Enum):
    BRANCH_DEPTHWISE = "branch_depthwise"   # BranchGRPO: leaf-mean rewards, per-depth z-scores
    TREE_BACKPROP = "tree_backprop"         # TreeGRPO: leaf z-scores averaged up the tree


def check_tree(node_of: torch.Tensor) -> None:
    """node_of (B, D+1) int64: one root per tree at depth 0, one leaf per row at depth D, and
    every node one parent (rows sharing a node at depth d share it at d - 1)."""
    if node_of.ndim != 2 or node_of.shape[1] < 2 or node_of.dtype != torch.int64:
        raise InvalidRequestError("node_of is (rows, depth + 1) int64 with depth >= 1",
                                  field="node_of", expected="(B, D+1) int64",
                                  actual=(tuple(node_of.shape), str(node_of.dtype)))
    rows, depth = node_of.shape[0], node_of.shape[1] - 1
    if torch.unique(node_of[:, depth]).numel() != rows:
        raise InvalidRequestError("two rows end at the same leaf (one sample counted twice)",
                                  field="node_of", expected=f"{rows} leaves",
                                  actual=int(torch.unique(node_of[:, depth]).numel()))
    for d in range(1, depth + 1):
        for node in torch.unique(node_of[:, d]).tolist():
            parents = torch.unique(node_of[node_of[:, d] == node, d - 1])
            if parents.numel() != 1:
                raise InvalidRequestError(f"node {node} at depth {d} has several parents",
                                          field="node_of", expected="one parent per node",
                                          actual=parents.tolist())


def node_rewards(node_of: torch.Tensor, leaf_rewards: torch.Tensor) -> torch.Tensor:
    """(B, D+1) float32: the reward of the node row b is at after d steps, the mean of its leaf
    descendants' rewards (BranchGRPO's reward fusion). leaf_rewards: (B,)."""
    check_tree(node_of)
    if leaf_rewards.shape != (node_of.shape[0],):
        raise InvalidRequestError("one reward per leaf row", field="leaf_rewards",
                                  expected=(node_of.shape[0],), actual=tuple(leaf_rewards.shape))
    if not bool(torch.isfinite(leaf_rewards).all()):
        raise NonFiniteError("a leaf reward is NaN or Inf", field="leaf_rewards")
    r = leaf_rewards.double()
    out = torch.empty(node_of.shape, dtype=torch.float64)
    for d in range(node_of.shape[1]):
        ids, inverse = torch.unique(node_of[:, d], return_inverse=True)
        sums = torch.zeros(ids.numel(), dtype=torch.float64).index_add_(0, inverse, r)
        counts = torch.bincount(inverse, minlength=ids.numel()).double()
        out[:, d] = (sums / counts)[inverse]
    return out.float()


def _roots(node_of: torch.Tensor) -> tuple[torch.Tensor, int]:
    roots, tree = torch.unique(node_of[:, 0], return_inverse=True)
    return tree, roots.numel()


def branch_depthwise_advantages(node_of: torch.Tensor,
                                leaf_rewards: torch.Tensor) -> torch.Tensor:
    """BranchGRPO's per-node advantage of every (row, depth): (B, D+1) float32, column 0 (the
    roots) 0. The distinct nodes of one depth of one tree are standardised together."""
    rewards = node_rewards(node_of, leaf_rewards).double()
    tree, trees = _roots(node_of)
    out = torch.zeros(node_of.shape, dtype=torch.float64)
    for t in range(trees):
        mine = tree == t
        for d in range(node_of.shape[1]):
            ids, first = _first_rows(node_of[mine, d])
            if ids.numel() <= 1:
                continue
            values = rewards[mine, d][first]
            std = values.std()                                     # sample std, as torch's
            if float(std) < 1e-6:
                continue
            adv = (values - values.mean()) / (std + 1e-8)
            _, inverse = torch.unique(node_of[mine, d], return_inverse=True)
            out[torch.nonzero(mine).flatten(), d] = adv[inverse]
    return out.float()


def _first_rows(ids_of_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct ids (sorted) and the first row holding each."""
    ids, inverse = torch.unique(ids_of_rows, return_inverse=True)
    first = torch.full((ids.numel(),), ids_of_rows.numel(), dtype=torch.long)
    first = first.scatter_reduce(0, inverse, torch.arange(ids_of_rows.numel()), "amin")
    return ids, first


def tree_backprop_advantages(node_of: torch.Tensor, leaf_rewards: torch.Tensor, *,
                             eps: float = 1e-4) -> torch.Tensor:
    """TreeGRPO's per-node advantage of every (row, depth): (B, D+1) float32. Leaves:
    (r - mean_tree r) / (std_tree r + eps), population std (the project's GRPO normalisation);
    a node: the mean of its children's advantages (each child once, however many leaves)."""
    node_rewards(node_of, leaf_rewards)                           # checks the tree and rewards
    r = leaf_rewards.double()
    tree, trees = _roots(node_of)
    depth = node_of.shape[1] - 1
    out = torch.zeros(node_of.shape, dtype=torch.float64)
    for t in range(trees):
        mine = tree == t
        values = r[mine]
        out[mine, depth] = (values - values.mean()) / (values.std(unbiased=False) + eps)
    for d in range(depth - 1, -1, -1):
        ids, inverse = torch.unique(node_of[:, d], return_inverse=True)
        for k in range(ids.numel()):
            rows = inverse == k
            _, first = _first_rows(node_of[rows, d + 1])
            out[rows, d] = out[rows, d + 1][first].mean()
    return out.float()


def tree_advantages(node_of: torch.Tensor, leaf_rewards: torch.Tensor,
                    estimator: TreeAdvantage) -> torch.Tensor:
    """The configured estimator's (B, D+1) per-node advantages."""
    estimator = TreeAdvantage(estimator)
    if estimator is TreeAdvantage.BRANCH_DEPTHWISE:
        return branch_depthwise_advantages(node_of, leaf_rewards)
    return tree_backprop_advantages(node_of, leaf_rewards)


def edge_weights(node_of: torch.Tensor) -> torch.Tensor:
    """(B, D) float32: the weight of row b's step j, 1 / (rows under the node it enters), so a
    mean over rows counts each shared edge (transition) once and the rows' weights of one step
    sum to its number of distinct edges."""
    check_tree(node_of)
    out = torch.empty(node_of.shape[0], node_of.shape[1] - 1)
    for d in range(1, node_of.shape[1]):
        _, inverse, counts = torch.unique(node_of[:, d], return_inverse=True,
                                          return_counts=True)
        out[:, d - 1] = 1.0 / counts[inverse].float()
    return out


def tree_node_ids(trees: Sequence[RolloutTree | None], rows: Sequence[int],
                  num_steps: int) -> torch.Tensor:
    """(B, N+1) node ids of the batch's rows (requests in order, `rows[i]` output rows each):
    depth 0 one node per request (its prompt group), depth j + 1 the engine's node that ran step
    j (`RolloutTree.ancestor`; a request that did not fork: each row its own path). Each
    request's depth-0 node is its own root, so trees never share a node."""
    out, offset = [], 0
    for tree, count in zip(trees, rows):
        for r in range(count):
            ids = [offset]
            for j in range(num_steps):
                node = r if tree is None else tree.ancestor(r, j)
                ids.append(offset + 1 + node)
            out.append(ids)
        size = count if tree is None else len(tree.seeds)
        offset += 1 + size
    return torch.tensor(out, dtype=torch.int64)
