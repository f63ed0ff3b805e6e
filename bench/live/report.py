"""The live benchmark's figures: per configuration, what was served and how fast, what its log says, and
how its greedy outputs compare with stock SGLang without speculation. One table, one JSON."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .client import Answer, PhaseResult, Request, check
from .logs import LogFacts


@dataclass
class ConfigResult:
    """One server configuration's run."""

    name: str
    title: str
    status: str = "not run"  # served / crashed / did not start / skipped (...)
    start_s: Optional[float] = None
    phases: List[PhaseResult] = field(default_factory=list)
    requests: Dict[str, Request] = field(default_factory=dict)
    log: Optional[LogFacts] = None
    notes: List[str] = field(default_factory=list)

    def answers(self, prefix: str = "") -> List[Answer]:
        return [a for p in self.phases for a in p.answers if p.name.startswith(prefix)]

    def problems(self, prefix: str = "") -> List[str]:
        return [f"{a.rid}: {msg}" for a in self.answers(prefix) if (msg := check(self.requests[a.rid], a))]

    def speed(self, concurrency: int) -> Optional[Dict[str, float]]:
        """Per-token latency (median over requests of server e2e latency / tokens, ms) and tokens/s
        (all tokens of the phase / its wall time) of the better run of the speed phase at ``concurrency``."""
        runs = []
        for phase in self.phases:
            if phase.name.startswith(f"speed{concurrency}.") and phase.answers and all(a.ok for a in phase.answers):
                per_token = [1e3 * (a.e2e_latency or a.seconds) / max(1, len(a.output_ids)) for a in phase.answers]
                runs.append({"itl_ms": statistics.median(per_token), "tok_s": phase.tokens / phase.wall_s})
        return max(runs, key=lambda r: r["tok_s"]) if runs else None

    def acceptance(self) -> Optional[float]:
        """Mean accepted tokens per verify step over answers that speculated (1 + correct / verifies)."""
        rates = [1 + (a.spec_num_correct_drafts or 0) / a.spec_verify_ct for a in self.answers()
                 if a.ok and a.spec_verify_ct]
        return statistics.mean(rates) if rates else None


def greedy_match(reference: ConfigResult, other: ConfigResult) -> Optional[Dict[str, Any]]:
    """Token-for-token comparison over the requests both served: requests identical, and the share of
    tokens before each request's first difference."""
    ref = {a.rid: a.output_ids for a in reference.answers() if a.ok and not a.rid.startswith("warm")}
    got = {a.rid: a.output_ids for a in other.answers() if a.ok and not a.rid.startswith("warm")}
    common = sorted(set(ref) & set(got))
    if not common:
        return None
    same, prefix, total, first_diff = 0, 0, 0, []
    for rid in common:
        a, b = ref[rid], got[rid]
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += a == b
        prefix += n
        total += max(len(a), len(b))
        if a != b and len(first_diff) < 5:
            first_diff.append(f"{rid}@{n}")
    return {"requests": len(common), "identical": same, "token_match": prefix / max(1, total),
            "first_diffs": first_diff}


def _fmt(value: Optional[float], spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table(results: Dict[str, ConfigResult], dtype: str, spec_flavour: str) -> str:
    """The summary table (last thing the benchmark prints)."""
    stock = results.get("stock")
    lines = [f"live SGLang 0.5.12.post1, dtype {dtype}, speculation {spec_flavour}; ITL = median e2e/token (ms), "
             f"tok/s = phase tokens / wall"]
    head = (f"{'config':<11} {'status':<12} {'ok/asked':>9} {'start s':>7} {'cap s':>6} {'graph MiB':>9} "
            f"{'acc':>4} {'C1 ITL':>6} {'C1 tok/s':>8} {'C8 ITL':>6} {'C8 tok/s':>8} {'C32 ITL':>7} {'C32 tok/s':>9} "
            f"{'greedy = stock':>16}")
    lines += [head, "-" * len(head)]
    for name, r in results.items():
        answers = r.answers()
        ok = sum(1 for a in answers if not check(r.requests[a.rid], a))
        cap, probe = (r.log.target_capture, r.log.target_probe) if r.log else (None, None)
        s = {c: r.speed(c) for c in (1, 8, 32)}
        match = greedy_match(stock, r) if stock is not None and r is not stock else None
        match_s = f"{match['identical']}/{match['requests']} {100 * match['token_match']:.0f}%" if match else "-"
        lines.append(
            f"{name:<11} {r.status[:12]:<12} {f'{ok}/{len(answers)}':>9} {_fmt(r.start_s, '.0f'):>7} "
            f"{_fmt(cap and cap['seconds'], '.2f'):>6} {_fmt(probe and probe['reserved_mib'], '.1f'):>9} "
            f"{_fmt(r.acceptance(), '.2f'):>4} "
            + " ".join(f"{_fmt(s[c] and s[c]['itl_ms'], '.2f'):>{w1}} {_fmt(s[c] and s[c]['tok_s'], '.0f'):>{w2}}"
                       for c, w1, w2 in ((1, 6, 8), (8, 6, 8), (32, 7, 9)))
            + f" {match_s:>16}")
    lines += [""] + verdicts(results)
    return "\n".join(lines)


def verdicts(results: Dict[str, ConfigResult]) -> List[str]:
    """The issue's acceptance items, each as one line: PASS / FAIL / n/a with the figure."""
    out = []
    sw, crash, stock, spec, nospec = (results.get(k) for k in ("gp-switch", "sgl-switch", "stock", "stock-spec",
                                                               "gp-nospec"))
    if sw and sw.log:
        probs = sw.problems("ramp")
        ramp_n = len(sw.answers("ramp"))
        reps, eager = sw.log.replays, sw.log.decode_eager
        good = ramp_n >= 200 and not probs and reps.get("DECODE", 0) > 0 and reps.get("TARGET_VERIFY", 0) > 0 \
            and not eager and sw.log.gp_fallbacks in ("", "none")
        out.append(f"[{'PASS' if good else 'FAIL'}] 1 ramp 1->32->1 on graphpool switch: {ramp_n - len(probs)}/{ramp_n} "
                   f"as asked; replays {reps}; flips {len(sw.log.flips)}; eager decode lines {len(eager)}; "
                   f"graphpool fallbacks: {sw.log.gp_fallbacks or 'none'}" + (f"; first problems {probs[:3]}" if probs else ""))
    if crash and crash.log:
        served = sw and sw.answers("burst") and not sw.problems("burst")
        out.append(f"[{'PASS' if crash.log.crash and served else 'FAIL'}] 2 switch over SGLang's runner: "
                   f"{crash.log.crash or 'no shape crash in log'}; graphpool switch served the same burst: {bool(served)}")
    if stock and sw:
        m = greedy_match(stock, sw)
        out.append(f"[{'PASS' if m and m['identical'] == m['requests'] else 'INFO'}] 3 greedy graphpool switch vs "
                   f"stock: {m}")
    for c in (1, 8, 32):
        a, b, n, d = (r.speed(c) if r else None for r in (stock, spec, nospec, sw))
        if a and n:
            out.append(f"[{'PASS' if n['tok_s'] >= a['tok_s'] else 'FAIL'}] 4 C={c} gp-nospec {n['tok_s']:.0f} tok/s vs "
                       f"stock {a['tok_s']:.0f} ({n['tok_s'] / a['tok_s']:.3f}x), ITL {n['itl_ms']:.2f} vs {a['itl_ms']:.2f} ms")
        if d and (a or b):
            best = max((x for x in (a, b) if x), key=lambda x: x["tok_s"])
            out.append(f"[{'PASS' if d['tok_s'] >= 0.95 * best['tok_s'] else 'FAIL'}] 4 C={c} gp-switch "
                       f"{d['tok_s']:.0f} tok/s vs best stock {best['tok_s']:.0f} ({d['tok_s'] / best['tok_s']:.3f}x)")
    if sw and nospec and (d := sw.speed(32)) and (n := nospec.speed(32)):
        # Both decode plainly at C=32: the difference is what a plain step of the switch adds (the draft
        # model's one-token extend that keeps its KV in step, and the bookkeeping).
        out.append(f"[INFO] plain-step cost at C=32: gp-switch {d['itl_ms']:.2f} ms/token vs gp-nospec "
                   f"{n['itl_ms']:.2f} ({d['itl_ms'] / n['itl_ms']:.2f}x)")
    host = {name: r.log.replay_host_us for name, r in results.items() if r.log and r.log.replay_host_us}
    if host:  # the runners' own host cost per replay, whatever the scheduler around them did in this run
        out.append("[INFO] target graph runner host us per replay (median of the probe's windows): " + ", ".join(
            f"{name} {statistics.median(v):.1f} ({len(v)} windows)" for name, v in host.items()))
    ps, pg = (spec.log.target_probe if spec and spec.log else None), (sw.log.target_probe if sw and sw.log else None)
    if ps and pg and ps["reserved_mib"] > 0:
        ratio = pg["reserved_mib"] / ps["reserved_mib"]
        out.append(f"[{'PASS' if ratio <= 1.10 else 'FAIL'}] 4 graph memory gp (DECODE+TARGET_VERIFY) "
                   f"{pg['reserved_mib']:.1f} MiB vs stock spec (TARGET_VERIFY) {ps['reserved_mib']:.1f} MiB: "
                   f"{ratio:.3f}x; capture {pg['seconds']:.2f} s vs {ps['seconds']:.2f} s")
    return out
