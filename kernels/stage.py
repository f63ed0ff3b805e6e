"""Stage every input of a step into its static buffer and pad the tail, in one kernel launch.

The host does not copy anything. For each step it writes one row of a small pinned *ring table*:
``[real_bs, src_ptr_0, src_ptr_1, ...]``. The staging kernel, captured as the first node of each graph,
finds the row of the step its device-side counter names, copies the real rows of every input from its
source pointer into the static buffer, and writes each input's fill row into the padded rows. One
kernel, one graph node: each extra node costs ~0.5 us of host time per replay.

Why it looks the way it does (its GPU time is latency, not bandwidth: a step moves a few kilobytes):

* **The row is read from device memory when it can be.** A read of pinned host memory is a PCIe round
  trip, ~3 us of a step's critical path on an H200. So every step's graph also holds a *prefetch* node,
  on a branch beside the step's own work (off its critical path): it reads the ring row of the *next*
  step from host memory into a device *mirror*, if the host has already written and committed it (a
  host running ahead, as in any decode loop under load). The next staging kernel reads the mirror
  (device memory, at a fixed address, in parallel with its counter), and reads the host row only when
  the mirror does not hold its step (a host that was not ahead).
* **No torn or stale row is ever used.** The host and the prefetch run at the same time, and a GPU's
  reads of host memory are not ordered. So every 8-byte word of a row carries, in its top 16 bits, the
  *generation* of the host write that produced it (a host counter of row writes, never 0), and the host
  writes a *commit* word per ring slot, ``step_tag << 16 | generation``, when the step is enqueued (after
  its last write to the row). The prefetch keeps a row only if the commit names the step it wants and
  every word carries the commit's generation: a word of an earlier, abandoned write to that row (a
  ``stage`` never replayed, a step whose ``prepare`` raised) or of the slot's previous step fails that
  test. Values are 48-bit (x86-64 and AArch64 user addresses, batch sizes); generations cycle through
  1..32767, so a read would have to straddle 32,767 host writes of one ring row to mistake one.
* **No atomics, no "last program" tail.** Every program keeps its own step counter
  (``counters[program]``), reads it, and advances it itself. The grid is the same for every graph of a
  pool (sized for the largest key; programs past a small key's data copy nothing), so all counters stay
  equal without any program waiting for another.
* **Progress is published off the critical path.** The prefetch node (which starts after the step's
  staging kernel finished) writes the counter to pinned host memory (``done``): that many stagings have
  consumed their rows, so the host may rewrite any row of an older step.
* **Ring reads are plain loads.** A discrete GPU does not keep host memory in its L2, and L1 lines die
  with the kernel, so no read is stale. (Volatile loads of pinned memory measured ~80 us per step on an
  H200: every thread went to the host.)
* **Words, not bytes**: data moves in ``WORD``-byte units, the smallest element size among the inputs
  (every input's rows and addresses are multiples of it).

The static metadata of each input is one row of ``meta``: ``[dst_ptr, fill_ptr, row_words, per_token]``
(``fill_ptr`` points at one row holding the fill value). The mirror is ``[step, real_bs, src_ptr...]``
on the device (``step`` -1: holds no step).

File layout: the ring format, the kernels, their launchers with asserts, then the plain-torch reference
(the CPU path and the test oracle).
"""
from __future__ import annotations

import torch

from .ring import TAG_MASK, TAG_SHIFT, VALUE_MASK, commit_word  # noqa: F401  (commit_word: the format's API)

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is an extra: a CPU install stages with the reference below
    triton = tl = None

META_COLUMNS = 4  # dst_ptr, fill_ptr, row_words, per_token
STAGE_BLOCK = 1024  # words per program
_WORD_TYPES = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}

if triton is not None:  # without Triton only the reference (the eager twin's path) is here
    _VALUE_MASK: tl.constexpr = tl.constexpr(VALUE_MASK)
    _TAG_SHIFT: tl.constexpr = tl.constexpr(TAG_SHIFT)
    _TAG_MASK: tl.constexpr = tl.constexpr(TAG_MASK)

    @triton.jit
    def _as_words(src_addr, dst_addr, fill_addr, WORD_TYPE: tl.constexpr):
        kind = tl.pointer_type(WORD_TYPE)
        return src_addr.to(kind), dst_addr.to(kind), fill_addr.to(kind)

    @triton.jit
    def _stage_kernel(ring_addr, mirror_ptr, counters_ptr, meta_ptr, padded_bs, tokens_per_seq, ring_slots,
                      ring_width, WORD: tl.constexpr, BLOCK: tl.constexpr):
        which = tl.program_id(0)   # which input
        block = tl.program_id(1)   # which BLOCK-word chunk of it
        program = which * tl.num_programs(1) + block
        # Independent loads (device memory): the counter, the mirror and this input's metadata.
        step = tl.load(counters_ptr + program)
        mirror_step = tl.load(mirror_ptr)
        mirror_bs = tl.load(mirror_ptr + 1)
        mirror_src = tl.load(mirror_ptr + 2 + which)
        meta = meta_ptr + which * 4
        dst_addr = tl.load(meta)
        fill_addr = tl.load(meta + 1)
        row_words = tl.load(meta + 2)
        rows_per_seq = tl.where(tl.load(meta + 3) != 0, tokens_per_seq, 1)
        tl.store(counters_ptr + program, step + 1)
        # The host row only when the prefetch did not bring this step's row (a masked-off load costs nothing).
        miss = mirror_step != step
        row = ring_addr.to(tl.pointer_type(tl.int64)) + (step % ring_slots) * ring_width
        host_bs = tl.load(row, mask=miss, other=0)
        host_src = tl.load(row + 1 + which, mask=miss, other=0)
        real_bs = tl.where(miss, host_bs & _VALUE_MASK, mirror_bs)
        src_addr = tl.where(miss, host_src & _VALUE_MASK, mirror_src)
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
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < total_words
        real = offs < real_words
        from_src = tl.load(src + offs, mask=inside & real, other=0)
        from_fill = tl.load(fill + offs % row_words, mask=inside & (offs >= real_words), other=0)
        tl.store(dst + offs, tl.where(real, from_src, from_fill), mask=inside)

    @triton.jit
    def _prefetch_kernel(ring_addr, commits_addr, mirror_ptr, counters_ptr, done_addr, ring_slots, ring_width,
                         WIDTH: tl.constexpr):
        following = tl.load(counters_ptr)  # stagings executed so far = the step the next staging kernel runs
        tl.store(done_addr.to(tl.pointer_type(tl.int64)), following)
        slot = following % ring_slots
        commit = tl.load(commits_addr.to(tl.pointer_type(tl.int64)) + slot)
        generation = commit & _TAG_MASK
        cols = tl.arange(0, WIDTH)
        words = tl.load(ring_addr.to(tl.pointer_type(tl.int64)) + slot * ring_width + cols, mask=cols < ring_width,
                        other=generation << _TAG_SHIFT)
        foreign = tl.sum((((words >> _TAG_SHIFT) & _TAG_MASK) != generation).to(tl.int32), axis=0)
        valid = (((commit >> 16) & _TAG_MASK) == (following & _TAG_MASK)) & (generation != 0) & (foreign == 0)
        tl.store(mirror_ptr + 1 + cols, words & _VALUE_MASK, mask=cols < ring_width)
        tl.store(mirror_ptr, tl.where(valid, following, -1))


def stage_grid(n_inputs: int, max_words: int) -> tuple[int, int]:
    """The launch grid of a pool: one program per input and ``STAGE_BLOCK``-word chunk of its largest key."""
    return n_inputs, max(1, -(-max_words // STAGE_BLOCK))


def _need_triton() -> None:
    if triton is None:
        raise RuntimeError("graphpool's ring staging needs Triton: pip install triton, or build the pool "
                           "with staging='torch'")


def stage_launch(ring: torch.Tensor, mirror: torch.Tensor, counters: torch.Tensor, meta: torch.Tensor,
                 padded_bs: int, tokens_per_seq: int, word: int, grid: tuple[int, int]) -> None:
    """Launch the staging kernel (capturable into a CUDA graph).

    Args:
        ring: int64 ``[slots, 1 + n_inputs]`` ring table of tagged words, host-pinned on CUDA (read by the
            GPU at run time, only where ``mirror`` does not hold the step).
        mirror: int64 ``[2 + n_inputs]`` on the device: ``[step, real_bs, src_ptr...]`` from
            :func:`prefetch_launch` (``step`` -1, or any step but this one, sends the kernel to ``ring``).
        counters: int64 ``[grid[0] * grid[1]]`` on the device: each program's count of executed stagings
            (the step it runs; row ``counters[p] % slots``); all equal between launches.
        meta: int64 ``[n_inputs, 4]`` on the device: ``dst_ptr, fill_ptr, row_words, per_token``.
        padded_bs: the batch size of the graph this launch belongs to.
        tokens_per_seq: rows per sequence of per-token inputs in this mode.
        word: bytes per copied word (1, 2, 4 or 8): divides every input's element size.
        grid: from :func:`stage_grid`, the same for every launch that shares ``counters``.
    """
    _need_triton()
    n_inputs = meta.shape[0]
    assert ring.dtype == torch.int64 and ring.dim() == 2 and ring.shape[1] == 1 + n_inputs, ring.shape
    assert ring.is_contiguous() and meta.is_contiguous() and meta.shape[1] == META_COLUMNS, meta.shape
    assert mirror.dtype == torch.int64 and mirror.numel() == 2 + n_inputs and mirror.device == counters.device
    assert counters.dtype == torch.int64 and counters.numel() == grid[0] * grid[1] and grid[0] == n_inputs
    assert word in _WORD_TYPES and padded_bs >= 1 and tokens_per_seq >= 1
    _stage_kernel[grid](ring.data_ptr(), mirror, counters, meta, padded_bs, tokens_per_seq, ring.shape[0],
                        ring.shape[1], WORD=word, BLOCK=STAGE_BLOCK)


def prefetch_launch(ring: torch.Tensor, commits: torch.Tensor, mirror: torch.Tensor, counters: torch.Tensor,
                    done: torch.Tensor) -> None:
    """Launch the prefetch kernel (capturable), after a staging kernel: publish ``counters[0]`` (stagings
    executed) in ``done``, and copy the ring row of the step the next staging kernel runs into ``mirror``
    if its commit says it is final (``mirror[0]`` = that step), else mark the mirror empty (-1).

    Args:
        ring: as for :func:`stage_launch`.
        commits: int64 ``[slots]``, host-pinned on CUDA: ``ring.commit_word`` of each slot's latest enqueued step.
        mirror, counters: as for :func:`stage_launch`.
        done: int64 ``[1]``, host-pinned on CUDA.
    """
    _need_triton()
    assert commits.dtype == torch.int64 and commits.numel() == ring.shape[0] and done.dtype == torch.int64
    assert mirror.numel() == 1 + ring.shape[1] and ring.shape[0] <= TAG_MASK
    _prefetch_kernel[(1,)](ring.data_ptr(), commits.data_ptr(), mirror, counters, done.data_ptr(), ring.shape[0],
                           ring.shape[1], WIDTH=triton.next_power_of_2(ring.shape[1]))


def stage_reference(dst: torch.Tensor, src: torch.Tensor, fill_row: torch.Tensor) -> None:
    """Plain-torch staging of one input: ``dst[:n] = src``, every row of ``dst[n:]`` = ``fill_row``."""
    n = src.shape[0]
    dst[:n].copy_(src)
    dst[n:].copy_(fill_row.expand_as(dst[n:]))
