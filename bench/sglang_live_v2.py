"""Live SGLang 0.5.17 (runner API) on one H200 or H100 (the throughput phase needs the H200's memory): graphpool's
launcher and spec-v2 switch on a model of Llama-3.1-8B's shape (dummy weights, no tokenizer: requests by input ids)
against stock SGLang.

Three phases, each one device call with a deadline (``--phase``; most important first):

  correctness  Triton attention (FA3, SGLang's Hopper default, needs sglang-kernel's 1.1 GB flash_ops, which
               cannot travel; Triton also needs no host lengths under the overlap scheduler). Stock SGLang
               without speculation (the greedy reference), then graphpool's launcher with EAGLE3 spec v2 and
               the switch (off above 16 running requests, on at <= 12): topk 1 and 4 with the overlap scheduler
               (SGLang's default), topk 1 and 4 without. Each serves a ramp 1 -> 32 -> 1 of 204 requests with
               stop tokens and 21 aborts mid-stream.
  flashinfer   The same with FlashInfer attention (its reference, topk 1 and 4, overlap on); then stock
               --speculative-adaptive against graphpool's launcher on the same flags (its step 0 as plain steps),
               one step table (3 draft steps up to 16 requests, none above): graph memory and capture time of
               both, and the GPU time of a decode step at 32 requests (graphpool's plain DECODE step against
               adaptive's step 0) over a 15 s window at C = 32.
  throughput   Stock SGLang without speculation, graphpool without speculation, stock with EAGLE3, graphpool's
               switch: resident together (each on the same pinned cores, --sleep-on-idle), measured in turn,
               A/B/C/D, in timed windows of >= 10 s at C = 1, 8 and 32, two rounds each: median and spread
               (four need the H200's memory; on an H100, two calls of two, --configs).

Per server: ``--load-format dummy --skip-tokenizer-init --grammar-backend none --cuda-graph-max-bs-decode 32``,
prefill graphs off (alike for all), bfloat16. Writes the server logs, ``sglang_live_v2_<phase>.json`` and
``summary_<phase>.txt`` to ``--out`` (at most 8 files); prints a short table last. ``--server-module`` runs a
stand-in server (tests/live_fake_server.py) for dry runs on a CPU machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.live import logs, workloads  # noqa: E402
from bench.live.client import Request, check, run_phase, wait_healthy  # noqa: E402
from bench.live.report import ConfigResult, greedy_match  # noqa: E402
from bench.live.servers import Server, ServerSpec, free_port, parse_cpus  # noqa: E402
from bench.live.window import Window, run_window, summary  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
PHASES = ("correctness", "flashinfer", "throughput")
GP, SGL = "graphpool.integrations.sglang.launch", "sglang.launch_server"
OFF_ABOVE, ON_AT = 16, 12
CONCURRENCY = (1, 8, 32)
ROUNDS = 2           # throughput: timed windows per server and concurrency
MAX_TOKENS = 16384   # KV pool per server: 32 requests of <= 280 tokens need about 9k
STATIC_GIB = 26      # weights (16.1 GiB), an EAGLE3 draft (2.6), KV (2.2) and margin, per resident server


@dataclass
class Config:
    """One server of a phase: its flags, whether it is the greedy reference, what the phase measures."""

    name: str
    title: str
    module: str
    args: List[str]
    reference: bool = False
    switch: bool = False


def server_args(models: str, attention: str, *, overlap: bool = True, topk: Optional[int] = None,
                switch: bool = False, adaptive: bool = False, mem_fraction: float = 0.5,
                sleep_on_idle: bool = False) -> List[str]:
    """The flags of one server (``topk`` None: no speculation)."""
    args = ["--model-path", f"{models}/llama-3.1-8b", "--load-format", "dummy", "--skip-tokenizer-init",
            "--dtype", "bfloat16", "--attention-backend", attention, "--sampling-backend", "pytorch",
            "--grammar-backend", "none", "--cuda-graph-max-bs-decode", "32", "--cuda-graph-backend-prefill", "disabled",
            "--max-running-requests", "32", "--max-total-tokens", str(MAX_TOKENS), "--context-length", "4096",
            "--mem-fraction-static", f"{mem_fraction:.3f}", "--decode-log-interval", "20", "--random-seed", "0"]
    if not overlap:
        args.append("--disable-overlap-schedule")
    if sleep_on_idle:
        args.append("--sleep-on-idle")
    if topk is not None:
        args += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", f"{models}/eagle3-llama-3.1-8b",
                 "--speculative-draft-load-format", "dummy", "--speculative-num-steps", "3",
                 "--speculative-eagle-topk", str(topk), "--speculative-num-draft-tokens", "4" if topk == 1 else "16"]
    if adaptive:
        args += ["--speculative-adaptive", "--speculative-adaptive-config", f"{models}/adaptive.json"]
    if switch:
        args += ["--graphpool-spec-off-above", str(OFF_ABOVE), "--graphpool-spec-on-at-or-below", str(ON_AT)]
    return args


def phase_configs(phase: str, models: str, only: Optional[List[str]] = None) -> List[Config]:
    """The servers of a phase, in the order they run (the reference first); ``only`` keeps those named and the
    reference, which the others' greedy output is checked against."""
    configs = _all_configs(phase, models)
    if only:
        unknown = sorted(set(only) - {c.name for c in configs})
        if unknown:
            raise ValueError(f"--configs: {', '.join(unknown)} not in phase {phase}; expected some of "
                             f"{', '.join(c.name for c in configs)}")
        configs = [c for c in configs if c.reference or c.name in only]
    return configs


def _all_configs(phase: str, models: str) -> List[Config]:
    if phase == "correctness":
        return [Config("stock", "SGLang, no speculation (reference)", SGL, server_args(models, "triton"),
                       reference=True),
                *[Config(f"gp-k{k}-{'ovl' if ovl else 'sync'}",
                         f"graphpool switch, topk {k}, overlap {'on' if ovl else 'off'}",
                         GP, server_args(models, "triton", overlap=ovl, topk=k, switch=True), switch=True)
                  for ovl, k in ((True, 1), (True, 4), (False, 1), (False, 4))]]
    if phase == "flashinfer":
        return [Config("stock-fi", "SGLang, no speculation, FlashInfer (reference)", SGL,
                       server_args(models, "flashinfer"), reference=True),
                *[Config(f"gp-fi-k{k}", f"graphpool switch, FlashInfer, topk {k}", GP,
                         server_args(models, "flashinfer", topk=k, switch=True), switch=True) for k in (1, 4)],
                Config("stock-adaptive", "SGLang --speculative-adaptive", SGL,
                       server_args(models, "triton", topk=1, adaptive=True)),
                Config("gp-adaptive", "graphpool, --speculative-adaptive (step 0 plain)", GP,
                       server_args(models, "triton", topk=1, adaptive=True))]
    return [Config("stock", "SGLang, no speculation", SGL, server_args(models, "triton", sleep_on_idle=True)),
            Config("gp-nospec", "graphpool, no speculation", GP, server_args(models, "triton", sleep_on_idle=True)),
            Config("stock-spec", "SGLang, EAGLE3 topk 1", SGL,
                   server_args(models, "triton", topk=1, sleep_on_idle=True)),
            Config("gp-switch", "graphpool switch, EAGLE3 topk 1", GP,
                   server_args(models, "triton", topk=1, switch=True, sleep_on_idle=True), switch=True)]


@dataclass
class Outcome:
    """What a server did in this run."""

    result: ConfigResult
    windows: List[Window] = field(default_factory=list)
    url: str = ""  # where it served (its port may have moved past one taken)


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a, self.t0 = a, time.perf_counter()
        probe = os.path.join(HERE, "live", "probe_v2")
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", GRAPHPOOL_REPLAY_LOG_EVERY="200",
                        PYTHONPATH=os.pathsep.join(p for p in (probe, os.environ.get("PYTHONPATH", "")) if p))
        self.out: Dict[str, Outcome] = {}
        self.reference: Optional[str] = None  # the greedy reference of this phase
        self.switches: List[str] = []          # servers whose ramp is checked (graphpool's switch)
        self.started = 0

    def left(self) -> float:
        return self.a.deadline_s - (time.perf_counter() - self.t0)

    def say(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:5.0f}s] {msg}", flush=True)

    # ------------------------------------------------------------------------------- servers
    def start(self, cfg: Config, port: int, extra: Optional[List[str]] = None) -> Optional[Server]:
        """Start a server on ``port`` (or the next free one: its URL goes to ``self.out[cfg.name].url``) and wait
        for /health; None (status noted) when it does not come up in time."""
        res = ConfigResult(cfg.name, cfg.title)
        self.out[cfg.name] = Outcome(res)
        budget = self.a.start_s * (1.6 if self.started == 0 else 1.0)
        if self.left() < budget * 0.6 + 20:
            res.status = f"skipped ({self.left():.0f}s left)"
            self.say(f"{cfg.name}: {res.status}")
            return None
        # A port held by any socket of the machine (another server, or an outgoing connection that drew it as its
        # ephemeral port) would make the server die at its bind and lose the config's measurements.
        free = free_port(port)
        if free is None:
            res.status = "no free port"
            self.say(f"{cfg.name}: port {port} and those above it are all in use: not started")
            return None
        if free != port:
            res.notes.append(f"port {port} in use: served on {free}")
            self.say(f"{cfg.name}: port {port} in use, serving on {free} instead")
        port, self.out[cfg.name].url = free, f"http://127.0.0.1:{free}"
        args = cfg.args + (extra or []) + ["--port", str(port)]
        # A dry run's stand-in serves every config: it is told which ones graphpool's launcher would serve.
        env = {"FAKE_SERVER_GRAPHPOOL": "1"} if self.a.server_module and cfg.module == GP else {}
        spec = ServerSpec(cfg.name, cfg.title, self.a.server_module or cfg.module, args, env=env)
        server = Server(spec, self.a.python, os.path.abspath(os.path.join(self.a.out, f"{cfg.name}.log")), self.env,
                        cwd=self.a.server_cwd, cpus=self.a.cpus)
        self.say(f"{cfg.name}: starting ({cfg.title})")
        res.start_s = wait_healthy(self.out[cfg.name].url, server.alive, min(budget, self.left() - 15))
        if res.start_s is None:
            res.status = "did not start" if not server.alive() else "start timeout"
            self.stop(cfg.name, server)
            last = server.log_text().strip().splitlines()[-1:]
            res.notes.append(f"its log ends: {last[0][:200] if last else '(empty)'}")
            return None
        self.started += 1
        res.status = "served"
        self.say(f"{cfg.name}: healthy after {res.start_s:.0f}s")
        return server

    def stop(self, name: str, server: Server) -> None:
        res = self.out[name].result
        server.stop()
        res.log = logs.parse(server.log_text())
        if (res.log.crash or res.log.tracebacks) and res.status == "served":
            res.status = "crashed"
        self.say(f"{name}: {res.status}; replays {res.log.replays}, fallbacks {res.log.gp_fallbacks or '-'}, "
                 f"graphs {res.log.graph_totals()}")

    def phase(self, name: str, url: str, cfg: Config, reqs: List[Request], concurrency: int) -> bool:
        res = self.out[cfg.name].result
        res.requests.update({r.rid: r for r in reqs})
        p = run_phase(url, name, reqs, concurrency, timeout=max(10.0, min(120.0, self.left() - 10)))
        res.phases.append(p)
        bad = [a for a in p.answers if not a.ok]
        self.say(f"{cfg.name}: {name} C={concurrency}: {len(reqs) - len(bad)}/{len(reqs)} HTTP 200, {p.tokens} tokens "
                 f"in {p.wall_s:.1f}s")
        return not bad

    # ------------------------------------------------------------------------------- phases
    def run_ramps(self, configs: List[Config]) -> None:
        """Each server alone: warm-up, the ramp with stops and aborts, stop (the reference first)."""
        scale = 0.1 if self.a.quick else 1.0
        for i, cfg in enumerate(configs):
            if cfg.reference:
                self.reference = cfg.name
            if cfg.switch:
                self.switches.append(cfg.name)
            if cfg.name.endswith("adaptive"):
                self.run_adaptive(cfg, self.a.port + i)
                continue
            server = self.start(cfg, self.a.port + i)
            if server is None:
                continue
            url = self.out[cfg.name].url
            try:
                if self.phase("warm", url, cfg, workloads.warmup(), 8):
                    for k, (c, reqs) in enumerate(workloads.ramp(scale, abort_every=3 if self.a.quick else 7)):
                        if self.left() < 20:
                            self.out[cfg.name].result.notes.append(f"ramp cut at phase {k}: deadline")
                            break
                        if not self.phase(f"ramp-c{c}-{k}", url, cfg, reqs, c) and not server.alive():
                            break
            finally:
                self.stop(cfg.name, server)

    def run_adaptive(self, cfg: Config, port: int) -> None:
        """Start (graph memory, capture time), then a 15 s window at C = 32: the step GPU time above the threshold."""
        server = self.start(cfg, port)
        if server is None:
            return
        url = self.out[cfg.name].url
        try:
            self.phase("warm", url, cfg, workloads.warmup(), 8)
            seconds = 0.5 if self.a.quick else 15.0
            win = run_window(url, cfg.name, 32, seconds, lambda rid: Request(rid, workloads.prompt(rid), 128))
            self.out[cfg.name].windows.append(win)
            self.say(f"{cfg.name}: C=32 window {win.tok_s:.0f} tok/s over {len(win.answers)} requests")
        finally:
            self.stop(cfg.name, server)

    def run_throughput(self, configs: List[Config]) -> None:
        """Every server resident (started in turn, each taking its share of the free memory), then windows in
        turn: for each C, round 1 A/B/C/D, round 2 A/B/C/D. A window not measured is noted with its reason."""
        free, need = self.free_gib(), len(configs) * STATIC_GIB
        # The last servers would die at their start, minutes in (stand-ins of a dry run need no GPU memory).
        if not self.a.server_module and free is not None and free < need:
            raise SystemExit(f"sglang_live_v2: the throughput phase keeps its {len(configs)} servers resident, about "
                             f"{need} GiB of GPU memory; {free:.0f} GiB are free: name fewer with --configs (of "
                             f"{', '.join(c.name for c in configs)})")
        servers: Dict[str, Server] = {}
        try:
            for i, cfg in enumerate(configs):
                fraction = self.mem_fraction()
                cfg.args[cfg.args.index("--mem-fraction-static") + 1] = f"{fraction:.3f}"
                server = self.start(cfg, self.a.port + i)
                if server is not None:
                    servers[cfg.name] = server
                    self.phase("warm", self.out[cfg.name].url, cfg, workloads.warmup(), 8)
            seconds = 0.15 if self.a.quick else self.a.window_s
            for c in CONCURRENCY:
                for r in range(ROUNDS):
                    for cfg in configs:
                        if cfg.name not in servers:
                            continue  # its status says why
                        if self.left() < seconds + 25:
                            self.out[cfg.name].result.notes.append(f"C={c} round {r + 1} not measured: deadline")
                            continue
                        max_new = 64 if c == 1 else 128
                        win = run_window(self.out[cfg.name].url, cfg.name, c, seconds,
                                         lambda rid, n=max_new: Request(rid, workloads.prompt(rid), n), round_no=r)
                        self.out[cfg.name].windows.append(win)
                        self.say(f"{cfg.name}: C={c} round {r + 1}: {win.tok_s:.0f} tok/s, {len(win.answers)} requests "
                                 f"in {win.wall_s:.1f}s" + (f", {win.failed} failed" if win.failed else ""))
        finally:
            for name, server in servers.items():
                self.stop(name, server)

    def free_gib(self) -> Optional[float]:
        """GPU memory free now; None without a GPU (a dry run)."""
        try:
            return float(subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                                        capture_output=True, text=True, timeout=20).stdout.split()[0]) / 1024
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            return None

    def mem_fraction(self) -> float:
        """``--mem-fraction-static`` giving this server about STATIC_GIB of the memory free now (SGLang takes
        the fraction of what is free when it starts)."""
        free = self.free_gib()
        return 0.2 if free is None else min(0.9, STATIC_GIB / free)

    # ------------------------------------------------------------------------------- report
    def report(self, phase: str) -> str:
        lines = [f"live SGLang 0.5.17, Llama-3.1-8B shape (dummy weights), phase {phase}, "
                 f"{time.perf_counter() - self.t0:.0f}s"]
        if phase == "throughput":
            lines += self.throughput_table()
        else:
            lines += self.serving_table()
        if phase == "flashinfer":
            lines += self.adaptive_lines()
        return "\n".join(lines)

    def serving_table(self) -> List[str]:
        head = (f"{'config':<15} {'status':<12} {'ok/asked':>9} {'aborts':>7} {'start s':>7} {'graph MiB':>9} "
                f"{'DECODE':>7} {'VERIFY':>7} {'eager':>6} {'flips':>5} {'greedy = reference':>19}")
        out = [head, "-" * len(head)]
        ref = self.out[self.reference].result if self.reference in self.out else None
        verdicts = []
        for name, o in self.out.items():
            if name.endswith("adaptive"):
                continue
            r = o.result
            answers = r.answers("ramp")
            ok = sum(1 for a in answers if not check(r.requests[a.rid], a))
            aborted = [a for a in answers if r.requests[a.rid].abort_after]
            aborts_ok = sum(1 for a in aborted if (a.finish_reason or {}).get("type") == "abort")
            log_ = r.log or logs.LogFacts()
            eager = len(log_.decode_eager) + sum(int(x.rsplit(":", 1)[1]) for x in
                                                 (log_.gp_fallbacks or "").split(", ") if ":" in x)
            totals = log_.graph_totals()
            match = greedy_match(ref, _without_aborts(r)) if ref is not None and r is not ref else None
            match_s = f"{match['identical']}/{match['requests']} {100 * match['token_match']:.0f}%" if match else "-"
            out.append(f"{name:<15} {r.status[:12]:<12} {f'{ok}/{len(answers)}':>9} {f'{aborts_ok}/{len(aborted)}':>7} "
                       f"{_f(r.start_s, '.0f'):>7} {_f(totals and totals['reserved_mib'], '.0f'):>9} "
                       f"{log_.replays.get('DECODE', 0):>7} {log_.replays.get('TARGET_VERIFY', 0):>7} {eager:>6} "
                       f"{len(log_.flips):>5} {match_s:>19}")
            if name in self.switches:
                # an abort may land after a short request's last token; most must land mid-stream
                good = (r.status == "served" and answers and ok == len(answers) and eager == 0
                        and 2 * aborts_ok >= len(aborted) and log_.replays.get("DECODE", 0) > 0
                        and log_.replays.get("TARGET_VERIFY", 0) > 0)
                verdicts.append(f"[{'PASS' if good else 'FAIL'}] {name}: ramp {ok}/{len(answers)} as asked (aborts "
                                f"{aborts_ok}/{len(aborted)} aborted mid-stream), replays {log_.replays or '-'}, "
                                f"{eager} eager steps, status {r.status}" + (f"; problems {r.problems('ramp')[:2]}"
                                                                             if ok < len(answers) else ""))
                if match:
                    verdicts.append(f"[{'PASS' if match['identical'] == match['requests'] else 'FAIL'}] {name}: greedy "
                                    f"= reference for {match['identical']}/{match['requests']} requests "
                                    f"({100 * match['token_match']:.1f}% of tokens; first differences "
                                    f"{match['first_diffs']})")
        return out + [""] + verdicts

    def adaptive_lines(self) -> List[str]:
        s, g = (self.out.get(n) for n in ("stock-adaptive", "gp-adaptive"))
        if not (s and g and s.result.log and g.result.log):
            return ["[n/a] adaptive side by side: not run"]
        st, gt = s.result.log.graph_totals(), g.result.log.graph_totals()
        ss, gs = s.result.log.step_gpu("bs=32 tok=1"), g.result.log.step_gpu("bs=32 tok=1")
        out = [f"[INFO] graphs (target + draft + adaptive states): stock-adaptive "
               f"{_f(st and st['reserved_mib'], '.0f')} MiB "
               f"in {_f(st and st['seconds'], '.1f')} s; gp-adaptive {_f(gt and gt['reserved_mib'], '.0f')} MiB in "
               f"{_f(gt and gt['seconds'], '.1f')} s",
               f"[INFO] step GPU time at 32 requests (1 token per request): stock adaptive step 0 {_f(ss, '.0f')} us, "
               f"graphpool plain DECODE step {_f(gs, '.0f')} us" + (f" ({gs / ss:.3f}x)" if ss and gs else "")]
        for o in (s, g):
            if o.windows:
                out.append(f"[INFO] {o.result.name}: C=32 {o.windows[0].tok_s:.0f} tok/s "
                           f"({len(o.windows[0].answers)} requests)")
        return out

    def throughput_table(self) -> List[str]:
        head = f"{'config':<11} " + " ".join(f"{f'C={c} tok/s (min-max, n)':>26}" for c in CONCURRENCY)
        out, stats = [head, "-" * len(head)], {}
        for name, o in self.out.items():
            stats[name] = {c: summary([w for w in o.windows if w.concurrency == c]) for c in CONCURRENCY}
            cells = []
            for c in CONCURRENCY:
                x = stats[name][c]
                per_round = x["requests"] // max(1, x["rounds"]) if x else 0
                cells.append(f"{x['median']:.0f} ({x['min']:.0f}-{x['max']:.0f}, {x['rounds']}x{per_round})"
                             if x else "-")
            out.append(f"{name:<11} " + " ".join(f"{cell:>26}" for cell in cells))
        out.append("")
        for c in CONCURRENCY:
            st, gn, ss, gs = (stats.get(n, {}).get(c) for n in ("stock", "gp-nospec", "stock-spec", "gp-switch"))
            if st and gn:
                ratio = gn["median"] / st["median"]
                out.append(f"[{'PASS' if ratio >= 0.97 else 'FAIL'}] C={c} graphpool without speculation {ratio:.3f}x "
                           f"stock ({gn['median']:.0f} vs {st['median']:.0f} tok/s; "
                           f"{min(gn['rounds'], st['rounds'])} rounds)")
            # Named: with --configs one stock may be missing, and "the better stock" would then be the only one.
            stocks = [(name, x) for name, x in (("stock", st), ("stock-spec", ss)) if x]
            if gs and stocks:
                name, best = max(stocks, key=lambda nx: nx[1]["median"])
                ratio = gs["median"] / best["median"]
                out.append(f"[{'PASS' if ratio >= 0.97 else 'FAIL'}] C={c} graphpool switch {ratio:.3f}x the better "
                           f"stock of {len(stocks)}, {name} ({gs['median']:.0f} vs {best['median']:.0f} tok/s)")
        return out + self.missing_windows()

    def missing_windows(self) -> List[str]:
        """One line per server short of a window: which ones, and why (its status, or the deadline)."""
        out = []
        for name, o in self.out.items():
            have = {(w.concurrency, w.round) for w in o.windows}
            gone = [f"C={c} round {r + 1}" for c in CONCURRENCY for r in range(ROUNDS) if (c, r) not in have]
            if gone:
                why = "; ".join(([] if o.result.status == "served" else [o.result.status]) + o.result.notes)
                out.append(f"[MISSING] {name}: {len(gone)} of {len(CONCURRENCY) * ROUNDS} windows not measured "
                           f"({', '.join(gone)}): {why}")
        return out

    def write(self, phase: str, text: str) -> None:
        data = {"phase": phase, "elapsed_s": time.perf_counter() - self.t0, "configs": {
            n: {"status": o.result.status, "start_s": o.result.start_s, "notes": o.result.notes,
                "log": o.result.log.as_dict() if o.result.log else None,
                "phases": [p.as_dict() for p in o.result.phases],
                "requests": {k: asdict(v) for k, v in o.result.requests.items()},
                "windows": [w.as_dict() for w in o.windows]} for n, o in self.out.items()}}
        with open(os.path.join(self.a.out, f"sglang_live_v2_{phase}.json"), "w") as f:
            json.dump(data, f)
        with open(os.path.join(self.a.out, f"summary_{phase}.txt"), "w") as f:
            f.write(text + "\n")

    def run(self) -> int:
        configs = phase_configs(self.a.phase, os.path.abspath(self.a.models), self.a.configs)
        if self.a.phase == "throughput":
            self.run_throughput(configs)
        else:
            self.run_ramps(configs)
        text = self.report(self.a.phase)
        self.write(self.a.phase, text)
        print(text, flush=True)
        return 0


def _without_aborts(result: ConfigResult) -> ConfigResult:
    """The result with its aborted requests left out (their length depends on when the abort landed)."""
    kept = ConfigResult(result.name, result.title, result.status)
    kept.requests = result.requests
    for p in result.phases:
        q = type(p)(p.name, p.concurrency, p.wall_s, [a for a in p.answers if not result.requests[a.rid].abort_after])
        kept.phases.append(q)
    return kept


def _f(value: Optional[float], spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=PHASES, required=True)
    p.add_argument("--configs", default=None, type=lambda v: [n for n in v.split(",") if n],
                   help="run only these servers of the phase (and its reference), e.g. gp-k1-sync,gp-k4-sync")
    p.add_argument("--out", default=os.environ.get("OUT", "out/sglang_live_v2"))
    p.add_argument("--models", default=".sgl17/models",
                   help="folder with llama-3.1-8b/, eagle3-llama-3.1-8b/, adaptive.json")
    p.add_argument("--deadline-s", type=float, default=float(os.environ.get("DEADLINE_S", 540)))
    p.add_argument("--start-s", type=float, default=110.0,
                   help="budget for a server to answer /health (the first: 1.6x)")
    p.add_argument("--window-s", type=float, default=10.0, help="throughput: seconds per timed window (>= 10)")
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--cpus", default=None, type=parse_cpus,
                   help="run every server (and its subprocesses) on these CPUs only, e.g. 0-11")
    p.add_argument("--client-cpus", default=None, type=parse_cpus,
                   help="run this client on these CPUs (after the servers' set is checked), e.g. 12-15")
    p.add_argument("--quick", action="store_true", help="short workloads and windows (dry runs)")
    p.add_argument("--server-module", default="", help="dry runs: a stand-in server module for every config")
    p.add_argument("--server-cwd", default="", help="folder the servers run in (the laid-out graphpool copy)")
    a = p.parse_args(argv)
    try:
        phase_configs(a.phase, a.models, a.configs)
    except ValueError as e:
        p.error(str(e))
    os.makedirs(a.out, exist_ok=True)
    if a.client_cpus:  # servers pin themselves at start (a process may widen its own set within its cgroup)
        os.sched_setaffinity(0, a.client_cpus)
    return Bench(a).run()


if __name__ == "__main__":
    sys.exit(main())
