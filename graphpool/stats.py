"""Counters the pool keeps: per graph, per miss reason, and in total."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .modes import GraphKey


@dataclass
class KeyStats:
    """One graph's figures: capture time, bytes the shared pool grew by, replays, padded token rows."""

    capture_s: float = 0.0
    graph_bytes: int = 0
    replays: int = 0
    padded_rows: int = 0


@dataclass
class PoolStats:
    """Everything :class:`~graphpool.GraphPool` counts. ``misses`` maps a reason to its step count."""

    backend: str = ""
    keys: dict[GraphKey, KeyStats] = field(default_factory=dict)
    misses: Counter = field(default_factory=Counter)
    buffer_bytes: int = 0

    @property
    def graph_bytes(self) -> int:
        """Bytes of graph memory in the shared pool, summed over keys."""
        return sum(s.graph_bytes for s in self.keys.values())

    @property
    def replays(self) -> int:
        return sum(s.replays for s in self.keys.values())

    def mode_bytes(self, mode: str) -> int:
        return sum(s.graph_bytes for k, s in self.keys.items() if k.mode == mode)

    def table(self) -> str:
        """A plain-text table of every key, then misses and totals."""
        lines = [f"{'mode':<10} {'bs':>5} {'capture ms':>11} {'graph MiB':>10} {'replays':>8} {'padded rows':>12}"]
        for key in sorted(self.keys, key=lambda k: (k.mode, k.bs)):
            s = self.keys[key]
            lines.append(f"{key.mode:<10} {key.bs:>5} {s.capture_s * 1e3:>11.1f} {s.graph_bytes / 2**20:>10.2f} "
                         f"{s.replays:>8} {s.padded_rows:>12}")
        lines.append(f"backend {self.backend}: {len(self.keys)} graphs, {self.replays} replays, "
                     f"graph memory {self.graph_bytes / 2**20:.2f} MiB, static buffers {self.buffer_bytes / 2**10:.1f} KiB")
        for reason, n in self.misses.items():
            lines.append(f"miss ({reason}): {n} steps ran eagerly")
        return "\n".join(lines)
