"""Tables and the plot of the replay-latency benchmark: every column explained under its table, and a plot
that says on its face what ran."""
from __future__ import annotations

import logging
import statistics
import textwrap

import graphpool as gp

log = logging.getLogger(__name__)

def explain(text: str) -> str:
    """A table's legend: ``text`` wrapped under the table, indented two spaces."""
    return textwrap.fill(text, width=110, initial_indent="  ", subsequent_indent="  ")


GRAPH_METHODS = ["floor", "graphpool", "graphpool-run", "graphpool+prep", "triton-launch", "sglang", "foreach",
                 "graph-pad"]


def plot(rows: list[dict], modes: list[gp.Mode], sizes: list[int], path: str, what_ran: str) -> bool:
    """Host us per step vs batch size, one line per method, one panel per mode; the x axis is labelled
    with the captured batch sizes, and the title says what ran. Returns False, with a logged warning and
    nothing written, without matplotlib (an optional dependency: the JSON and CSV hold every figure)."""
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot written")
        return False
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.8), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for method in sorted({r["method"] for r in rows}):
            pts = sorted((r["bs"], r["host_us"]) for r in rows if r["mode"] == mode.name and r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set(xscale="log", yscale="log", xlabel="batch size (sequences)", ylabel="host us per step (median)",
               title=f"{mode.name} ({mode.tokens_per_seq} token/seq)")
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())  # the batch sizes are the ticks
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(what_ran, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def paired_overheads(floor: list[float], graphpool: list[float], sglang: list[float]) -> tuple[float, float, float]:
    """Median over rounds of graphpool's and SGLang-style staging's host time above the floor, and of
    their ratio, each computed within one round (the rounds' medians of each method, in the same order)."""
    gp_ovh = [g - f for f, g in zip(floor, graphpool)]
    sgl_ovh = [s - f for f, s in zip(floor, sglang)]
    ratios = [g / s if s > 0 else float("inf") for g, s in zip(gp_ovh, sgl_ovh)]
    med = statistics.median
    return med(gp_ovh), med(sgl_ovh), med(ratios)


def summary(rows: list[dict], modes: list[gp.Mode], sizes: list[int], cuda: bool, misses: int) -> str:
    """The tables printed last: host time per method, then (GPU) the GPU time against the floor."""
    get = {(r["mode"], r["bs"], r["method"]): r for r in rows}
    if not cuda:
        lines = ["host us per step (median), eager twin on CPU: not a speed measurement",
                 f"{'mode':<8}{'bs':>5}{'graphpool':>11}{'eager':>9}{'match':>7}"]
        lines += [f"{m.name:<8}{b:>5}{get[m.name, b, 'graphpool']['host_us']:>11.1f}{get[m.name, b, 'eager']['host_us']:>9.1f}"
                  f"{get[m.name, b, 'graphpool']['token_match']:>7.2f}" for m in modes for b in sizes]
        lines.append(explain("mode, bs: the step's mode and batch size (real = captured). graphpool: pool.stage + "
                             "pool.replay on the eager twin (checks, routing, torch staging, the step run eagerly). "
                             "eager: the step function called directly. match: share of greedy tokens pool.run "
                             "returned equal to the eager step's."))
        lines.append(f"graph misses for bs <= {sizes[-1]}: {misses}. CPU smoke run: the code path ran; for "
                     "host and GPU costs run on a CUDA GPU.")
        return "\n".join(lines)
    head = (f"{'mode':<7}{'bs':>5}{'floor':>8}{'run':>7}{'st+rp':>7}{'gp+prep':>8}{'triton':>8}{'sglang':>8}"
            f"{'foreach':>8}{'g-pad':>8}{'eager':>9}{'gp stage':>9}{'gp ovh':>8}{'sgl ovh':>8}{'ratio':>7}")
    lines, ok, ok_b2b = ["host us per step (median, GPU idle at the start of each step)", head], True, True
    b2b_lines = ["", "host us per step (median, steps issued back to back: the GPU busy, as in a decode loop)",
                 f"{'mode':<7}{'bs':>5}{'floor':>8}{'run':>7}{'sglang':>8}{'gp ovh':>8}{'sgl ovh':>8}{'ratio':>7}"]
    for m in modes:
        for b in sizes:
            h = {meth: get[m.name, b, meth]["host_us"] for meth in GRAPH_METHODS + ["eager"]}
            gp_ovh, sgl_ovh, ratio = paired_overheads(*(get[m.name, b, meth]["host_rounds_us"]
                                                        for meth in ("floor", "graphpool-run", "sglang")))
            stage = get[m.name, b, "graphpool"]["stage_us"]
            ok &= ratio <= 0.1 and stage <= 10.0
            lines.append(f"{m.name:<7}{b:>5}{h['floor']:>8.1f}{h['graphpool-run']:>7.1f}{h['graphpool']:>7.1f}"
                         f"{h['graphpool+prep']:>8.1f}{h['triton-launch']:>8.1f}{h['sglang']:>8.1f}{h['foreach']:>8.1f}"
                         f"{h['graph-pad']:>8.1f}{h['eager']:>9.1f}{stage:>9.1f}{gp_ovh:>8.1f}{sgl_ovh:>8.1f}{ratio:>7.3f}")
            hb = {meth: get[m.name, b, meth].get("host_b2b_us", float("nan")) for meth in ("floor", "graphpool-run", "sglang")}
            gb, sb = hb["graphpool-run"] - hb["floor"], hb["sglang"] - hb["floor"]
            rb = gb / sb if sb > 0 else float("inf")
            ok_b2b &= rb <= 0.1
            b2b_lines.append(f"{m.name:<7}{b:>5}{hb['floor']:>8.1f}{hb['graphpool-run']:>7.1f}{hb['sglang']:>8.1f}"
                             f"{gb:>8.1f}{sb:>8.1f}{rb:>7.3f}")
    lines.append(explain(
        "mode, bs: the step's mode and batch size (real = captured). floor: the step's graph without staging, "
        "replayed on buffers staged beforehand. run: graphpool's pool.run (validate, route, write the ring row, "
        "replay; the graph's first node stages). st+rp: the same as pool.stage + pool.replay. gp+prep: graphpool "
        "with a prepare hook (staging graph, hook, step graph). triton: the staging kernel launched eagerly, then "
        "the step graph. sglang: SGLang-style fills + slice copies, then the graph. foreach: fills + grouped "
        "_foreach_copy_. g-pad: grouped copies of the real rows + a device count, the graph pads. eager: no "
        "graph. gp stage: pool.stage alone (validate + route + stage). gp ovh, sgl ovh: run and sglang above the "
        "floor, and ratio: gp ovh / sgl ovh (target <= 0.1), each the median over rounds of that round's figure "
        "(a round times every method in turn, so a swing of the machine's speed reaches all three alike)."))
    lines += b2b_lines
    lines.append(explain(
        "The same methods timed inside the back-to-back blocks of the GPU table below: the host never waits "
        "for the GPU, and each method's code stays warm in the CPU caches, as in a serving loop."))
    lines += ["", "GPU us per step (median, CUDA events around staging + replay)",
              f"{'mode':<7}{'bs':>5}{'floor':>9}{'gpool':>9}{'gpool-floor':>12}{'sglang':>9}{'match':>7}"
              f"{'b2b floor':>11}{'b2b gpool':>11}{'b2b added':>11}"]
    added = []
    for m in modes:
        for b in sizes:
            g = {meth: get[m.name, b, meth]["gpu_us"] for meth in ("floor", "graphpool", "sglang")}
            f2, g2 = (get[m.name, b, meth].get("gpu_b2b_us", float("nan")) for meth in ("floor", "graphpool"))
            added.append(g2 - f2)
            lines.append(f"{m.name:<7}{b:>5}{g['floor']:>9.1f}{g['graphpool']:>9.1f}{g['graphpool'] - g['floor']:>12.1f}"
                         f"{g['sglang']:>9.1f}{get[m.name, b, 'graphpool']['token_match']:>7.2f}"
                         f"{f2:>11.1f}{g2:>11.1f}{g2 - f2:>11.1f}")
    lines.append(explain(
        "floor: GPU time of the step's graph alone (no staging), replayed on pre-staged buffers: the GPU floor. "
        "gpool: graphpool's step, its in-graph staging node included. gpool-floor: what graphpool's staging "
        "adds on the GPU, with graphpool's host staging time (the GPU starts idle, so it waits for the host). "
        "sglang: the SGLang-style step (its copies and fills are separate launches). match: share of greedy "
        "tokens pool.run returned equal to the eager step's (bf16 can break near-ties). b2b floor, b2b gpool: "
        "GPU us per step over blocks of steps issued back to back (the host ahead of the GPU, so this is the "
        "GPU's own time; two untimed steps lead each block in); b2b added: what staging costs on the GPU (the "
        "in-graph staging node; issue 14's target: <= 2 us)."))
    lines.append(f"graph misses for bs <= {sizes[-1]}: {misses}")
    lines.append(f"acceptance (ratio <= 0.1 and graphpool validate+route+stage <= 10 us at every key, no misses): "
                 f"idle-start {'PASS' if ok and misses == 0 else 'FAIL'}, back to back "
                 f"{'PASS' if ok_b2b and misses == 0 else 'FAIL'}")
    lines.append(f"acceptance (staging's GPU cost, b2b added <= 2 us at every key): "
                 f"{'PASS' if all(a <= 2.0 for a in added) else 'FAIL'} (max {max(added):.1f} us)")
    return "\n".join(lines)
