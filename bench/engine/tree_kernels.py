"""The speculative step's tail in two kernels: the draft tree's selection, and acceptance plus commit.

:func:`bench.engine.tree.select_tree` (``topk``, ``sort``, a scatter, gathers, cats and a ``max_depth``-long
ancestor loop) and :func:`bench.engine.tree.greedy_accept` plus the commit of ``Engine.speculate`` (a
permutation of the row's ``req_to_token`` slots and the committed tokens' write to ``token_table``) are
~50 tiny launches per step. On the H200 at batch size 1 each costs ~2 us plus a gap, so the step is bound
by the launch count, not by work. Here each is one launch, one program per sequence, everything in
registers:

* :func:`select_tree_fused` ranks every candidate by score (candidates with a higher score, or an equal
  score and a lower index, come first) and keeps those of rank ``< N - 1``; a kept candidate's node is its
  place in generation order among the kept ones (a cumsum), its parent node is its parent candidate's node
  (0 for the root's children), and the ancestor mask is a ``max_depth``-long parent walk in node space.
* :func:`accept_and_commit_fused` finds the accepted nodes (every non-root node on the way from the root
  matches the target's choice at its parent), orders them by depth before the rest, reads the row's ``N``
  tree slots in that order and writes them back in place (a barrier between the reads and the writes: it is
  a permutation within the row), and writes the committed tokens.

Ties: the kernel keeps the lowest index among equal scores (``torch.topk`` leaves their order unspecified),
which can change which of two equally scored drafts is verified, never the output: the verify step is
exact whatever the tree. The torch functions of :mod:`bench.engine.tree` are the CPU path and the test
oracle; ``fused=False`` runs them anywhere. ``fused=True`` needs Triton on CUDA, or Triton's interpreter
(see :func:`bench.engine.draft_select.resolve_draft_select`).
"""
from __future__ import annotations

import torch

from .tree import Tree, greedy_accept, select_tree

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: the torch path serves everywhere
    triton = tl = None

RANK_BLOCK = 32  # candidates compared per pass of the ranking loop ([C, RANK_BLOCK] at a time)


def select_tree_fused(root: torch.Tensor, cand_tokens: torch.Tensor, cand_scores: torch.Tensor,
                      cand_parents: torch.Tensor, cand_depth: torch.Tensor, num_nodes: int, max_depth: int,
                      fused: bool) -> Tree:
    """:func:`bench.engine.tree.select_tree` (same arguments, same :class:`Tree`), in one kernel when ``fused``.

    The kernel's tree equals torch's whenever the kept set is unambiguous (no tie at the cut); on ties it
    keeps the lowest indices.
    """
    if not fused:
        return select_tree(root, cand_tokens, cand_scores, cand_parents, cand_depth, num_nodes, max_depth)
    bs, c = cand_tokens.shape
    if not 2 <= num_nodes <= c + 1:
        raise ValueError(f"num_nodes must be in [2, {c + 1}] for {c} candidates, got {num_nodes}")
    dev = cand_tokens.device
    tokens = torch.empty(bs, num_nodes, dtype=torch.long, device=dev)
    parents, depth = torch.empty_like(tokens), torch.empty_like(tokens)
    mask = torch.empty(bs, num_nodes, num_nodes, dtype=torch.bool, device=dev)
    cb = triton.next_power_of_2(c)
    _select_kernel[(bs,)](root.contiguous(), cand_tokens.contiguous(), cand_scores.contiguous(),
                          cand_parents.contiguous(), cand_depth.contiguous(), tokens, parents, depth, mask, c,
                          N=num_nodes, NB=triton.next_power_of_2(num_nodes), CB=cb, BJ=min(cb, RANK_BLOCK),
                          MAX_DEPTH=max_depth)
    return Tree(tokens, parents, depth, mask)


def accept_and_commit_fused(tree: Tree, target_tokens: torch.Tensor, max_depth: int, rows: torch.Tensor,
                            seq_lens: torch.Tensor, req_to_token: torch.Tensor, token_table: torch.Tensor,
                            tree_cols: torch.Tensor, commit_cols: torch.Tensor, fused: bool) -> torch.Tensor:
    """Greedy acceptance of a verified tree and its commit; returns the accept lengths ``[bs]`` (int64).

    For sequence ``b`` (``row = rows[b]``, ``n = seq_lens[b]``) with the acceptance ``acc`` of
    :func:`bench.engine.tree.greedy_accept`: the tree's slots (columns ``n-1 .. n-2+N`` of the row, node i
    at ``n-1+i``) are permuted so that the accepted nodes' slots come first, by depth
    (``req_to_token[row, n-1+i] = old req_to_token[row, n-1+acc.order[i]]``: no KV moves), and
    ``token_table[row, n+j] = acc.new_tokens[j]`` for ``j <= max_depth``.

    Args:
        tree: the verified tree (``N`` nodes).
        target_tokens: ``[bs, N]`` the target's argmax at every node.
        max_depth: deepest level.
        rows, seq_lens: ``[bs]`` request rows and committed lengths.
        req_to_token, token_table: the engine's ``[rows, max_context]`` tables, written in place.
        tree_cols, commit_cols: ``arange(N)`` and ``arange(max_depth + 1)`` (the torch path's index columns).
        fused: one Triton kernel, else the torch ops.
    """
    if not fused:
        acc = greedy_accept(tree, target_tokens, max_depth)
        cols = (seq_lens - 1)[:, None] + tree_cols
        slots = req_to_token[rows[:, None], cols]
        # Accepted nodes' slots move to columns n-1 .. n-1+a (a permutation of the row: no KV copies).
        req_to_token[rows[:, None], cols] = slots.gather(1, acc.order)
        token_table[rows[:, None], seq_lens[:, None] + commit_cols] = acc.new_tokens
        return acc.accept_len
    bs, n = tree.tokens.shape
    if req_to_token.stride(1) != 1 or token_table.stride(1) != 1:
        raise ValueError("req_to_token and token_table need contiguous rows")
    accept_len = torch.empty(bs, dtype=torch.long, device=tree.tokens.device)
    _accept_kernel[(bs,)](tree.tokens.contiguous(), tree.parents.contiguous(), tree.depth.contiguous(),
                          tree.mask.contiguous(), target_tokens.contiguous(), rows.contiguous(),
                          seq_lens.contiguous(), req_to_token, token_table, accept_len, req_to_token.stride(0),
                          token_table.stride(0), N=n, NB=triton.next_power_of_2(n), D1=max_depth + 1,
                          DB=triton.next_power_of_2(max_depth + 1))
    return accept_len


if triton is not None:
    @triton.jit
    def _select_kernel(root_ptr, tok_ptr, score_ptr, par_ptr, depth_ptr, out_tok_ptr, out_par_ptr, out_depth_ptr,
                       out_mask_ptr, C, N: tl.constexpr, NB: tl.constexpr, CB: tl.constexpr, BJ: tl.constexpr,
                       MAX_DEPTH: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        ci = tl.arange(0, CB)
        in_c = ci < C
        s_i = tl.load(score_ptr + b * C + ci, mask=in_c, other=0.0)
        # rank: candidates ahead of each one (higher score, or equal score and lower index).
        rank = tl.zeros([CB], dtype=tl.int32)
        for j0 in tl.static_range(0, CB, BJ):
            cj = j0 + tl.arange(0, BJ)
            s_j = tl.load(score_ptr + b * C + cj, mask=cj < C, other=0.0)
            ahead = (s_j[None, :] > s_i[:, None]) | ((s_j[None, :] == s_i[:, None]) & (cj[None, :] < ci[:, None]))
            rank += tl.sum((ahead & (cj[None, :] < C)).to(tl.int32), axis=1)
        keep = in_c & (rank < N - 1)
        # A kept candidate's node: its place among the kept ones in generation order (1-based; 0 if not kept).
        node = tl.where(keep, tl.cumsum(keep.to(tl.int32), axis=0), 0)
        m = tl.arange(0, NB)
        is_cand = (m >= 1) & (m < N)
        cand = tl.sum(tl.where(keep[None, :] & (node[None, :] == m[:, None]), ci[None, :], 0), axis=1)
        tok = tl.load(tok_ptr + b * C + cand, mask=is_cand, other=0)
        dep = tl.load(depth_ptr + cand, mask=is_cand, other=0)
        par_cand = tl.load(par_ptr + b * C + cand, mask=is_cand, other=-1)
        # The parent candidate's node (0 for the root's children: no candidate has index -1).
        par = tl.sum(tl.where(ci[None, :] == par_cand[:, None], node[None, :], 0), axis=1)
        tok = tl.where(m == 0, tl.load(root_ptr + b), tok)
        in_n = m < N
        tl.store(out_tok_ptr + b * N + m, tok.to(tl.int64), mask=in_n)
        tl.store(out_par_ptr + b * N + m, par.to(tl.int64), mask=in_n)
        tl.store(out_depth_ptr + b * N + m, dep.to(tl.int64), mask=in_n)
        # anc[i, j]: node j is node i or one of its ancestors (the walk stays at the root once there).
        anc = m[:, None] == m[None, :]
        cur = par
        for _ in tl.static_range(MAX_DEPTH):
            hit = m[None, :] == cur[:, None]
            anc = anc | hit
            cur = tl.sum(tl.where(hit, par[None, :], 0), axis=1)
        tl.store(out_mask_ptr + b * N * N + m[:, None] * N + m[None, :], anc, mask=in_n[:, None] & in_n[None, :])

    @triton.jit
    def _accept_kernel(tok_ptr, par_ptr, depth_ptr, mask_ptr, target_ptr, rows_ptr, lens_ptr, r2t_ptr, table_ptr,
                       accept_ptr, r2t_stride, table_stride, N: tl.constexpr, NB: tl.constexpr, D1: tl.constexpr,
                       DB: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        i = tl.arange(0, NB)
        valid = i < N
        tok = tl.load(tok_ptr + b * N + i, mask=valid, other=0)
        par = tl.load(par_ptr + b * N + i, mask=valid, other=0)
        dep = tl.load(depth_ptr + b * N + i, mask=valid, other=0)
        tgt = tl.load(target_ptr + b * N + i, mask=valid, other=0)
        tgt_at_parent = tl.load(target_ptr + b * N + par, mask=valid, other=0)
        bad = valid & (i >= 1) & (tok != tgt_at_parent)  # a non-root node off the target's choice
        anc = tl.load(mask_ptr + b * N * N + i[:, None] * N + i[None, :], mask=valid[:, None] & valid[None, :],
                      other=0) != 0
        accepted = valid & (tl.sum((anc & bad[None, :]).to(tl.int32), axis=1) == 0)
        accept_len = tl.sum(accepted.to(tl.int32), axis=0)
        # order: accepted nodes by depth, then the rest by index (argsort of a key with no equal entries).
        key = tl.where(accepted, dep, N + i)
        before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & (i[None, :] < i[:, None]))
        pos = tl.sum((before & valid[None, :]).to(tl.int32), axis=1)  # each node's place in the order
        order = tl.sum(tl.where(valid[None, :] & (pos[None, :] == i[:, None]), i[None, :], 0), axis=1)
        last = tl.sum(tl.where(valid & (pos == accept_len - 1), i, 0), axis=0)  # the deepest accepted node
        bonus = tl.sum(tl.where(i == last, tgt, 0), axis=0)
        d = tl.arange(0, DB)
        path_tok = tl.sum(tl.where(accepted[None, :] & (pos[None, :] == d[:, None] + 1), tok[None, :], 0), axis=1)
        new_tok = tl.where(d < accept_len - 1, path_tok, bonus)
        row = tl.load(rows_ptr + b)
        n = tl.load(lens_ptr + b)
        tree_slots = r2t_ptr + row * r2t_stride + (n - 1)
        moved = tl.load(tree_slots + order, mask=valid)
        tl.debug_barrier()  # every read of the row's tree slots before any write: the writes permute them
        tl.store(tree_slots + i, moved, mask=valid)
        tl.store(table_ptr + row * table_stride + n + d, new_tok.to(tl.int64), mask=d < D1)
        tl.store(accept_ptr + b, accept_len.to(tl.int64))
