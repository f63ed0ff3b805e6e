"""Shared test setup: the `gpu` marker skips without CUDA, the `slow` marker without ``--runslow``; every test of a
``test_sglang_*``, ``test_transformers_*`` or ``test_hf_*`` module is marked `optional`."""
from __future__ import annotations

import gc
import os

# One intra-op thread unless the caller says otherwise (subprocesses and TP ranks inherit it): the tests'
# tensors are tiny, and torch's OpenMP threads spin while they wait, so beside any other busy process on a
# small machine a step that takes 0.5 s with one thread took 10-50 s with two.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; it must be chosen before any
# kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tp", type=int, default=2,
                     help="tensor-parallel ranks of the GPU tests in tests/test_engine_tp.py (one GPU each)")
    parser.addoption("--live", action="store_true", default=False,
                     help="also run the live tier: real SGLang servers on CPU (CI: .ci/sglang-live.sh)")
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the long versions of checks marked `slow` (CI runs them: pytest --runslow -m slow)")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze the heap that collection built (torch, Triton, SGLang's classes: ~570,000 objects), so that the
    full collection before every capture (graphpool/capture.py) scans only what the tests made since: it
    took ~0.5 s per capture, a large share of the suite's time."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    interpreter = pytest.mark.skip(reason="runs Triton kernels on CPU tensors, which needs Triton's interpreter "
                                          "(turned on above only where there is no CUDA GPU)")
    slow = pytest.mark.skip(reason="the long version of a check that also runs short by default: --runslow runs it")
    runslow = config.getoption("--runslow")
    live = pytest.mark.skip(reason="starts real SGLang servers on CPU: --live runs it (CI: .ci/sglang-live.sh)")
    for item in items:
        if "live" in item.keywords and not config.getoption("--live"):
            item.add_marker(live)
        if item.path.name.startswith(("test_sglang_", "test_transformers_", "test_hf_")):
            item.add_marker(pytest.mark.optional)  # SGLang's and transformers' tests: they skip where it is absent
        if "slow" in item.keywords and not runslow:
            item.add_marker(slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(gpu)
        if "interpreter" in item.keywords and os.environ.get("TRITON_INTERPRET") != "1":
            item.add_marker(interpreter)


@pytest.fixture
def live_server(tmp_path: "os.PathLike[str]"):
    """Real SGLang servers on CPU for a test (the live tier, ``tests/live/server.py``; tests using it are marked
    ``live``): ``server = live_server([... SGLang and graphpool arguments ...])`` starts one through graphpool's
    launcher (``graphpool=False``: SGLang's own) on the tier's tiny model and returns it once ``/health`` answers;
    ``server.client`` sends requests, ``server.log()`` reads graphpool's replays, flips and catch-ups. Every server
    started is stopped at teardown."""
    from pathlib import Path

    from tests.live.server import LiveServer

    started = []

    def start(args, **kwargs):
        kwargs.setdefault("name", f"server{len(started)}")
        kwargs.setdefault("model_root", Path(tmp_path) / "models")
        server = LiveServer.start(args, Path(tmp_path), **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
