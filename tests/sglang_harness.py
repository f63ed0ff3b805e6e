"""A stand-in for SGLang's ``ModelRunner`` to drive the graphpool SGLang runner without a GPU server.

What is real SGLang here: ``ForwardMode``, ``ForwardBatch``, ``CaptureHiddenMode``, ``EagleVerifyInput``,
``LogitsProcessorOutput``, ``SpeculativeAlgorithm``, the ``AttentionBackend`` base class (its ``forward``
dispatch) and ``ModelRunner._forward_raw`` / ``forward_decode`` / ``forward_extend``, bound to the
stand-in, so every step is routed by SGLang's own code. What is ours: a tiny Llama-like model, a
plain-torch paged attention backend implementing SGLang's graph hooks, a request-to-token table and a
KV pool. Importing this module puts ``tests/stubs`` (torchvision, sgl_kernel stand-ins) on ``sys.path``.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend  # noqa: E402
from sglang.srt.layers.logits_processor import LogitsProcessorOutput  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import (CaptureHiddenMode, ForwardBatch,  # noqa: E402
                                                          ForwardMode)
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleVerifyInput  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402


@dataclass
class HarnessConfig:
    vocab: int = 48
    hidden: int = 32
    heads: int = 2
    layers: int = 2
    max_reqs: int = 64
    max_ctx: int = 192
    kv_slots: int = 40000
    draft_tokens: int = 4  # tokens per sequence of a TARGET_VERIFY step (a chain: bonus + 3 drafts)
    batch_sizes: Tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64)
    dtype: torch.dtype = torch.float64


# ----------------------------------------------------------------------------------- KV state
class ReqToTokenPool:
    """Request row -> KV slot of each position (SGLang's ``req_to_token_pool`` surface)."""

    def __init__(self, size: int, max_ctx: int, device: torch.device):
        self.size = size
        self.req_to_token = torch.zeros((size, max_ctx), dtype=torch.int32, device=device)

    def write(self, indices: Any, values: torch.Tensor) -> None:
        self.req_to_token[indices] = values


class KVPool:
    """Per-layer K and V buffers indexed by slot; slot 0 is the dummy that padded tokens write."""

    def __init__(self, cfg: HarnessConfig, device: torch.device):
        shape = (cfg.layers, cfg.kv_slots, cfg.heads, cfg.hidden // cfg.heads)
        self.k_buffer = torch.zeros(shape, dtype=cfg.dtype, device=device)
        self.v_buffer = torch.zeros(shape, dtype=cfg.dtype, device=device)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer_id].index_copy_(0, loc, k)
        self.v_buffer[layer_id].index_copy_(0, loc, v)


class SlotAllocator:
    """Hands out fresh KV slots (never reused: the harness is short)."""

    def __init__(self, size: int):
        self.size, self.next = size, 1

    def alloc(self, n: int, device: torch.device) -> torch.Tensor:
        if self.next + n > self.size:
            raise RuntimeError(f"harness KV pool exhausted ({self.size} slots); raise HarnessConfig.kv_slots")
        out = torch.arange(self.next, self.next + n, dtype=torch.int64, device=device)
        self.next += n
        return out


# ----------------------------------------------------------------------------------- attention
@dataclass
class AttnMetadata:
    """What the attention kernels read: each sequence's slots, its visible prefix, and the visibility
    among the step's own tokens (``[bs, T, T]``; T = 1 for decode)."""

    kv_slots: torch.Tensor
    prefix_lens: torch.Tensor
    tree_mask: torch.Tensor


class TorchPagedAttention(AttentionBackend):
    """Plain-torch paged attention with SGLang's CUDA graph hooks.

    Like FlashInfer it keeps DECODE and TARGET_VERIFY graph metadata apart (own static buffers per mode,
    registered per (mode, bs) at capture), so replaying with another mode than captured fails loudly.
    """

    def __init__(self, cfg: HarnessConfig, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool):
        self.cfg, self.req_to_token_pool, self.kv_pool = cfg, req_to_token_pool, kv_pool
        self.forward_metadata: Optional[AttnMetadata] = None
        self.graph_state_inits: List[Tuple[int, int]] = []
        self.graph_meta: Dict[Tuple[ForwardMode, int], AttnMetadata] = {}
        self.replay_log: List[Tuple[ForwardMode, int]] = []

    # eager path ------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        mode, bs = fb.forward_mode, fb.batch_size
        slots = self.req_to_token_pool.req_to_token[fb.req_pool_indices].long()
        if mode.is_decode():
            ones = torch.ones((bs, 1, 1), dtype=torch.bool, device=slots.device)
            self.forward_metadata = AttnMetadata(slots, fb.seq_lens.long() - 1, ones)
        elif mode.is_target_verify():
            tree = _tree_from_custom_mask(fb.spec_info.custom_mask, fb.seq_lens[:bs].long(), self.cfg.draft_tokens)
            self.forward_metadata = AttnMetadata(slots, fb.seq_lens.long(), tree)
        elif mode == ForwardMode.EXTEND:  # uniform-length extend (prefill / draft extend): causal
            t = fb.input_ids.shape[0] // bs
            causal = torch.ones((t, t), dtype=torch.bool, device=slots.device).tril().expand(bs, t, t)
            self.forward_metadata = AttnMetadata(slots, fb.seq_lens.long() - t, causal)
        else:
            raise ValueError(f"TorchPagedAttention: unsupported forward mode {mode.name}")

    # graph path ------------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_state_inits.append((max_bs, max_num_tokens))
        dev, ctx, t = self.req_to_token_pool.req_to_token.device, self.cfg.max_ctx, self.cfg.draft_tokens
        self.static = {
            ForwardMode.DECODE: AttnMetadata(torch.zeros((max_bs, ctx), dtype=torch.int64, device=dev),
                                             torch.zeros((max_bs,), dtype=torch.int64, device=dev),
                                             torch.ones((max_bs, 1, 1), dtype=torch.bool, device=dev)),
            ForwardMode.TARGET_VERIFY: AttnMetadata(torch.zeros((max_bs, ctx), dtype=torch.int64, device=dev),
                                                    torch.zeros((max_bs,), dtype=torch.int64, device=dev),
                                                    torch.ones((max_bs, t, t), dtype=torch.bool, device=dev))}

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info):
        per_seq = {ForwardMode.DECODE: 1, ForwardMode.TARGET_VERIFY: self.cfg.draft_tokens}.get(forward_mode)
        if per_seq is None or num_tokens != bs * per_seq:
            raise ValueError(f"capture of {forward_mode.name} bs={bs} with {num_tokens} tokens: expected "
                             f"bs x {per_seq} tokens")
        if forward_mode.is_decode() and spec_info is not None:
            raise ValueError("a DECODE graph with a spec_info is a draft decode; plain decode passes spec_info=None")
        s = self.static[forward_mode]
        meta = AttnMetadata(s.kv_slots[:bs], s.prefix_lens[:bs], s.tree_mask[:bs])
        self.graph_meta[(forward_mode, bs)] = meta
        self._fill(meta, forward_mode, bs, req_pool_indices, seq_lens, None)
        self.forward_metadata = meta

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu):
        meta = self.graph_meta.get((forward_mode, bs))
        if meta is None:
            raise KeyError(f"no {forward_mode.name} graph metadata for bs={bs}: captured {sorted(self.graph_meta)}")
        self._fill(meta, forward_mode, bs, req_pool_indices, seq_lens, spec_info)
        self.replay_log.append((forward_mode, bs))
        self.forward_metadata = meta

    def _fill(self, meta: AttnMetadata, mode: ForwardMode, bs: int, req_pool_indices, seq_lens, spec_info) -> None:
        meta.kv_slots.copy_(self.req_to_token_pool.req_to_token[req_pool_indices[:bs]])
        lens = seq_lens[:bs].long()
        meta.prefix_lens.copy_(lens - 1 if mode.is_decode() else lens)
        if mode.is_target_verify():
            meta.tree_mask.fill_(True)  # padded rows: any finite attention
            if spec_info is not None and spec_info.custom_mask is not None and spec_info.positions is not None:
                raw = spec_info.positions.shape[0] // self.cfg.draft_tokens
                meta.tree_mask[:raw].copy_(_tree_from_custom_mask(spec_info.custom_mask, lens[:raw],
                                                                  self.cfg.draft_tokens))

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # kernels (graph-safe: fixed shapes, no host sync) ----------------------------------------------
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        return self._attend(q, k, v, layer, forward_batch)

    def _attend(self, q, k, v, layer, forward_batch):
        meta = self.forward_metadata
        self.kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc, k, v)
        bs, t = meta.tree_mask.shape[0], meta.tree_mask.shape[1]
        heads, dim = k.shape[1], k.shape[2]
        keys = self.kv_pool.k_buffer[layer.layer_id][meta.kv_slots]  # [bs, ctx, H, D]
        values = self.kv_pool.v_buffer[layer.layer_id][meta.kv_slots]
        ctx = meta.kv_slots.shape[1]
        j = torch.arange(ctx, device=q.device)
        rel = j[None, :] - meta.prefix_lens[:, None]  # position relative to the step's first token
        in_step = (rel >= 0) & (rel < t)
        tree = meta.tree_mask.gather(2, rel.clamp(0, t - 1)[:, None, :].expand(bs, t, ctx))
        allowed = (j[None, None, :] < meta.prefix_lens[:, None, None]) | (in_step[:, None, :] & tree)
        qs = q.view(bs, t, heads, dim)
        scores = torch.einsum("bthd,bjhd->bhtj", qs, keys) / math.sqrt(dim)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        out = torch.einsum("bhtj,bjhd->bthd", scores.softmax(-1), values)
        return out.reshape(bs * t, heads * dim)


def _tree_from_custom_mask(custom_mask: torch.Tensor, prefix_lens: torch.Tensor, t: int) -> torch.Tensor:
    """SGLang's flattened verify mask (per sequence ``t x (prefix + t)``, concatenated) -> ``[bs, t, t]``."""
    block = t * (prefix_lens + t)
    start = torch.cumsum(block, 0) - block
    r = torch.arange(t, device=custom_mask.device)
    idx = start[:, None, None] + r[None, :, None] * (prefix_lens[:, None, None] + t) + prefix_lens[:, None, None] \
        + r[None, None, :]
    return custom_mask[idx]


def chain_custom_mask(prefix_lens: torch.Tensor, t: int) -> torch.Tensor:
    """SGLang's flattened verify mask for a chain of ``t`` tokens after each prefix (topk = 1)."""
    parts = []
    causal = torch.ones((t, t), dtype=torch.bool, device=prefix_lens.device).tril()
    for length in prefix_lens.tolist():
        parts.append(torch.cat([torch.ones((t, length), dtype=torch.bool, device=prefix_lens.device), causal], 1))
    return torch.cat([p.reshape(-1) for p in parts])


# ----------------------------------------------------------------------------------- model
class TinyLM(nn.Module):
    """A two-layer pre-norm transformer with learned positions and SGLang's model ``forward`` signature."""

    def __init__(self, cfg: HarnessConfig, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        h = cfg.hidden
        rand = lambda *s: nn.Parameter(torch.randn(*s, generator=g, dtype=cfg.dtype) / math.sqrt(s[-1]))  # noqa: E731
        self.embed, self.pos = rand(cfg.vocab, h), rand(cfg.max_ctx, h)
        self.qkv = nn.ParameterList([rand(3 * h, h) for _ in range(cfg.layers)])
        self.o = nn.ParameterList([rand(h, h) for _ in range(cfg.layers)])
        self.up = nn.ParameterList([rand(2 * h, h) for _ in range(cfg.layers)])
        self.down = nn.ParameterList([rand(h, 2 * h) for _ in range(cfg.layers)])
        self.head = rand(cfg.vocab, h)
        self.attn_layers = [SimpleNamespace(layer_id=i, tp_q_head_num=cfg.heads, v_head_dim=h // cfg.heads)
                            for i in range(cfg.layers)]
        self.heads = cfg.heads

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch):
        x = self.embed[input_ids] + self.pos[positions]
        n, h = x.shape
        for i, layer in enumerate(self.attn_layers):
            q, k, v = (_norm(x) @ self.qkv[i].T).split(h, dim=-1)
            shape = (n, self.heads, h // self.heads)
            a = forward_batch.attn_backend.forward(q.reshape(shape), k.reshape(shape), v.reshape(shape), layer,
                                                   forward_batch)
            x = x + a @ self.o[i].T
            x = x + torch.relu(_norm(x) @ self.up[i].T) @ self.down[i].T
        hidden = _norm(x)
        want = forward_batch.capture_hidden_mode or CaptureHiddenMode.NULL
        return LogitsProcessorOutput(next_token_logits=hidden @ self.head.T,
                                     hidden_states=hidden if want.need_capture() else None)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


# ----------------------------------------------------------------------------------- model runner
class HarnessModelRunner:
    """The attributes of SGLang's ``ModelRunner`` that graph runners and ``_forward_raw`` read, with
    SGLang's own routing methods bound to it."""

    _forward_raw = ModelRunner._forward_raw
    forward_decode = ModelRunner.forward_decode
    forward_extend = ModelRunner.forward_extend

    def __init__(self, cfg: HarnessConfig, device: torch.device, speculative: bool, model_seed: int = 0):
        # A torch.device, not SGLang's string: `_forward_raw` compares it with "cpu" to pick the CPU-graph
        # rule (DECODE only), and the harness wants the CUDA-graph rule (DECODE and TARGET_VERIFY) on CPU too.
        self.cfg, self.device = cfg, torch.device(device)
        algo = "EAGLE" if speculative else None
        self.spec_algorithm = SpeculativeAlgorithm.from_string(algo)
        self.server_args = SimpleNamespace(
            cuda_graph_bs=list(cfg.batch_sizes), speculative_algorithm=algo, speculative_num_steps=cfg.draft_tokens - 1,
            speculative_num_draft_tokens=cfg.draft_tokens, speculative_eagle_topk=1, enable_return_hidden_states=False,
            disable_cuda_graph_padding=False, enable_pdmux=False, enable_torch_compile=False, pp_size=1)
        self.model_config = SimpleNamespace(is_encoder_decoder=False, hidden_size=cfg.hidden, vocab_size=cfg.vocab,
                                            dtype=cfg.dtype)
        self.req_to_token_pool = ReqToTokenPool(cfg.max_reqs, cfg.max_ctx, device)
        self.token_to_kv_pool = KVPool(cfg, device)
        self.attn_backend = TorchPagedAttention(cfg, self.req_to_token_pool, self.token_to_kv_pool)
        self.model = TinyLM(cfg, model_seed).to(device)
        self.graph_runner = None
        self.is_draft_worker = False
        self.hisparse_coordinator = None
        self.piecewise_cuda_graph_runner = None
        self.support_pp = False
        self.device_timer = None
        self.is_generation = True

    def forward(self, forward_batch: ForwardBatch) -> Any:
        """SGLang's ``ModelRunner._forward_raw``: graph replay when ``graph_runner.can_run``, else eager."""
        return self._forward_raw(forward_batch, False, None)


# ----------------------------------------------------------------------------------- steps
@dataclass
class Requests:
    """Per-request state shared by a runner and its oracle: committed tokens; KV is valid for every
    position but the last token, which is the next step's input."""

    tokens: List[List[int]] = field(default_factory=list)

    def kv_len(self, r: int) -> int:
        return len(self.tokens[r]) - 1


def prefill(mr: HarnessModelRunner, reqs: Requests, alloc: Optional[SlotAllocator]) -> None:
    """Write the KV of every prompt token but the last (one uniform-length EXTEND step). With ``alloc``
    new slots are recorded in ``req_to_token``; without, the slots already there are reused (a draft
    model sharing the target's table)."""
    n, t, dev = len(reqs.tokens), reqs.kv_len(0), mr.device
    if alloc is not None:
        mr.req_to_token_pool.req_to_token[:n, :t] = alloc.alloc(n * t, dev).view(n, t).to(torch.int32)
    extend(mr, list(range(n)), [0] * n, [tok[:t] for tok in reqs.tokens])


def extend(mr: HarnessModelRunner, rows: List[int], starts: List[int], tokens: List[List[int]]) -> None:
    """Run ``tokens[i]`` of row ``rows[i]`` at positions ``starts[i]...`` eagerly (EXTEND), writing KV at the
    slots ``req_to_token`` holds for those positions; rows are grouped by length (uniform per forward)."""
    dev = mr.device
    groups: Dict[int, List[int]] = {}
    for i, toks in enumerate(tokens):
        groups.setdefault(len(toks), []).append(i)
    for t, members in groups.items():
        idx = torch.tensor([rows[i] for i in members], dtype=torch.int64, device=dev)
        start = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=dev)
        pos = start[:, None] + torch.arange(t, device=dev)[None, :]
        slots = mr.req_to_token_pool.req_to_token[idx[:, None], pos].long().reshape(-1)
        fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=len(members),
                          input_ids=torch.tensor([tokens[i] for i in members], device=dev).reshape(-1),
                          req_pool_indices=idx, seq_lens=start + t, out_cache_loc=slots,
                          seq_lens_sum=int((start + t).sum()), positions=pos.reshape(-1),
                          capture_hidden_mode=CaptureHiddenMode.NULL, **_runner_fields(mr))
        mr.attn_backend.init_forward_metadata(fb)
        mr.model.forward(fb.input_ids, fb.positions, fb)


def decode_batch(mr: HarnessModelRunner, reqs: Requests, rows: List[int], alloc: SlotAllocator,
                 input_ids: Optional[torch.Tensor] = None) -> ForwardBatch:
    """A plain DECODE step of ``rows``: one new slot each, seq_lens counting the new token."""
    dev = mr.device
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    lens = torch.tensor([reqs.kv_len(r) for r in rows], dtype=torch.int64, device=dev)
    slots = alloc.alloc(len(rows), dev)
    mr.req_to_token_pool.write((idx, lens), slots.to(torch.int32))
    if input_ids is None:
        input_ids = torch.tensor([reqs.tokens[r][-1] for r in rows], dtype=torch.int64, device=dev)
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(rows), input_ids=input_ids,
                        req_pool_indices=idx, seq_lens=lens + 1, seq_lens_cpu=(lens + 1).cpu(),
                        out_cache_loc=slots, seq_lens_sum=int(lens.sum()) + len(rows), positions=lens.clone(),
                        capture_hidden_mode=CaptureHiddenMode.FULL, **_runner_fields(mr))


def _runner_fields(mr: HarnessModelRunner) -> Dict[str, Any]:
    # What ForwardBatch.init_new copies from the model runner.
    return dict(attn_backend=mr.attn_backend, req_to_token_pool=mr.req_to_token_pool,
                token_to_kv_pool=mr.token_to_kv_pool, spec_algorithm=mr.spec_algorithm)


def verify_batch(mr: HarnessModelRunner, reqs: Requests, rows: List[int], drafts: torch.Tensor,
                 alloc: SlotAllocator) -> ForwardBatch:
    """A TARGET_VERIFY step: per row the last committed token then ``drafts[i]`` (a chain)."""
    dev, t = mr.device, mr.cfg.draft_tokens
    n = len(rows)
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    lens = torch.tensor([reqs.kv_len(r) for r in rows], dtype=torch.int64, device=dev)
    slots = alloc.alloc(n * t, dev)
    pos = (lens[:, None] + torch.arange(t, device=dev)[None, :])
    mr.req_to_token_pool.write((idx[:, None].expand(n, t), pos), slots.view(n, t).to(torch.int32))
    last = torch.tensor([reqs.tokens[r][-1] for r in rows], dtype=torch.int64, device=dev)
    input_ids = torch.cat([last[:, None], drafts.to(dev)], 1).reshape(-1)
    spec = EagleVerifyInput(
        draft_token=input_ids, custom_mask=chain_custom_mask(lens, t), positions=pos.reshape(-1),
        retrieve_index=None, retrieve_next_token=None, retrieve_next_sibling=None, retrieve_cum_len=None,
        spec_steps=t - 1, topk=1, draft_token_num=t, capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=int(lens.sum()), seq_lens_cpu=lens.cpu())
    return ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=n, input_ids=input_ids,
                        req_pool_indices=idx, seq_lens=lens, seq_lens_cpu=lens.cpu(), out_cache_loc=slots,
                        seq_lens_sum=int(lens.sum()), positions=pos.reshape(-1), spec_info=spec,
                        capture_hidden_mode=CaptureHiddenMode.FULL, **_runner_fields(mr))


def make_requests(cfg: HarnessConfig, n: int, prompt_len: int, seed: int) -> Requests:
    g = torch.Generator().manual_seed(seed)
    return Requests([torch.randint(0, cfg.vocab, (prompt_len,), generator=g).tolist() for _ in range(n)])


def forget_graph_memory_pool() -> None:
    """Start the next "server" without SGLang's global graph memory pool, as a new process would.

    Tests build several servers in one process. A graph pool is released with its last graph, and
    capturing into the stale handle again trips a caching-allocator assertion (seen with torch 2.11).
    """
    from sglang.srt.model_executor import cuda_graph_runner

    cuda_graph_runner.set_global_graph_memory_pool(None)
