"""Tables, target checks and the plot for bench/decode_loop.py."""
from __future__ import annotations

import logging
from pathlib import Path

from graphpool.bench.report import explain

log = logging.getLogger(__name__)

LABELS = {"plain": "plain", "spec": "spec", "dynamic": "dynamic", "dynamic_eager_plain": "dyn-eager"}
NAMES = {"plain": "(i) plain decode, graphs", "spec": "(ii) speculation always, graphs",
         "dynamic": "(iii) dynamic, graphs in both modes", "dynamic_eager_plain": "(iv) dynamic, plain steps eager"}
# On a CPU the pool's eager twin stands in for the graphs: the legend says so.
NAMES_CPU = {"plain": "(i) plain decode, eager twin", "spec": "(ii) speculation always, eager twin",
             "dynamic": "(iii) dynamic, both modes via the pool (eager twin)",
             "dynamic_eager_plain": "(iv) dynamic, plain steps eager"}


def count(n: float) -> str:
    """A parameter count with a unit a person reads at a glance: 1.75 B, 12.3 M, 840 k."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f}"


ROOFLINE_LEGEND = explain(
    "C: sequences per step. plain / spec GFLOP, GB: work and bytes moved by one plain decode step / one "
    "speculative step (draft passes + verify of 16 tokens per sequence); ms: their roofline time on an H200 "
    "(max of compute and memory time, no kernel overheads). break-even A: tokens a verify step must commit per "
    "sequence for speculation to match plain decode (spec ms / plain ms).")

STATS_LEGEND = (
    "mode: decode (1 token per sequence), verify (speculation: {verify} tokens per sequence), prefill (the "
    "prompt of newly admitted requests, {prefill} tokens per sequence, batch sizes up to 8). bs: the graph's "
    "batch size. capture ms: its capture (warm-up included). graph MiB: memory it added to the shared pool{mib}. "
    "replays: steps it served. padded rows: token rows filled with padding because fewer sequences than bs "
    "came.")


def _tps(results: dict, v: str, c: int) -> float | None:
    r = results.get((v, c))
    return r["tokens_per_s"] if r else None


def check_targets(results: dict, cs: list[int]) -> list[dict]:
    """Issue 5's targets per C: dynamic >= 0.95 x max(plain, spec); at C >= 32 dynamic >= 1.5 x dyn-eager;
    no graph misses. Only the comparisons whose runs exist are listed."""
    out = []
    for c in cs:
        dyn, plain, spec, eager = (_tps(results, v, c) for v in ("dynamic", "plain", "spec", "dynamic_eager_plain"))
        row = {"concurrency": c}
        if dyn is not None and plain is not None and spec is not None:
            row["dyn_over_best"] = dyn / max(plain, spec)
            row["dyn_ok"] = row["dyn_over_best"] >= 0.95
        if dyn is not None and eager is not None and c >= 32:
            row["dyn_over_eager"] = dyn / eager
            row["eager_ok"] = row["dyn_over_eager"] >= 1.5
        row["misses"] = sum(results[(v, c)]["graph_misses"] for v in LABELS if (v, c) in results)
        out.append(row)
    return out


def table(results: dict, cs: list[int], checks: list[dict], gpu: bool = True, policy_note: str = "") -> str:
    """The summary table printed last, each column explained under it. On a GPU the ratio columns judge
    the speed targets and ``policy_note`` (the crossover and the threshold the dynamic runs used) comes
    before the targets line; on a CPU (the eager twin) no ratio is shown: its timings are no measurement."""
    head = f"{'C':>4} " + " ".join(f"{LABELS[v]:>10}" for v in LABELS) + f" {'accept':>6}"
    head += f" {'dyn/best':>9} {'dyn/eager':>9}" if gpu else ""
    head += f" {'match':>6}"
    lines = ["output tokens/s by concurrency C" + ("" if gpu else " (eager twin on CPU: not a speed measurement)"),
             head]
    by_c = {row["concurrency"]: row for row in checks}
    for c in cs:
        cells = [f"{_tps(results, v, c):>10.1f}" if (v, c) in results else f"{'-':>10}" for v in LABELS]
        spec = results.get(("spec", c)) or results.get(("dynamic", c))
        acc = f"{spec['mean_accept']:>6.2f}" if spec and spec["mean_accept"] else f"{'-':>6}"
        row = by_c[c]
        best = f"{row['dyn_over_best']:>8.2f}{'' if row['dyn_ok'] else '!'}" if "dyn_over_best" in row else f"{'-':>9}"
        eager = f"{row['dyn_over_eager']:>8.2f}{'' if row['eager_ok'] else '!'}" if "dyn_over_eager" in row else f"{'-':>9}"
        m = (results.get(("dynamic", c)) or {}).get("match_vs_plain", {}).get("identical")
        lines.append(f"{c:>4} " + " ".join(cells) + f" {acc}" + (f" {best:>9} {eager:>9}" if gpu else "")
                     + " " + (f"{m:>6.2f}" if m is not None else f"{'-':>6}"))
    lines += [explain(t) for t in (
        "C: requests in flight. plain, spec, dynamic, dyn-eager: output tokens/s of variants (i)-(iv): plain "
        "decode always; speculation always; SpeculationPolicy per step, both modes from the pool; the same, "
        "plain steps eager. '-': not run.",
        "accept: tokens committed per sequence per verify step (the spec run's, else dynamic's; '-': no "
        "verify step ran). match: share of requests whose dynamic output equals plain decode's, token for "
        "token ('-': nothing to compare).")]
    if gpu:
        lines.append(explain("dyn/best: dynamic / max(plain, spec), target >= 0.95. dyn/eager: dynamic / dyn-eager, "
                     "target >= 1.5, judged at C >= 32 only ('-' below 32). '!': that target missed."))
    if policy_note:
        lines.append(policy_note)
    if not gpu:
        return "\n".join(lines)
    failed = [r["concurrency"] for r in checks if r.get("dyn_ok") is False or r.get("eager_ok") is False or r["misses"]]
    lines.append("targets: dynamic >= 0.95 x max(plain, spec) at every C; dynamic >= 1.5 x dyn-eager at C >= 32; "
                 "no graph misses -> " + (f"MISSED at C = {failed} (marked !)" if failed else "all met"))
    return "\n".join(lines)


def plot(results: dict, cs: list[int], path: Path, title: str = "", gpu: bool = True) -> Path | None:
    """Throughput vs concurrency, one line per variant (log2 x axis labelled with the swept C). On a CPU the
    plot says on its face that the eager twin ran and that it is no speed measurement. Returns the path,
    None without matplotlib."""
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot written")
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v, name in (NAMES if gpu else NAMES_CPU).items():
        pts = [(c, results[(v, c)]["tokens_per_s"]) for c in cs if (v, c) in results]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # the swept C are the ticks
    ax.set_xlabel("concurrency C (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_title((title or "decode loop throughput") + ("" if gpu else "\nCPU smoke run: eager twin, no CUDA graphs"))
    if not gpu:
        ax.text(0.5, 0.5, "not a speed measurement", transform=ax.transAxes, ha="center", va="center",
                fontsize=20, color="red", alpha=0.35, rotation=20)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def acceptance(results: dict, cs: list[int], checks: list[dict], roofline_ms: dict[int, tuple[float, float]],
               identity: dict | None = None) -> list[tuple[str, bool | None, str]]:
    """Issue 11's acceptance checks as ``(name, ok, detail)``; ``ok`` is None where the run lacks what a
    check needs. ``roofline_ms[c] = (plain step ms, speculative step ms)`` from :mod:`bench.engine.costs`."""
    out: list[tuple[str, bool | None, str]] = []
    plain1, spec1 = _tps(results, "plain", 1), _tps(results, "spec", 1)
    if plain1 and 1 in roofline_ms:
        step_ms, roof = 1e3 / plain1, roofline_ms[1][0]  # at C = 1 a plain step commits one token
        out.append(("plain step at C=1 within 1.3x its roofline", step_ms <= 1.3 * roof,
                    f"{step_ms:.3f} ms vs roofline {roof:.3f} ms: {step_ms / roof:.2f}x"))
    else:
        out.append(("plain step at C=1 within 1.3x its roofline", None, "needs plain at C=1"))
    if plain1 and spec1 and 1 in roofline_ms:
        accept = results[("spec", 1)]["mean_accept"]
        want = 0.85 * accept * roofline_ms[1][0] / roofline_ms[1][1]
        out.append(("spec/plain at C=1 >= 0.85 x accept x roofline ratio", spec1 / plain1 >= want,
                    f"{spec1 / plain1:.2f}x vs {want:.2f}x (accept {accept:.2f}, roofline plain "
                    f"{roofline_ms[1][0]:.3f} ms, spec {roofline_ms[1][1]:.3f} ms)"))
    else:
        out.append(("spec/plain at C=1 >= 0.85 x accept x roofline ratio", None, "needs plain and spec at C=1"))
    best = [r for r in checks if "dyn_ok" in r]
    out.append(("dynamic >= 0.95 x max(plain, spec) at every C", all(r["dyn_ok"] for r in best) if best else None,
                ", ".join(f"C={r['concurrency']}: {r['dyn_over_best']:.2f}" for r in best) or "needs all three"))
    eager = [r for r in checks if "eager_ok" in r]
    out.append(("dynamic >= 1.5 x dyn-eager at C >= 32", all(r["eager_ok"] for r in eager) if eager else None,
                ", ".join(f"C={r['concurrency']}: {r['dyn_over_eager']:.2f}" for r in eager) or "no C >= 32 run"))
    misses = sum(r["misses"] for r in checks)
    out.append(("no graph misses", misses == 0, f"{misses} misses"))
    if identity is not None:
        out.append(("float32 greedy output of spec and dynamic identical to plain", identity["ok"],
                    f"{identity['attention']} attention: spec {identity['spec_identical']}/{identity['requests']}, "
                    f"dynamic {identity['dynamic_identical']}/{identity['requests']} requests identical, "
                    f"switched modes: {identity['switched']}, misses {identity['graph_misses']}"))
    return out


def acceptance_lines(checks: list[tuple[str, bool | None, str]]) -> str:
    """One ``PASS``/``FAIL``/``N/A`` line per acceptance check."""
    word = {True: "PASS", False: "FAIL", None: "N/A "}
    return "\n".join(f"{word[ok]}  {name}: {detail}" for name, ok, detail in checks)
