"""The engine: target + draft models over paged KV caches, and the step functions the GraphPool captures
(``prefill``, ``decode``, ``verify``, and ``verify_<n>`` for each shorter speculation tier).

Every step reads only two per-sequence inputs, ``seq_lens`` (committed tokens ``n``) and
``req_pool_indices`` (request rows), and derives the rest in-graph from device tables:
``token_table[row, pos]`` (committed tokens) and ``req_to_token[row, pos]`` (KV slots). So a step needs no
host-side slot allocation and no host copy of tokens, and nothing in a step needs the host to know
more than which rows run (the attention metadata is built in-graph too, see
:mod:`bench.engine.fi_attention`). Padded rows carry row 0 (all dummy slot) and ``seq_lens`` 1.

State of a sequence with ``n`` committed tokens: the target KV holds positions ``0..n-2``; token ``n-1``
is pending (the next step's input). The draft KV holds positions ``0..draft_len-1``.

Speculation tiers (``docs/tiers.md``): besides ``spec``, the engine can draft shorter trees (other topk, steps and
draft tokens), one verify mode each, all in the one pool. Every tier's first draft pass re-reads the same
``window`` (the deepest tier's steps + 1) committed tokens, which covers what any tier's step committed: moving
between tiers needs no catch-up of the draft, only resuming after plain steps does.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from graphpool import GraphPool, Mode, StepBatch, StepInput

from .attention import TorchLayouts
from .config import ModelConfig, SpecConfig, tier_modes
from .draft_inputs import DraftInputs, draft_inputs
from .draft_select import Candidates, draft_level, draft_level_into, resolve_draft_select
from .fi_attention import HEAD_DIMS, FlashInferLayouts, flashinfer_available
from .kv_cache import DUMMY_ROW, KVCache, ReqToTokenPool, SlotAllocator
from .model import build_draft, build_target
from .parallel import TensorParallel
from .tree import DEPTH_PENALTY
from .tree_kernels import accept_and_commit_fused, select_tree_fused

log = logging.getLogger(__name__)

ATTENTION = ("torch", "flashinfer", "flashinfer-reference")

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
        attention: ``"torch"`` (gather + SDPA, :mod:`bench.engine.attention`), ``"flashinfer"`` (CUDA, bf16/fp16,
            :mod:`bench.engine.fi_attention`), ``"flashinfer-reference"`` (FlashInfer's metadata with the attention
            math in torch: CPU and float32 checks), or ``"auto"`` (FlashInfer where it can run, else torch).
        kernels: elementwise kernels of the model, see :func:`bench.engine.model.resolve_kernels`.
        tiers: shorter speculation tiers besides ``spec`` (fewer draft tokens each, same draft model): verify
            modes ``verify_<num_draft_tokens>`` (:func:`bench.engine.config.tier_modes`).
    """

    def __init__(self, cfg: ModelConfig, spec: SpecConfig, max_rows: int, prompt_len: int, max_new_tokens: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0,
                 tp: TensorParallel | None = None, attention: str = "torch", kernels: str = "auto",
                 tiers: Sequence[SpecConfig] = ()):
        #: Speculative modes, longest draft first: ``{"verify": spec, "verify_8": ..., ...}``.
        self.tiers = tier_modes(spec, tiers)
        #: Committed tokens every tier's first draft pass re-reads: what the deepest tier's step can commit.
        self.window = max(t.window for t in self.tiers.values())
        if prompt_len < self.window + 1:
            raise ValueError(f"prompt_len must be >= {self.window + 1} (the draft re-reads the last "
                             f"{self.window} tokens), got {prompt_len}")
        self.cfg, self.spec, self.device, self.dtype = cfg, spec, torch.device(device), dtype
        self.prompt_len, self.max_new_tokens = prompt_len, max_new_tokens
        # Room for the longest request plus one step's tree (verify) and draft scratch past its end.
        self.max_context = prompt_len + max_new_tokens + max(t.num_draft_tokens + t.topk * t.steps
                                                             for t in self.tiers.values())
        if self.max_context + spec.num_draft_tokens > cfg.max_positions:
            raise ValueError(f"max_context {self.max_context} exceeds the model's max_positions {cfg.max_positions}")
        self.fused_draft_select = resolve_draft_select(spec.draft_select, self.device)
        self.target = build_target(cfg, seed, self.device, dtype, kernels)
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
        target_cache, draft_cache = KVCache(cfg.num_layers, *kv), KVCache(spec.draft_layers, *kv)
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.attention = resolve_attention(attention, self.device, dtype, cfg.head_dim)
        # The catch-up after plain steps has a different token count every time: it runs eagerly with
        # the torch attention on the same draft cache, whichever backend the steps use.
        self.torch_layouts = TorchLayouts(self.req_to_token, self.group)
        if self.attention == "torch":
            self.layouts = self.torch_layouts
        else:
            kernel = "flashinfer" if self.attention == "flashinfer" else "reference"
            self.layouts = FlashInferLayouts(self.req_to_token, self.num_heads, self.num_kv_heads, cfg.head_dim, dtype,
                                             kernel)
        self.target_attn = self.layouts.attention(target_cache)
        self.draft_attn = self.layouts.attention(draft_cache)
        self.catch_up_attn = self.torch_layouts.attention(draft_cache)
        self.token_table = torch.zeros(max_rows + 1, self.max_context, dtype=torch.int64, device=self.device)
        self._consts = {mode: _StepConstants(t, self.window, self.device) for mode, t in self.tiers.items()}
        self._prompt_cols = torch.arange(prompt_len - 1, device=self.device)
        log.info("engine: %d target layers, %d draft layers, %d rows x %d positions, KV %.1f MiB, %s attention, "
                 "%s kernels", cfg.num_layers, spec.draft_layers, max_rows, self.max_context,
                 (target_cache.nbytes + draft_cache.nbytes) / 2**20, self.attention,
                 "fused" if self.target.fused else "torch")

    # ------------------------------------------------------------------------------------- the pool
    #: Every step returns one value per sequence (new tokens, accept lengths, rows): the pool's output rule.
    OUTPUTS = "seq"

    def modes(self, prefill_batch_sizes: Sequence[int] | None = None) -> list[Mode]:
        """decode (1 token/seq), each speculative tier (``num_draft_tokens``/seq; ``verify`` first), prefill (the
        prompt but its last token; its own batch sizes if given)."""
        sizes = tuple(prefill_batch_sizes) if prefill_batch_sizes is not None else None
        return [Mode("decode", 1), *(Mode(m, t.num_draft_tokens) for m, t in self.tiers.items()),
                Mode("prefill", self.prompt_len - 1, sizes)]

    def build_pool(self, batch_sizes: list[int], prefill_batch_sizes: list[int], backend: str = "auto") -> GraphPool:
        """A GraphPool with every mode over :data:`STEP_INPUTS` (prefill with its own sizes)."""
        return GraphPool(self.modes(prefill_batch_sizes), STEP_INPUTS, batch_sizes, device=self.device,
                         backend=backend)

    @torch.no_grad()
    def step(self, batch: StepBatch):
        """The step function the pool captures: dispatch on the batch's mode."""
        seq_lens, rows = batch.inputs["seq_lens"], batch.inputs["req_pool_indices"]
        name = batch.mode.name
        if self.tp is not None and not batch.captured:  # graphs are checked in the pool's prepare hook
            self.tp.agree(f"eager_{name}", batch.bs, batch.bs)
        if name == "decode":
            return self.decode(seq_lens, rows)
        if name in self.tiers:
            return self.speculate(seq_lens, rows, name)
        if name == "prefill":
            return self.prefill(rows)
        raise ValueError(f"the engine has no step for mode {name!r}; its modes are decode, {', '.join(self.tiers)}, "
                         f"prefill")

    # ------------------------------------------------------------------------------------ the steps
    def prefill(self, rows: torch.Tensor) -> torch.Tensor:
        """Target and draft KV for prompt positions ``0..P-2`` (the prompt is already in token_table)."""
        t = self.prompt_len - 1
        pos = self._prompt_cols.expand(rows.shape[0], t)
        meta = self.layouts.causal(rows, torch.zeros_like(rows), t)
        ids, flat = self.token_table[rows[:, None], pos].reshape(-1), pos.reshape(-1)
        for model, attn in ((self.target, self.target_attn), (self.draft, self.draft_attn)):
            attn.meta = meta
            model(ids, flat, attn)
        return rows

    def decode(self, seq_lens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One plain greedy decode step; commits ``token_table[row, n]``. Returns the new tokens ``[bs]``."""
        last = seq_lens - 1
        self.target_attn.meta = self.layouts.causal(rows, last, 1)
        hidden = self.target(self.token_table[rows, last], last, self.target_attn)
        return self.target.greedy(hidden, commit=(self.token_table, rows, seq_lens))  # token_table[row, n] = next

    def speculate(self, seq_lens: torch.Tensor, rows: torch.Tensor, mode: str = "verify") -> torch.Tensor:
        """Draft a tree of tier ``mode``, verify it with the target, accept greedily, commit. Returns accept
        lengths ``[bs]``.

        With ``fused_draft_select`` (``spec.draft_select`` "fused", or "auto" on CUDA) the tree's selection
        (end of :meth:`_draft_tree`) and the acceptance with its commit each run as one Triton kernel
        (:mod:`bench.engine.tree_kernels`), besides the draft's index arithmetic
        (:mod:`bench.engine.draft_inputs`) and each draft level (:meth:`_draft_levels_fused`); else the torch ops."""
        sp, n, bs, c = self.tiers[mode], seq_lens, rows.shape[0], self._consts[mode]
        inputs = draft_inputs(self.token_table, rows, n, self.window, sp.steps, sp.topk, c.window_cols,
                              self.fused_draft_select)
        tree = self._draft_tree(n, rows, inputs, sp, c)
        # Verify: node i sits in the row's slot at column n-1+i (the root's own slot, then scratch columns).
        last = inputs.last
        self.target_attn.meta = self.layouts.tree(rows, last, tree.mask)
        hidden = self.target(tree.tokens.reshape(-1), (last[:, None] + tree.depth).reshape(-1), self.target_attn)
        # Accept; the accepted nodes' slots move to columns n-1 .. n-1+a (a permutation of the row: no KV
        # copies) and their tokens plus the bonus token go to token_table from column n.
        return accept_and_commit_fused(tree, self.target.greedy(hidden).view(bs, -1), sp.steps, rows, n,
                                       self.req_to_token, self.token_table, c.tree_cols, c.commit_cols,
                                       self.fused_draft_select)

    def _draft_tree(self, n: torch.Tensor, rows: torch.Tensor, inputs: DraftInputs, sp: SpecConfig,
                    c: "_StepConstants"):
        bs, k, w = rows.shape[0], sp.topk, self.window
        # Pass 1 re-reads the last `window` committed tokens: it (re)writes their draft KV, which covers
        # every token committed by the previous step, and scores the root's children.
        self.draft_attn.meta = self.layouts.causal(rows, inputs.start, w)
        hidden = self.draft(inputs.window_ids, inputs.window_pos, self.draft_attn)
        root_logits = self.draft.lm_head(hidden.view(bs, w, -1)[:, -1])
        if self.fused_draft_select:
            return self._draft_levels_fused(n, rows, inputs, root_logits, sp, c)
        # The torch ops (the CPU path and the fused path's oracle).
        root = draft_level(root_logits, None, k, DEPTH_PENALTY, 0, fused=False)
        cand_tok, cand_score = [root.tokens], [root.scores]
        cand_par = [c.root_parents.expand(bs, k)]
        beam_tok, beam_score, beam_id = root.beam_tokens, root.beam_scores, c.first_beam.expand(bs, k)
        # Beam nodes get draft-KV scratch slots at columns n, n+1, ... (past every committed position);
        # beam_anc[b, i, j]: scratch column n+j holds an ancestor of beam node i (or the node itself).
        beam_anc = c.first_ancestors.expand(bs, -1, -1)
        offset = k
        for d in range(2, sp.steps + 1):
            # Forward the level d-1 beam (its nodes' KV go to scratch columns n+(d-2)k ..): each node
            # attends the committed prefix and its own ancestors.
            self.draft_attn.meta = self.layouts.tree(rows, n, beam_anc[:, :, :(d - 1) * k])
            hidden = self.draft(beam_tok.reshape(-1), inputs.level_pos[d - 2], self.draft_attn)
            level = draft_level(self.draft.lm_head(hidden), beam_score, k, DEPTH_PENALTY, offset, fused=False)
            cand_tok.append(level.tokens), cand_score.append(level.scores)
            cand_par.append(beam_id[..., None].expand(bs, k, k).reshape(bs, k * k))
            best = level.best
            beam_tok, beam_score, beam_id = level.beam_tokens, level.beam_scores, level.beam_ids
            if d < sp.steps:
                beam_anc = beam_anc.gather(1, (best // k)[..., None].expand(bs, k, beam_anc.shape[2]))
                beam_anc[:, :, (d - 1) * k:d * k] |= c.eye
            offset += k * k
        return select_tree_fused(inputs.root, torch.cat(cand_tok, 1), torch.cat(cand_score, 1), torch.cat(cand_par, 1),
                                 c.cand_depth, sp.num_draft_tokens, sp.steps, fused=False)

    def _draft_levels_fused(self, n: torch.Tensor, rows: torch.Tensor, inputs: DraftInputs, root_logits: torch.Tensor,
                            sp: SpecConfig, c: "_StepConstants"):
        """:meth:`_draft_tree` from the root's logits on, one launch per level for each level's selection,
        candidates, parents and the next beam's ancestors (:func:`bench.engine.draft_select.draft_level_into`):
        the same tree as the torch loop there, without its concatenations, expand copies and gathers."""
        bs, k, width = rows.shape[0], sp.topk, c.first_ancestors.shape[2]
        cands = Candidates.empty(bs, c.cand_depth.shape[0], rows.device)
        beam = draft_level_into(root_logits, None, k, DEPTH_PENALTY, 0, cands, width, 0 if sp.steps > 1 else None)
        offset = k
        for d in range(2, sp.steps + 1):
            self.draft_attn.meta = self.layouts.tree(rows, n, beam.ancestors[:, :, :(d - 1) * k])
            hidden = self.draft(beam.tokens.reshape(-1), inputs.level_pos[d - 2], self.draft_attn)
            beam = draft_level_into(self.draft.lm_head(hidden), beam, k, DEPTH_PENALTY, offset, cands, width,
                                    (d - 1) * k if d < sp.steps else None)
            offset += k * k
        return select_tree_fused(inputs.root, cands.tokens, cands.scores, cands.parents, c.cand_depth,
                                 sp.num_draft_tokens, sp.steps, True)

    # ------------------------------------------------------------------------------- eager helpers
    @torch.no_grad()
    def draft_catch_up(self, row: int, draft_len: int, upto: int) -> None:
        """Eagerly write draft KV for positions ``draft_len .. upto-1`` of one row (after plain decode
        steps, before speculation resumes). Not graphed: it only runs when the mode switches, with a
        different token count each time, so it uses the torch attention (same cache) whatever the backend."""
        if upto <= draft_len:
            return
        if self.tp is not None:
            self.tp.agree("draft_catch_up", 1, upto - draft_len)
        rows = torch.tensor([row], device=self.device)
        pos = torch.arange(draft_len, upto, device=self.device)[None, :]
        self.catch_up_attn.meta = self.torch_layouts.causal(rows, torch.tensor([draft_len], device=self.device),
                                                            upto - draft_len)
        self.draft(self.token_table[rows[:, None], pos].reshape(-1), pos.reshape(-1), self.catch_up_attn)


class _StepConstants:
    """Index tensors a tier's steps use every time, made once (an ``arange`` inside a graph is a kernel)."""

    def __init__(self, spec: SpecConfig, window: int, device: torch.device):
        # Beam scratch columns: k per level after the first (the root's beam writes the first k, so at least k
        # even for a one-level tree, which has no later level)
        k, n_scratch = spec.topk, spec.topk * max(spec.steps - 1, 1)
        self.window_cols = torch.arange(window, device=device)
        self.tree_cols = torch.arange(spec.num_draft_tokens, device=device)
        self.commit_cols = torch.arange(spec.steps + 1, device=device)
        self.root_parents = torch.full((1, k), -1, dtype=torch.long, device=device)
        self.first_beam = torch.arange(k, device=device)[None]
        self.eye = torch.eye(k, dtype=torch.bool, device=device)
        self.first_ancestors = torch.zeros(1, k, n_scratch, dtype=torch.bool, device=device)
        self.first_ancestors[0, :, :k] = self.eye
        self.cand_depth = torch.tensor([1] * k + [d for d in range(2, spec.steps + 1) for _ in range(k * k)],
                                       device=device)


def resolve_attention(attention: str, device: torch.device, dtype: torch.dtype, head_dim: int = 128) -> str:
    """The attention backend for ``attention`` (one of :data:`ATTENTION` or ``"auto"``): ``"auto"`` picks
    FlashInfer on CUDA in bf16/fp16 for the head sizes it is built for, where it is installed, else torch."""
    if attention == "auto":
        ok = (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and head_dim in HEAD_DIMS
              and flashinfer_available())
        return "flashinfer" if ok else "torch"
    if attention not in ATTENTION:
        raise ValueError(f"attention must be 'auto' or one of {ATTENTION}, got {attention!r}")
    return attention
