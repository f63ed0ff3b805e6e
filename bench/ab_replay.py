"""The replay-latency benchmark of several checkouts, alternated in one process tree on one machine: what a
change costs the host per step, without comparing figures taken on different machines (run BA's H200 host and
a later one differed by 2x in the bare replay alone).

Each checkout is a folder holding ``graphpool/``, ``kernels/``, ``integrations/`` and ``bench/`` (e.g.
``git archive REV graphpool kernels integrations bench | tar -x -C DIR``). Their ``bench/replay_latency.py``
runs in turn, ``--rounds`` times each (A B A B ...), with the same options; the table printed last gives per
key the back-to-back host overhead of ``pool.run`` above the bare replay (median over rounds) per checkout.

Usage: ``python3 bench/ab_replay.py --checkout old=DIR --checkout new=. [--rounds 2] [--out OUT] -- --iters 100``
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def run_one(name: str, folder: Path, round_: int, out: Path, extra: list[str]) -> dict:
    """One replay-latency run of ``folder``; returns its JSON."""
    target = out / f"{name}_{round_}"
    env = dict(os.environ, PYTHONPATH=str(folder))
    started = time.perf_counter()
    done = subprocess.run([sys.executable, str(folder / "bench" / "replay_latency.py"), "--no-plots",
                           "--out", str(target), *extra], cwd=folder, env=env, capture_output=True, text=True)
    (out / f"{name}_{round_}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"ab_replay: {name} round {round_} failed (exit {done.returncode}); see its log:\n"
                         + "\n".join((done.stdout + done.stderr).splitlines()[-15:]))
    print(f"ab_replay: {name} round {round_} done in {time.perf_counter() - started:.0f} s", flush=True)
    return json.loads((target / "replay_latency.json").read_text())


def overheads(data: dict) -> dict[tuple[str, int], tuple[float, float]]:
    """(mode, bs) -> (bare replay host us, pool.run's host us above it), back to back."""
    rows = {(r["mode"], r["bs"], r["method"]): r for r in data["rows"]}
    return {(m, b): (rows[m, b, "floor"]["host_b2b_us"], rows[m, b, "graphpool-run"]["host_b2b_us"]
                     - rows[m, b, "floor"]["host_b2b_us"])
            for (m, b, meth) in rows if meth == "floor"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkout", action="append", required=True, help="name=folder, two or more")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="out/ab_replay")
    args = p.parse_args(argv)
    checkouts = [(c.split("=", 1)[0], Path(c.split("=", 1)[1]).resolve()) for c in args.checkout]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {name: [] for name, _ in checkouts}
    for r in range(args.rounds):
        for name, folder in checkouts:
            results[name].append(overheads(run_one(name, folder, r, out, extra)))
    keys = sorted(results[checkouts[0][0]][0], key=lambda k: (k[0], k[1]))
    med = statistics.median
    head = f"{'mode':<8}{'bs':>5}" + "".join(f"{n + ' floor':>14}{n + ' ovh':>12}" for n, _ in checkouts)
    lines = ["host us per step, back to back: the bare replay (floor) and pool.run above it (ovh), median over "
             f"{args.rounds} rounds per checkout", head]
    summary = {}
    for key in keys:
        cells = ""
        for name, _ in checkouts:
            floor = med(run[key][0] for run in results[name])
            ovh = med(run[key][1] for run in results[name])
            summary.setdefault(name, []).append(ovh)
            cells += f"{floor:>14.2f}{ovh:>12.2f}"
        lines.append(f"{key[0]:<8}{key[1]:>5}{cells}")
    lines.append("range of ovh over keys: " + ", ".join(f"{n} {min(v):.2f}-{max(v):.2f} us" for n, v in summary.items()))
    (out / "ab_replay.json").write_text(json.dumps({n: [{f"{k[0]}:{k[1]}": v for k, v in run.items()} for run in rs]
                                                    for n, rs in results.items()}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
