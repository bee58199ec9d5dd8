"""Per-node advantages of branched rollouts (trainer/algorithms/tree.py).

BranchGRPO against its reference code on the same random trees and rewards (fp32, rtol 1e-5).
Excerpts cut to the lines used from Fredreic1849/BranchGRPO
19fbb9fc92ad1857212f3b664d6e9ff80c8b3804: fastvideo/train_branchgrpo_flux.py (TreeNode with
add_child / is_leaf / get_all_leaf_descendants; compute_node_rewards_from_leaves, the plain
leaf-mean branch, steps 2-3; compute_hierarchical_advantages_by_depth; the edge -> child
advantage pairing of train_one_step_tree's collect_all_transitions). Changed: main_print dropped.

TreeGRPO (arXiv 2512.08153) has no public code: its leaf z-scores averaged up the tree are checked
on closed forms (a balanced tree's node is the mean of its leaves' advantages, the root of any
tree standardised from its leaves is 0 when balanced, a hand-computed unbalanced tree).
"""
from __future__ import annotations

import pytest
import torch

from contract import InvalidRequestError
from trainer.algorithms.tree import (TreeAdvantage, branch_depthwise_advantages, edge_weights,
                                     node_rewards, tree_advantages, tree_backprop_advantages)


# ---- excerpts of the reference code -------------------------------------------------------
class TreeNode:
    def __init__(self, node_id, parent=None):
        self.node_id = node_id
        self.parent = parent
        self.children = []
        self.reward = None
        self.advantage = None
        self.depth = 0 if parent is None else parent.depth + 1

    def add_child(self, child):
        self.children.append(child)
        child.depth = self.depth + 1

    def is_leaf(self):
        return len(self.children) == 0

    def get_all_leaf_descendants(self):
        if self.is_leaf():
            return [self]
        leaves = []
        for child in self.children:
            leaves.extend(child.get_all_leaf_descendants())
        return leaves


def ref_compute_node_rewards_from_leaves(root_node):
    all_nodes = []

    def collect_nodes(node):
        all_nodes.append(node)
        for child in node.children:
            collect_nodes(child)
    collect_nodes(root_node)
    max_depth = max(node.depth for node in all_nodes)
    nodes_by_depth = {depth: [] for depth in range(max_depth + 1)}
    for node in all_nodes:
        nodes_by_depth[node.depth].append(node)
    for depth in reversed(range(max_depth)):
        for node in nodes_by_depth[depth]:
            if not node.is_leaf():
                leaf_descendants = node.get_all_leaf_descendants()
                descendant_rewards = [leaf.reward for leaf in leaf_descendants]
                node.reward = torch.stack(descendant_rewards).mean()
    return all_nodes, nodes_by_depth


def ref_compute_hierarchical_advantages_by_depth(nodes_by_depth):
    node_advantages = {}
    for depth, nodes in nodes_by_depth.items():
        if len(nodes) <= 1:
            for node in nodes:
                node.advantage = torch.tensor(0.0)
                node_advantages[node.node_id] = node.advantage
        else:
            rewards = torch.stack([node.reward for node in nodes])
            mean_reward = rewards.mean()
            std_reward = rewards.std()
            if std_reward < 1e-6:
                advantages = torch.zeros_like(rewards)
            else:
                advantages = (rewards - mean_reward) / (std_reward + 1e-8)
            for i, node in enumerate(nodes):
                node.advantage = advantages[i]
                node_advantages[node.node_id] = node.advantage
    return node_advantages


# ---- random branched rollouts --------------------------------------------------------------
def _forest(trees: int, depth: int, forks: dict[int, int], gen: torch.Generator):
    """node_of (B, depth+1): every tree forks at step k into forks[k] children (a random
    branch factor in 1..forks[k] per node, so trees are unbalanced)."""
    rows: list[list[int]] = []
    next_id = 0
    for _ in range(trees):
        paths = [[next_id]]
        next_id += 1
        for d in range(1, depth + 1):
            grown = []
            for path in paths:
                n = int(torch.randint(1, forks[d - 1] + 1, (1,), generator=gen)) \
                    if d - 1 in forks else 1
                for _ in range(n):
                    grown.append(path + [next_id])
                    next_id += 1
            paths = grown
        rows += paths
    return torch.tensor(rows, dtype=torch.int64)


def _reference_tree(node_of, leaf_rewards, tree_rows):
    nodes = {}
    root = None
    for b in tree_rows:
        for d, node in enumerate(node_of[b].tolist()):
            if node not in nodes:
                parent = None if d == 0 else nodes[node_of[b, d - 1].item()]
                nodes[node] = TreeNode(node, parent)
                if parent is None:
                    root = nodes[node]
                else:
                    parent.add_child(nodes[node])
        nodes[node_of[b, -1].item()].reward = leaf_rewards[b]
    return root


@pytest.mark.parametrize("seed", range(4))
def test_branch_depthwise_equals_branchgrpos(seed):
    gen = torch.Generator().manual_seed(seed)
    node_of = _forest(3, 6, {1: 3, 3: 2, 4: 2}, gen)
    leaf_rewards = torch.randn(node_of.shape[0], generator=gen)
    got = branch_depthwise_advantages(node_of, leaf_rewards)
    roots = node_of[:, 0]
    compared = 0
    for root_id in torch.unique(roots).tolist():
        tree_rows = torch.nonzero(roots == root_id).flatten().tolist()
        root = _reference_tree(node_of, leaf_rewards, tree_rows)
        _, by_depth = ref_compute_node_rewards_from_leaves(root)
        ref = ref_compute_hierarchical_advantages_by_depth(by_depth)
        for b in tree_rows:      # the edge into depth d trains with the child node's advantage
            for d in range(1, node_of.shape[1]):
                want = ref[node_of[b, d].item()].float()
                torch.testing.assert_close(got[b, d], want, rtol=1e-5, atol=1e-6)
                compared += 1
    assert compared == node_of.shape[0] * (node_of.shape[1] - 1)
    assert float(got.abs().max()) > 0.1


def test_node_rewards_are_leaf_means_and_edges_count_once():
    # one tree, depth 3: root -> a (step 0, shared), fork at step 1 into b, c; c forks into
    # two leaves at step 2, b goes on alone
    node_of = torch.tensor([[0, 1, 2, 4], [0, 1, 3, 5], [0, 1, 3, 6]])
    r = torch.tensor([1.0, 2.0, 4.0])
    nodes = node_rewards(node_of, r)
    torch.testing.assert_close(nodes[:, 0], torch.full((3,), 7 / 3))
    torch.testing.assert_close(nodes[:, 2], torch.tensor([1.0, 3.0, 3.0]))
    w = edge_weights(node_of)
    torch.testing.assert_close(w, torch.tensor([[1 / 3, 1.0, 1.0], [1 / 3, 0.5, 1.0],
                                                [1 / 3, 0.5, 1.0]]))
    assert torch.allclose(w.sum(dim=0), torch.tensor([1.0, 2.0, 3.0]))   # distinct edges


def test_tree_backprop_closed_forms():
    # balanced: two forks of two -> each node's advantage is the mean of its leaves', root 0
    node_of = torch.tensor([[0, 1, 2, 6], [0, 1, 2, 7], [0, 1, 3, 8], [0, 1, 3, 9]])
    r = torch.tensor([0.0, 1.0, 3.0, 5.0])
    a = tree_backprop_advantages(node_of, r)
    z = (r - r.mean()) / (r.std(unbiased=False) + 1e-4)
    torch.testing.assert_close(a[:, 3], z)
    torch.testing.assert_close(a[:, 2], torch.stack([z[:2].mean()] * 2 + [z[2:].mean()] * 2))
    assert abs(float(a[0, 0])) < 1e-6 and torch.equal(a[:, 0], a[:, 1])
    # unbalanced: the node's children count once each, not by their leaves
    node_of = torch.tensor([[0, 1, 3], [0, 2, 4], [0, 2, 5]])
    r = torch.tensor([3.0, 0.0, 0.0])
    a = tree_backprop_advantages(node_of, r)
    z = (r - 1.0) / (r.std(unbiased=False) + 1e-4)
    torch.testing.assert_close(a[:, 1], torch.stack([z[0], z[1], z[1]]))
    torch.testing.assert_close(a[0, 0], (z[0] + z[1]) / 2)            # not mean(z) = 0
    assert torch.equal(tree_advantages(node_of, r, TreeAdvantage.TREE_BACKPROP), a)


def test_bad_trees_are_typed_errors_naming_the_field():
    bad = [(torch.tensor([[0, 1], [0, 1]]), "node_of"),                  # two rows, one leaf
           (torch.tensor([[0, 2, 3], [1, 2, 4]]), "node_of"),            # node 2: two parents
           (torch.tensor([[0], [0]]), "node_of"),                        # no step
           (torch.tensor([[0.0, 1.0]]), "node_of")]                      # not int64
    for node_of, field in bad:
        with pytest.raises(InvalidRequestError) as e:
            node_rewards(node_of, torch.zeros(node_of.shape[0]))
        assert e.value.field == field
    with pytest.raises(InvalidRequestError) as e:
        node_rewards(torch.tensor([[0, 1], [0, 2]]), torch.zeros(3))
    assert e.value.field == "leaf_rewards"
