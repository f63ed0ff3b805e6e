"""Probe: what a CUDA graph launch costs the host, by the kind of node in the graph (issue 11).

The profile of the speculative step showed ``cudaGraphLaunch`` taking 180-450 us of host time for a graph of
~190 kernels, more with the Triton GEMV in the models than without. This times the host side of
``replay()`` (the GPU idle before each launch, and with the GPU busy), unprofiled, for graphs of N nodes of
one kind each, and for the engine's decode and verify graphs with the GEMV on and off.

    python bench/launch_probe.py [--nodes 188] [--engine]

Run AK in bench/RESULTS_HISTORY.md: unprofiled, the engine's graphs cost the host 8-10 us per replay with the GEMV on
or off; the profile's 180-460 us per ``cudaGraphLaunch`` is the profiler's own.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _tiny(x_ptr, N):
    i = tl.program_id(0)
    if i == 0:
        tl.store(x_ptr, tl.load(x_ptr) + 1)


def host_us(replay, reps: int = 60, busy: bool = False) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(2_000_000)
        t = time.perf_counter()
        replay()
        times.append((time.perf_counter() - t) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times[5:])


def capture(body) -> torch.cuda.CUDAGraph:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nodes", type=int, default=188)
    p.add_argument("--engine", action="store_true", help="also the engine's graphs, GEMV on and off")
    p.add_argument("--gemv-state", action="store_true",
                   help="the GEMV-off engine's graphs timed before and after GEMV launches, graphs and a GEMV-on "
                        "engine in the same process (run AK)")
    p.add_argument("--no-synthetic", action="store_true", help="skip the graphs of one node kind")
    p.add_argument("--flip-engine", default=None, choices=sorted(ENGINE_FLIPS),
                   help="the GEMV-off engine's graphs timed before and after one thing of this kind (one process each)")
    p.add_argument("--flip", default=None, help="time a graph before and after capturing one kernel of this kind "
                                                "(none, gemv, gemv-4warps, gemv-16-outputs, gemv-2-stages, tiny-32000, "
                                                "tiny-8warps)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("launch_probe: needs a CUDA GPU (it times graph launches); nothing to do here")
        return 2
    dev = torch.device("cuda")
    n = args.nodes
    x = torch.zeros(1024, device=dev)
    a, b = torch.randn(16, 4096, device=dev, dtype=torch.bfloat16), torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    big = torch.zeros(1, device=dev)
    kinds = {
        "torch add": lambda: [x.add_(1) for _ in range(n)],
        "triton 1 program": lambda: [_tiny[(1,)](x, 1) for _ in range(n)],
        "triton 32000 programs": lambda: [_tiny[(32000,)](big, 1) for _ in range(n)],
        "cublas 16x4096x4096": lambda: [a @ b for _ in range(n // 2)],
    }
    if not args.no_synthetic:
        print(f"host us per replay() (median), graphs of {n} nodes of one kind", flush=True)
    for name, body in ({} if args.no_synthetic else kinds).items():
        g = capture(body)
        print(f"  {name:24} idle {host_us(g.replay):8.1f}   gpu busy {host_us(g.replay, busy=True):8.1f}", flush=True)
        del g
    if args.engine:
        from bench.engine import gemv
        from bench.engine.config import ModelConfig, SpecConfig
        from bench.engine.harness import build
        for on in (True, False):
            gemv.use_gemv(on)
            engine, pool = build(ModelConfig.medium(), SpecConfig(), [1], 32, 112, "cuda", torch.bfloat16,
                                 attention="flashinfer", kernels="fused")
            for mode in ("decode", "verify"):
                g = pool.graph(mode, 1)
                print(f"  engine {mode:7} gemv {'on ' if on else 'off'}   idle {host_us(g.replay):8.1f}   gpu busy "
                      f"{host_us(g.replay, busy=True):8.1f}", flush=True)
            del engine, pool
            torch.cuda.empty_cache()
    if args.gemv_state:
        gemv_state()
    if args.flip:
        flip(args.flip)
    if args.flip_engine:
        flip_engine(args.flip_engine)
    return 0


def flip(kind: str) -> None:
    """A graph of small kernels (Triton, torch, cuBLAS) timed before and after a graph holding one ``kind`` kernel
    was captured and replayed in this process (run once per process: the effect, where there is one, stays)."""
    from bench.engine import gemv
    dev = torch.device("cuda")
    x = torch.zeros(1, device=dev)
    a, b = torch.randn(16, 1024, device=dev, dtype=torch.bfloat16), torch.randn(1024, 1024, device=dev, dtype=torch.bfloat16)
    victim = capture(lambda: [(_tiny[(1,)](x, 1), x.add_(1), a @ b) for _ in range(60)])
    before = graph_gpu_us(victim.replay, 60)
    v = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    w16 = torch.randn(16, 4096, device=dev, dtype=torch.bfloat16)
    kinds = {
        "none": lambda: x.add_(1),
        "gemv": lambda: gemv.gemv(v, w),
        "gemv-4warps": lambda: gemv.gemv(v, w, config=(1, 2048, 4, 1)),
        "gemv-16-outputs": lambda: gemv.gemv(v, w16),
        "gemv-2-stages": lambda: gemv.gemv(v, w, config=(1, 2048, 8, 2)),
        "tiny-32000": lambda: _tiny[(32000,)](x, 1),
        "tiny-8warps": lambda: _tiny[(1,)](x, 1, num_warps=8),
    }
    g = capture(kinds[kind])
    g.replay()
    torch.cuda.synchronize()
    after = graph_gpu_us(victim.replay, 60)
    print(f"  {kind:16} victim graph GPU us: before {before:7.1f}  after {after:7.1f}  ({after - before:+.1f})", flush=True)


def graph_gpu_us(replay, reps: int = 40) -> float:
    """GPU us per replay, back to back (CUDA events around blocks of 10)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps // 10):
        torch.cuda.synchronize()
        start.record()
        for _ in range(10):
            replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) * 1e3 / 10)
    return statistics.median(out)


def gemv_state() -> None:
    """One process: the GEMV-off engine's verify graph timed, then again after each thing a GEMV-on process
    does that the GEMV-off one does not (run AK: the GEMV-on process's graphs have ~0.3 us longer gaps)."""
    from bench.engine import gemv
    from bench.engine.config import ModelConfig, SpecConfig
    from bench.engine.harness import build
    from bench.engine.loop import DecodeLoop, make_requests
    gemv.use_gemv(False)
    engine, pool = build(ModelConfig.medium(), SpecConfig(), [1], 32, 112, "cuda", torch.bfloat16,
                         attention="flashinfer", kernels="fused")
    DecodeLoop(engine, pool, "spec").run(make_requests(1, 32, engine.cfg.vocab_size, 40, 40), 1, max_steps=5)
    verify, decode = pool.graph("verify", 1), pool.graph("decode", 1)
    x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    print("GPU us per replay of the GEMV-off engine's graphs, back to back", flush=True)

    def show(what: str) -> None:
        print(f"  {what:58} verify {graph_gpu_us(verify.replay):8.1f}   decode {graph_gpu_us(decode.replay):8.1f}",
              flush=True)
    show("as built (GEMV off)")
    show("again")
    gemv.use_gemv(True)
    gemv.gemv(x, w)
    torch.cuda.synchronize()
    show("after one eager GEMV launch")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        gemv.gemv(x, w)
    g.replay()
    torch.cuda.synchronize()
    show("after a graph holding a GEMV was captured and replayed")
    engine2, pool2 = build(ModelConfig.medium(), SpecConfig(), [1], 32, 112, "cuda", torch.bfloat16,
                           attention="flashinfer", kernels="fused")
    show("after a second engine, GEMV on, was built and captured")
    d2 = pool2.graph("decode", 1)
    print(f"  (the GEMV-on engine's own: verify {graph_gpu_us(pool2.graph('verify', 1).replay):8.1f}   decode "
          f"{graph_gpu_us(d2.replay):8.1f})", flush=True)
    for _ in range(20):
        d2.replay()
    torch.cuda.synchronize()
    show("after its decode graph ran 20 times")


def _clocks() -> str:
    """SM and memory clocks (MHz), power (W) and the active throttle reasons, from nvidia-smi (or why not)."""
    import subprocess
    query = "clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader",
                              f"--id={torch.cuda.current_device()}"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi: {exc}"


def _kernel_attributes(kernel) -> str:
    """Registers, spills, shared and local memory of a compiled Triton kernel (cuFuncGetAttribute)."""
    import ctypes
    cuda = ctypes.CDLL("libcuda.so.1")
    fn = ctypes.c_void_p(kernel.function)
    names = {"shared": 1, "const": 2, "local": 3, "regs": 4, "max_dyn_shared": 8, "carveout": 9}
    out = []
    for name, attr in names.items():
        value = ctypes.c_int()
        rc = cuda.cuFuncGetAttribute(ctypes.byref(value), attr, fn)
        out.append(f"{name}={value.value if rc == 0 else f'rc{rc}'}")
    return f"n_regs={kernel.n_regs} n_spills={kernel.n_spills} " + " ".join(out)


def _flip_bodies(dev: torch.device) -> dict:
    from bench.engine import gemv
    x = torch.randn(1, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    y = torch.zeros(1024, device=dev)
    lens = torch.zeros(1, dtype=torch.int64, device=dev)
    return {
        "add": lambda: y.add_(1),
        "add-int64": lambda: lens.add_(1),
        "alloc": lambda: torch.empty(1, 4096, device=dev).fill_(1.0),
        "cublas-m1": lambda: torch.nn.functional.linear(x, w),
        "gemv": lambda: gemv.gemv(x, w),
        "tiny-32000-8warps": lambda: _tiny[(32000,)](y, 1, num_warps=8),
    }


ENGINE_FLIPS = ("add", "alloc", "cublas-m1", "gemv", "gemv-no-replay", "gemv-freed", "gemv-eager-x20",
                "tiny-32000-8warps", "sync", "gc", "empty-cache", "raw-capture", "malloc-free-1g",
                "malloc-free-1g-empty-cache", "gemv-on-build", "add-int64", "add-before-build")


def flip_engine(kind: str) -> None:
    """Runs AM, AN: the GEMV-off engine's verify and decode graphs, back to back, before and after one thing
    of ``kind``, with the GPU's clocks beside each line. A graph of ``add``, ``alloc``, ``cublas-m1``, ``gemv``,
    ``tiny-32000-8warps`` captured with ``torch.cuda.graph`` and replayed; ``gemv-no-replay``: captured only;
    ``gemv-freed``: then the graph freed; ``gemv-eager-x20``: 20 eager launches, no graph. What
    ``torch.cuda.graph`` does around a capture, one at a time: ``sync``, ``gc`` (``gc.collect``),
    ``empty-cache``; ``raw-capture``: an ``add`` captured with ``capture_begin``/``capture_end`` on a side stream
    (no ``empty_cache``); ``malloc-free-1g[-empty-cache]``: 1 GiB allocated and dropped (then the cache
    emptied); ``gemv-on-build``: the engine built with the GEMV on, nothing done after; ``add-int64``: a graph of an
    int64 add (a kernel the engine's graphs already hold); ``add-before-build``: an ``add`` graph captured and
    replayed before the engine is built, nothing after."""
    import gc
    from bench.engine import gemv
    from bench.engine.config import ModelConfig, SpecConfig
    from bench.engine.harness import build
    from bench.engine.loop import DecodeLoop, make_requests
    dev = torch.device("cuda")
    gemv.use_gemv(kind == "gemv-on-build")
    if kind == "add-before-build":
        early = capture(_flip_bodies(dev)["add"])
        early.replay()
    engine, pool = build(ModelConfig.medium(), SpecConfig(), [1], 32, 112, "cuda", torch.bfloat16,
                         attention="flashinfer", kernels="fused")
    DecodeLoop(engine, pool, "spec").run(make_requests(1, 32, engine.cfg.vocab_size, 40, 40), 1, max_steps=5)
    verify, decode = pool.graph("verify", 1), pool.graph("decode", 1)

    def show(what: str) -> None:
        v, d = graph_gpu_us(verify.replay, 60), graph_gpu_us(decode.replay, 60)
        print(f"  {kind:18} {what:28} verify {v:8.1f}   decode {d:8.1f}   [{_clocks()}]", flush=True)
    show("before")
    show("before, again")
    if kind in ("gemv-on-build", "add-before-build"):
        return
    gemv.use_gemv(True)
    bodies = _flip_bodies(dev)
    g = None
    if kind == "gemv-eager-x20":
        for _ in range(20):
            bodies["gemv"]()
    elif kind == "sync":
        torch.cuda.synchronize()
    elif kind == "gc":
        gc.collect()
    elif kind == "empty-cache":
        torch.cuda.empty_cache()
    elif kind.startswith("malloc-free-1g"):
        big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
        big.fill_(1)
        del big
        if kind.endswith("empty-cache"):
            torch.cuda.empty_cache()
    elif kind == "raw-capture":
        g, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            bodies["add"]()
            g.capture_begin()
            bodies["add"]()
            g.capture_end()
        torch.cuda.current_stream().wait_stream(side)
        g.replay()
    else:
        g = capture(bodies["gemv" if kind.startswith("gemv") else kind])
        if kind != "gemv-no-replay":
            g.replay()
    torch.cuda.synchronize()
    show("after")
    show("after, again")
    if kind == "gemv-freed":
        del g
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        show("after the graph was freed")
    if kind.startswith("gemv"):
        print(f"  GEMV kernel: {_kernel_attributes(next(iter(gemv._gemv_kernel.device_caches[0][0].values())))}",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
