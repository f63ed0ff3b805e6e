"""What a live server's log says: graph capture (SGLang's lines and the probe's), graphpool's replays by
mode and switch flips, SGLang's decode-batch lines (eager fallbacks show as ``cuda graph: False``), and
the crash that SGLang's own runner hits on a plain step. Formats are SGLang 0.5.12.post1's (and 0.5.14+'s capture
lines), the probes' (bench/live/probe, probe_v2) and graphpool's own log lines."""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

_CAPTURE = re.compile(r"Capture (cuda graph|draft cuda graph|draft extend cuda graph) end\. Time elapsed: "
                      r"([\d.]+) s\. mem usage=([\d.]+) GB")
_PROBE = re.compile(r"graph-probe: (target|draft) (\w+) captured in ([\d.]+) s: torch reserved \+(-?[\d.]+) MiB, "
                    r"device \+(-?[\d.]+) MiB")
# The runner-API probe (bench/live/probe_v2): graph-building calls, and decode steps' GPU spans.
_PROBE_V2 = re.compile(r"graph-probe: (target|draft|spec) init_cuda_graphs (\w+) in ([\d.]+) s: torch reserved "
                       r"\+(-?[\d.]+) MiB, device \+(-?[\d.]+) MiB")
_STEP_GPU = re.compile(r"graph-probe: step gpu us: (.*)$")
_STEP_PART = re.compile(r"bs=(\d+) tok=(\d+) median ([\d.]+) p90 ([\d.]+) n=(\d+)")
# SGLang 0.5.14+'s own capture lines ("Capture decode CUDA graph end. elapsed=2.10 s, mem usage=0.20 GB, ...").
_CAPTURE_V2 = re.compile(r"Capture (\w+(?: \w+)?) CUDA graph end\. elapsed=([\d.]+) s, mem usage=(-?[\d.]+) GB")
_REPLAY_HOST = re.compile(r"graph-probe: (target|draft) (\w+) replay host us: median ([\d.]+) p90 ([\d.]+) "
                          r"over (\d+) calls")
_GP_CAPTURED = re.compile(r"graphpool captured (\d+) graphs for \[([^\]]*)\] at batch sizes \[([^\]]*)\]")
_GP_REPLAYS = re.compile(r"graphpool replays by mode: (.*?); eager fallbacks: (.*)$")
_GP_FLIP = re.compile(r"graphpool switch: speculation (ON|OFF) at (\d+) running requests")
_DECODE = re.compile(r"Decode batch.*?#running-req: (\d+),.*?(?:accept len: ([\d.]+),.*?)?(?:cuda|cpu) graph: "
                     r"(True|False)")
# SGLang's runner on a plain step: a shape error at a larger batch; at batch 1 its verify graph's rows
# come back as tokens, which the plain step refuses with its own message.
_SHAPE_CRASH = re.compile(r"The size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)"
                          r"|the target returned (\d+) tokens for (\d+) sequences")
_FIRED_UP = "The server is fired up and ready to roll!"


@dataclass
class LogFacts:
    """Everything the table and the JSON report take from one server log."""

    fired_up: bool = False
    capture: Dict[str, List[Dict[str, float]]] = field(default_factory=dict)  # kind -> [{seconds, gb}]
    probe: List[Dict[str, Any]] = field(default_factory=list)
    replay_host_us: List[float] = field(default_factory=list)  # the probe's median per window, target runner
    #: runner-API probe: "bs=32 tok=1" -> [(median us, steps) per logged window] of decode steps' GPU spans
    step_gpu_us: Dict[str, List[List[float]]] = field(default_factory=dict)
    gp_graphs: Optional[int] = None
    gp_modes: List[str] = field(default_factory=list)
    gp_batch_sizes: List[int] = field(default_factory=list)
    replays: Dict[str, int] = field(default_factory=dict)  # last "replays by mode" line
    gp_fallbacks: str = ""
    flips: List[Dict[str, Any]] = field(default_factory=list)
    decode_lines: int = 0
    decode_eager: List[int] = field(default_factory=list)  # #running-req of lines with cuda graph: False
    decode_accept_by_bs: Dict[int, List[float]] = field(default_factory=dict)
    crash: Optional[str] = None
    tracebacks: int = 0
    errors: List[str] = field(default_factory=list)

    @property
    def target_capture(self) -> Optional[Dict[str, float]]:
        """SGLang's line for the target model's graphs (the first ``Capture cuda graph end``)."""
        lines = self.capture.get("cuda graph")
        return lines[0] if lines else None

    @property
    def target_probe(self) -> Optional[Dict[str, Any]]:
        return next((p for p in self.probe if p["role"] == "target"), None)

    def graph_totals(self) -> Optional[Dict[str, float]]:
        """The runner-API probe's graph-building calls summed (target, draft, spec worker): MiB reserved, s."""
        rows = [p for p in self.probe if p["role"] in ("target", "draft", "spec")]
        if not rows:
            return None
        return {"reserved_mib": sum(p["reserved_mib"] for p in rows), "device_mib": sum(p["device_mib"] for p in rows),
                "seconds": sum(p["seconds"] for p in rows)}

    def step_gpu(self, key: str) -> Optional[float]:
        """Median GPU span (us) of decode steps of ``key`` (``"bs=32 tok=1"``), steps-weighted over windows."""
        rows = self.step_gpu_us.get(key)
        if not rows:
            return None
        values = sorted(v for v, n in rows for _ in range(int(n)))
        return values[len(values) // 2]

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def parse(text: str) -> LogFacts:
    """Read one server log."""
    facts = LogFacts(fired_up=_FIRED_UP in text)
    for line in text.splitlines():
        if m := _CAPTURE.search(line):
            facts.capture.setdefault(m[1], []).append({"seconds": float(m[2]), "gb": float(m[3])})
        elif m := _PROBE.search(line):
            facts.probe.append({"role": m[1], "runner": m[2], "seconds": float(m[3]),
                                "reserved_mib": float(m[4]), "device_mib": float(m[5])})
        elif m := _PROBE_V2.search(line):
            facts.probe.append({"role": m[1], "runner": m[2], "seconds": float(m[3]),
                                "reserved_mib": float(m[4]), "device_mib": float(m[5])})
        elif m := _STEP_GPU.search(line):
            for part in _STEP_PART.finditer(m[1]):
                facts.step_gpu_us.setdefault(f"bs={part[1]} tok={part[2]}", []).append([float(part[3]), int(part[5])])
        elif m := _CAPTURE_V2.search(line):
            facts.capture.setdefault(m[1].lower(), []).append({"seconds": float(m[2]), "gb": float(m[3])})
        elif m := _REPLAY_HOST.search(line):
            if m[1] == "target":
                facts.replay_host_us.append(float(m[3]))
        elif m := _GP_CAPTURED.search(line):
            facts.gp_graphs = int(m[1])
            facts.gp_modes = [s.strip(" '\"") for s in m[2].split(",") if s.strip()]
            facts.gp_batch_sizes = [int(s) for s in m[3].split(",") if s.strip()]
        elif m := _GP_FLIP.search(line):
            facts.flips.append({"speculation": m[1], "running": int(m[2])})
            if r := _GP_REPLAYS.search(line):
                _replays(facts, r)
        elif m := _GP_REPLAYS.search(line):
            _replays(facts, m)
        elif m := _DECODE.search(line):
            facts.decode_lines += 1
            bs = int(m[1])
            if m[3] == "False":
                facts.decode_eager.append(bs)
            if m[2] is not None:
                facts.decode_accept_by_bs.setdefault(bs, []).append(float(m[2]))
        if facts.crash is None and (m := _SHAPE_CRASH.search(line)):
            facts.crash = m[0]
        if line.startswith("Traceback"):
            facts.tracebacks += 1
        if ("Error" in line or "error:" in line) and len(facts.errors) < 12 and "ServerArgs" not in line:
            facts.errors.append(line.strip()[:240])
    return facts


def _replays(facts: LogFacts, m: "re.Match[str]") -> None:
    facts.replays = {k: int(v) for k, v in (kv.split("=") for kv in m[1].split() if "=" in kv)}
    facts.gp_fallbacks = m[2].strip()
