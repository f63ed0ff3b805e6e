"""Draft-tree selection and greedy tree acceptance, as fixed-shape tensor code (graph-safe).

A speculative step grows a tree from the *root* (the last committed token): level 1 holds the draft's
``topk`` best children of the root; every later level expands each of the previous level's ``topk``
beam nodes into ``topk`` children and keeps the ``topk`` best of those as the next beam (scores are
cumulative draft log-probabilities). The verify step checks the root plus the ``num_draft_tokens - 1``
best candidates of all levels. A child always scores below its parent, so the best-k set is closed
under taking ancestors: every selected node's parent is selected too.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DEPTH_PENALTY = 1e-4  # strict parent > child order even when a log-prob rounds to 0


@dataclass
class Tree:
    """A selected draft tree, ``N = num_draft_tokens`` nodes per sequence, node 0 the root.

    Nodes are ordered so that every ancestor comes before its descendants.

    Attributes:
        tokens: ``[bs, N]`` token of each node (root included).
        parents: ``[bs, N]`` parent node index (the root is its own parent).
        depth: ``[bs, N]`` depth (root 0).
        mask: ``[bs, N, N]`` bool, ``mask[b, i, j]``: node j is node i or an ancestor of it.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    mask: torch.Tensor


def select_tree(root: torch.Tensor, cand_tokens: torch.Tensor, cand_scores: torch.Tensor,
                cand_parents: torch.Tensor, cand_depth: torch.Tensor, num_nodes: int, max_depth: int) -> Tree:
    """Keep the root and the ``num_nodes - 1`` best candidates.

    Args:
        root: ``[bs]`` root tokens.
        cand_tokens, cand_scores: ``[bs, C]`` candidates in generation order (level by level).
        cand_parents: ``[bs, C]`` candidate index of each candidate's parent, -1 for the root.
        cand_depth: ``[C]`` level of each candidate (1-based).
        num_nodes: nodes to keep, root included.
        max_depth: deepest level (bounds the ancestor walk).
    """
    bs, c = cand_tokens.shape
    best = cand_scores.topk(num_nodes - 1, dim=1).indices.sort(dim=1).values  # generation order: parents first
    node_ids = torch.arange(1, num_nodes, device=root.device).expand(bs, -1)
    node_of_cand = torch.zeros(bs, c, dtype=torch.long, device=root.device).scatter_(1, best, node_ids)
    par_cand = cand_parents.gather(1, best)
    par_node = torch.where(par_cand < 0, 0, node_of_cand.gather(1, par_cand.clamp(min=0)))
    zero = torch.zeros(bs, 1, dtype=torch.long, device=root.device)
    parents = torch.cat([zero, par_node], dim=1)
    depth = torch.cat([zero, cand_depth[best]], dim=1)
    tokens = torch.cat([root[:, None], cand_tokens.gather(1, best)], dim=1)
    mask = torch.eye(num_nodes, dtype=torch.bool, device=root.device).expand(bs, -1, -1).clone()
    cur = parents
    for _ in range(max_depth):
        mask.scatter_(2, cur[..., None], True)
        cur = parents.gather(1, cur)
    return Tree(tokens, parents, depth, mask)


@dataclass
class Acceptance:
    """Greedy acceptance of one verify step.

    Attributes:
        accept_len: ``[bs]`` committed tokens this step: accepted draft nodes + the bonus token (>= 1).
        path: ``[bs, max_depth + 1]`` accepted node at each depth (root first); past the last accepted
            depth it repeats the last accepted node.
        new_tokens: ``[bs, max_depth + 1]`` the committed tokens in order (entries past
            ``accept_len`` repeat the bonus token and are not committed).
        order: ``[bs, N]`` a permutation of the nodes: accepted nodes by depth, then the rest.
    """

    accept_len: torch.Tensor
    path: torch.Tensor
    new_tokens: torch.Tensor
    order: torch.Tensor


def greedy_accept(tree: Tree, target_tokens: torch.Tensor, max_depth: int) -> Acceptance:
    """Accept the longest tree path whose every token equals the target's greedy choice at its parent.

    Args:
        tree: the verified tree.
        target_tokens: ``[bs, N]`` the target's argmax at every node.
        max_depth: deepest level.
    """
    bs, n = tree.tokens.shape
    dev = tree.tokens.device
    # A node is accepted when it and each of its ancestors (the root aside) carry the target's choice at
    # their parent. Siblings carry distinct tokens (top-k), so the accepted nodes form one root path.
    match = tree.tokens == target_tokens.gather(1, tree.parents)
    accepted = ~(tree.mask[:, :, 1:] & ~match[:, None, 1:]).any(-1)
    accept_len = accepted.sum(1)
    order = torch.where(accepted, tree.depth, n + torch.arange(n, device=dev)).argsort(dim=1)
    last = order.gather(1, (accept_len - 1)[:, None])  # the deepest accepted node
    j = torch.arange(max_depth + 1, device=dev)
    head = order[:, :max_depth + 1]
    if head.shape[1] <= max_depth:  # fewer nodes than levels: a path is at most n nodes long
        head = torch.cat([head, last.expand(bs, max_depth + 1 - n)], 1)
    path = torch.where(j < accept_len[:, None], head, last)
    bonus = target_tokens.gather(1, last)
    new_tokens = torch.where(j < (accept_len - 1)[:, None], torch.cat([tree.tokens.gather(1, path[:, 1:]), bonus], 1),
                             bonus)
    return Acceptance(accept_len, path, new_tokens, order)
