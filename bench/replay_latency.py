"""Replay-latency microbenchmark from the checkout: ``graphpool-bench`` (``graphpool.bench``) with its outputs
in the checkout's ignored ``out/replay_latency`` folder. Same options (``--help``); the implementation lives in
the installed package, :mod:`graphpool.bench`.
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a script from anywhere: this checkout's graphpool
from graphpool.bench import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, default_out=os.path.join(ROOT, "out", "replay_latency"))


if __name__ == "__main__":
    sys.exit(main())
