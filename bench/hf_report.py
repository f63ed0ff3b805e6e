"""bench/hf_decode.py's results: the points, the issue's goals as checks, the table, the JSON, CSV and plot."""
from __future__ import annotations

import csv
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from graphpool.bench.outputs import OutputSet

VARIANTS = ("hf-eager", "hf-static", "hf-lookup", "gp-plain", "gp-lookup")
LETTER = dict(zip(VARIANTS, "abcde"))


@dataclass
class Run:
    """One (variant, batch size) point. ``error`` says why a point has no figure (failed, skipped, refused)."""

    variant: str
    bs: int
    tokens_per_s: float | None = None
    seconds: float | None = None          # median timed call
    first_call_s: float | None = None     # the warm-up call (compiles, for hf-static on CUDA)
    compile_s: float | None = None        # hf-static: first call minus a timed call
    accept: float | None = None           # gp-lookup: tokens per sequence per verify step
    steps: int | None = None
    verify_steps: int | None = None
    misses: int | None = None
    step_ms: float | None = None          # gp: mean wall time of a decode-loop step
    match_vs_eager: float | None = None   # rows whose tokens equal hf-eager's (bf16: a near-tie can flip one)
    error: str | None = None
    tokens: list = field(default_factory=list, repr=False)


def _points(runs: list[Run]) -> dict[tuple[str, int], Run]:
    return {(r.variant, r.bs): r for r in runs}


def _tps(points: dict, variant: str, bs: int) -> float | None:
    run = points.get((variant, bs))
    return run.tokens_per_s if run is not None else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def add_agreement(runs: list[Run]) -> None:
    """Each graphpool point's share of rows equal to hf-eager's at the same batch size."""
    points = _points(runs)
    for run in runs:
        base = points.get(("hf-eager", run.bs))
        if run.variant.startswith("gp-") and run.tokens and base is not None and base.tokens:
            run.match_vs_eager = sum(a == b for a, b in zip(run.tokens, base.tokens)) / len(base.tokens)


def check_goals(runs: list[Run], steps: dict[str, float], judged: bool, sampled: bool = False) -> list[dict[str, Any]]:
    """Issue 27's goals, each ``{"goal", "value", "status"}``: PASS, FAIL, n.a. (no figure), or not judged (smoke).
    ``sampled``: the variants sampled, so no row's tokens are compared with (a)'s."""
    if not sampled:
        add_agreement(runs)
    points = _points(runs)
    sizes = sorted({r.bs for r in runs})
    goals = []

    def goal(text: str, value: str, ok: bool | None) -> None:
        status = "n.a." if ok is None else ("PASS" if ok else "FAIL")
        goals.append({"goal": text, "value": value, "status": status if judged else f"not judged (smoke; {status})"})

    r = _ratio(_tps(points, "gp-plain", 1), _tps(points, "hf-eager", 1))
    goal("(d) >= 2x (a) at bs 1", f"{r:.2f}x" if r else "no figure", None if r is None else r >= 2.0)
    ratios = {bs: _ratio(_tps(points, "gp-plain", bs), _tps(points, "hf-static", bs)) for bs in sizes}
    have = {bs: x for bs, x in ratios.items() if x is not None}
    missing = [bs for bs in sizes if bs not in have]
    goal("(d) >= 1.0x (b) at every bs measured", ", ".join(f"bs {bs}: {x:.2f}x" for bs, x in have.items())
         + (f"; no (b) figure at bs {missing}" if missing else ""),
         all(x >= 1.0 for x in have.values()) if have else None)
    r = _ratio(steps.get("verify"), steps.get("decode"))
    goal("graphed verify step <= 1.3x graphed plain step at bs 1",
         f"{steps['verify']:.3f} / {steps['decode']:.3f} ms = {r:.2f}x" if r else "no figure",
         None if r is None else r <= 1.3)
    paying = {bs: (points[("gp-lookup", bs)].accept,
                   _ratio(_tps(points, "gp-lookup", bs), _tps(points, "gp-plain", bs)))
              for bs in sizes if ("gp-lookup", bs) in points and (points[("gp-lookup", bs)].accept or 0) >= 1.5}
    accepts = ", ".join(f"bs {r.bs}: {r.accept:.2f}" for r in runs if r.variant == "gp-lookup" and r.accept)
    goal("(e) >= 1.0x (d) where acceptance >= 1.5",
         (", ".join(f"bs {bs}: {x:.2f}x (accept {a:.2f})" for bs, (a, x) in paying.items() if x) if paying else
          f"acceptance below 1.5 at every bs ({accepts or 'no verify step'})"),
         None if not paying else all(x is not None and x >= 1.0 for _, x in paying.values()))
    lookup_errors = {bs: points[("hf-lookup", bs)].error or "" for bs in sizes if ("hf-lookup", bs) in points}
    refused = [bs for bs, error in lookup_errors.items() if bs > 1 and "refused" in error]
    batched = [bs for bs in refused if _tps(points, "gp-lookup", bs)]
    goal("(e) batched where (c) cannot be", f"(c) refused at bs {refused}; (e) ran at bs {batched}",
         None if not refused else batched == refused)
    return goals


def _fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def table(runs: list[Run], steps: dict[str, float], goals: list[dict], meta: dict) -> str:
    """The short table printed last: tokens/s per variant and batch size, the ratios, then the goals."""
    points = _points(runs)
    sizes = sorted({r.bs for r in runs})
    head = (f"{'bs':>3} " + " ".join(f"{LETTER[v] + ' ' + v:>12}" for v in VARIANTS)
            + f" {'d/a':>6} {'d/b':>6} {'e/d':>6} {'accept':>6} {'match d,e':>9}")
    lines = [f"hf_decode: {meta['model']} in {meta['dtype']} on {meta['device_name']}, tokens/s (all rows, "
             f"{meta['new_tokens']} new tokens each):", head]
    for bs in sizes:
        e, d = points.get(("gp-lookup", bs)), points.get(("gp-plain", bs))
        match = "/".join(_fmt(x.match_vs_eager if x else None, ".2f") for x in (d, e))
        lines.append(f"{bs:>3} " + " ".join(f"{_fmt(_tps(points, v, bs)):>12}" for v in VARIANTS)
                     + f" {_fmt(_ratio(_tps(points, 'gp-plain', bs), _tps(points, 'hf-eager', bs)), '.2f'):>6}"
                     + f" {_fmt(_ratio(_tps(points, 'gp-plain', bs), _tps(points, 'hf-static', bs)), '.2f'):>6}"
                     + f" {_fmt(_ratio(_tps(points, 'gp-lookup', bs), _tps(points, 'gp-plain', bs)), '.2f'):>6}"
                     + f" {_fmt(e.accept if e else None, '.2f'):>6} {match:>9}")
    compiles = ", ".join(f"bs {r.bs} {r.compile_s:.0f} s" for r in runs if r.variant == "hf-static" and r.compile_s)
    skipped = [r for r in runs if r.error and r.error.startswith("skipped")]
    # the reason each skip recorded: the compile budget and the run's deadline call for different flags
    why = " or ".join(sorted({"the run's deadline, --deadline-s" if "deadline" in r.error else
                              "a failed compile" if "failed" in r.error else
                              "the compile budget, --compile-budget-s" for r in skipped}))
    errors = sorted({f"{r.variant} bs {r.bs}: {r.error}" for r in runs
                     if r.error and not r.error.startswith(("skipped", "refused"))})
    lines += [f"graphpool capture {_fmt(meta['capture_s'], '.2f')} s (all graphs); (b) compile: {compiles or '-'}"
              + (f"; (b) skipped at bs {[r.bs for r in skipped]} ({why})" if skipped else ""),
              "graphed step at bs 1, GPU ms: " + (", ".join(f"{m} {ms:.3f}" for m, ms in steps.items()) or "-")
              + "; accept: tokens per sequence per verify step of (e); match: rows equal to (a)'s",
              f"(d), (e): graphpool, {meta['graphpool_step']}; (b): transformers' static cache, "
              f"torch.compile(mode='reduce-overhead'); (c): batch 1 only; "
              + (f"every variant sampled {meta['choice']}: match not compared" if meta.get("sampled") else "greedy")]
    lines += [f"error: {e}" for e in errors]
    lines += [f"goal {g['status']:<5} {g['goal']}: {g['value']}" for g in goals]
    if meta["smoke"]:
        lines.append("hf_decode: smoke run done (CPU timings of the eager twin: no goal is judged)")
    else:
        passed = sum(g["status"] == "PASS" for g in goals)
        lines.append(f"goals: {passed} of {len(goals)} PASS"
                     + "".join(f"; {g['status']}: {g['goal']}" for g in goals if g["status"] != "PASS"))
    return "\n".join(lines)


def write_outputs(outputs: OutputSet, meta: dict, runs: list[Run], steps: dict[str, float], goals: list[dict]) -> None:
    """JSON (everything but the tokens), CSV (one row per point) and the plot, into ``outputs`` (all or none)."""
    json_path, csv_path, png_path = outputs.paths
    rows = [{k: v for k, v in asdict(r).items() if k != "tokens"} for r in runs]
    with open(outputs.temporary(json_path), "w") as f:
        json.dump({"meta": meta, "step_gpu_ms": steps, "goals": goals, "results": rows}, f, indent=1)
    with open(outputs.temporary(csv_path), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(runs, meta, outputs.temporary(png_path))


def plot(runs: list[Run], meta: dict, path: Any) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant in VARIANTS:
        pts = sorted((r.bs, r.tokens_per_s) for r in runs if r.variant == variant and r.tokens_per_s)
        if pts:
            ax.plot(*zip(*pts), marker="o", label=f"({LETTER[variant]}) {variant}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{meta['model']}, {meta['dtype']}, {meta['device_name']}"
                 + (" (smoke: not a measurement)" if meta["smoke"] else ""), fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
