"""Start tensor-parallel ranks, run one function on each, and tear down in the order that exits cleanly.

Two ways in, one function per rank ``fn(tp, *args)`` (``tp``: this rank's
:class:`~bench.engine.parallel.TensorParallel`):

* :func:`spawn`: this process starts ``world_size`` ranks itself (``torch.multiprocessing``, spawn
  context), waits for them with an optional deadline, kills stragglers, and returns every rank's result;
* :func:`run_ranks` also works under ``torchrun``: it then runs the function on this process's rank only.

Teardown order. A CUDA graph that captured an NCCL collective keeps using the communicator; a probe on two
H200s hung at exit when ``destroy_process_group`` ran while a pool's graphs were still alive. Each rank
therefore drops the function's objects first (the return value is handed over, locals die with the call, and
an exception's frames are cleared), collects garbage so the graphs are destroyed, synchronises the device,
and only then destroys the process group. The launching process also checks that every rank exits on its
own after reporting, and names any that does not.
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .parallel import TensorParallel

log = logging.getLogger(__name__)

RankFn = Callable[..., Any]

#: How long a rank may take to exit after it reported (teardown included) before it counts as hung.
EXIT_GRACE_S = 60.0
#: How long the other ranks may keep running after one rank failed (they are usually stuck in a collective).
FAILURE_GRACE_S = 20.0


class RankFailure(RuntimeError):
    """One or more ranks raised, crashed, hung, or did not exit.

    Attributes:
        errors: rank -> the exception it raised (where it could be sent back), else a description.
    """

    def __init__(self, message: str, errors: dict[int, Any]):
        super().__init__(message)
        self.errors = errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command-line flags of a tensor-parallel run (``--tp``, ``--tp-check``)."""
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks: spawns them (or runs under torchrun); rank 0 prints")
    parser.add_argument("--tp-check", action="store_true",
                        help="debug: compare (step, mode, batch size) across ranks before every step and raise "
                             "RankDisagreementError on a mismatch instead of hanging")


def in_torchrun() -> bool:
    """Whether this process is a rank started by ``torchrun`` (its environment names rank and world)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "LOCAL_RANK" in os.environ)


def run_ranks(fn: RankFn, world_size: int, args: tuple = (), backend: str = "gloo", check: bool = False,
              timeout_s: float | None = None, quiet: bool = True) -> list[Any]:
    """Run ``fn(tp, *args)`` on ``world_size`` ranks: this process's rank under torchrun (returns a list of
    one result), else ranks spawned here (returns every rank's result, rank order). See :func:`spawn`."""
    if not in_torchrun():
        return spawn(fn, world_size, args, backend, check, timeout_s, quiet)
    if int(os.environ["WORLD_SIZE"]) != world_size:
        raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} ranks but --tp is {world_size}: "
                         f"pass --nproc-per-node {world_size}")
    ok, payload = _run_rank(fn, args, backend, check, quiet)
    if not ok:
        raise payload[0] if payload[0] is not None else RankFailure(payload[1], {int(os.environ["RANK"]): payload[1]})
    return [payload]


def spawn(fn: RankFn, world_size: int, args: tuple = (), backend: str = "gloo", check: bool = False,
          timeout_s: float | None = None, quiet: bool = True) -> list[Any]:
    """Start ``world_size`` ranks (one process each, on ``127.0.0.1``), run ``fn(tp, *args)`` on each, return
    the results in rank order.

    Args:
        fn: a module-level function (it is pickled into the spawned processes).
        backend: ``"nccl"`` (rank ``r`` uses ``cuda:r``) or ``"gloo"``.
        check: build each rank's TensorParallel with the per-step agreement check.
        timeout_s: the most seconds the ranks may run; past it every rank is killed (``None``: no limit).
        quiet: ranks other than 0 write their stdout to ``/dev/null`` (stderr stays).

    Raises:
        RankFailure: a rank raised (its exception is in ``errors``; the others get ``FAILURE_GRACE_S`` to
            finish), crashed, ran past ``timeout_s``, or did not exit within ``EXIT_GRACE_S`` of reporting.
    """
    ctx = mp.get_context("spawn")
    results: queue_mod.Queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(rank, world_size, port, backend, check, quiet, fn, args, results),
                         name=f"tp-rank-{rank}", daemon=True)  # daemon: gone when the launcher exits
             for rank in range(world_size)]
    for p in procs:
        p.start()
    started = time.monotonic()
    done: dict[int, tuple[bool, Any]] = {}
    errors: dict[int, Any] = {}
    first_failure = None
    try:
        while len(done) < world_size:
            now = time.monotonic()
            if timeout_s is not None and now - started > timeout_s:
                errors.update({r: f"still running after the {timeout_s:.0f} s limit" for r in range(world_size)
                               if r not in done})
                break
            if first_failure is not None and now - first_failure > FAILURE_GRACE_S:
                errors.update({r: f"still running {FAILURE_GRACE_S:.0f} s after another rank failed (stuck in a "
                                  f"collective?)" for r in range(world_size) if r not in done})
                break
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue_mod.Empty:
                for rank, p in enumerate(procs):  # a rank that died without reporting (signal, os._exit)
                    if rank not in done and not p.is_alive() and results.empty():
                        done[rank] = (False, None)
                        errors[rank] = f"exited with code {p.exitcode} without reporting"
                        first_failure = first_failure or time.monotonic()
                continue
            done[rank] = (ok, payload)
            if not ok:
                exc, text = payload
                errors[rank] = exc if exc is not None else text
                log.error("tensor-parallel rank %d failed:\n%s", rank, text)
                first_failure = first_failure or time.monotonic()
    finally:
        errors.update(_reap(procs, done))
    if errors:
        summary = "; ".join(f"rank {r}: {e!r}" if isinstance(e, BaseException) else f"rank {r}: {e}"
                            for r, e in sorted(errors.items()))
        raise RankFailure(f"{len(errors)} of {world_size} tensor-parallel ranks failed: {summary}", errors)
    return [done[r][1] for r in range(world_size)]


def _reap(procs: list, done: dict[int, tuple[bool, Any]]) -> dict[int, str]:
    """Wait for every rank to exit; kill those that do not, and say which (a hang at exit is a failure)."""
    hung = {}
    deadline = time.monotonic() + EXIT_GRACE_S
    for rank, p in enumerate(procs):
        p.join(max(0.0, deadline - time.monotonic()) if rank in done else 0.0)
        if p.is_alive():
            if rank in done:
                hung[rank] = f"reported but did not exit within {EXIT_GRACE_S:.0f} s (hung at teardown); killed"
            p.terminate()
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
    return hung


def _child(rank: int, world_size: int, port: int, backend: str, check: bool, quiet: bool, fn: RankFn,
           args: tuple, results: Any) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ok, payload = _run_rank(fn, args, backend, check, quiet)
    try:  # the queue pickles in a background thread: find out here whether the payload pickles
        pickle.dumps(payload)
    except Exception as exc:  # noqa: BLE001
        ok, payload = False, (None, payload[1] if not ok else f"the result does not pickle: {exc!r}")
    results.put((rank, ok, payload))


def _run_rank(fn: RankFn, args: tuple, backend: str, check: bool, quiet: bool) -> tuple[bool, Any]:
    """Init this rank's process group, run ``fn``, tear down (graphs first). Returns (ok, result) or
    (False, (exception or None, traceback text))."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if quiet and rank:
        sys.stdout = open(os.devnull, "w")
    device_id = None
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device_id = torch.device("cuda", local_rank)  # creates the communicator now, outside any capture
    dist.init_process_group(backend, device_id=device_id)
    tp = None
    try:
        tp = TensorParallel(check=check)
        return True, fn(tp, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher, which re-raises
        text = traceback.format_exc()
        traceback.clear_frames(exc.__traceback__)  # frames hold the pool: its graphs must die before the group
        return False, (exc, text)
    finally:
        teardown(tp)


def teardown(tp: TensorParallel | None) -> None:
    """Free this rank's graphs (``GraphPool.close``), synchronise, then destroy the process group (in that
    order; see the module docstring)."""
    gc.collect()
    for pool in tp.live_pools() if tp is not None else []:
        pool.close()  # a pool still referenced somewhere: its graphs go now, before the group
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
