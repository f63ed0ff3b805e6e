"""The one-launch staging kernel against its plain-torch reference.

On CPU the kernel runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1); on the H200 it runs
for real (`-m gpu`), reading its ring table from pinned host memory.
"""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
from graphpool.kernels.stage import MAX_CHUNK_PROGRAMS, STAGE_BLOCK, stage_grid, stage_launch, stage_reference  # noqa: E402

DTYPES = [torch.int32, torch.int64, torch.float32, torch.bfloat16]
TRAILING = [(), (3,), (2, 2), (5,)]
DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter), pytest.param("cuda", marks=pytest.mark.gpu)]


def random_case(rng: random.Random, device: str):
    n_inputs = rng.randint(1, 6)
    max_bs, tps = rng.choice([1, 3, 8, 16]), rng.choice([1, 2, 16])
    specs = [(rng.choice(DTYPES), rng.choice(TRAILING), rng.random() < 0.6) for _ in range(n_inputs)]
    dsts, fills = [], []
    for dtype, trailing, per_token in specs:
        rows = max_bs * (tps if per_token else 1)
        dsts.append(torch.full((rows, *trailing), -7, dtype=dtype, device=device))  # poison: every row is written
        fills.append(torch.full((1, *trailing), rng.randint(-3, 3), dtype=dtype, device=device))
    return specs, max_bs, tps, dsts, fills


def random_source(spec, rows: int, device: str) -> torch.Tensor:
    dtype, trailing, _ = spec
    if dtype.is_floating_point:
        return torch.randn(rows, *trailing).to(dtype).to(device)
    return torch.randint(-2**30, 2**30, (rows, *trailing), dtype=dtype).to(device)


def kernel_setup(specs, dsts, fills, device, slots):
    pinned = device == "cuda"
    word = min(8, *(d.element_size() for d in dsts))
    ring = torch.zeros(slots, 1 + len(specs), dtype=torch.int64, pin_memory=pinned)
    done = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)
    meta = torch.tensor([[d.data_ptr(), f.data_ptr(), d[0].numel() * d.element_size() // word, int(p)]
                         for d, f, (_, _, p) in zip(dsts, fills, specs)], dtype=torch.int64, device=device)
    grid = stage_grid(len(specs), max(d.numel() * d.element_size() // word for d in dsts))
    counters = torch.zeros(grid[0] * grid[1], dtype=torch.int64, device=device)
    return ring, done, meta, word, grid, counters


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(12))
def test_kernel_equals_reference(device, seed):
    rng = random.Random(seed)
    specs, max_bs, tps, dsts, fills = random_case(rng, device)
    slots = 4
    ring, done, meta, word, grid, counters = kernel_setup(specs, dsts, fills, device, slots)
    expected = [d.clone() for d in dsts]
    # Several steps in a row, more than the ring has slots, so the kernel must follow the device counters.
    for i in range(slots + 3):
        padded_bs = rng.randint(1, max_bs)
        real_bs = padded_bs if rng.random() < 0.3 else rng.randint(1, padded_bs)
        srcs = [random_source(s, real_bs * (tps if s[2] else 1), device) for s in specs]
        ring[i % slots, 0] = real_bs
        ring[i % slots, 1:] = torch.tensor([s.data_ptr() for s in srcs])
        stage_launch(ring, counters, meta, done, padded_bs, tps, word, grid)
        for spec, exp, src, fill in zip(specs, expected, srcs, fills):
            rows = padded_bs * (tps if spec[2] else 1)
            stage_reference(exp[:rows], src, fill)
        if device == "cuda":
            torch.cuda.synchronize()
        for k, (got, exp) in enumerate(zip(dsts, expected)):
            assert torch.equal(got, exp), f"step {i} input {k} {specs[k]} real_bs={real_bs} padded_bs={padded_bs}"
        # Every program advanced its own counter; program 0 published how many stagings finished before it.
        assert counters.tolist() == [i + 1] * counters.numel() and int(done[0]) == i


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_never_writes_past_the_padded_rows(device):
    """A ring row that claims more real rows than the graph's batch size (a corrupt row, or a row meant for a
    larger graph) still writes inside the graph's padded rows only: the buffer past them is untouched."""
    specs = [(torch.int64, (), True), (torch.int32, (), False)]
    dsts = [torch.full((32,), -7, dtype=torch.int64, device=device), torch.full((8,), -7, dtype=torch.int32, device=device)]
    fills = [torch.zeros(1, dtype=torch.int64, device=device), torch.ones(1, dtype=torch.int32, device=device)]
    ring, done, meta, word, grid, counters = kernel_setup(specs, dsts, fills, device, 2)
    srcs = [torch.arange(64, dtype=torch.int64, device=device), torch.arange(16, dtype=torch.int32, device=device)]
    ring[0, 0] = 16  # claims 16 sequences; the graph holds 2 (x 4 tokens per sequence)
    ring[0, 1:] = torch.tensor([s.data_ptr() for s in srcs])
    stage_launch(ring, counters, meta, done, 2, 4, word, grid)
    if device == "cuda":
        torch.cuda.synchronize()
    assert dsts[0][:8].tolist() == list(range(8)) and (dsts[0][8:] == -7).all()
    assert dsts[1][:2].tolist() == [0, 1] and (dsts[1][2:] == -7).all()


CUDA_MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y, where the kernel's chunks go


def test_the_launch_grid_stays_inside_cuda_limits_for_any_input_size():
    """Before: the grid's second dimension was ceil(max_words / 1024), so a large per-token float input beside
    a 1-byte input (words are bytes then) passed CUDA's 65,535 and the pool could not launch its staging."""
    hidden = 4096 * 8192 * 4  # bytes of 4,096 tokens of float32 hidden states of 8,192: 131,072 chunks of bytes
    for n_inputs, max_words in ((2, hidden), (7, 2**40), (1, 1), (3, STAGE_BLOCK * CUDA_MAX_GRID_Y + 1)):
        inputs, chunks = stage_grid(n_inputs, max_words)
        assert inputs == n_inputs and 1 <= chunks <= min(CUDA_MAX_GRID_Y, -(-max_words // STAGE_BLOCK))
    assert MAX_CHUNK_PROGRAMS <= CUDA_MAX_GRID_Y and stage_grid(2, hidden)[1] == MAX_CHUNK_PROGRAMS


@pytest.mark.parametrize("device", DEVICES)
def test_a_grid_with_fewer_programs_than_chunks_stages_every_chunk(device):
    """Past the grid's limit each program stages every ``grid[1]``-th chunk: staged with 2 chunk programs, an
    input of 5 chunks beside a 1-byte input equals the reference, its real rows and its padded tail."""
    specs = [(torch.float32, (640,), True), (torch.bool, (), False)]
    max_bs, tps = 4, 2
    dsts = [torch.full((max_bs * tps, 640), -7.0, device=device), torch.zeros(max_bs, dtype=torch.bool, device=device)]
    fills = [torch.full((1, 640), 0.5, device=device), torch.ones(1, dtype=torch.bool, device=device)]
    ring, done, meta, word, full_grid, _ = kernel_setup(specs, dsts, fills, device, 4)
    assert word == 1 and full_grid[1] == -(-max_bs * tps * 640 * 4 // STAGE_BLOCK)  # 20 chunks of bytes
    grid = (len(specs), 2)
    counters = torch.zeros(grid[0] * grid[1], dtype=torch.int64, device=device)
    expected = [d.clone() for d in dsts]
    for i, (real_bs, padded_bs) in enumerate(((3, 4), (1, 2), (4, 4))):
        srcs = [torch.randn(real_bs * tps, 640, device=device), torch.rand(real_bs, device=device) < 0.5]
        ring[i, 0] = real_bs
        ring[i, 1:] = torch.tensor([t.data_ptr() for t in srcs])
        stage_launch(ring, counters, meta, done, padded_bs, tps, word, grid)
        stage_reference(expected[0][:padded_bs * tps], srcs[0], fills[0])
        stage_reference(expected[1][:padded_bs], srcs[1], fills[1])
        if device == "cuda":
            torch.cuda.synchronize()
        for got, want in zip(dsts, expected):
            assert torch.equal(got, want), f"step {i}: real_bs={real_bs} padded_bs={padded_bs}"
        assert counters.tolist() == [i + 1] * counters.numel()
