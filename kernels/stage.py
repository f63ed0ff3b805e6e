"""Stage every input of a step into its static buffer and pad the tail, in one kernel launch.

The host does not copy anything. For each step it writes one row of a small pinned *ring table*:
``[real_bs, src_ptr_0, src_ptr_1, ...]``. The staging kernel, captured as the first node of each graph,
reads the row chosen by a device-side step counter, copies the real rows of every input from its source
pointer into the static buffer, and writes each input's fill row into the padded rows. One kernel, one
graph node: each extra node costs ~0.5 us of host time per replay.

Why it looks the way it does (its GPU time is latency, not bandwidth: a step moves a few kilobytes):

* **No atomics, no "last program" tail.** Every program keeps its own step counter
  (``counters[program]``), reads it, and advances it itself. The grid is the same for every graph of a
  pool (sized for the largest key; programs past a small key's data copy nothing), so all counters stay
  equal without any program waiting for another. Its chunk dimension stops at CUDA's 65,535; past that a
  program stages every 65,535th chunk, so no input is too large to launch.
* **Progress is published early.** Program 0 writes its counter value ``s`` to pinned host memory
  (``done``) as it starts: ``s`` stagings ran before this one, and the stream finished them all before
  this kernel began, so the host may rewrite any row older than ``s``. The host sees progress one step
  late, which costs one ring slot of run-ahead and no GPU time.
* **Ring reads are plain loads.** The host rewrites a row between two kernels that read it; a discrete
  GPU does not keep host memory in its L2, and L1 lines die with the kernel, so no read is stale. (Volatile
  loads of pinned memory measured ~80 us per step on an H200: every thread went to the host.)
* **Words, not bytes**: data moves in ``WORD``-byte units, the smallest element size among the inputs
  (every input's rows and addresses are multiples of it).

The static metadata of each input is one row of ``meta``: ``[dst_ptr, fill_ptr, row_words, per_token]``
(``fill_ptr`` points at one row holding the fill value).

File layout: kernel, launcher with its asserts, then the plain-torch reference (the CPU path and the
test oracle).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is an extra: a CPU install stages with the reference below
    triton = tl = None

META_COLUMNS = 4  # dst_ptr, fill_ptr, row_words, per_token
STAGE_BLOCK = 1024  # words per program and pass
#: CUDA's limit on a grid's second dimension (the chunks). Words move in the smallest element size, so a large
#: per-token float input beside a 1-byte input has many chunks: 4,096 tokens x 8,192 float32 values are
#: 131,072 chunks of bytes. Past the limit each program loops over its chunks instead of failing to launch.
MAX_CHUNK_PROGRAMS = 65535
_WORD_TYPES = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


if triton is not None:  # without Triton only the reference (the eager twin's path) is here
    @triton.jit
    def _as_words(src_addr, dst_addr, fill_addr, WORD_TYPE: tl.constexpr):
        kind = tl.pointer_type(WORD_TYPE)
        return src_addr.to(kind), dst_addr.to(kind), fill_addr.to(kind)

    @triton.jit
    def _stage_kernel(ring_addr, counters_ptr, meta_ptr, done_addr, padded_bs, tokens_per_seq, ring_slots,
                      ring_width, WORD: tl.constexpr, BLOCK: tl.constexpr):
        which = tl.program_id(0)   # which input
        block = tl.program_id(1)   # which BLOCK-word chunk of it
        program = which * tl.num_programs(1) + block
        step = tl.load(counters_ptr + program)
        tl.store(counters_ptr + program, step + 1)
        if program == 0:
            tl.store(done_addr.to(tl.pointer_type(tl.int64)), step)
        row = ring_addr.to(tl.pointer_type(tl.int64)) + (step % ring_slots) * ring_width
        real_bs = tl.load(row)
        src_addr = tl.load(row + 1 + which)
        meta = meta_ptr + which * 4
        dst_addr = tl.load(meta)
        fill_addr = tl.load(meta + 1)
        row_words = tl.load(meta + 2)
        rows_per_seq = tl.where(tl.load(meta + 3) != 0, tokens_per_seq, 1)
        if WORD == 8:
            src, dst, fill = _as_words(src_addr, dst_addr, fill_addr, tl.int64)
        elif WORD == 4:
            src, dst, fill = _as_words(src_addr, dst_addr, fill_addr, tl.int32)
        elif WORD == 2:
            src, dst, fill = _as_words(src_addr, dst_addr, fill_addr, tl.int16)
        else:
            src, dst, fill = _as_words(src_addr, dst_addr, fill_addr, tl.int8)
        real_words = real_bs * rows_per_seq * row_words
        total_words = padded_bs * rows_per_seq * row_words
        # Chunks block, block + blocks, ...: one pass unless an input has more chunks than the grid has rows.
        start = block.to(tl.int64) * BLOCK
        stride = tl.num_programs(1).to(tl.int64) * BLOCK
        while start < total_words:
            offs = start + tl.arange(0, BLOCK)
            inside = offs < total_words
            real = offs < real_words
            from_src = tl.load(src + offs, mask=inside & real, other=0)
            from_fill = tl.load(fill + offs % row_words, mask=inside & (offs >= real_words), other=0)
            tl.store(dst + offs, tl.where(real, from_src, from_fill), mask=inside)
            start += stride


def stage_grid(n_inputs: int, max_words: int) -> tuple[int, int]:
    """The launch grid of a pool: one program per input and ``STAGE_BLOCK``-word chunk of its largest key,
    at most :data:`MAX_CHUNK_PROGRAMS` chunks a row (a program then stages every that-many-th chunk)."""
    return n_inputs, max(1, min(MAX_CHUNK_PROGRAMS, -(-max_words // STAGE_BLOCK)))


def stage_launch(ring: torch.Tensor, counters: torch.Tensor, meta: torch.Tensor, done: torch.Tensor,
                 padded_bs: int, tokens_per_seq: int, word: int, grid: tuple[int, int]) -> None:
    """Launch the staging kernel (capturable into a CUDA graph).

    Args:
        ring: int64 ``[slots, 1 + n_inputs]`` ring table, host-pinned on CUDA (read by the GPU at run time).
        counters: int64 ``[grid[0] * grid[1]]`` on the device: each program's count of executed stagings
            (row ``counters[p] % slots`` is read); all equal between launches.
        meta: int64 ``[n_inputs, 4]`` on the device: ``dst_ptr, fill_ptr, row_words, per_token``.
        done: int64 ``[1]`` host-pinned: program 0 writes the count of stagings finished before this one.
        padded_bs: the batch size of the graph this launch belongs to.
        tokens_per_seq: rows per sequence of per-token inputs in this mode.
        word: bytes per copied word (1, 2, 4 or 8): divides every input's element size.
        grid: from :func:`stage_grid`, the same for every launch that shares ``counters``.
    """
    if triton is None:
        raise RuntimeError("graphpool's ring staging needs Triton: pip install triton, or build the pool "
                           "with staging='torch'")
    n_inputs = meta.shape[0]
    assert ring.dtype == torch.int64 and ring.dim() == 2 and ring.shape[1] == 1 + n_inputs, ring.shape
    assert ring.is_contiguous() and meta.is_contiguous() and meta.shape[1] == META_COLUMNS, meta.shape
    assert counters.dtype == torch.int64 and counters.numel() == grid[0] * grid[1] and grid[0] == n_inputs
    assert done.dtype == torch.int64 and word in _WORD_TYPES
    assert padded_bs >= 1 and tokens_per_seq >= 1
    _stage_kernel[grid](ring.data_ptr(), counters, meta, done.data_ptr(), padded_bs, tokens_per_seq, ring.shape[0],
                        ring.shape[1], WORD=word, BLOCK=STAGE_BLOCK)


def stage_reference(dst: torch.Tensor, src: torch.Tensor, fill_row: torch.Tensor) -> None:
    """Plain-torch staging of one input: ``dst[:n] = src``, every row of ``dst[n:]`` = ``fill_row``."""
    n = src.shape[0]
    dst[:n].copy_(src)
    dst[n:].copy_(fill_row.expand_as(dst[n:]))
