"""Measurement probe for the live benchmark (bench/sglang_live.py puts this folder on PYTHONPATH of every
server it starts, stock SGLang and graphpool alike; nothing else uses it).

SGLang logs the target model's graph capture as ``Capture cuda graph end. Time elapsed: X s. mem
usage=Y GB`` with two decimals of GB, too coarse for graphs of a tiny model. This probe wraps
``ModelRunner.init_device_graphs`` (where SGLang builds the target's graph runner, its own or graphpool's)
once the module is imported, and logs the same capture with the change in the caching allocator's
reserved bytes (where CUDA graph pools live) and in free device memory, in MiB::

    graph-probe: CudaGraphRunner captured in 1.23 s: torch reserved +41.0 MiB, device +44.0 MiB

It also times the host side of every ``replay`` of the target's graph runner (SGLang's runner stages the
inputs, plans attention and launches the graph there; graphpool's the same, its own way), from call to
return, and logs every ``GRAPH_PROBE_EVERY`` (default 200) calls::

    graph-probe: target CudaGraphRunner replay host us: median 85.3 p90 97.1 over 200 calls

so that two servers' runners compare by their own cost even where whole-request latency is dominated by
the scheduler and swings from run to run. It changes no behaviour: the wrapped methods run unchanged
between two clock reads (~1 us).
"""
import importlib.abc
import importlib.machinery
import sys
import time

_TARGET = "sglang.srt.model_executor.model_runner"


def _wrap(module):
    runner_cls = getattr(module, "ModelRunner", None)
    original = getattr(runner_cls, "init_device_graphs", None)
    if original is None or getattr(original, "_graph_probe", False):
        return

    def init_device_graphs(self, *args, **kwargs):
        import torch

        if not torch.cuda.is_available():
            return original(self, *args, **kwargs)
        torch.cuda.synchronize()
        free0, reserved0, t0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved(), time.perf_counter()
        out = original(self, *args, **kwargs)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        free1, reserved1 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        runner = getattr(self, "graph_runner", None)
        if runner is not None:
            role = "draft" if getattr(self, "is_draft_worker", False) else "target"
            print(f"graph-probe: {role} {type(runner).__name__} captured in {seconds:.2f} s: torch reserved "
                  f"+{(reserved1 - reserved0) / 2**20:.1f} MiB, device +{(free0 - free1) / 2**20:.1f} MiB",
                  file=sys.stderr, flush=True)
            if role == "target":
                time_replays(runner, role)
        return out

    init_device_graphs._graph_probe = True
    runner_cls.init_device_graphs = init_device_graphs


def time_replays(runner, role, every=None):
    """Wrap ``runner.replay`` (on the instance) to log its host time per call, every ``every`` calls."""
    import os

    every = every or int(os.environ.get("GRAPH_PROBE_EVERY", "200"))
    original, samples = runner.replay, []

    def replay(*args, **kwargs):
        t0 = time.perf_counter()
        out = original(*args, **kwargs)
        samples.append((time.perf_counter() - t0) * 1e6)
        if len(samples) >= every:
            s = sorted(samples)
            print(f"graph-probe: {role} {type(runner).__name__} replay host us: median {s[len(s) // 2]:.1f} "
                  f"p90 {s[int(len(s) * 0.9)]:.1f} over {len(s)} calls", file=sys.stderr, flush=True)
            samples.clear()
        return out

    runner.replay = replay


class _Finder(importlib.abc.MetaPathFinder):
    """Runs :func:`_wrap` right after SGLang's model_runner module executes (in every process)."""

    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            try:
                _wrap(module)
            except Exception as e:  # a probe must never stop the server
                print(f"graph-probe: not installed ({type(e).__name__}: {e})", file=sys.stderr, flush=True)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
