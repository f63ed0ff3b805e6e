"""Measurement probe for the live benchmark on SGLang's runner API (0.5.14+): bench/sglang_live_v2.py puts this
folder on the PYTHONPATH of every server it starts, stock SGLang and graphpool alike; nothing else uses it.

Graph memory and capture time. SGLang logs its captures in GB with two decimals; the probe wraps where graphs
are made and logs each with the change in the caching allocator's reserved bytes (where CUDA graph pools
live) and in free device memory, in MiB:

* ``ModelRunner.init_cuda_graphs`` (the target's decode runner, SGLang's or graphpool's; the draft's)::

    graph-probe: target init_cuda_graphs MultiModeDecodeRunner in 3.10 s: torch reserved +210.0 MiB, device +212.0 MiB

* ``EAGLEWorkerV2.init_cuda_graphs`` (the draft's graphs and, with ``--speculative-adaptive``, one more target
  runner and draft graph set per step count)::

    graph-probe: spec init_cuda_graphs EAGLEWorkerV2 in 9.00 s: torch reserved +800.0 MiB, device +810.0 MiB

Step GPU time. The scheduler's model worker (``Scheduler.model_worker.forward_batch_generation``, wrapped on
the instance once the scheduler exists, so it sits outside graphpool's switch too) records a CUDA event on the
current stream before and after each decode step; every ``GRAPH_PROBE_EVERY`` (default 200) steps the probe
logs the medians of the completed ones, by batch size and tokens per sequence of the step (1: plain decode,
graphpool's plain step, SGLang's adaptive step 0; more: a verify)::

    graph-probe: step gpu us: bs=32 tok=1 median 9800.0 p90 10100.0 n=150; bs=32 tok=4 median ...

The span runs from when the GPU reaches the step to when it finishes it, gaps waiting for the host included.
The probe changes no behaviour: events are recorded on the stream the step runs on and read once complete.
"""
import importlib.abc
import importlib.machinery
import os
import sys
import time

_EVERY = int(os.environ.get("GRAPH_PROBE_EVERY", "200"))


def _say(msg):
    print(f"graph-probe: {msg}", file=sys.stderr, flush=True)


def _measured(role_of, label):
    """Wrap a graph-building method: its time and the memory it took."""
    def wrap(original):
        def measured(self, *args, **kwargs):
            import torch

            if not torch.cuda.is_available():
                return original(self, *args, **kwargs)
            torch.cuda.synchronize()
            free0, reserved0, t0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved(), time.perf_counter()
            out = original(self, *args, **kwargs)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            free1, reserved1 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
            runner = getattr(self, "decode_cuda_graph_runner", None)
            name = type(runner).__name__ if runner is not None else type(self).__name__
            _say(f"{role_of(self)} {label} {name} in {seconds:.2f} s: torch reserved "
                 f"+{(reserved1 - reserved0) / 2**20:.1f} MiB, device +{(free0 - free1) / 2**20:.1f} MiB")
            return out
        measured._graph_probe = True
        return measured
    return wrap


def _timed_steps(step):
    """``step`` (a bound forward_batch_generation) with its decode steps' GPU spans recorded."""
    import torch

    pending, spans = [], {}

    def timed(batch, *args, **kwargs):
        mode = getattr(batch, "forward_mode", None)
        decode = mode is not None and mode.is_decode() and torch.cuda.is_available()
        if not decode:
            return step(batch, *args, **kwargs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = step(batch, *args, **kwargs)
        end.record()
        tokens = getattr(out, "speculative_num_draft_tokens", None) or 1
        pending.append((int(batch.seq_lens.shape[0]), int(tokens), start, end))
        if len(pending) >= _EVERY:
            _report(pending, spans)
        return out

    return timed


def _report(pending, spans):
    done = [p for p in pending if p[3].query()]
    for bs, tokens, start, end in done:
        spans.setdefault((bs, tokens), []).append(start.elapsed_time(end) * 1e3)
    pending[:] = [p for p in pending if not p[3].query()]
    parts = []
    for (bs, tokens), values in sorted(spans.items()):
        v = sorted(values)
        parts.append(f"bs={bs} tok={tokens} median {v[len(v) // 2]:.1f} p90 {v[int(len(v) * 0.9)]:.1f} n={len(v)}")
    if parts:
        _say("step gpu us: " + "; ".join(parts))
    spans.clear()


def _wrap_model_runner(module):
    cls = getattr(module, "ModelRunner", None)
    original = getattr(cls, "init_cuda_graphs", None)
    if original is not None and not getattr(original, "_graph_probe", False):
        def role(self):
            return "draft" if getattr(self, "is_draft_worker", False) else "target"
        cls.init_cuda_graphs = _measured(role, "init_cuda_graphs")(original)


def _wrap_eagle_worker(module):
    cls = getattr(module, "EAGLEWorkerV2", None)
    original = getattr(cls, "init_cuda_graphs", None)
    if original is not None and not getattr(original, "_graph_probe", False):
        cls.init_cuda_graphs = _measured(lambda self: "spec", "init_cuda_graphs")(original)


def _wrap_scheduler(module):
    cls = getattr(module, "Scheduler", None)
    init = getattr(cls, "__init__", None)
    if init is None or getattr(init, "_graph_probe", False):
        return

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        worker = getattr(self, "model_worker", None)
        if worker is not None:  # the instance's own attribute: outside any class-level patch (graphpool's)
            worker.forward_batch_generation = _timed_steps(worker.forward_batch_generation)

    __init__._graph_probe = True
    cls.__init__ = __init__


_HOOKS = {"sglang.srt.model_executor.model_runner": _wrap_model_runner,
          "sglang.srt.speculative.eagle_worker_v2": _wrap_eagle_worker,
          "sglang.srt.managers.scheduler": _wrap_scheduler}


class _Finder(importlib.abc.MetaPathFinder):
    """Runs the hook of a module right after it executes (in every process)."""

    def find_spec(self, name, path, target=None):
        hook = _HOOKS.get(name)
        if hook is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader_exec = spec.loader.exec_module

        def exec_module(module):
            loader_exec(module)
            try:
                hook(module)
            except Exception as e:  # a probe must never stop the server
                _say(f"not installed on {name} ({type(e).__name__}: {e})")

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Finder())
