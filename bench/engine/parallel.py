"""Tensor parallelism for the reference engine: sharded layers over ``torch.distributed``.

Every rank builds the SAME full model from the same seed as a single-process engine would, then keeps its
shard (:meth:`TensorParallel.shard`), so a TP run computes what the TP=1 run computes, up to the rounding of
the split sums. (Each rank holds the full weights for a moment while it shards them: fine for this engine's
test models, not how a model too large for one GPU would be loaded.)
The split, Megatron-style, for a world of ``N`` ranks:

* ``qkv_proj``: column-parallel; rank ``r`` keeps query heads ``[r*H/N, (r+1)*H/N)`` and KV heads
  ``[r*KVH/N, (r+1)*KVH/N)``, so each local query head still reads its own KV head. The KV cache is sharded
  the same way (the engine allocates ``KVH/N`` heads per rank); attention sees fewer heads and nothing else.
* ``o_proj``: row-parallel (the local heads' columns), then an all-reduce.
* ``gate_up_proj``: column-parallel (the rank's slice of gate AND of up); ``down_proj``: row-parallel, then
  an all-reduce.
* ``lm_head``: split by vocabulary rows; the local logits are all-gathered into the full vocabulary, so
  argmax, top-k and the accept lengths are computed from the same bytes on every rank.
* Embedding and norms: replicated (small; a vocab-parallel embedding would add one more all-reduce a step).

The collectives run through ``torch.distributed``: NCCL on CUDA (captured inside the CUDA graphs), gloo on
CPU (the eager twin runs them eagerly). Their results are bitwise identical on every rank (ring and tree
all-reduce compute each element's sum once and send it everywhere; an all-gather copies), so every rank
holds the same residual stream and the same logits.

How every rank takes the same decision each step. Each rank replays its own graphs, and those graphs hold
collectives: if two ranks replayed different (mode, batch size) graphs, they would wait on each other's
collectives forever. The mode and padded batch size are therefore **computed from inputs identical by
construction**, not decided on rank 0 and broadcast: every rank runs the same deterministic loop over the
same requests, and the only values the host reads back from the device (a verify step's accept lengths)
derive from all-gathered logits, identical on every rank; :class:`graphpool.SpeculationPolicy` depends only
on the batch size, and the padded size is the pool's routing of it over identical captured sizes. This is
how SGLang's TP ranks work too (each rank runs a scheduler on the broadcast requests). A broadcast per step
would cost a host-side collective (tens of microseconds, the size of graphpool's whole staging cost) to send
a value each rank already has. Anything a rank measures itself is rank-local and must not steer a step: the
benchmark's automatic threshold (picked from timings) is taken from rank 0 once, before the dynamic runs
(:meth:`TensorParallel.broadcast`), and its timed windows end after a step count, never on a clock
(``decode_loop.py`` refuses ``--min-seconds`` with ``--tp``). What can still break it (a rank-local clock or
RNG in a policy) is what the debug check catches: with ``TensorParallel(check=True)``, every step compares
(step counter, mode, padded and real batch size) across ranks before it replays
(:class:`graphpool.agreement.StepAgreement`) and raises
:class:`~graphpool.agreement.RankDisagreementError` on every rank, naming the ranks that disagree,
instead of hanging.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from graphpool.agreement import StepAgreement
from .config import ModelConfig
from .gemv import Projection
from .model import LlamaModel

PrepareFn = Callable[[Any, int], None]


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    """Gather ``inp`` of every rank into ``out`` (rank-major along dim 0: ``out`` has ``world * len(inp)``
    rows). NCCL gathers into one tensor (capturable); gloo takes the list form, which every torch version's
    gloo supports (the single-tensor call was renamed in torch 2.13)."""
    if dist.get_backend(group) == "gloo":
        dist.all_gather(list(out.chunk(dist.get_world_size(group))), inp, group=group)
        return
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, inp, group=group)


class TensorParallel:
    """This process's place in a tensor-parallel group, and the collectives the sharded layers call.

    Build it on every rank after ``torch.distributed.init_process_group`` (see
    :mod:`bench.engine.tp_launch`), then pass it to :class:`~bench.engine.engine.Engine`.

    Args:
        group: the process group of the tensor-parallel ranks (default: the world).
        check: compare each step's (step, mode, batch size) across ranks before it runs and raise
            :class:`~graphpool.agreement.RankDisagreementError` on a mismatch (debug; one small gloo
            all-gather per step, so off by default).
        check_timeout_s: how long the check waits for a rank that never arrives.
    """

    def __init__(self, group: Any = None, check: bool = False, check_timeout_s: float = 60.0):
        if not dist.is_initialized():
            raise RuntimeError("TensorParallel needs torch.distributed: call init_process_group first "
                               "(bench.engine.tp_launch does it for you)")
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.agreement = StepAgreement(self.group, check_timeout_s) if check else None
        self._pools: list[weakref.ref] = []

    # ------------------------------------------------------------------------------- the collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along its last dimension (rank order)."""
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.empty(self.size * flat.shape[0], flat.shape[1], dtype=x.dtype, device=x.device)
        all_gather_flat(out, flat, self.group)
        return out.view(self.size, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])

    def broadcast(self, obj: Any) -> Any:
        """``obj`` as rank 0 holds it, on every rank: for a decision taken from a rank-local measurement
        (a threshold picked from timings), which would otherwise differ between ranks."""
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    # ---------------------------------------------------------------------------------- the split
    def local_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(query heads, KV heads) on this rank; raises if they do not split evenly."""
        self._check_divides(cfg)
        return cfg.num_heads // self.size, cfg.num_kv_heads // self.size

    def _check_divides(self, cfg: ModelConfig) -> None:
        self.check_split(cfg, self.size)

    @staticmethod
    def check_split(cfg: ModelConfig, size: int) -> None:
        """Raise ``ValueError`` unless ``size`` ranks split ``cfg`` evenly (checkable before spawning ranks)."""
        parts = {"num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
                 "intermediate_size": cfg.intermediate_size, "vocab_size": cfg.vocab_size}
        bad = {k: v for k, v in parts.items() if v % size}
        if bad:
            raise ValueError(f"tensor parallelism over {size} ranks splits heads, KV heads, the MLP and the "
                             f"vocabulary evenly; {bad} do not divide by {size}: pick a tp that divides them")

    @torch.no_grad()
    def shard(self, model: LlamaModel) -> LlamaModel:
        """Keep this rank's shard of ``model``'s full weights, in place (the module docstring gives the split).
        Returns ``model``; ``model.cfg`` stays the full shape."""
        cfg, n, r = model.cfg, self.size, self.rank
        heads, kv_heads = self.local_heads(cfg)
        d, inter = cfg.head_dim, cfg.intermediate_size // n
        q_dim, kv_dim = cfg.num_heads * d, cfg.num_kv_heads * d
        lq, lkv = heads * d, kv_heads * d
        for layer in model.layers:
            w = layer.qkv_proj.weight
            q, k, v = w.split([q_dim, kv_dim, kv_dim])
            layer.qkv_proj = ColumnParallelLinear.of(torch.cat([q[r * lq:(r + 1) * lq], k[r * lkv:(r + 1) * lkv],
                                                                v[r * lkv:(r + 1) * lkv]]))
            layer.o_proj = RowParallelLinear.of(layer.o_proj.weight[:, r * lq:(r + 1) * lq], self)
            gate, up = layer.gate_up_proj.weight.chunk(2)
            layer.gate_up_proj = ColumnParallelLinear.of(torch.cat([gate[r * inter:(r + 1) * inter],
                                                                    up[r * inter:(r + 1) * inter]]))
            layer.down_proj = RowParallelLinear.of(layer.down_proj.weight[:, r * inter:(r + 1) * inter], self)
            layer.num_heads, layer.num_kv_heads = heads, kv_heads
        vocab = cfg.vocab_size // n
        model.lm_head = VocabParallelHead.of(model.lm_head.weight[r * vocab:(r + 1) * vocab], self)
        model.fused = model.fused  # the new projections take the model's kernel choice
        return model

    # ------------------------------------------------------------------------ one decision per step
    def agree(self, what: str, bs: int, real_bs: int) -> None:
        """With ``check=True``: raise unless every rank is about to run the same step (else a no-op)."""
        if self.agreement is not None:
            self.agreement.check(what, bs, real_bs)

    def guard(self, prepare: PrepareFn | None) -> PrepareFn | None:
        """The pool's ``prepare`` hook with the agreement check in front (``prepare`` itself without
        ``check``). The pool calls it before every capture and replay, outside the graph; eager batches
        (``captured=False``) are checked by the engine's step itself."""
        if self.agreement is None:
            return prepare

        def checked(batch: Any, real_bs: int) -> None:
            if batch.captured:
                self.agree(batch.mode.name, batch.bs, real_bs)
            if prepare is not None:
                prepare(batch, real_bs)
        return checked

    # ------------------------------------------------------------------------------------ teardown
    def track(self, pool: Any) -> None:
        """Remember ``pool`` (weakly), so :meth:`live_pools` can tell whether graphs outlive the group."""
        self._pools.append(weakref.ref(pool))

    def live_pools(self) -> list[Any]:
        """Tracked pools still alive. Their graphs hold this group's collectives: close them
        (``GraphPool.close``) before ``destroy_process_group``, or NCCL can hang at exit."""
        return [p for p in (ref() for ref in self._pools) if p is not None]


class ColumnParallelLinear(Projection):
    """``x @ weight.T`` with this rank's output rows; no communication (the next layer reads local columns)."""


class RowParallelLinear(Projection):
    """``x_local @ weight_local.T`` summed over the ranks (one all-reduce): the full layer's output."""

    def __init__(self, in_features: int, out_features: int, weight: torch.Tensor, tp: TensorParallel):
        super().__init__(in_features, out_features, weight)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class VocabParallelHead(Projection):
    """The LM head over this rank's vocabulary rows, all-gathered into logits over the full vocabulary."""

    def __init__(self, in_features: int, out_features: int, weight: torch.Tensor, tp: TensorParallel):
        super().__init__(in_features, out_features, weight)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.gather_last_dim(super().forward(x))
