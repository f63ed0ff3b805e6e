"""Stage every input of a step into its static buffer and pad the tail, in one kernel launch.

The host does not copy anything. For each step it writes one row of a small pinned *ring table*:
``[real_bs, src_ptr_0, src_ptr_1, ...]``. The staging kernel, captured as the first node of each graph,
reads the row chosen by a device-side step counter, copies the real rows of every input from its source
pointer into the static buffer, and writes each input's fill row into the padded rows. The last program
to finish advances the counter and publishes it to pinned memory (``done``), so the host knows which
ring rows the GPU has consumed and never overwrites a row that a queued replay has not read yet. One
kernel, one graph node: each extra node costs ~0.5 us of host time per replay.

Everything is copied as bytes, so one launch serves any mix of dtypes (int32, int64, float32, bfloat16,
...) and trailing shapes. The static metadata of each input is one row of ``meta``:
``[dst_ptr, fill_ptr, row_bytes, per_token]`` (``fill_ptr`` points at one row holding the fill value).

File layout: kernels, launchers with their asserts, then the plain-torch reference (the CPU path and
the test oracle).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is an extra: a CPU install stages with the reference below
    triton = tl = None

META_COLUMNS = 4  # dst_ptr, fill_ptr, row_bytes, per_token
STAGE_BLOCK = 1024


if triton is not None:  # without Triton only the reference (the eager twin's path) is here
    @triton.jit
    def _stage_kernel(ring_addr, step_ptr, meta_ptr, done_addr, padded_bs, tokens_per_seq, ring_slots, ring_width,
                      BLOCK: tl.constexpr):
        which = tl.program_id(0)   # which input
        block = tl.program_id(1)   # which BLOCK-byte chunk of it
        slot = tl.load(step_ptr) % ring_slots
        row = ring_addr.to(tl.pointer_type(tl.int64)) + slot * ring_width
        real_bs = tl.load(row)
        src = tl.load(row + 1 + which).to(tl.pointer_type(tl.uint8))
        meta = meta_ptr + which * 4
        dst = tl.load(meta).to(tl.pointer_type(tl.uint8))
        fill = tl.load(meta + 1).to(tl.pointer_type(tl.uint8))
        row_bytes = tl.load(meta + 2)
        rows_per_seq = tl.where(tl.load(meta + 3) != 0, tokens_per_seq, 1)
        real_bytes = real_bs * rows_per_seq * row_bytes
        total_bytes = padded_bs * rows_per_seq * row_bytes
        offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < total_bytes
        real = offs < real_bytes
        from_src = tl.load(src + offs, mask=inside & real, other=0)
        from_fill = tl.load(fill + offs % row_bytes, mask=inside & (offs >= real_bytes), other=0)
        tl.store(dst + offs, tl.where(real, from_src, from_fill), mask=inside)
        # The last program to arrive advances the step counter: by then every program has read it.
        # (atomic_add is acq_rel, so each program's read of the counter is ordered before its arrival.)
        programs = tl.num_programs(0) * tl.num_programs(1)
        if tl.atomic_add(step_ptr + 1, 1) == programs - 1:
            tl.store(step_ptr + 1, 0)
            step = tl.load(step_ptr) + 1
            tl.store(step_ptr, step)
            tl.store(done_addr.to(tl.pointer_type(tl.int64)), step)


def stage_launch(ring: torch.Tensor, step: torch.Tensor, meta: torch.Tensor, done: torch.Tensor,
                 padded_bs: int, tokens_per_seq: int, max_bytes: int) -> None:
    """Launch the staging kernel (capturable into a CUDA graph).

    Args:
        ring: int64 ``[slots, 1 + n_inputs]`` ring table, host-pinned on CUDA (read by the GPU at run time).
        step: int64 ``[2]`` on the device: executed steps (row ``step[0] % slots`` is read) and the
            count of programs that finished this step (zero between steps).
        meta: int64 ``[n_inputs, 4]`` on the device: ``dst_ptr, fill_ptr, row_bytes, per_token``.
        done: int64 ``[1]`` host-pinned: the kernel's last program writes the new step count there.
        padded_bs: the batch size of the graph this launch belongs to.
        tokens_per_seq: rows per sequence of per-token inputs in this mode.
        max_bytes: the largest ``padded rows x row_bytes`` over the inputs (sizes the grid).
    """
    if triton is None:
        raise RuntimeError("graphpool's ring staging needs Triton: pip install triton, or build the pool "
                           "with staging='torch'")
    n_inputs = meta.shape[0]
    assert ring.dtype == torch.int64 and ring.dim() == 2 and ring.shape[1] == 1 + n_inputs, ring.shape
    assert ring.is_contiguous() and meta.is_contiguous() and meta.shape[1] == META_COLUMNS, meta.shape
    assert step.dtype == torch.int64 and step.numel() == 2 and done.dtype == torch.int64
    assert padded_bs >= 1 and tokens_per_seq >= 1 and max_bytes >= 1
    grid = (n_inputs, triton.cdiv(max_bytes, STAGE_BLOCK))
    _stage_kernel[grid](ring.data_ptr(), step, meta, done.data_ptr(), padded_bs, tokens_per_seq, ring.shape[0],
                        ring.shape[1], BLOCK=STAGE_BLOCK)


def stage_reference(dst: torch.Tensor, src: torch.Tensor, fill_row: torch.Tensor) -> None:
    """Plain-torch staging of one input: ``dst[:n] = src``, every row of ``dst[n:]`` = ``fill_row``."""
    n = src.shape[0]
    dst[:n].copy_(src)
    dst[n:].copy_(fill_row.expand_as(dst[n:]))
