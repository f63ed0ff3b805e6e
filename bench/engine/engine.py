"""The engine: target + draft models over paged KV caches, and the three step functions the GraphPool
captures (``prefill``, ``decode``, ``verify``).

Every step reads only two per-sequence inputs, ``seq_lens`` (committed tokens ``n``) and
``req_pool_indices`` (request rows), and derives the rest in-graph from device tables:
``token_table[row, pos]`` (committed tokens) and ``req_to_token[row, pos]`` (KV slots). So a step needs no
host-side slot allocation and no host copy of tokens, and the host never waits for the GPU except to
read the accept lengths of a verify step. Padded rows carry row 0 (all dummy slot) and ``seq_lens`` 1.

State of a sequence with ``n`` committed tokens: the target KV holds positions ``0..n-2``; token ``n-1``
is pending (the next step's input). The draft KV holds positions ``0..draft_len-1``.
"""
from __future__ import annotations

import logging

import torch

from graphpool import GraphPool, Mode, StepBatch, StepInput

from .attention import AttnMeta, PagedAttention
from .config import ModelConfig, SpecConfig
from .kv_cache import DUMMY_ROW, KVCache, ReqToTokenPool, SlotAllocator
from .model import LlamaModel, build_draft, build_target
from .parallel import TensorParallel
from .tree import DEPTH_PENALTY, greedy_accept, select_tree

log = logging.getLogger(__name__)

STEP_INPUTS = [
    StepInput("seq_lens", torch.int64, per="seq", fill=1),
    StepInput("req_pool_indices", torch.int64, per="seq", fill=DUMMY_ROW),  # row 0: every slot the dummy
]


class Engine:
    """Models, caches and step functions for one run.

    Args:
        cfg: target model shape.
        spec: speculation shape and draft.
        max_rows: the most requests in flight (request rows).
        prompt_len: every prompt's length (fixed, so prefill is one graph shape).
        max_new_tokens: the longest output a request may ask for.
        device, dtype: where and in what precision the models and caches live.
        seed: weights seed (the draft uses ``seed + 1``).
        tp: tensor parallelism (:mod:`bench.engine.parallel`): this rank keeps its shard of the same full
            weights and its KV heads; ``None`` runs the whole model in this process.
    """

    def __init__(self, cfg: ModelConfig, spec: SpecConfig, max_rows: int, prompt_len: int, max_new_tokens: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                 tp: TensorParallel | None = None):
        if prompt_len < spec.window + 1:
            raise ValueError(f"prompt_len must be >= {spec.window + 1} (the draft re-reads the last "
                             f"{spec.window} tokens), got {prompt_len}")
        self.cfg, self.spec, self.device, self.dtype = cfg, spec, torch.device(device), dtype
        self.prompt_len, self.max_new_tokens = prompt_len, max_new_tokens
        # Room for the longest request plus one step's tree (verify) and draft scratch past its end.
        self.max_context = prompt_len + max_new_tokens + spec.num_draft_tokens + spec.topk * spec.steps
        if self.max_context + spec.num_draft_tokens > cfg.max_positions:
            raise ValueError(f"max_context {self.max_context} exceeds the model's max_positions {cfg.max_positions}")
        self.target = build_target(cfg, seed, self.device, dtype)
        self.draft = build_draft(self.target, spec.draft_layers, spec.draft_noise, seed + 1)
        self.tp = tp
        # Heads this process attends over (its shard under tensor parallelism); the KV cache holds these.
        self.num_heads, self.num_kv_heads = tp.local_heads(cfg) if tp else (cfg.num_heads, cfg.num_kv_heads)
        if tp is not None:  # shard both models only now: the draft is made from the full target
            tp.shard(self.target)
            tp.shard(self.draft)
        num_slots = 1 + max_rows * self.max_context
        self.slots = SlotAllocator(num_slots)
        self.rows = ReqToTokenPool(max_rows, self.max_context, self.slots, self.device)
        self.req_to_token = self.rows.req_to_token
        kv = (num_slots, self.num_kv_heads, cfg.head_dim, dtype, self.device)
        self.target_attn = PagedAttention(KVCache(cfg.num_layers, *kv))
        self.draft_attn = PagedAttention(KVCache(spec.draft_layers, *kv))
        self.token_table = torch.zeros(max_rows + 1, self.max_context, dtype=torch.int64, device=self.device)
        self.group = cfg.num_heads // cfg.num_kv_heads
        self._cand_depth = torch.tensor([1] * spec.topk + [d for d in range(2, spec.steps + 1)
                                                            for _ in range(spec.topk ** 2)], device=self.device)
        log.info("engine: %d target layers, %d draft layers, %d rows x %d positions, KV %.1f MiB", cfg.num_layers,
                 spec.draft_layers, max_rows, self.max_context,
                 (self.target_attn.cache.nbytes + self.draft_attn.cache.nbytes) / 2**20)

    # ------------------------------------------------------------------------------------- the pool
    def modes(self) -> list[Mode]:
        """decode (1 token/seq), verify (``num_draft_tokens``/seq), prefill (the prompt but its last token)."""
        return [Mode("decode", 1), Mode("verify", self.spec.num_draft_tokens), Mode("prefill", self.prompt_len - 1)]

    def build_pool(self, batch_sizes: list[int], prefill_batch_sizes: list[int], backend: str = "auto") -> GraphPool:
        """A GraphPool with all three modes over :data:`STEP_INPUTS` (prefill with its own sizes)."""
        modes = self.modes()
        modes[2] = Mode("prefill", self.prompt_len - 1, tuple(prefill_batch_sizes))
        return GraphPool(modes, STEP_INPUTS, batch_sizes, device=self.device, backend=backend)

    @torch.no_grad()
    def step(self, batch: StepBatch):
        """The step function the pool captures: dispatch on the batch's mode."""
        seq_lens, rows = batch.inputs["seq_lens"], batch.inputs["req_pool_indices"]
        name = batch.mode.name
        if self.tp is not None and not batch.captured:  # graphs are checked in the pool's prepare hook
            self.tp.agree(f"eager_{name}", batch.bs, batch.bs)
        if name == "decode":
            return self.decode(seq_lens, rows)
        if name == "verify":
            return self.speculate(seq_lens, rows)
        if name == "prefill":
            return self.prefill(rows)
        raise ValueError(f"the engine has no step for mode {name!r}; its modes are decode, verify, prefill")

    # ------------------------------------------------------------------------------------ the steps
    def _meta_causal(self, rows: torch.Tensor, start: torch.Tensor, positions: torch.Tensor) -> AttnMeta:
        slots = self.req_to_token[rows[:, None], positions]
        return AttnMeta.causal(self.req_to_token, rows, start, slots, self.max_context, self.group)

    def prefill(self, rows: torch.Tensor) -> torch.Tensor:
        """Target and draft KV for prompt positions ``0..P-2`` (the prompt is already in token_table)."""
        t = self.prompt_len - 1
        pos = torch.arange(t, device=rows.device).expand(rows.shape[0], t)
        meta = self._meta_causal(rows, torch.zeros_like(rows), pos)
        ids, flat = self.token_table[rows[:, None], pos].reshape(-1), pos.reshape(-1)
        for model, attn in ((self.target, self.target_attn), (self.draft, self.draft_attn)):
            attn.meta = meta
            model(ids, flat, attn)
        return rows

    def decode(self, seq_lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One plain greedy decode step; commits ``token_table[row, n]``. Returns the new tokens ``[bs]``."""
        pos = (seq_lens - 1)[:, None]
        self.target_attn.meta = self._meta_causal(rows, seq_lens - 1, pos)
        hidden = self.target(self.token_table[rows[:, None], pos].reshape(-1), pos.reshape(-1), self.target_attn)
        nxt = self.target.logits(hidden).argmax(-1)
        self.token_table[rows, seq_lens] = nxt
        return nxt

    def speculate(self, seq_lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Draft a tree, verify it with the target, accept greedily, commit. Returns accept lengths ``[bs]``."""
        sp, n, bs = self.spec, seq_lens, rows.shape[0]
        tree = self._draft_tree(n, rows)
        # Verify: node i sits in the row's slot at column n-1+i (the root's own slot, then scratch columns).
        cols = (n - 1)[:, None] + torch.arange(sp.num_draft_tokens, device=n.device)
        slots = self.req_to_token[rows[:, None], cols]
        self.target_attn.meta = AttnMeta.build(self.req_to_token, rows, n - 1, slots, slots, tree.mask,
                                               self.max_context, self.group)
        positions = ((n - 1)[:, None] + tree.depth).reshape(-1)
        hidden = self.target(tree.tokens.reshape(-1), positions, self.target_attn)
        target_tokens = self.target.logits(hidden).argmax(-1).view(bs, -1)
        acc = greedy_accept(tree, target_tokens, sp.steps)
        # Accepted nodes' slots move to columns n-1 .. n-1+a (a permutation of the row: no KV copies).
        self.req_to_token[rows[:, None], cols] = slots.gather(1, acc.order)
        new_cols = n[:, None] + torch.arange(sp.steps + 1, device=n.device)
        self.token_table[rows[:, None], new_cols] = acc.new_tokens
        return acc.accept_len

    def _draft_tree(self, n: torch.Tensor, rows: torch.Tensor):
        sp, bs, dev = self.spec, rows.shape[0], rows.device
        k, w = sp.topk, sp.window
        # Pass 1 re-reads the last `window` committed tokens: it (re)writes their draft KV, which covers
        # every token committed by the previous step, and scores the root's children.
        start = (n - w).clamp(min=0)  # clamp: padded rows have n = 1
        pos = start[:, None] + torch.arange(w, device=dev)
        self.draft_attn.meta = self._meta_causal(rows, start, pos)
        hidden = self.draft(self.token_table[rows[:, None], pos].reshape(-1), pos.reshape(-1), self.draft_attn)
        logp = self.draft.logits(hidden.view(bs, w, -1)[:, -1]).log_softmax(-1)
        top = logp.topk(k, dim=-1)
        cand_tok, cand_score = [top.indices], [top.values - DEPTH_PENALTY]
        cand_par = [torch.full((bs, k), -1, dtype=torch.long, device=dev)]
        beam_tok, beam_score, beam_id = top.indices, cand_score[0], torch.arange(k, device=dev).expand(bs, k)
        # Beam nodes get draft-KV scratch slots at columns n, n+1, ... (past every committed position).
        n_scratch = k * (sp.steps - 1)
        scratch = self.req_to_token[rows[:, None], n[:, None] + torch.arange(max(n_scratch, 1), device=dev)]
        beam_anc = torch.zeros(bs, k, max(n_scratch, 1), dtype=torch.bool, device=dev)
        beam_anc[:, :, :k] = torch.eye(k, dtype=torch.bool, device=dev)
        offset = k
        for d in range(2, sp.steps + 1):
            # Forward the level d-1 beam: each node attends the committed prefix and its own ancestors.
            write = scratch[:, (d - 2) * k:(d - 1) * k]
            self.draft_attn.meta = AttnMeta.build(self.req_to_token, rows, n, write, scratch, beam_anc,
                                                  self.max_context, self.group)
            positions = (n - 2 + d)[:, None].expand(bs, k).reshape(-1)
            hidden = self.draft(beam_tok.reshape(-1), positions, self.draft_attn)
            top = self.draft.logits(hidden).log_softmax(-1).topk(k, dim=-1)
            score = (beam_score[..., None] + top.values.view(bs, k, k) - DEPTH_PENALTY).reshape(bs, k * k)
            toks = top.indices.view(bs, k * k)
            par = beam_id[..., None].expand(bs, k, k).reshape(bs, k * k)
            cand_tok.append(toks), cand_score.append(score), cand_par.append(par)
            best = score.topk(k, dim=-1).indices
            parent_beam = best // k
            beam_tok, beam_score, beam_id = toks.gather(1, best), score.gather(1, best), offset + best
            if d < sp.steps:
                beam_anc = beam_anc.gather(1, parent_beam[..., None].expand_as(beam_anc)).clone()
                beam_anc[:, :, (d - 1) * k:d * k] |= torch.eye(k, dtype=torch.bool, device=dev)
            offset += k * k
        root = self.token_table[rows, n - 1]
        return select_tree(root, torch.cat(cand_tok, 1), torch.cat(cand_score, 1), torch.cat(cand_par, 1),
                           self._cand_depth, sp.num_draft_tokens, sp.steps)

    # ------------------------------------------------------------------------------- eager helpers
    @torch.no_grad()
    def draft_catch_up(self, row: int, draft_len: int, upto: int) -> None:
        """Eagerly write draft KV for positions ``draft_len .. upto-1`` of one row (after plain decode
        steps, before speculation resumes). Not graphed: it only runs when the mode switches."""
        if upto <= draft_len:
            return
        if self.tp is not None:
            self.tp.agree("draft_catch_up", 1, upto - draft_len)
        rows = torch.tensor([row], device=self.device)
        pos = torch.arange(draft_len, upto, device=self.device)[None, :]
        self.draft_attn.meta = self._meta_causal(rows, torch.tensor([draft_len], device=self.device), pos)
        self.draft(self.token_table[rows[:, None], pos].reshape(-1), pos.reshape(-1), self.draft_attn)
