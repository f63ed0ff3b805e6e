"""sgl_kernel's CPU ops that a dense Llama with EAGLE / EAGLE3 / STANDALONE needs, in plain torch.

Each follows the semantics of SGLang's own kernel as its Triton twin and its call sites show them (page size 1, no
sliding window, no logit cap, no attention sinks: the tiny models of the live tier use none, and each op refuses
what it does not implement). Written for clarity, not speed: the live tier's models are tiny.
"""
from __future__ import annotations

import ctypes
import math
from typing import Any, Optional, Tuple

import torch


# ----------------------------------------------------------------------------------- attention
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, logit_cap: float,
            visible: Optional[torch.Tensor]) -> torch.Tensor:
    """``q`` [n, H, D] over ``k``/``v`` [L, Hkv, D]; ``visible`` [n, L] bool or None (all). Returns [n, H, Dv]."""
    groups = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(groups, dim=1)
    v = v.float().repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale
    if logit_cap and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if visible is not None:
        scores = scores.masked_fill(~visible[None], -math.inf)
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def _refuse(sliding_window: int, sinks: Any, encoder_lens: Any, is_cross: bool) -> None:
    if sliding_window > 0 or sinks is not None or encoder_lens is not None or is_cross:
        raise NotImplementedError("live-tier stand-in attention: no sliding window, sinks or cross attention")


def decode_attention_cpu(*args: Any) -> None:
    """One query row per sequence over its KV (``req_to_token[row, :seq_len]``); writes the step's own K/V at
    ``loc`` first when given. SGLang 0.5.20 to 0.5.23 pass K/V scales after the buffers (19 arguments), 0.5.16 to
    0.5.19 not (17)."""
    if len(args) == 19:
        q, k_buffer, v_buffer, _k_scale, _v_scale, o, k, v, loc, _logits, req_to_token, rows, seq_lens, scale, \
            logit_cap, is_cross, window, encoder_lens, sinks = args
    elif len(args) == 17:
        q, k_buffer, v_buffer, o, k, v, loc, _logits, req_to_token, rows, seq_lens, scale, logit_cap, is_cross, \
            window, encoder_lens, sinks = args
    else:
        raise TypeError(f"decode_attention_cpu: {len(args)} arguments; the stand-in knows those of SGLang 0.5.16 to "
                        f"0.5.23 (17 or 19)")
    _refuse(window, sinks, encoder_lens, is_cross)
    if k is not None and v is not None:
        k_buffer[loc.long()] = k.view(-1, *k_buffer.shape[1:]).to(k_buffer.dtype)
        v_buffer[loc.long()] = v.view(-1, *v_buffer.shape[1:]).to(v_buffer.dtype)
    if q.shape[0] != seq_lens.shape[0]:  # as SGLang's own kernel, which reads one length per query row
        raise IndexError(f"decode_attention_cpu: {q.shape[0]} query rows but {seq_lens.shape[0]} sequence lengths")
    for i in range(q.shape[0]):
        slots = req_to_token[int(rows[i]), :int(seq_lens[i])].long()
        o[i] = _attend(q[i:i + 1], k_buffer[slots], v_buffer[slots], scale, logit_cap, None)[0].to(o.dtype)


def extend_attention_cpu(*args: Any) -> None:
    """Each sequence's ``extend_seq_lens[i]`` new query rows over its prefix (from the KV buffers) and its new K/V
    (``k``/``v``; from the buffers where ``None``): causal, or by ``tree_mask`` (per sequence, row-major, one block
    after another: ``ext x ext`` over the new tokens or ``ext x seq_len`` over all), or fully visible where
    ``is_causal`` is False. SGLang 0.5.16 to 0.5.18 pass neither K/V scales nor ``is_causal`` (19 arguments), 0.5.19
    ``is_causal`` last (20), 0.5.20 to 0.5.23 both (22)."""
    if len(args) == 22:
        q, k, v, o, k_buffer, v_buffer, _ks, _vs, req_to_token, rows, seq_lens, ext_lens, starts, _max_ext, scale, \
            logit_cap, is_cross, window, encoder_lens, sinks, tree_mask, is_causal = args
    elif len(args) in (19, 20):
        q, k, v, o, k_buffer, v_buffer, req_to_token, rows, seq_lens, ext_lens, starts, _max_ext, scale, \
            logit_cap, is_cross, window, encoder_lens, sinks, tree_mask = args[:19]
        is_causal = args[19] if len(args) == 20 else True
    else:
        raise TypeError(f"extend_attention_cpu: {len(args)} arguments; the stand-in knows those of SGLang 0.5.16 to "
                        f"0.5.23 (19, 20 or 22)")
    _refuse(window, sinks, encoder_lens, is_cross)
    # SGLang 0.5.23 on CPU passes the tree mask over the new tokens only (ext x ext per sequence, QLEN_ONLY; the
    # prefix is visible to all), 0.5.17 over prefix and new tokens (ext x seq_len, FULL_MASK): its size tells which.
    tree_only = tree_mask is not None and tree_mask.numel() == int((ext_lens.long() ** 2).sum())
    mask_at = 0
    for i in range(seq_lens.shape[0]):
        seq, ext, start, row = int(seq_lens[i]), int(ext_lens[i]), int(starts[i]), int(rows[i])
        prefix = seq - ext
        slots = req_to_token[row, :seq].long()
        keys, values = k_buffer[slots[:prefix]], v_buffer[slots[:prefix]]
        new_k = k[start:start + ext] if k is not None else k_buffer[slots[prefix:]]
        new_v = v[start:start + ext] if v is not None else v_buffer[slots[prefix:]]
        keys = torch.cat([keys, new_k.view(ext, *k_buffer.shape[1:]).to(keys.dtype)])
        values = torch.cat([values, new_v.view(ext, *v_buffer.shape[1:]).to(values.dtype)])
        if tree_only:
            tree = tree_mask[mask_at:mask_at + ext * ext].view(ext, ext).bool()
            visible = torch.cat([torch.ones((ext, prefix), dtype=torch.bool), tree], dim=1)
            mask_at += ext * ext
        elif tree_mask is not None and tree_mask.numel():
            visible = tree_mask[mask_at:mask_at + ext * seq].view(ext, seq).bool()
            mask_at += ext * seq
        elif is_causal:
            visible = torch.arange(seq)[None, :] <= (prefix + torch.arange(ext))[:, None]
        else:
            visible = None
        o[start:start + ext] = _attend(q[start:start + ext], keys, values, scale, logit_cap, visible).to(o.dtype)


def build_draft_decode_metadata_cpu(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, topk: int,
                                    num_steps: int, pool_len: int) -> torch.Tensor:
    """One ``req_to_token`` row per draft candidate (``bs * topk``, request-major): the request's prefix, then the
    candidate's own draft slots (``topk`` runs of ``num_steps`` slots reserved from ``seq_len`` on)."""
    bs = seq_lens.shape[0]
    table = torch.zeros((bs * topk, pool_len), dtype=req_to_token.dtype, device=req_to_token.device)
    for b in range(bs):
        row, n = int(rows[b]), int(seq_lens[b])
        for j in range(topk):
            table[b * topk + j, :n] = req_to_token[row, :n]
            table[b * topk + j, n:n + num_steps] = req_to_token[row, n + j * num_steps:n + (j + 1) * num_steps]
    return table


# ----------------------------------------------------------------------------------- the draft tree and its verify
def _parent_position(selected: torch.Tensor, parent_list: torch.Tensor, b: int, position: int, topk: int,
                     draft_tokens: int) -> Tuple[bool, int]:
    """Where the parent of tree node ``position`` (0-based over the selected nodes) sits among the selected nodes:
    (found, index); the root's children report (True, -1)."""
    parent_tb = int(selected[b, position]) // topk
    if parent_tb == 0:
        return True, -1
    parent_token = int(parent_list[b, parent_tb])
    for pp in range(draft_tokens - 1):
        if int(selected[b, pp]) == parent_token:
            return True, pp
    return False, 0


def build_tree_kernel_efficient_cpu(parent_list: torch.Tensor, selected_index: torch.Tensor, verified_seq_len: torch.Tensor,
                                    tree_mask: torch.Tensor, positions: torch.Tensor, retrieve_index: torch.Tensor,
                                    retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor, topk: int,
                                    depth: int, draft_token_num: int, tree_mask_mode: int) -> None:
    """SGLang's EAGLE tree from the selected draft nodes: retrieve index / first child / next sibling per node, the
    tree's positions and its attention mask (mode 0, full: each node's row over prefix + tree; 1: tree only)."""
    ndt = draft_token_num
    parents = parent_list.view(parent_list.shape[0], -1) if parent_list.dim() > 1 else parent_list.view(1, -1)
    prefix_sum = 0
    for b in range(verified_seq_len.shape[0]):
        seq_len = int(verified_seq_len[b])
        base = ndt * ndt * b + prefix_sum * ndt
        prefix_sum += seq_len
        positions[b * ndt] = seq_len
        for i in range(ndt - 1, 0, -1):
            retrieve_index[b, i] = b * ndt + i
            found, at = _parent_position(selected_index, parents, b, i - 1, topk, ndt)
            if found:
                parent = at + 1
                previous = int(retrieve_next_token[b, parent])
                retrieve_next_token[b, parent] = i
                if previous != -1:
                    retrieve_next_sibling[b, i] = previous
        retrieve_index[b, 0] = b * ndt
        for x in range(ndt):
            if tree_mask_mode == 0:
                at_row = base + (seq_len + ndt) * x + seq_len + 1
            else:
                at_row = ndt * ndt * b + ndt * x + 1
            tree_mask[at_row - 1] = True
            tree_mask[at_row:at_row + ndt - 1] = False
            if x == 0:
                continue
            node, steps = x - 1, 0
            for _ in range(depth):
                steps += 1
                tree_mask[at_row + node] = True
                found, at = _parent_position(selected_index, parents, b, node, topk, ndt)
                if not found or at < 0:
                    break
                node = at
            positions[b * ndt + x] = steps + seq_len


def verify_tree_greedy_cpu(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                           candidates: torch.Tensor, retrive_index: torch.Tensor, retrive_next_token: torch.Tensor,
                           retrive_next_sibling: torch.Tensor, target_predict: torch.Tensor) -> None:
    """Greedy acceptance down the tree: from the root, take the child whose draft token equals the target's
    prediction at the last accepted node, as long as one does; the target's token after the last accepted node
    is the bonus. (The argument names are SGLang's op schema's.)"""
    steps = accept_index.shape[1]
    flat_target = target_predict.view(-1)
    for b in range(candidates.shape[0]):
        last = int(retrive_index[b, 0])
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for j in range(1, steps):
            node = int(retrive_next_token[b, node])
            target = int(flat_target[last])
            while node != -1 and int(candidates[b, node]) != target:
                node = int(retrive_next_sibling[b, node])
            if node == -1:
                break
            predicts[last] = target
            accepted += 1
            last = int(retrive_index[b, node])
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = flat_target[last]


# ----------------------------------------------------------------------------------- KV slot bookkeeping
def assign_req_to_token_pool_cpu(rows: torch.Tensor, req_to_token: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """``req_to_token[row_i, start_i:end_i]`` = the next ``end_i - start_i`` slots of ``out_cache_loc``."""
    at = 0
    for i in range(rows.shape[0]):
        s, e = int(starts[i]), int(ends[i])
        req_to_token[int(rows[i]), s:e] = out_cache_loc[at:at + e - s].to(req_to_token.dtype)
        at += e - s


def assign_extend_cache_locs_cpu(rows: torch.Tensor, req_to_token: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """The reverse: the next ``end_i - start_i`` entries of ``out_cache_loc`` = ``req_to_token[row_i, start_i:end_i]``."""
    at = 0
    for i in range(rows.shape[0]):
        s, e = int(starts[i]), int(ends[i])
        out_cache_loc[at:at + e - s] = req_to_token[int(rows[i]), s:e].to(out_cache_loc.dtype)
        at += e - s


def assign_draft_cache_locs_contiguous_cpu(rows: torch.Tensor, req_to_token: torch.Tensor, seq_lens: torch.Tensor,
                                           out_cache_loc: torch.Tensor, pool_len: int, topk: int, num_steps: int) -> None:
    """Each request's ``topk * num_steps`` draft slots, reserved in ``req_to_token`` from ``seq_len`` on."""
    width = topk * num_steps
    for i in range(rows.shape[0]):
        n = int(seq_lens[i])
        out_cache_loc[i * width:(i + 1) * width] = req_to_token[int(rows[i]), n:n + width].to(out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor,
                          accept_stride: int) -> None:
    """Each request's last accepted token (``accept_lens`` counts the bonus token)."""
    flat = accept_tokens.reshape(-1)
    for i in range(bonus_tokens.shape[0]):
        bonus_tokens[i] = flat[accept_stride * i + int(accept_lens[i]) - 1]


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor) -> None:
    """The slots of the accepted tree nodes (``accept_index`` >= 0), packed in order."""
    flat = accept_index.reshape(-1)
    kept = flat[flat >= 0].long()
    accept_out_cache_loc[:kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """Every KV buffer (``data_ptrs[j]``, ``strides[j]`` bytes per slot): slot ``tgt_loc[i]`` = slot ``src_loc[i]``
    (all sources read before any is written, as the parallel kernel reads them)."""
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(ptr + int(s) * stride, stride) for s in src_loc.tolist()]
        for t, data in zip(tgt_loc.tolist(), rows):
            ctypes.memmove(ptr + int(t) * stride, data, stride)
