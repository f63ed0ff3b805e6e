"""Probe: a step's row delivered in the staging kernel's launch parameters instead of a pinned ring (issue 14).

Today's staging kernel reads its row ``[real_bs, src_ptr...]`` from pinned host memory over PCIe, after a
device counter names the slot: two dependent reads, ~3 us of the step's GPU time. A CUDA graph's kernel
node can instead be given new arguments before each launch (``cuGraphExecKernelNodeSetParams``: "already
enqueued launches are not affected"), so the row can travel with the launch, as kernel arguments.

This probe answers, on the GPU: (1) is a parameter update per launch correct while the host runs far ahead
of the GPU (every launch stages its own row), (2) what it costs the host per step, (3) what the staging
node then costs the GPU over the bare step (graphpool.bench's default step, as bench/replay_latency.py).

    python bench/param_probe.py

Run AJ in bench/RESULTS_HISTORY.md: correct (every queued launch staged its own row); one node costs 2.3-5.0 us over
the bare step against the ring's 4.9-7.7 us in the same run (the update itself 0.6-1.9 us of it), still
above issue 14's 2 us, so graphpool keeps the ring for now.
"""
from __future__ import annotations

import ctypes
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import graphpool as gp  # noqa: E402
from graphpool.bench import step as default_step  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MAX_INPUTS = 8


class KernelNodeParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h, CUDA 12+)
    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.POINTER(ctypes.c_void_p)), ("extra", ctypes.POINTER(ctypes.c_void_p)),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


try:  # the CUDA driver; main() says so and stops where there is none
    cu = ctypes.CDLL("libcuda.so.1")
except OSError:
    cu = None


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: CUresult {rc}")


def kernel_nodes(graph_handle: int) -> list[tuple[int, KernelNodeParams]]:
    n = ctypes.c_size_t(0)
    check(cu.cuGraphGetNodes(ctypes.c_void_p(graph_handle), None, ctypes.byref(n)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * n.value)()
    check(cu.cuGraphGetNodes(ctypes.c_void_p(graph_handle), nodes, ctypes.byref(n)), "cuGraphGetNodes")
    out = []
    for node in nodes:
        kind = ctypes.c_int(-1)
        check(cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == 0:  # CU_GRAPH_NODE_TYPE_KERNEL
            p = KernelNodeParams()
            check(cu.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(p)), "GetParams")
            out.append((node, p))
    return out


def param_layout(func: int) -> list[tuple[int, int]]:
    out, i = [], 0
    while True:
        off, size = ctypes.c_size_t(), ctypes.c_size_t()
        if cu.cuFuncGetParamInfo(ctypes.c_void_p(func), ctypes.c_size_t(i), ctypes.byref(off), ctypes.byref(size)):
            return out
        out.append((off.value, size.value))
        i += 1


@triton.jit
def _pick(which, v0, v1, v2, v3, v4, v5, v6, v7):
    """Argument ``which`` of eight: a program's own input, chosen among scalar arguments."""
    return tl.where(which == 0, v0, tl.where(which == 1, v1, tl.where(which == 2, v2, tl.where(
        which == 3, v3, tl.where(which == 4, v4, tl.where(which == 5, v5, tl.where(which == 6, v6, v7)))))))


# The copy is graphpool's staging kernel's (kernels/stage.py, `_stage_kernel`) with the row taken from the
# arguments instead of the pinned ring. It is a copy on purpose: the core kernel stays as the H200 runs
# validated it until this design is adopted (then both would share one Triton helper).
@triton.jit
def _copy_rows(src, dst, fill, row_words, rows_per_seq, real_bs, padded_bs, block, BLOCK: tl.constexpr):
    """This program's ``BLOCK`` words of one input: its real rows from ``src``, the fill row past them."""
    real_words = real_bs * rows_per_seq * row_words
    total_words = padded_bs * rows_per_seq * row_words
    offs = block.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < total_words
    real = offs < real_words
    from_src = tl.load(src + offs, mask=inside & real, other=0)
    from_fill = tl.load(fill + offs % row_words, mask=inside & (offs >= real_words), other=0)
    tl.store(dst + offs, tl.where(real, from_src, from_fill), mask=inside)


@triton.jit(do_not_specialize=["real_bs", "s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7", "step", "done_addr"])
def _param_stage_kernel(real_bs: tl.int64, s0: tl.int64, s1: tl.int64, s2: tl.int64, s3: tl.int64, s4: tl.int64,
                        s5: tl.int64, s6: tl.int64, s7: tl.int64, step: tl.int64, done_addr: tl.int64, meta_ptr,
                        padded_bs, tokens_per_seq, WORD: tl.constexpr, BLOCK: tl.constexpr):
    which = tl.program_id(0)
    block = tl.program_id(1)
    if which + block == 0:
        tl.store(done_addr.to(tl.pointer_type(tl.int64)), step)
    src_addr = _pick(which, s0, s1, s2, s3, s4, s5, s6, s7)
    meta = meta_ptr + which * 4
    dst_addr = tl.load(meta)
    fill_addr = tl.load(meta + 1)
    row_words = tl.load(meta + 2)
    rows_per_seq = tl.where(tl.load(meta + 3) != 0, tokens_per_seq, 1)
    if WORD == 4:
        kind = tl.pointer_type(tl.int32)
    else:
        kind = tl.pointer_type(tl.int64)
    _copy_rows(src_addr.to(kind), dst_addr.to(kind), fill_addr.to(kind), row_words, rows_per_seq, real_bs,
               padded_bs, block, BLOCK)


_ARGS = [f"{c}{i}" for c in "sdfwp" for i in range(MAX_INPUTS)]


# Every input's metadata as arguments too (no device read before the source's), and `done` published only
# with PUBLISH: what the node costs once nothing but the source and fill rows is read from memory.
@triton.jit(do_not_specialize=["real_bs", "step", "done_addr", *_ARGS])
def _args_stage_kernel(real_bs: tl.int64, step: tl.int64, done_addr: tl.int64,
                       s0: tl.int64, s1: tl.int64, s2: tl.int64, s3: tl.int64, s4: tl.int64, s5: tl.int64,
                       s6: tl.int64, s7: tl.int64, d0: tl.int64, d1: tl.int64, d2: tl.int64, d3: tl.int64,
                       d4: tl.int64, d5: tl.int64, d6: tl.int64, d7: tl.int64, f0: tl.int64, f1: tl.int64,
                       f2: tl.int64, f3: tl.int64, f4: tl.int64, f5: tl.int64, f6: tl.int64, f7: tl.int64,
                       w0: tl.int64, w1: tl.int64, w2: tl.int64, w3: tl.int64, w4: tl.int64, w5: tl.int64,
                       w6: tl.int64, w7: tl.int64, p0: tl.int64, p1: tl.int64, p2: tl.int64, p3: tl.int64,
                       p4: tl.int64, p5: tl.int64, p6: tl.int64, p7: tl.int64, padded_bs, tokens_per_seq,
                       PUBLISH: tl.constexpr, BLOCK: tl.constexpr):
    which = tl.program_id(0)
    block = tl.program_id(1)
    if PUBLISH:
        if which + block == 0:
            tl.store(done_addr.to(tl.pointer_type(tl.int64)), step)
    kind = tl.pointer_type(tl.int32)
    rows_per_seq = tl.where(_pick(which, p0, p1, p2, p3, p4, p5, p6, p7) != 0, tokens_per_seq, 1)
    src = _pick(which, s0, s1, s2, s3, s4, s5, s6, s7).to(kind)
    dst = _pick(which, d0, d1, d2, d3, d4, d5, d6, d7).to(kind)
    fill = _pick(which, f0, f1, f2, f3, f4, f5, f6, f7).to(kind)
    _copy_rows(src, dst, fill, _pick(which, w0, w1, w2, w3, w4, w5, w6, w7), rows_per_seq, real_bs, padded_bs, block,
               BLOCK)


@triton.jit
def _empty_kernel(x_ptr, N):
    pass


class ParamNode:
    """One staging node of one instantiated graph, and a parameter buffer laid out as its arguments."""

    def __init__(self, graph: torch.cuda.CUDAGraph, node: int, params: KernelNodeParams):
        self.node, self.params = node, params
        func = params.func
        if not params.kernelParams:
            raise RuntimeError("the captured node holds no kernelParams array")
        layout = param_layout(func)
        self.values = [(ctypes.c_char * size)() for _, size in layout]
        for i, (_, size) in enumerate(layout):  # copy the captured arguments
            ctypes.memmove(self.values[i], self.params.kernelParams[i], size)
        self.pointers = (ctypes.c_void_p * len(layout))(*[ctypes.addressof(v) for v in self.values])
        self.params.kernelParams = ctypes.cast(self.pointers, ctypes.POINTER(ctypes.c_void_p))
        self.params.extra = None
        self.exec = ctypes.c_void_p(graph.raw_cuda_graph_exec())
        self.node_p = ctypes.c_void_p(self.node)
        self.params_ref = ctypes.byref(self.params)
        self.sizes = [s for _, s in layout]
        self.set = cu.cuGraphExecKernelNodeSetParams_v2

    def write(self, index: int, value: int) -> None:
        ctypes.c_int64.from_buffer(self.values[index]).value = value

    def update(self) -> None:
        rc = self.set(self.exec, self.node_p, self.params_ref)
        if rc:
            raise RuntimeError(f"cuGraphExecKernelNodeSetParams: {rc}")


def main() -> int:
    if cu is None or not torch.cuda.is_available():
        print("param_probe: needs a CUDA GPU and its driver (it rewrites graph nodes on the GPU); nothing to do here")
        return 2
    dev = torch.device("cuda")
    torch.cuda.init()
    done = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    lines = []

    # ---- 1. correctness with the host far ahead: 300 launches queued behind a 50 ms spin
    n = 256
    static = torch.zeros(n, dtype=torch.int64, device=dev)
    fill = torch.zeros(1, dtype=torch.int64, device=dev)
    meta = torch.tensor([[static.data_ptr(), fill.data_ptr(), 1, 0]] + [[0, 0, 1, 0]] * 7, dtype=torch.int64, device=dev)
    results = torch.zeros(400, n, dtype=torch.int64, device=dev)
    sources = [torch.arange(n, device=dev) * 1000 + i for i in range(400)]
    index = torch.zeros(1, dtype=torch.int64, device=dev)

    def body(src: torch.Tensor, step: int) -> None:
        k = _param_stage_kernel[(1, 1)](n, src.data_ptr(), 0, 0, 0, 0, 0, 0, 0, step, done.data_ptr(), meta, n, 1,
                                        WORD=8, BLOCK=256)
        index.copy_(static[:1] % 1000)
        results.index_copy_(0, index, static[None])
        return k

    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        compiled = body(sources[0], 0)
    torch.cuda.synchronize()
    func = compiled.function
    print("param layout", param_layout(func), flush=True)
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        body(sources[0], 0)
    g.instantiate()
    found = [(nd, p) for nd, p in kernel_nodes(g.raw_cuda_graph()) if p.func == func]
    assert len(found) == 1, f"{len(found)} staging nodes"
    node = ParamNode(g, *found[0])
    results.zero_()
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # ~50 ms of GPU spin: every launch below queues behind it
    t = time.perf_counter()
    for i in range(1, 300):
        node.write(1, sources[i].data_ptr())
        node.write(9, i)
        node.update()
        g.replay()
    host_us = (time.perf_counter() - t) / 299 * 1e6
    queued = done[0].item()
    torch.cuda.synchronize()
    ok = all(torch.equal(results[i], sources[i]) for i in range(1, 300))
    lines.append(f"correct with 299 launches queued behind a spin: {ok} (done when queued: {queued}, after: "
                 f"{done[0].item()}); host us per update+replay while queued: {host_us:.2f}")

    # host cost: replay alone vs update + replay, and update alone (GPU busy, host ahead)
    def per_call(fn, k=400) -> float:
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        t = time.perf_counter()
        for _ in range(k):
            fn()
        us = (time.perf_counter() - t) / k * 1e6
        torch.cuda.synchronize()
        return us

    def upd_replay():
        node.write(1, sources[5].data_ptr())
        node.update()
        g.replay()

    for _ in range(2):
        rep, both, upd = per_call(g.replay), per_call(upd_replay), per_call(node.update)
    lines.append(f"host us per call (GPU busy): replay {rep:.2f}, write+update+replay {both:.2f}, update alone {upd:.2f}")

    # ---- 2. GPU cost over the bare default step: bare, ring (graphpool), params (6 inputs)
    keys = [(gp.Mode("decode", 1), 1), (gp.Mode("decode", 1), 8), (gp.Mode("decode", 1), 64),
            (gp.Mode("verify", 16), 1), (gp.Mode("verify", 16), 8), (gp.Mode("verify", 16), 32),
            (gp.Mode("verify", 16), 64)]
    step = default_step.make(dev, 64 * 16)
    modes = [gp.Mode("decode", 1), gp.Mode("verify", 16)]
    ring_pool = gp.GraphPool(modes, step.inputs, [1, 8, 32, 64], device=dev)
    ring_pool.capture(step.step_fn, outputs=step.outputs)
    floor_pool = gp.GraphPool(modes, step.inputs, [1, 8, 32, 64], device=dev, staging="torch")
    floor_pool.capture(step.step_fn, outputs=step.outputs)
    rows = []
    for mode, bs in keys:
        inputs = step.sample(mode, bs)
        floor_pool.run(mode.name, **inputs)
        bare = floor_pool.graph(mode.name, bs)
        views = floor_pool.static_inputs
        # the param graph: the param kernel staging the 6 inputs into the floor pool's views, then the step
        specs = step.inputs
        vs = {sp.name: views[sp.name] for sp in specs}
        fills = {sp.name: torch.full((1,), sp.fill, dtype=sp.dtype, device=dev) for sp in specs}
        batch = gp.StepBatch(mode, bs, bs * mode.tokens_per_seq,
                             {sp.name: vs[sp.name][:bs * (mode.tokens_per_seq if sp.per == "token" else 1)] for sp in specs})
        # one staging node for all six inputs, as graphpool's: 4-byte words (an int64 element is two)
        size = {sp.name: torch.tensor([], dtype=sp.dtype).element_size() for sp in specs}
        m = torch.tensor([[vs[sp.name].data_ptr(), fills[sp.name].data_ptr(), size[sp.name] // 4,
                           1 if sp.per == "token" else 0] for sp in specs] + [[0, 0, 1, 0]] * (8 - len(specs)),
                         dtype=torch.int64, device=dev)
        srcs = [inputs[sp.name].data_ptr() for sp in specs] + [0] * (8 - len(specs))
        launches = [(len(specs), m, srcs, 4)]

        def pbody():
            ks = []
            for cnt, m, srcs, word in launches:
                ks.append(_param_stage_kernel[(cnt, 2)](bs, *srcs, 0, done.data_ptr(), m, bs, mode.tokens_per_seq,
                                                        WORD=word, BLOCK=1024))
            step.step_fn(batch)
            return ks
        with torch.cuda.stream(s):
            pbody()
        torch.cuda.synchronize()
        pg = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(pg, pool=floor_pool.memory_pool):
            ks = pbody()
        pg.instantiate()
        funcs = {k.function for k in ks}
        nodes_all = [ParamNode(pg, nd, p) for nd, p in kernel_nodes(pg.raw_cuda_graph()) if p.func in funcs]
        counter = [0]

        def param_step():
            counter[0] += 1
            for pn in nodes_all:
                pn.write(9, counter[0])
                pn.update()
            pg.replay()

        def ring_step():
            ring_pool.run(mode.name, **inputs)

        # The same with every input's metadata in the arguments, with and without publishing `done`; and an
        # empty kernel node before the bare step (what one extra serial node costs at all).
        words = {sp.name: size[sp.name] // 4 for sp in specs}
        pad = [0] * (MAX_INPUTS - len(specs))
        arg_meta = ([vs[sp.name].data_ptr() for sp in specs] + pad + [fills[sp.name].data_ptr() for sp in specs] + pad
                    + [words[sp.name] for sp in specs] + [1] * len(pad)
                    + [1 if sp.per == "token" else 0 for sp in specs] + pad)

        def args_graph(publish: bool):
            def body():
                k = _args_stage_kernel[(len(specs), 2)](bs, 0, done.data_ptr(), *srcs, *arg_meta, bs,
                                                        mode.tokens_per_seq, PUBLISH=publish, BLOCK=1024)
                step.step_fn(batch)
                return k
            with torch.cuda.stream(s):
                body()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graph, pool=floor_pool.memory_pool):
                k = body()
            graph.instantiate()
            found = [ParamNode(graph, nd, p) for nd, p in kernel_nodes(graph.raw_cuda_graph()) if p.func == k.function]
            assert len(found) == 1
            return graph, found[0]

        def args_step(graph, pn):
            count = [0]

            def fn():
                count[0] += 1
                pn.write(0, bs)
                pn.write(1, count[0])
                for i, sp in enumerate(specs):
                    pn.write(3 + i, inputs[sp.name].data_ptr())
                pn.update()
                graph.replay()
            return fn

        ag_pub, an_pub = args_graph(True)
        ag, an = args_graph(False)

        def empty_body():
            _empty_kernel[(1,)](fill_dummy, 1)
            step.step_fn(batch)
        fill_dummy = torch.zeros(1, device=dev)
        with torch.cuda.stream(s):
            empty_body()
        torch.cuda.synchronize()
        eg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(eg, pool=floor_pool.memory_pool):
            empty_body()

        # check: the param graph stages the same as the floor's torch staging
        for v in vs.values():
            v.zero_()
        param_step()
        torch.cuda.synchronize()
        ok_stage = all(torch.equal(vs[sp.name][:len(inputs[sp.name])], inputs[sp.name]) for sp in specs)
        for v in vs.values():
            v.zero_()
        args_step(ag, an)()
        torch.cuda.synchronize()
        ok_stage = ok_stage and all(torch.equal(vs[sp.name][:len(inputs[sp.name])], inputs[sp.name]) for sp in specs)
        fns = {"bare": bare.replay, "ring": ring_step, "param": param_step, "param-fixed": pg.replay,
               "args": args_step(ag_pub, an_pub), "args-nodone": args_step(ag, an), "args-nodone-fixed": ag.replay,
               "empty-node": eg.replay}
        times = {k: [] for k in fns}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(3):
            for fn in fns.values():
                fn()
        for _ in range(30):
            for name, fn in fns.items():
                torch.cuda.synchronize()
                start.record()
                for _ in range(20):
                    fn()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) * 1e3 / 20)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append((mode.name, bs, med, ok_stage, len(nodes_all)))
    print("\n".join(lines))
    print("GPU us per step, back to back (median of 30 blocks of 20); +x over bare")
    cols = ["ring", "param", "param-fixed", "args", "args-nodone", "args-nodone-fixed", "empty-node"]
    print(f"{'mode':8} {'bs':>3} {'bare':>7} " + " ".join(f"{c:>8}" for c in cols) + " staged-ok")
    for name, bs, med, ok_stage, nn in rows:
        b = med["bare"]
        print(f"{name:8} {bs:3d} {b:7.1f} " + " ".join(f"{med[c] - b:+8.2f}" for c in cols) + f" {ok_stage}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
