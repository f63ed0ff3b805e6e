"""A stand-in for SGLang's ``ModelRunner`` to drive the graphpool SGLang runner without a GPU server.

What is real SGLang here: ``ForwardMode``, ``ForwardBatch``, ``CaptureHiddenMode``, ``EagleVerifyInput``,
``LogitsProcessorOutput``, ``SpeculativeAlgorithm``, the ``AttentionBackend`` base class (its ``forward``
dispatch) and ``ModelRunner._forward_raw`` / ``forward_decode`` / ``forward_extend``, bound to the
stand-in, so every step is routed by SGLang's own code. What is the reference engine's (:mod:`bench.engine`):
the model (``LlamaModel``), the KV cache, the slot free list and the paged attention. What is ours: thin
adapters to SGLang's surfaces (model ``forward(input_ids, positions, forward_batch)``, an attention backend
with SGLang's graph hooks, an int32 ``req_to_token`` table). Importing this module puts ``tests/stubs``
(torchvision, sgl_kernel stand-ins) on ``sys.path``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import sys
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

from tests.optional import require_sglang  # noqa: E402

require_sglang()  # skips (or, in CI, fails) the importing test module where SGLang is absent
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

from bench.engine import attention as engine_attention  # noqa: E402
from bench.engine import kv_cache as engine_kv  # noqa: E402
from bench.engine.config import ModelConfig  # noqa: E402
from bench.engine.model import build_target  # noqa: E402

#: Extend modes: causal attention over a chunk, logits kept for each sequence's last token only (spec
#: v1's DRAFT_EXTEND exists up to SGLang 0.5.13; later releases have DRAFT_EXTEND_V2 instead).
EXTEND_MODES = tuple(m for m in (ForwardMode.EXTEND, getattr(ForwardMode, "DRAFT_EXTEND", None)) if m is not None)


@dataclass
class HarnessConfig:
    """The stand-in server: the engine's model shape, request and KV pool sizes, graph batch sizes."""

    model: ModelConfig = ModelConfig.tiny()
    max_reqs: int = 64
    max_ctx: int = 192
    kv_slots: int = 40000
    draft_tokens: int = 4  # tokens per sequence of a TARGET_VERIFY step (a chain: bonus + 3 drafts)
    batch_sizes: Tuple[int, ...] = (1, 2, 4, 8, 16, 32, 48, 64)
    dtype: torch.dtype = torch.float64

    @property
    def vocab(self) -> int:
        return self.model.vocab_size

    @property
    def hidden(self) -> int:
        return self.model.hidden_size


def require_api(api: str) -> None:
    """Skip the calling test module, with a one-line reason, unless SGLang's graph-runner API is ``api``
    (``"classic"`` or ``"runner"``, :mod:`graphpool.integrations.sglang.versions`)."""
    import pytest

    from graphpool.integrations.sglang import versions

    if versions.runner_api() != api:
        pytest.skip(f"needs the {api} API of SGLang's graph runner ({versions.SUPPORTED[api]}); installed: SGLang "
                    f"{versions.sglang_version()}", allow_module_level=True)


def require_eagle_v1() -> None:
    """Skip the calling test module unless SGLang has the EAGLE v1 worker the classic speculation switch
    drives (0.5.9 to 0.5.12.x; 0.5.13.x keeps the classic runner API but has only eagle_worker_v2)."""
    import pytest

    from graphpool.integrations.sglang import versions

    if not versions.has_eagle_v1():
        pytest.skip(f"needs SGLang's EAGLE v1 worker (the classic speculation switch); SGLang "
                    f"{versions.sglang_version()} has none", allow_module_level=True)


# ----------------------------------------------------------------------------------- KV state
class ReqToTokenPool:
    """Request row -> KV slot of each position (SGLang's ``req_to_token_pool`` surface: int32, every row
    a request, slots recorded per step; the engine's pool reserves slots per row up front instead)."""

    def __init__(self, size: int, max_ctx: int, device: torch.device):
        self.size, self.device = size, device
        self.req_to_token = torch.zeros((size, max_ctx), dtype=torch.int32, device=device)

    def write(self, indices: Any, values: torch.Tensor) -> None:
        self.req_to_token[indices] = values


class KVPool(engine_kv.KVCache):
    """The engine's KV cache as SGLang's ``token_to_kv_pool``; slot 0 is the dummy that padded tokens write."""

    @property
    def k_buffer(self) -> torch.Tensor:
        """Every layer's K stacked, ``[layers, slots, kv_heads, head_dim]`` (a copy, for comparisons)."""
        return torch.stack(self.k)


class SlotAllocator:
    """The engine's slot free list, handing out slots as an int64 tensor (SGLang's ``out_cache_loc``)."""

    def __init__(self, size: int):
        self.free_list = engine_kv.SlotAllocator(size)

    def alloc(self, n: int, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(self.free_list.alloc(n)).to(device)


# ----------------------------------------------------------------------------------- attention
class TorchPagedAttention(AttentionBackend):
    """SGLang's attention-backend surface over the engine's paged attention (:mod:`bench.engine.attention`).

    A step's ``T`` tokens per sequence sit at positions ``[start, start + T)`` of ``req_to_token`` (SGLang
    records a step's slots there before the forward). They attend the cache before ``start`` and each
    other under the step's mask: ``[[True]]`` for DECODE, the tree of ``spec_info.custom_mask`` for
    TARGET_VERIFY, causal for EXTEND. K and V are written at ``forward_batch.out_cache_loc``.

    Like FlashInfer it keeps DECODE and TARGET_VERIFY graph metadata apart (own static buffers per mode,
    allocated once in ``init_cuda_graph_state`` and registered per (mode, bs) at capture), so replaying
    with another mode than captured fails loudly.
    """

    def __init__(self, cfg: HarnessConfig, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool,
                 draft_tokens: Optional[int] = None):
        self.cfg, self.req_to_token_pool, self.kv_pool = cfg, req_to_token_pool, kv_pool
        # The verify width its graphs are captured for (SGLang's backends read it when built: a speculation tier's
        # backend is built for its tier's); an eager verify step carries its own (spec_info.draft_token_num).
        self.draft_tokens = draft_tokens or cfg.draft_tokens
        self.forward_metadata: Optional[engine_attention.AttnMeta] = None
        self.graph_state_inits: List[Tuple[int, int]] = []
        self.graph_meta: Dict[Tuple[ForwardMode, int], engine_attention.AttnMeta] = {}
        self.replay_log: List[Tuple[ForwardMode, int]] = []
        self.ragged: Optional[torch.Tensor] = None  # real-token rows of a ragged extend's padded layout

    # eager path ------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        fb = forward_batch
        mode, bs = fb.forward_mode, fb.batch_size
        self.ragged = None
        if mode in EXTEND_MODES:  # prefill, draft catch-up: causal
            self.forward_metadata, self.ragged = self._extend_meta(fb)
            return
        if mode.is_decode() or mode.is_target_verify():
            tree = self._tree(mode, bs, fb.seq_lens, fb.spec_info)
        else:
            raise ValueError(f"TorchPagedAttention: unsupported forward mode {mode.name}")
        self.forward_metadata = self._meta(mode, bs, fb.req_pool_indices, fb.seq_lens, tree)

    def _extend_meta(self, fb: ForwardBatch) -> Tuple[engine_attention.AttnMeta, Optional[torch.Tensor]]:
        """Causal metadata for an extend whose sequences add ``extend_seq_lens`` tokens each (uniform
        when the batch gives none), ending at ``seq_lens``. Ragged lengths are padded to the longest:
        returns the metadata of the padded ``[bs, T]`` layout and the flat rows of the real tokens in it
        (``None`` when no row is padded)."""
        bs, lens_all = fb.batch_size, fb.seq_lens[:fb.batch_size].long()
        dev = lens_all.device
        if fb.extend_seq_lens is not None:
            lens = fb.extend_seq_lens[:bs].long().to(dev)
        else:
            lens = torch.full((bs,), fb.input_ids.shape[0] // bs, dtype=torch.int64, device=dev)
        t = int(lens.max())
        start = lens_all - lens
        cols = torch.arange(t, device=dev)
        valid = cols[None, :] < lens[:, None]
        table = self.req_to_token_pool.req_to_token
        pos = (start[:, None] + cols[None, :]).clamp(max=table.shape[1] - 1)
        slots = torch.where(valid, table[fb.req_pool_indices[:, None], pos].long(), 0)
        # Keys past a sequence's length are masked; every query keeps its own slot (no empty row).
        tree = (torch.ones((t, t), dtype=torch.bool, device=dev).tril() & valid[:, None, :]) \
            | torch.eye(t, dtype=torch.bool, device=dev)
        group = self.cfg.model.num_heads // self.cfg.model.num_kv_heads
        meta = engine_attention.AttnMeta.build(table, fb.req_pool_indices, start, slots, slots, tree,
                                               self.cfg.max_ctx, group)
        ragged = None if bool(valid.all()) else valid.reshape(-1).nonzero().squeeze(1)
        return meta, ragged

    def _meta(self, mode: ForwardMode, bs: int, req_pool_indices, seq_lens, tree) -> engine_attention.AttnMeta:
        """The engine's metadata for ``bs`` sequences whose step tokens see each other under ``tree``."""
        t, lens, rows = tree.shape[-1], seq_lens[:bs].long(), req_pool_indices[:bs]
        # SGLang's seq_lens count a decode step's token and a prefill's tokens, not the drafts of a verify.
        start = lens if mode.is_target_verify() else lens - t
        table = self.req_to_token_pool.req_to_token
        slots = table[rows[:, None], start[:, None] + torch.arange(t, device=lens.device)].long()
        group = self.cfg.model.num_heads // self.cfg.model.num_kv_heads
        return engine_attention.AttnMeta.build(table, rows, start, slots, slots, tree, self.cfg.max_ctx, group)

    def _tree(self, mode: ForwardMode, bs: int, seq_lens, spec_info) -> torch.Tensor:
        """``[bs, T, T]`` visibility among the step's tokens; rows past the real batch see all (finite)."""
        t = (getattr(spec_info, "draft_token_num", None) or self.draft_tokens) if mode.is_target_verify() else 1
        tree = torch.ones((bs, t, t), dtype=torch.bool, device=seq_lens.device)
        if mode.is_target_verify() and spec_info is not None and spec_info.positions is not None:
            raw = spec_info.positions.shape[0] // t
            tree[:raw] = _tree_from_custom_mask(spec_info.custom_mask, seq_lens[:raw].long(), t)
        return tree

    # graph path ------------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_state_inits.append((max_bs, max_num_tokens))
        dev = self.req_to_token_pool.req_to_token.device
        rows, lens = torch.zeros(max_bs, dtype=torch.int64, device=dev), torch.ones(max_bs, dtype=torch.int64, device=dev)
        self.static = {}
        for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            meta = self._meta(mode, max_bs, rows, lens, self._tree(mode, max_bs, lens, None))
            # Dense copies the graphs own (a one-token step's mask comes back as an expanded view).
            self.static[mode] = replace(meta, write_slots=meta.write_slots.contiguous(),
                                        gather_idx=meta.gather_idx.contiguous(), mask=meta.mask.contiguous())

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, encoder_lens,
                                                 forward_mode, spec_info):
        per_seq = {ForwardMode.DECODE: 1, ForwardMode.TARGET_VERIFY: self.draft_tokens}.get(forward_mode)
        if per_seq is None or num_tokens != bs * per_seq:
            raise ValueError(f"capture of {forward_mode.name} bs={bs} with {num_tokens} tokens: expected "
                             f"bs x {per_seq} tokens")
        if forward_mode.is_decode() and spec_info is not None:
            raise ValueError("a DECODE graph with a spec_info is a draft decode; plain decode passes spec_info=None")
        s = self.static[forward_mode]
        meta = engine_attention.AttnMeta(bs, per_seq, s.write_slots[:bs * per_seq], s.gather_idx[:bs], s.mask[:bs])
        self.graph_meta[(forward_mode, bs)] = meta
        self._fill(meta, forward_mode, bs, req_pool_indices, seq_lens, None)
        self.forward_metadata, self.ragged = meta, None

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum, encoder_lens,
                                                forward_mode, spec_info, seq_lens_cpu):
        meta = self.graph_meta.get((forward_mode, bs))
        if meta is None:
            raise KeyError(f"no {forward_mode.name} graph metadata for bs={bs}: captured {sorted(self.graph_meta)}")
        self._fill(meta, forward_mode, bs, req_pool_indices, seq_lens, spec_info)
        self.replay_log.append((forward_mode, bs))
        self.forward_metadata, self.ragged = meta, None

    def _fill(self, meta, mode: ForwardMode, bs: int, req_pool_indices, seq_lens, spec_info) -> None:
        """Write the step's metadata into a graph's static views (outside the graph)."""
        step = self._meta(mode, bs, req_pool_indices, seq_lens, self._tree(mode, bs, seq_lens, spec_info))
        for static, value in ((meta.write_slots, step.write_slots), (meta.gather_idx, step.gather_idx),
                              (meta.mask, step.mask)):
            static.copy_(value)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """SGLang 0.5.14+'s graph hook (capture and replay in one): the classic hooks above, fed from the
        batch (a ForwardBatch at capture, the runner's replay view at replay)."""
        fb = forward_batch
        if in_capture:
            self.init_forward_metadata_capture_cuda_graph(fb.batch_size, fb.input_ids.shape[0], fb.req_pool_indices,
                                                          fb.seq_lens, None, fb.forward_mode, fb.spec_info)
        else:
            self.init_forward_metadata_replay_cuda_graph(fb.batch_size, fb.req_pool_indices, fb.seq_lens,
                                                         fb.seq_lens_sum, None, fb.forward_mode, fb.spec_info,
                                                         fb.seq_lens_cpu)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # kernels (the engine's: graph-safe, fixed shapes, no host sync) -----------------------------------
    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        # K and V go where SGLang says, out_cache_loc: padded graph rows carry the dummy slot there.
        ragged = self.ragged
        if ragged is None:
            meta = replace(self.forward_metadata, write_slots=forward_batch.out_cache_loc)
            return engine_attention.PagedAttention(self.kv_pool, meta)(layer.layer_id, q, k, v)
        # Ragged extend: scatter the real tokens into the padded layout (padding writes the dummy slot 0).
        meta = self.forward_metadata
        write = torch.zeros_like(meta.write_slots)
        write[ragged] = forward_batch.out_cache_loc.long()
        padded = [x.new_zeros((meta.write_slots.shape[0], *x.shape[1:])).index_copy_(0, ragged, x) for x in (q, k, v)]
        out = engine_attention.PagedAttention(self.kv_pool, replace(meta, write_slots=write))(layer.layer_id, *padded)
        return out[ragged]

    forward_decode = forward_extend = _attend


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
class SGLangModel(nn.Module):
    """The engine's ``LlamaModel`` (seeded random weights) behind SGLang's model ``forward`` signature,
    attending through ``forward_batch.attn_backend``."""

    def __init__(self, cfg: HarnessConfig, seed: int, device: torch.device):
        super().__init__()
        m = cfg.model
        self.llama = build_target(m, seed=seed, device=device, dtype=cfg.dtype)
        self.attn_layers = [SimpleNamespace(layer_id=i, tp_q_head_num=m.num_heads, tp_k_head_num=m.num_kv_heads,
                                            head_dim=m.head_dim, v_head_dim=m.head_dim) for i in range(m.num_layers)]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch):
        backend = getattr(forward_batch, "attn_backend", None) or _context_attn_backend()

        def attn(layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return backend.forward(q, k, v, self.attn_layers[layer_id], forward_batch)

        hidden = self.llama(input_ids, positions, attn)
        want = forward_batch.capture_hidden_mode or CaptureHiddenMode.NULL
        logits = self.llama.logits(hidden)
        if forward_batch.forward_mode in EXTEND_MODES:
            # SGLang's logits processor keeps the last token of each sequence of an extend.
            lens = forward_batch.extend_seq_lens
            if lens is not None:
                last = torch.cumsum(lens.long().to(hidden.device), 0) - 1
            else:
                n = input_ids.shape[0] // forward_batch.batch_size
                last = torch.arange(1, forward_batch.batch_size + 1, device=hidden.device) * n - 1
            logits = logits[last]
            if want == CaptureHiddenMode.LAST:
                hidden = hidden[last]
        return LogitsProcessorOutput(next_token_logits=logits, hidden_states=hidden if want.need_capture() else None)


# ----------------------------------------------------------------------------------- model runner
class HarnessModelRunner:
    """The attributes of SGLang's ``ModelRunner`` that graph runners and ``_forward_raw`` read, with
    SGLang's own routing methods bound to it."""

    _forward_raw = ModelRunner._forward_raw
    # The classic ModelRunner's eager paths (0.5.14+ runs eager steps through its EagerRunner instead).
    forward_decode = getattr(ModelRunner, "forward_decode", None)
    forward_extend = getattr(ModelRunner, "forward_extend", None)

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
        m = cfg.model
        self.token_to_kv_pool = KVPool(m.num_layers, cfg.kv_slots, m.num_kv_heads, m.head_dim, cfg.dtype, device)
        self.attn_backend = TorchPagedAttention(cfg, self.req_to_token_pool, self.token_to_kv_pool)
        self.model = SGLangModel(cfg, model_seed, self.device)
        self.graph_runner = None
        self.is_draft_worker = False
        self.hisparse_coordinator = None
        self.piecewise_cuda_graph_runner = None
        self.support_pp = False
        self.device_timer = None
        self.is_generation = True

    def forward(self, forward_batch: ForwardBatch, skip_attn_backend_init: bool = False,
                pp_proxy_tensors: Any = None) -> Any:
        """SGLang's ``ModelRunner._forward_raw``: graph replay when ``graph_runner.can_run``, else eager.
        From 0.5.13 ``_forward_raw`` takes no ``skip_attn_backend_init``: a pre-planned batch is marked."""
        if "skip_attn_backend_init" in inspect.signature(self._forward_raw).parameters:
            return self._forward_raw(forward_batch, skip_attn_backend_init, pp_proxy_tensors)
        if skip_attn_backend_init:
            forward_batch.mark_forward_metadata_ready()
        return self._forward_raw(forward_batch, pp_proxy_tensors)


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


def extend(mr: HarnessModelRunner, rows: List[int], starts: List[int], tokens: List[List[int]],
           capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.NULL) -> Any:
    """Run ``tokens[i]`` of row ``rows[i]`` at positions ``starts[i]...`` eagerly (EXTEND), writing KV at the
    slots ``req_to_token`` holds for those positions; rows are grouped by length (uniform per forward).
    Returns the model output of the last forward (the only one for rows of one length)."""
    dev, out = mr.device, None
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
                          capture_hidden_mode=capture_hidden_mode, **_runner_fields(mr))
        mr.attn_backend.init_forward_metadata(fb)
        with attention_context(mr):
            out = mr.model.forward(fb.input_ids, fb.positions, fb)
    return out


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
    # What ForwardBatch.init_new copies from the model runner (0.5.14+ keeps the pools and the attention
    # backend out of ForwardBatch: the model reads the backend from the forward context).
    fields = dict(attn_backend=mr.attn_backend, req_to_token_pool=mr.req_to_token_pool,
                  token_to_kv_pool=mr.token_to_kv_pool, spec_algorithm=mr.spec_algorithm)
    return {k: v for k, v in fields.items() if k in _FORWARD_BATCH_FIELDS}


_FORWARD_BATCH_FIELDS = frozenset(f.name for f in __import__("dataclasses").fields(ForwardBatch))


def _context_attn_backend() -> Any:
    """The attention backend of SGLang's forward context (0.5.14+, where ForwardBatch has none)."""
    from sglang.srt.model_executor.forward_context import get_forward_context

    return get_forward_context().attn_backend


def attention_context(mr: HarnessModelRunner) -> Any:
    """A forward context for an eager forward outside ``_forward_raw`` (0.5.14+; nothing for the classic API)."""
    if "attn_backend" in _FORWARD_BATCH_FIELDS:
        return contextlib.nullcontext()
    import inspect

    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    if "forward_batch" in inspect.signature(forward_context).parameters:
        return forward_context(ForwardContext(attn_backend=mr.attn_backend), forward_batch=None)
    return forward_context(ForwardContext(attn_backend=mr.attn_backend))


def verify_batch(mr: HarnessModelRunner, reqs: Requests, rows: List[int], drafts: torch.Tensor,
                 alloc: SlotAllocator) -> ForwardBatch:
    """A TARGET_VERIFY step: per row the last committed token then ``drafts[i]`` (a chain of ``drafts.shape[1] + 1``
    tokens)."""
    dev, t = mr.device, drafts.shape[1] + 1
    n = len(rows)
    idx = torch.tensor(rows, dtype=torch.int64, device=dev)
    lens = torch.tensor([reqs.kv_len(r) for r in rows], dtype=torch.int64, device=dev)
    slots = alloc.alloc(n * t, dev)
    pos = (lens[:, None] + torch.arange(t, device=dev)[None, :])
    mr.req_to_token_pool.write((idx[:, None].expand(n, t), pos), slots.view(n, t).to(torch.int32))
    last = torch.tensor([reqs.tokens[r][-1] for r in rows], dtype=torch.int64, device=dev)
    input_ids = torch.cat([last[:, None], drafts.to(dev)], 1).reshape(-1)
    prefix = "retrieve" if "retrieve_index" in {f.name for f in dataclasses.fields(EagleVerifyInput)} else "retrive"
    spec = EagleVerifyInput(  # the tree's index fields: "retrive_*" up to SGLang 0.5.10
        draft_token=input_ids, custom_mask=chain_custom_mask(lens, t), positions=pos.reshape(-1),
        **{f"{prefix}_{part}": None for part in ("index", "next_token", "next_sibling", "cum_len")},
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
    try:
        from sglang.srt.model_executor import cuda_graph_runner as pool_owner
    except ImportError:  # SGLang 0.5.14+: the runner package keeps the pool
        from sglang.srt.model_executor.runner_utils import pool as pool_owner

    pool_owner.set_global_graph_memory_pool(None)


# ----------------------------------------------------------------------------------- switch tests
#: The concurrency sweep of both switch tests (classic and runner API): past the threshold and back.
SWITCH_SWEEP = [1, 2, 4, 8, 16, 32, 64, 48, 32, 16, 8, 4, 2, 1]


def count_draft_forwards(world: Any) -> None:
    """Count ``world.draft``'s model forwards in ``world.draft_forwards`` (a plain step must add none)."""
    world.draft_forwards = 0
    forward = world.draft.model.forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        world.draft_forwards += 1
        return forward(*args, **kwargs)

    world.draft.model.forward = counted


def sweep_switch(world: Any, switch: Any, steps_per_phase: int = 3) -> None:
    """Run ``world`` (``spec_step`` / ``plain_step`` over request rows) through :data:`SWITCH_SWEEP` as
    ``switch`` (off above 16, on at <= 8) decides, and check the switch: crossed both ways with hysteresis,
    every plain step on a DECODE graph, one draft catch-up when speculation resumed."""
    decisions = []
    for concurrency in SWITCH_SWEEP:
        for _ in range(steps_per_phase):
            rows = list(range(concurrency))
            spec = switch.speculate(len(rows))
            decisions.append((concurrency, spec))
            (world.spec_step if spec else world.plain_step)(rows)
    assert switch.switches == 2, decisions
    assert all(spec for c, spec in decisions if c <= 8) and not any(spec for c, spec in decisions if c > 16)
    assert [spec for c, spec in decisions if c == 16] == [True] * 3 + [False] * 3, "16 on the way up vs down"
    assert switch.plain_steps > 0 and world.plain_graph_hits == switch.plain_steps, "every plain step: DECODE graph"
    assert world.lag.catch_ups == 1, "one draft catch-up, when speculation resumed"
