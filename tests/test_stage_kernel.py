"""The one-launch staging kernel and the ring-row prefetch against their plain-torch reference.

On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1); on the H200 they run
for real (`-m gpu`), reading the ring table and commits from pinned host memory. The host side here is
written out by hand (tagged words, commits), as ``graphpool.staging`` does it, so each rule of the ring
format is tested where the kernel reads it.
"""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
from graphpool.kernels.ring import TAG_SHIFT, commit_word  # noqa: E402
from graphpool.kernels.stage import prefetch_launch, stage_grid, stage_launch, stage_reference  # noqa: E402

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


class Ring:
    """A ring as graphpool's host side keeps it, plus the kernels' device state."""

    def __init__(self, specs, dsts, fills, device, slots):
        pinned = device == "cuda"
        self.device, self.slots = device, slots
        self.word = min(8, *(d.element_size() for d in dsts))
        self.table = torch.zeros(slots, 1 + len(specs), dtype=torch.int64, pin_memory=pinned)
        self.commits = torch.zeros(slots, dtype=torch.int64, pin_memory=pinned)
        self.done = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)
        self.mirror = torch.full((2 + len(specs),), -1, dtype=torch.int64, device=device)
        self.meta = torch.tensor([[d.data_ptr(), f.data_ptr(), d[0].numel() * d.element_size() // self.word, int(p)]
                                  for d, f, (_, _, p) in zip(dsts, fills, specs)], dtype=torch.int64, device=device)
        self.grid = stage_grid(len(specs), max(d.numel() * d.element_size() // self.word for d in dsts))
        self.counters = torch.zeros(self.grid[0] * self.grid[1], dtype=torch.int64, device=device)

    def write(self, step: int, real_bs: int, srcs, generation: int) -> None:
        tag = generation << TAG_SHIFT
        self.table[step % self.slots] = torch.tensor([real_bs | tag] + [s.data_ptr() | tag for s in srcs])

    def commit(self, step: int, generation: int) -> None:
        self.commits[step % self.slots] = commit_word(step, generation)

    def stage(self, padded_bs: int, tps: int) -> None:
        stage_launch(self.table, self.mirror, self.counters, self.meta, padded_bs, tps, self.word, self.grid)

    def prefetch(self) -> None:
        prefetch_launch(self.table, self.commits, self.mirror, self.counters, self.done)

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(12))
def test_kernels_equal_reference_with_and_without_the_prefetched_row(device, seed):
    """Steps in a row, more than the ring has slots. Before each step's prefetch the host has written and
    committed the next row (the prefetch must take it), or not yet, or only an abandoned write of it, or
    committed a generation whose words have not all landed (it must refuse those). Either way every
    step stages exactly its own inputs."""
    rng = random.Random(seed)
    specs, max_bs, tps, dsts, fills = random_case(rng, device)
    ring = Ring(specs, dsts, fills, device, slots=4)
    expected = [d.clone() for d in dsts]
    generation, ready, keep = 0, False, []

    def new_step():
        padded_bs = rng.randint(1, max_bs)
        real_bs = padded_bs if rng.random() < 0.3 else rng.randint(1, padded_bs)
        return padded_bs, real_bs, [random_source(s, real_bs * (tps if s[2] else 1), device) for s in specs]

    step = new_step()
    for i in range(ring.slots + 8):
        padded_bs, real_bs, srcs = step
        if not ready:  # the host writes this step's row only now (it was not ahead)
            generation += 1
            ring.write(i, real_bs, srcs, generation)
            ring.commit(i, generation)
        ring.stage(padded_bs, tps)
        following, case = new_step(), rng.choice(["ahead", "late", "abandoned", "torn"])
        keep.append(following)
        if case == "ahead":  # the next row written and committed before the prefetch reads it
            generation += 1
            ring.write(i + 1, following[1], following[2], generation)
            ring.commit(i + 1, generation)
        elif case in ("abandoned", "torn"):  # an earlier write of the next row, never committed ...
            decoys = [random_source(s, following[1] * (tps if s[2] else 1), device) for s in specs]
            keep.append(decoys)
            generation += 1
            ring.write(i + 1, following[1], decoys, generation)
            if case == "torn":  # ... or a commit whose generation the row's words do not carry yet
                ring.commit(i + 1, generation + 1)
        ring.prefetch()
        ring.sync()
        assert int(ring.mirror[0]) == (i + 1 if case == "ahead" else -1), case
        assert ring.counters.tolist() == [i + 1] * ring.counters.numel() and int(ring.done[0]) == i + 1
        ready = case == "ahead"
        for spec, exp, src, fill in zip(specs, expected, srcs, fills):
            stage_reference(exp[:padded_bs * (tps if spec[2] else 1)], src, fill)
        for k, (got, exp) in enumerate(zip(dsts, expected)):
            assert torch.equal(got, exp), f"step {i} input {k} {specs[k]} real_bs={real_bs} padded_bs={padded_bs}"
        step = following


@pytest.mark.parametrize("device", DEVICES)
def test_staging_reads_the_mirror_when_it_holds_the_step(device):
    """Once the prefetch took step 1's row, the staging kernel reads it from the mirror: a host row
    rewritten afterwards (decoy sources, same generation) is not read."""
    specs = [(torch.int64, (), True), (torch.float32, (3,), False)]
    dsts = [torch.full((8,), -7, dtype=torch.int64, device=device), torch.full((2, 3), -7.0, device=device)]
    fills = [torch.zeros(1, dtype=torch.int64, device=device), torch.ones(1, 3, device=device)]
    ring = Ring(specs, dsts, fills, device, slots=2)
    first = [torch.arange(4, device=device), torch.zeros(1, 3, device=device)]
    real = [torch.arange(100, 104, device=device), torch.full((1, 3), 5.0, device=device)]
    decoy = [torch.arange(900, 904, device=device), torch.full((1, 3), 9.0, device=device)]
    ring.write(0, 1, first, 1)
    ring.commit(0, 1)
    ring.stage(1, 4)
    ring.write(1, 1, real, 2)
    ring.commit(1, 2)
    ring.prefetch()
    ring.sync()
    assert int(ring.mirror[0]) == 1
    ring.write(1, 1, decoy, 2)  # only a kernel that ignored the mirror would read these
    ring.stage(2, 4)
    ring.sync()
    assert dsts[0].tolist() == [100, 101, 102, 103, 0, 0, 0, 0]
    assert dsts[1].tolist() == [[5.0] * 3, [1.0] * 3]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["stale commit", "one word torn", "generation 0"])
def test_prefetch_refuses_rows_that_are_not_final(device, case):
    """The mirror stays empty (the staging kernel then reads the host row) for a commit of the slot's
    previous step, a row with one word of another generation, and a row never written (generation 0)."""
    specs = [(torch.int64, (), False), (torch.int64, (), False)]
    dsts = [torch.full((4,), -7, dtype=torch.int64, device=device) for _ in specs]
    fills = [torch.zeros(1, dtype=torch.int64, device=device) for _ in specs]
    ring = Ring(specs, dsts, fills, device, slots=2)
    src = [torch.arange(4, device=device), torch.arange(4, device=device)]
    ring.write(0, 4, src, 1)
    ring.commit(0, 1)
    ring.stage(4, 1)
    if case == "stale commit":  # slot 1 holds step -1's commit (same slot, two steps earlier)
        ring.write(1, 4, src, 2)
        ring.commit(-1, 2)
    elif case == "one word torn":
        ring.write(1, 4, src, 2)
        ring.table[1, 2] = src[1].data_ptr() | (3 << TAG_SHIFT)
        ring.commit(1, 2)
    else:
        ring.table[1] = torch.tensor([4] + [s.data_ptr() for s in src])
        ring.commit(1, 0)
    ring.prefetch()
    ring.sync()
    assert int(ring.mirror[0]) == -1


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_never_writes_past_the_padded_rows(device):
    """A ring row that claims more real rows than the graph's batch size (a corrupt row, or a row meant for a
    larger graph) still writes inside the graph's padded rows only: the buffer past them is untouched."""
    specs = [(torch.int64, (), True), (torch.int32, (), False)]
    dsts = [torch.full((32,), -7, dtype=torch.int64, device=device), torch.full((8,), -7, dtype=torch.int32, device=device)]
    fills = [torch.zeros(1, dtype=torch.int64, device=device), torch.ones(1, dtype=torch.int32, device=device)]
    ring = Ring(specs, dsts, fills, device, slots=2)
    srcs = [torch.arange(64, dtype=torch.int64, device=device), torch.arange(16, dtype=torch.int32, device=device)]
    ring.write(0, 16, srcs, 1)  # claims 16 sequences; the graph holds 2 (x 4 tokens per sequence)
    ring.stage(2, 4)
    ring.sync()
    assert dsts[0][:8].tolist() == list(range(8)) and (dsts[0][8:] == -7).all()
    assert dsts[1][:2].tolist() == [0, 1] and (dsts[1][2:] == -7).all()
