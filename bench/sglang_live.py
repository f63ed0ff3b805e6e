"""Live SGLang servers, one after another, driven by the same concurrent client; one table at the end.

Configurations (``--configs``, run in this order by default):

  stock-spec  ``sglang.launch_server`` with speculation always on (first: it settles dtype and flavour)
  stock       ``sglang.launch_server``, no speculation
  gp-switch   graphpool's launcher: its runner + the switch (off above ``--off-above``, on at <= ``--on-at``)
  sgl-switch  the switch over SGLang's own runner (``--graphpool-keep-sglang-runner``): must crash
  gp-nospec   graphpool's launcher without speculation (its runner, DECODE graphs only)

Speculation is STANDALONE with the target's own config as its draft (dummy weights are seeded per
parameter, so draft and target are the same model: every draft the target agrees with is accepted), or
EAGLE3 with the tiny EAGLE3 draft (``--spec eagle3``: a random draft, acceptance about 1). Every server gets
the same flags (``--disable-overlap-schedule`` too: SGLang's EAGLE v1 worker, the one the switch drives,
needs it). Workloads: see ``bench/live/workloads.py``. A deadline (``--deadline-s``) skips what no longer
fits and still prints the table. ``--cpus 0-7`` runs every server (and the processes it starts) on the
same cores, so servers compared one after another are not placed differently by the OS. Needs a GPU and
SGLang importable: run ``bash bench/gpu.sh sglang-classic``, which lays them out (docs/benchmarks.md). Writes server logs, ``sglang_live.json`` and
``summary.txt`` to ``--out`` (at most 8 files).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.live import logs, workloads  # noqa: E402
from bench.live.client import run_phase, wait_healthy  # noqa: E402
from bench.live.report import ConfigResult, table  # noqa: E402
from bench.live.servers import Server, ServerSpec, parse_cpus  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ORDER = ("stock-spec", "stock", "gp-switch", "sgl-switch", "gp-nospec")
START_S = {"first": 110, "other": 70}  # budget to reach /health (the first start builds JIT kernels)
FP32_PROBE = """
import sys, torch
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import get_rope
def ops(dtype):
    x = torch.randn(8, 1024, device="cuda", dtype=dtype)
    norm = RMSNorm(1024).to("cuda", dtype)
    norm.forward_cuda(x.clone()); norm.forward_cuda(x.clone(), x.clone())
    SiluAndMul().forward_cuda(torch.randn(8, 2048, device="cuda", dtype=dtype))
    rope = get_rope(64, rotary_dim=64, max_position=4096, base=10000, is_neox_style=True, dtype=dtype).cuda()
    q = torch.randn(8, 16 * 64, device="cuda", dtype=dtype)
    rope.forward_cuda(torch.arange(8, device="cuda"), q, torch.randn(8, 8 * 64, device="cuda", dtype=dtype))
    torch.cuda.synchronize()
for dtype in (torch.float32, torch.bfloat16):  # bfloat16 only to tell a float32 refusal from a broken probe
    try:
        ops(dtype)
        print("kernels OK", dtype, flush=True)
        break
    except Exception as e:
        print("kernels FAILED", dtype, type(e).__name__, str(e)[:200], flush=True)
"""

def server_specs(a: argparse.Namespace, dtype: str, spec: str, port: int) -> Dict[str, ServerSpec]:
    models = os.path.abspath(a.models)
    base = ["--model-path", f"{models}/tiny-llama", "--load-format", "dummy", "--skip-tokenizer-init",
            "--attention-backend", "triton", "--sampling-backend", "pytorch", "--cuda-graph-max-bs", "32",
            "--max-running-requests", "32", "--mem-fraction-static", "0.5", "--disable-overlap-schedule",
            "--dtype", dtype, "--decode-log-interval", "20", "--random-seed", "0"]
    if spec == "standalone":
        sp = ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", f"{models}/tiny-llama",
              "--speculative-draft-load-format", "dummy", "--speculative-num-steps", "3",
              "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    else:
        sp = ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", f"{models}/tiny-eagle3",
              "--speculative-draft-load-format", "dummy", "--speculative-num-steps", "3",
              "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "16"]
    switch = ["--graphpool-spec-off-above", str(a.off_above), "--graphpool-spec-on-at-or-below", str(a.on_at)]
    # graphpool's switch also pauses speculation while the draft is below break-even (AcceptanceGate); the
    # crash reproduction over SGLang's runner switches by batch size only, as the origin story did
    gate = ["--graphpool-spec-min-accept", str(a.min_accept)] if a.min_accept else []
    gp, sgl = "graphpool.integrations.sglang.launch", "sglang.launch_server"
    specs = [ServerSpec("stock", "SGLang, no speculation", sgl, base),
             ServerSpec("gp-switch", "graphpool runner + switch", gp, base + sp + switch + gate, speculative=True,
                        switch=True),
             ServerSpec("sgl-switch", "switch over SGLang's runner", gp,
                        base + sp + switch + ["--graphpool-keep-sglang-runner"], speculative=True, switch=True,
                        expect_crash=True),
             ServerSpec("stock-spec", "SGLang, speculation always on", sgl, base + sp, speculative=True),
             ServerSpec("gp-nospec", "graphpool runner, no speculation", gp, base)]
    out = {}
    for i, s in enumerate(specs):
        s.args = s.args + ["--port", str(port + i)]
        if a.server_module:  # dry runs: a stand-in server module takes the same arguments
            s.module = a.server_module
        out[s.name] = s
    return out


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a, self.t0 = a, time.perf_counter()
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", GRAPHPOOL_REPLAY_LOG_EVERY=str(a.replay_log_every))
        probe = os.path.join(HERE, "live", "probe")
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (probe, os.environ.get("PYTHONPATH", "")) if p)
        self.results: Dict[str, ConfigResult] = {}
        self.started_once = False

    def left(self) -> float:
        return self.a.deadline_s - (time.perf_counter() - self.t0)

    def say(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:5.0f}s] {msg}", flush=True)

    def plan(self, spec: ServerSpec) -> List[tuple]:
        """(phase name, concurrency, requests) of a configuration, most important first."""
        q = self.a.quick
        # Each speed phase twice (the table keeps the better): a 1-2 s phase is noisy on a shared host.
        speed = [(f"speed{c}.{k}", c, workloads.speed(c, max_new=32 if q else 128))
                 for k in range(2) for c in workloads.SPEED_CONCURRENCY]
        ramp = [(f"ramp-c{c}-{i}", c, reqs) for i, (c, reqs) in enumerate(workloads.ramp(0.1 if q else 1.0))]
        burst = [("burst", 16, workloads.burst(16, 16 if q else 64))]
        warm = [("warm", 8, workloads.warmup())]
        return {"stock": warm + speed + ramp, "gp-switch": warm + burst + speed + ramp, "sgl-switch": burst,
                "stock-spec": warm + speed, "gp-nospec": warm + speed}[spec.name]

    def run_config(self, spec: ServerSpec) -> ConfigResult:
        res = ConfigResult(spec.name, spec.title)
        start_budget = START_S["other" if self.started_once else "first"]
        if self.left() < start_budget * 0.6 + 10:
            res.status = f"skipped ({self.left():.0f}s left)"
            self.say(f"{spec.name}: {res.status}")
            return res
        log_path = os.path.join(self.a.out, f"{spec.name}.log")
        self.say(f"{spec.name}: starting ({spec.title})")
        server = Server(spec, self.a.python, os.path.abspath(log_path), self.env, cwd=self.a.server_cwd,
                        cpus=self.a.cpus)
        url = "http://127.0.0.1:" + spec.args[spec.args.index("--port") + 1]
        try:
            res.start_s = wait_healthy(url, server.alive, min(start_budget * 1.6, self.left() - 10))
            if res.start_s is None:
                res.status = "did not start" if not server.alive() else "start timeout"
                return res
            self.started_once = True
            self.say(f"{spec.name}: healthy after {res.start_s:.0f}s")
            res.status = "served"
            for name, concurrency, reqs in self.plan(spec):
                if self.left() < 25:
                    res.notes.append(f"phases from {name} on skipped: deadline")
                    break
                res.requests.update({r.rid: r for r in reqs})
                # A healthy request takes seconds; a server whose scheduler died may never answer.
                cap = 25.0 if spec.expect_crash else 90.0
                phase = run_phase(url, name, reqs, concurrency, timeout=max(10.0, min(cap, self.left() - 15)))
                res.phases.append(phase)
                bad = [a for a in phase.answers if not a.ok]
                self.say(f"{spec.name}: {name} C={concurrency}: {len(reqs) - len(bad)}/{len(reqs)} HTTP 200, "
                         f"{phase.tokens} tokens in {phase.wall_s:.1f}s")
                if bad and not server.alive():
                    res.status = "crashed"
                    break
            return res
        finally:
            server.stop()
            res.log = logs.parse(server.log_text())
            if res.log.crash and res.status == "served":
                res.status = "crashed"
            self.say(f"{spec.name}: {res.status}; log: crash={res.log.crash}, replays={res.log.replays}, "
                     f"capture={res.log.target_capture}, probe={res.log.target_probe}")

    def choose_dtype(self) -> str:
        """float32 unless SGLang's layer kernels (RMSNorm, SiluAndMul, RoPE) refuse it where they take
        bfloat16; a probe that fails for both dtypes says nothing, and the server start decides."""
        if self.a.dtype != "auto":
            return self.a.dtype
        try:
            p = subprocess.run([self.a.python, "-c", FP32_PROBE], env=self.env, capture_output=True, text=True,
                               timeout=min(90, max(10, self.left() - 420)))
            out = p.stdout + p.stderr
        except subprocess.TimeoutExpired:
            out = "probe timed out"
        bf16_ok, fp32_ok = "kernels OK torch.bfloat16" in out, "kernels OK torch.float32" in out
        self.say(f"dtype probe: float32 {'OK' if fp32_ok else 'failed'}" + ("" if fp32_ok else
                 f", bfloat16 {'OK' if bf16_ok else 'failed'} ({(out.strip().splitlines() or ['?'])[-1][:200]})"))
        return "bfloat16" if bf16_ok and not fp32_ok else "float32"

    def run(self) -> int:
        a = self.a
        dtype, spec = self.choose_dtype(), a.spec
        specs = server_specs(a, dtype, spec, a.port)
        settled = False
        for name in a.configs:
            res = self.run_config(specs[name])
            # The first server settles dtype and speculation flavour: float32 and STANDALONE are the
            # choices never run live before; bfloat16 with EAGLE3 is (SGLANG_LIVE b/c). Nothing measured
            # before then depends on the choice.
            fallbacks = [("bfloat16", spec)] if dtype == "float32" else []
            if specs[name].speculative and spec == "standalone":
                fallbacks.append(("bfloat16", "eagle3"))
            while not settled and res.status in ("did not start", "start timeout") and fallbacks:
                dtype, spec = fallbacks.pop(0)
                self.say(f"{name}: did not start; trying dtype {dtype}, speculation {spec} for every server")
                specs = server_specs(a, dtype, spec, a.port + 10 * (2 - len(fallbacks)))
                res = self.run_config(specs[name])
            settled = settled or res.status not in ("did not start", "start timeout", "not run") \
                and not res.status.startswith("skipped")
            self.results[name] = res
        return self.report(dtype, spec)

    def report(self, dtype: str, spec: str) -> int:
        text = table(self.results, dtype, spec)
        data = {"dtype": dtype, "speculation": spec, "off_above": self.a.off_above, "on_at": self.a.on_at,
                "elapsed_s": time.perf_counter() - self.t0,
                "configs": {n: {"status": r.status, "start_s": r.start_s, "notes": r.notes,
                                "log": r.log.as_dict() if r.log else None,
                                "requests": {k: asdict(v) for k, v in r.requests.items()},
                                "phases": [p.as_dict() for p in r.phases]} for n, r in self.results.items()}}
        with open(os.path.join(self.a.out, "sglang_live.json"), "w") as f:
            json.dump(data, f)
        with open(os.path.join(self.a.out, "summary.txt"), "w") as f:
            f.write(text + "\n")
        print(text, flush=True)
        return 0


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "out/sglang_live"))
    p.add_argument("--models", default=".sgl/models", help="folder with tiny-llama/ and tiny-eagle3/ (config.json)")
    p.add_argument("--configs", default=",".join(ORDER), type=lambda s: [c for c in s.split(",") if c])
    p.add_argument("--spec", choices=("standalone", "eagle3"), default="standalone")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: float32 when SGLang's kernels take it (a quick probe), else bfloat16")
    p.add_argument("--off-above", type=int, default=8)
    p.add_argument("--on-at", type=int, default=4)
    p.add_argument("--min-accept", type=float, default=1.5,
                   help="gp-switch: pause speculation while verify steps commit fewer tokens per sequence "
                        "(0: batch size alone decides; default %(default)s)")
    p.add_argument("--deadline-s", type=float, default=float(os.environ.get("DEADLINE_S", 540)))
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--replay-log-every", type=int, default=200)
    p.add_argument("--cpus", default=None, type=parse_cpus,
                   help="run every server (and its subprocesses) on these CPUs only, e.g. 0-7: servers compared "
                        "one after another then get the same cores (default: wherever the OS puts them)")
    p.add_argument("--quick", action="store_true", help="short workloads (dry runs)")
    p.add_argument("--server-module", default="", help="dry runs: a stand-in server module for every config")
    p.add_argument("--server-cwd", default="", help="folder the servers run in (the laid-out graphpool copy)")
    a = p.parse_args(argv)
    unknown = [c for c in a.configs if c not in ORDER]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {list(ORDER)}")
    os.makedirs(a.out, exist_ok=True)
    return Bench(a).run()


if __name__ == "__main__":
    sys.exit(main())
