"""Where the staging node's GPU time goes: the GPU cost of one extra graph node, by what it touches.

graphpool's staging kernel is the first node of every graph: it reads a device step counter, one ring row
from pinned host memory (PCIe), then the caller's inputs (device memory), writes the static buffers, and
publishes progress to pinned host memory. This probe captures the benchmark's default step (as
``bench/replay_latency.py`` does, on static buffers that already hold the step) behind one tiny Triton
kernel of each kind below and times the graphs back to back on the GPU (CUDA events around blocks of
replays, the host far ahead), so each kind's added GPU time per step is measured against the bare step:

  bare          the step's graph alone (the floor)
  empty         + a kernel that stores one word to device memory
  dev-read      + a kernel that reads a device word, then stores it to device memory
  host-read     + a kernel that reads a word of pinned host memory (over PCIe), stores it to device memory
  host-write    + a kernel that stores a word to pinned host memory
  chain         + device counter -> host ring slot -> device data -> store, and a host store: the staging
                  kernel's dependency chain (8 programs)
  chain-nowr    the same without the host store (progress published less often?)
  whole-ring    the same, reading all 64 ring slots beside the counter (no counter -> host dependency)
  br-empty      the bare step with a side branch (a stream forked at the graph's start, joined at its end)
                holding the ``empty`` kernel: what a branch itself costs
  br-host-read  the same branch holding the ``host-read`` kernel (a prefetch of the next ring row would)
  br-copy-4k    the same branch holding a 4 KiB host-to-device copy (the copy engine, no SM)

It needs CUDA and Triton. Usage: ``python bench/staging_probe.py [--iters 400]``; prints one table.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import graphpool as gp  # noqa: E402
from graphpool.bench import step as default_step  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _probe(counter_ptr, host_addr, data_ptr, sink_ptr, READ_DEVICE: tl.constexpr, READ_HOST: tl.constexpr,
           WRITE_HOST: tl.constexpr, CHAIN: tl.constexpr, WHOLE_RING: tl.constexpr, SLOTS: tl.constexpr):
    host = host_addr.to(tl.pointer_type(tl.int64))
    program = tl.program_id(0)
    value = tl.zeros((), tl.int64)
    if READ_DEVICE:
        value += tl.load(counter_ptr + program)
    if READ_HOST:
        value += tl.load(host)
    if CHAIN:
        step = tl.load(counter_ptr + program)
        tl.store(counter_ptr + program, step + 1)
        if WHOLE_RING:  # every slot's word read at once, beside the counter; the right one picked after
            slots = tl.arange(0, SLOTS)
            ring = tl.load(host + slots)
            offset = tl.sum(tl.where(slots == step % SLOTS, ring, 0))
        else:  # the counter first, then the slot it names: two dependent reads
            offset = tl.load(host + step % SLOTS)
        value += tl.load(data_ptr + (offset % 8))   # depends on the host row
    tl.store(sink_ptr + program, value)
    if WRITE_HOST:
        if program == 0:
            tl.store(host + SLOTS, value)


_OFF = dict(READ_DEVICE=False, READ_HOST=False, WRITE_HOST=False, CHAIN=False, WHOLE_RING=False)
KINDS = {  # name: (probe kernel flags, programs, where it runs: before the step, or a side branch of it)
    "bare": None,
    "empty": ({**_OFF}, 1, "serial"),
    "dev-read": ({**_OFF, "READ_DEVICE": True}, 1, "serial"),
    "host-read": ({**_OFF, "READ_HOST": True}, 1, "serial"),
    "host-write": ({**_OFF, "WRITE_HOST": True}, 1, "serial"),
    "chain": ({**_OFF, "CHAIN": True, "WRITE_HOST": True}, 8, "serial"),
    "chain-nowr": ({**_OFF, "CHAIN": True}, 8, "serial"),
    "whole-ring": ({**_OFF, "CHAIN": True, "WHOLE_RING": True, "WRITE_HOST": True}, 8, "serial"),
    "br-empty": ({**_OFF}, 1, "branch"),
    "br-host-read": ({**_OFF, "READ_HOST": True}, 1, "branch"),
    "br-copy-4k": (None, 0, "branch"),  # no probe kernel: a host-to-device copy
}
SLOTS = 64


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=400, help="replays per kind (blocks of 20, kinds take turns)")
    p.add_argument("--keys", default="decode:1:8,verify:16:8,verify:16:32", help="mode:tokens_per_seq:bs list")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("staging_probe: needs a CUDA device (it times graph nodes on the GPU)")
        return 2
    device = torch.device("cuda")
    keys = [(gp.Mode(n, int(t)), int(b)) for n, t, b in (k.split(":") for k in args.keys.split(","))]
    step = default_step.make(device, max(m.tokens_per_seq * b for m, b in keys))
    counter = torch.zeros(8, dtype=torch.int64, device=device)
    host = torch.zeros(SLOTS + 1, dtype=torch.int64, pin_memory=True)
    data = torch.arange(8, dtype=torch.int64, device=device)
    sink = torch.zeros(8, dtype=torch.int64, device=device)
    host4k, dev4k = torch.zeros(512, dtype=torch.int64, pin_memory=True), torch.zeros(512, dtype=torch.int64, device=device)
    branch = torch.cuda.Stream()
    rows = []
    for mode, bs in keys:
        inputs = step.sample(mode, bs)
        batch = gp.StepBatch(mode, bs, bs * mode.tokens_per_seq, inputs)
        graphs = {}
        for name, kind in KINDS.items():
            def body(kind=kind) -> None:
                if kind is None:
                    step.step_fn(batch)
                    return
                flags, programs, where = kind

                def node() -> None:
                    if flags is None:
                        dev4k.copy_(host4k, non_blocking=True)
                    else:
                        _probe[(programs,)](counter, host.data_ptr(), data, sink, SLOTS=SLOTS, **flags)
                if where == "serial":
                    node()
                    step.step_fn(batch)
                    return
                main = torch.cuda.current_stream()
                branch.wait_stream(main)
                with torch.cuda.stream(branch):
                    node()
                step.step_fn(batch)
                main.wait_stream(branch)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                body()  # compile and warm up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            graphs[name] = graph
        times = {name: [] for name in graphs}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        block = 20
        for _ in range(max(1, args.iters // block)):
            for kind, graph in graphs.items():
                torch.cuda.synchronize()
                start.record()
                for _ in range(block):
                    graph.replay()
                end.record()
                end.synchronize()
                times[kind].append(start.elapsed_time(end) * 1e3 / block)
        med = {kind: statistics.median(v) for kind, v in times.items()}
        rows.append((mode.name, bs, med))
    kinds = list(KINDS)
    print("GPU us per step, graphs replayed back to back (median of blocks of 20); +x = added over bare")
    print(f"{'mode':8} {'bs':>3} {'bare':>8} " + " ".join(f"{k:>12}" for k in kinds[1:]))
    for name, bs, med in rows:
        print(f"{name:8} {bs:3d} {med['bare']:8.1f} " + " ".join(f"{'+%.2f' % (med[k] - med['bare']):>12}" for k in kinds[1:]))
    print("bare: the step's graph alone. empty: + a kernel node storing one device word. dev-read: + one dependent "
          "device read. host-read: + one read of pinned host memory. host-write: + one store to pinned host memory. "
          "chain: 8 programs, each device counter -> host ring slot -> device data -> store, program 0 a host store "
          "(the staging kernel's chain). chain-nowr: without the host store. whole-ring: every ring slot read beside "
          "the counter (no counter -> host dependency). br-*: the bare step with a side branch (forked at the "
          "graph's start, joined at its end) holding an empty kernel, a host read, or a 4 KiB host-to-device copy.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
