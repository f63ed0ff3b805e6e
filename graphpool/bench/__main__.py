"""``python -m graphpool.bench``: the replay-latency microbenchmark (see :mod:`graphpool.bench.cli`)."""
import sys

from .cli import main

sys.exit(main())
