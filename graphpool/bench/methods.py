"""The ways of feeding a graph that bench/replay_latency.py compares with graphpool's own staging.

Each stages a step's inputs into a pool's static buffers (``pool.static_inputs``) from Python; the pool
is built with ``staging="torch"``, so its graphs hold the step alone and replaying one after staging is
the whole step:

* :func:`sglang_style`: SGLang's runner: tail fills when the batch is padded, then a slice ``copy_`` per
  buffer (``grouped``: one ``torch._foreach_copy_`` per dtype group instead, SGLang 0.5.12's batching).
* :func:`padding_in_graph`: the step preceded, inside the graph, by padding every input past a device-side
  count; the host copies the real rows and sets the count.
* :class:`EagerTritonStage`: graphpool's staging kernel (``graphpool.kernels.stage``) launched eagerly from
  Python through its documented launcher, with a one-row table of its own.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

import graphpool as gp


def sglang_style(pool: gp.GraphPool, specs: Sequence[gp.StepInput], grouped: bool,
                 fills: bool = True) -> Callable[[gp.Mode, int, dict[str, torch.Tensor]], None]:
    """Staging as SGLang's runner does it: fills of the padded tails (of the inputs SGLang fills, where the step
    has them), then copies of the real rows."""
    buf = pool.static_inputs
    names = [s.name for s in specs]
    tail_fills = [(buf[s.name], s.fill) for s in specs if s.name in ("seq_lens", "out_cache_loc", "out_cache_loc_swa")]
    # the real batch size from any input's rows: a step of your own (--step) need not have SGLang's seq_lens
    first = specs[0]

    def stage(mode: gp.Mode, padded: int, inputs: dict[str, torch.Tensor]) -> None:
        raw_bs = inputs[first.name].shape[0] // (mode.tokens_per_seq if first.per == "token" else 1)
        if fills and padded != raw_bs:
            for tensor, value in tail_fills:
                tensor.fill_(value)
        dsts = [buf[n][: inputs[n].shape[0]] for n in names]
        srcs = [inputs[n] for n in names]
        if not grouped:
            for d, s in zip(dsts, srcs):
                d.copy_(s)
            return
        groups: dict[torch.dtype, tuple[list, list]] = {}
        for d, s in zip(dsts, srcs):
            groups.setdefault(d.dtype, ([], []))
            groups[d.dtype][0].append(d)
            groups[d.dtype][1].append(s)
        for d, s in groups.values():
            torch._foreach_copy_(d, s)
    return stage


def padding_in_graph(step_fn: Callable, specs: Sequence[gp.StepInput], count: torch.Tensor) -> Callable:
    """``step_fn`` preceded, inside the graph, by padding every input past a device-side count of real
    sequences: the host then only copies the real rows and sets the count."""
    def padded(batch: gp.StepBatch) -> object:
        for spec in specs:
            view = batch.inputs[spec.name]
            rows_per_seq = batch.mode.tokens_per_seq if spec.per == "token" else 1
            pad = torch.arange(view.shape[0], device=view.device) >= count * rows_per_seq
            view.masked_fill_(pad.view(-1, *[1] * (view.dim() - 1)), spec.fill)
        return step_fn(batch)
    return padded


class EagerTritonStage:
    """graphpool's staging kernel launched eagerly from Python into ``pool``'s static buffers.

    The kernel reads row ``step % slots`` of a host table ``[real_bs, src_ptr...]``; with one slot every
    launch reads row 0, which :meth:`stage` rewrites before each launch (the benchmark synchronises
    before each timed step, and within one key the row's content never changes).
    """

    def __init__(self, pool: gp.GraphPool, specs: Sequence[gp.StepInput]):
        from graphpool.kernels.stage import stage_grid, stage_launch

        self._launch = stage_launch
        device = next(iter(pool.static_inputs.values())).device
        self.specs = list(specs)
        self.fill_rows = [torch.full((1, *s.trailing), s.fill, dtype=s.dtype, device=device) for s in specs]
        static = pool.static_inputs
        self.word = min(8, *(static[s.name].element_size() for s in specs))
        rows = [[static[s.name].data_ptr(), fill.data_ptr(), fill.numel() * fill.element_size() // self.word,
                 int(s.per == "token")] for s, fill in zip(specs, self.fill_rows)]
        self.meta = torch.tensor(rows, dtype=torch.int64, device=device)
        self.grid = stage_grid(len(specs), max(static[s.name].numel() * static[s.name].element_size() // self.word
                                               for s in specs))
        self.table = torch.zeros(1, 1 + len(specs), dtype=torch.int64, pin_memory=True)
        self._table = self.table.numpy()
        self.done = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self.counters = torch.zeros(self.grid[0] * self.grid[1], dtype=torch.int64, device=device)

    def stager(self, mode: gp.Mode, bs: int, inputs: dict[str, torch.Tensor]) -> Callable[[], None]:
        """A zero-argument function that stages ``inputs`` (``bs`` sequences of ``mode``) with one launch."""
        row = np.array([bs] + [inputs[s.name].data_ptr() for s in self.specs], dtype=np.int64)
        tps = mode.tokens_per_seq

        def stage() -> None:
            self._table[0] = row
            self._launch(self.table, self.counters, self.meta, self.done, bs, tps, self.word, self.grid)
        return stage
