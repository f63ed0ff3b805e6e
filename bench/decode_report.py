"""Tables, target checks and the plot for bench/decode_loop.py."""
from __future__ import annotations

import logging
from pathlib import Path

from graphpool.bench.report import explain

log = logging.getLogger(__name__)

LABELS = {"plain": "plain", "spec": "spec", "dynamic": "dynamic", "dynamic_eager_plain": "dyn-eager", "tiers": "tiers"}
#: The table's columns whether they ran or not; fixed tiers (spec_<n>) and tiers join them when they ran.
BASE = ("plain", "spec", "dynamic", "dynamic_eager_plain")
NAMES = {"plain": "(i) plain decode, graphs", "spec": "(ii) speculation always, graphs",
         "dynamic": "(iii) dynamic, graphs in both modes", "dynamic_eager_plain": "(iv) dynamic, plain steps eager",
         "tiers": "(v) tiers: draft length by batch size, graphs"}
# On a CPU the pool's eager twin stands in for the graphs: the legend says so.
NAMES_CPU = {"plain": "(i) plain decode, eager twin", "spec": "(ii) speculation always, eager twin",
             "dynamic": "(iii) dynamic, both modes via the pool (eager twin)",
             "dynamic_eager_plain": "(iv) dynamic, plain steps eager", "tiers": "(v) tiers via the pool (eager twin)"}
TIERS_LEGEND = "verify_<n>: a shorter speculation tier (--tiers), n tokens per sequence."


def label(v: str) -> str:
    """A variant's column label: ``spec_8`` -> ``spec 8`` (the fixed tier of 8 draft tokens)."""
    return LABELS.get(v) or v.replace("_", " ")


def fixed_tiers(results: dict) -> list[str]:
    """The fixed shorter tiers that ran (``spec_<n>``), longest draft first."""
    runs = {v for v, _ in results if v.startswith("spec_")}
    return sorted(runs, key=lambda v: -int(v.split("_")[1]))


def columns(results: dict) -> list[str]:
    """The table's variants: the four of issue 5 always, then the fixed tiers and tiers that ran."""
    return [*BASE, *fixed_tiers(results), *(["tiers"] if any(v == "tiers" for v, _ in results) else [])]


def count(n: float) -> str:
    """A parameter count with a unit a person reads at a glance: 1.75 B, 12.3 M, 840 k."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f}"


ROOFLINE_LEGEND = explain(
    "C: sequences per step. plain / spec GFLOP, GB: work and bytes moved by one plain decode step / one "
    "speculative step (draft passes + verify of 16 tokens per sequence); ms: their roofline time on this GPU "
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
    no graph misses. With tiers (issue 40): tiers >= 0.98 x the best fixed tier (plain and spec included), and
    tiers above dynamic at a C where a shorter tier beats both plain and spec. Only the comparisons whose runs
    exist are listed."""
    out = []
    shorter = fixed_tiers(results)
    for c in cs:
        dyn, plain, spec, eager = (_tps(results, v, c) for v in ("dynamic", "plain", "spec", "dynamic_eager_plain"))
        row = {"concurrency": c}
        if dyn is not None and plain is not None and spec is not None:
            row["dyn_over_best"] = dyn / max(plain, spec)
            row["dyn_ok"] = row["dyn_over_best"] >= 0.95
        if dyn is not None and eager is not None and c >= 32:
            row["dyn_over_eager"] = dyn / eager
            row["eager_ok"] = row["dyn_over_eager"] >= 1.5
        tiers = _tps(results, "tiers", c)
        fixed = [t for t in (_tps(results, v, c) for v in ("plain", "spec", *shorter)) if t is not None]
        if tiers is not None and fixed:
            row["tiers_over_fixed"] = tiers / max(fixed)
            row["tiers_ok"] = row["tiers_over_fixed"] >= 0.98
        short_best = max((t for t in (_tps(results, v, c) for v in shorter) if t is not None), default=None)
        if (tiers is not None and dyn is not None and plain is not None and spec is not None
                and short_best is not None and short_best > max(plain, spec)):
            row["tiers_over_dyn"] = tiers / dyn
            row["tiers_dyn_ok"] = row["tiers_over_dyn"] > 1.0
        row["misses"] = sum(r["graph_misses"] for (v, rc), r in results.items() if rc == c)
        out.append(row)
    return out


def _ratio(row: dict, value: str, ok: str) -> str:
    """A target column's cell: the ratio, '!' where the target is missed, '-' where it is not judged."""
    return f"{row[value]:>8.2f}{'' if row[ok] else '!'}" if value in row else f"{'-':>9}"


def table(results: dict, cs: list[int], checks: list[dict], policy_note: str = "") -> str:
    """The GPU run's summary table, printed last, each column explained under it: output tokens/s per variant,
    the ratio columns judging the speed targets, ``policy_note`` (the crossover and the threshold the dynamic
    runs used), then the targets line. A CPU run prints :func:`steps_table` instead: its timings are no
    measurement."""
    cols = columns(results)
    tiered = "tiers" in cols
    targets = [("dyn/best", "dyn_over_best", "dyn_ok"), ("dyn/eager", "dyn_over_eager", "eager_ok")]
    if tiered:
        targets += [("tier/fixed", "tiers_over_fixed", "tiers_ok"), ("tier/dyn", "tiers_over_dyn", "tiers_dyn_ok")]
    head = (f"{'C':>4} " + " ".join(f"{label(v):>10}" for v in cols) + f" {'accept':>6}"
            + "".join(f" {name:>9}" for name, _, _ in targets) + f" {'match':>6}")
    lines = ["output tokens/s by concurrency C", head]
    by_c = {row["concurrency"]: row for row in checks}
    for c in cs:
        cells = [f"{_tps(results, v, c):>10.1f}" if (v, c) in results else f"{'-':>10}" for v in cols]
        ratios = "".join(f" {_ratio(by_c[c], value, ok):>9}" for _, value, ok in targets)
        m = (results.get(("dynamic", c)) or {}).get("match_vs_plain", {}).get("identical")
        lines.append(f"{c:>4} " + " ".join(cells) + f" {_accept(results, c):>6}" + ratios
                     + " " + (f"{m:>6.2f}" if m is not None else f"{'-':>6}"))
    lines += [explain(t) for t in (
        "C: requests in flight. plain, spec, dynamic, dyn-eager: output tokens/s of variants (i)-(iv): plain "
        "decode always; speculation always; SpeculationPolicy per step, both modes from the pool; the same, "
        "plain steps eager. '-': not run.",
        ACCEPT_LEGEND + " match: share of requests whose dynamic output equals plain decode's, token for "
        "token ('-': nothing to compare).")]
    if tiered:
        lines.append(explain("spec <n>: the shorter tier of n draft tokens on every step. tiers: (v), a TierSchedule "
                             "choosing the tier per step by batch size, plain decode last (docs/tiers.md)."))
    lines.append(explain("dyn/best: dynamic / max(plain, spec), target >= 0.95. dyn/eager: dynamic / dyn-eager, "
                         "target >= 1.5, judged at C >= 32 only ('-' below 32). '!': that target missed."))
    if tiered:
        lines.append(explain("tier/fixed: tiers / the best fixed tier (plain, spec, spec <n>), target >= 0.98. "
                             "tier/dyn: tiers / dynamic, target > 1, judged where a shorter tier beats both plain "
                             "and spec ('-' elsewhere)."))
    if policy_note:
        lines.append(policy_note)
    failed = [r["concurrency"] for r in checks if r["misses"] or any(r.get(ok) is False for _, _, ok in targets)]
    lines.append("targets: dynamic >= 0.95 x max(plain, spec) at every C; dynamic >= 1.5 x dyn-eager at C >= 32; "
                 + ("tiers >= 0.98 x the best fixed tier at every C, and above dynamic where a shorter tier wins; "
                    if tiered else "")
                 + "no graph misses -> " + (f"MISSED at C = {failed} (marked !)" if failed else "all met"))
    return "\n".join(lines)


ACCEPT_LEGEND = ("accept: tokens committed per sequence per verify step (the spec run's, else dynamic's; '-': no "
                 "verify step ran).")


def _accept(results: dict, c: int) -> str:
    spec = results.get(("spec", c)) or results.get(("dynamic", c))
    return f"{spec['mean_accept']:.2f}" if spec and spec["mean_accept"] else "-"


def identical(results: dict, c: int | None = None) -> tuple[int, int]:
    """Runs (at ``c``, or at every C) whose output equals plain decoding's token for token, and runs compared."""
    same = [r["match_vs_plain"]["identical"] == 1.0 for (v, rc), r in results.items()
            if (c is None or rc == c) and r.get("match_vs_plain", {}).get("identical") is not None]
    return sum(same), len(same)


def steps_table(results: dict, cs: list[int]) -> str:
    """A CPU run's summary table, printed last: what each variant ran at each C (its timed steps by mode), the
    acceptance, and how many runs gave plain decoding's tokens. No timings: the eager twin's are no measurement."""
    cols = columns(results)
    cell = {(v, c): ", ".join(f"{n} {m.replace('_decode', ' decode')}"
                              for m, n in results[(v, c)]["steps"].items() if n) or "0"
            for v in cols for c in cs if (v, c) in results}
    width = {v: max([len(label(v))] + [len(cell.get((v, c), "-")) for c in cs]) for v in cols}
    lines = ["steps by mode at each concurrency C (eager twin on CPU: what ran, not how fast)",
             f"{'C':>4}  " + "  ".join(f"{label(v):<{width[v]}}" for v in cols) + f"  {'accept':>6}  {'= plain':>7}"]
    for c in cs:
        same, runs = identical(results, c)
        lines.append(f"{c:>4}  " + "  ".join(f"{cell.get((v, c), '-'):<{width[v]}}" for v in cols)
                     + f"  {_accept(results, c):>6}  " + (f"{same}/{runs}" if runs else "-").rjust(7))
    lines += [explain(t) for t in (
        "C: requests in flight. plain, spec, dynamic, dyn-eager"
        + (", spec <n>, tiers" if any(v.startswith("spec_") or v == "tiers" for v in cols) else "")
        + ": each variant's timed steps by the mode it ran: decode (plain decode), verify (speculation), "
        "verify_<n> (a shorter tier, --tiers), eager decode (a plain step run eagerly, dyn-eager's). On a CPU "
        "the policies' bounds sit at the smallest C, so the chosen variants take more than one mode across C. "
        "'-': not run.",
        ACCEPT_LEGEND + " = plain: runs at this C whose output equals plain decoding's, token for token, of the "
        "runs compared.")]
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
    names = NAMES if gpu else NAMES_CPU
    for v in (*BASE, *fixed_tiers(results), "tiers"):
        name = names.get(v) or f"{label(v)}: the tier of {v.split('_')[1]} draft tokens always"
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
        out.append(("plain step at C=1 within 1.3x its roofline", None, "needs plain at C=1 and this GPU's roofline"))
    if plain1 and spec1 and 1 in roofline_ms:
        accept = results[("spec", 1)]["mean_accept"]
        want = 0.85 * accept * roofline_ms[1][0] / roofline_ms[1][1]
        out.append(("spec/plain at C=1 >= 0.85 x accept x roofline ratio", spec1 / plain1 >= want,
                    f"{spec1 / plain1:.2f}x vs {want:.2f}x (accept {accept:.2f}, roofline plain "
                    f"{roofline_ms[1][0]:.3f} ms, spec {roofline_ms[1][1]:.3f} ms)"))
    else:
        out.append(("spec/plain at C=1 >= 0.85 x accept x roofline ratio", None,
                    "needs plain and spec at C=1 and this GPU's roofline"))
    best = [r for r in checks if "dyn_ok" in r]
    out.append(("dynamic >= 0.95 x max(plain, spec) at every C", all(r["dyn_ok"] for r in best) if best else None,
                ", ".join(f"C={r['concurrency']}: {r['dyn_over_best']:.2f}" for r in best) or "needs all three"))
    eager = [r for r in checks if "eager_ok" in r]
    out.append(("dynamic >= 1.5 x dyn-eager at C >= 32", all(r["eager_ok"] for r in eager) if eager else None,
                ", ".join(f"C={r['concurrency']}: {r['dyn_over_eager']:.2f}" for r in eager) or "no C >= 32 run"))
    if any(v == "tiers" for v, _ in results):
        fixed = [r for r in checks if "tiers_ok" in r]
        out.append(("tiers >= 0.98 x the best fixed tier at every C", all(r["tiers_ok"] for r in fixed) if fixed
                    else None, ", ".join(f"C={r['concurrency']}: {r['tiers_over_fixed']:.2f}" for r in fixed)
                    or "needs plain or a fixed tier"))
        dyn = [r for r in checks if "tiers_dyn_ok" in r]
        out.append(("tiers > dynamic where a shorter tier beats plain and spec", all(r["tiers_dyn_ok"] for r in dyn)
                    if dyn else None, ", ".join(f"C={r['concurrency']}: {r['tiers_over_dyn']:.2f}" for r in dyn)
                    or "no C where a shorter tier beat both (or dynamic not run)"))
    misses = sum(r["misses"] for r in checks)
    out.append(("no graph misses", misses == 0, f"{misses} misses"))
    if identity is not None:
        tiers = identity.get("identical", {})
        shown = "".join(f", {v} {n}/{identity['requests']}" for v, n in tiers.items() if v not in ("spec", "dynamic"))
        out.append(("float32 greedy output of spec" + (", dynamic and every tier" if tiers else " and dynamic")
                    + " identical to plain", identity["ok"],
                    f"{identity['attention']} attention: spec {identity['spec_identical']}/{identity['requests']}, "
                    f"dynamic {identity['dynamic_identical']}/{identity['requests']}{shown} requests identical, "
                    f"switched modes: {identity['switched']}, misses {identity['graph_misses']}"))
    return out


def acceptance_lines(checks: list[tuple[str, bool | None, str]]) -> str:
    """One ``PASS``/``FAIL``/``N/A`` line per acceptance check."""
    word = {True: "PASS", False: "FAIL", None: "N/A "}
    return "\n".join(f"{word[ok]}  {name}: {detail}" for name, ok, detail in checks)
