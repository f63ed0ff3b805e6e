"""Start a real SGLang server (graphpool's launcher, or SGLang's own), talk to it, read its log; stop it.

The live tier's one way to run a server, for its tests and for tiers built on it::

    with LiveServer.start(["--speculative-algorithm", "EAGLE", ...], log_dir=tmp_path) as server:
        outputs = server.client.generate_many([Request("the quick", max_new_tokens=16)] * 8)
        server.check_health()
        log = server.log()          # ServerLog: graphpool's replays by mode, switch flips, catch-ups, errors
        counts = server.forwards()  # forwards by (model, mode), counted in the scheduler process

Every server is bound to 127.0.0.1, started in a session of its own and stopped by its own process id (the
session's group: SGLang's scheduler and detokenizer processes go with it). Every wait is bounded. A server that
does not come up fails with its own first error line.

What the server needs on CPU comes from the test tree: ``stand_ins/`` (sgl_kernel's CPU ops in plain torch),
``../stubs`` (torchvision) and ``plugin/`` (SGLang's plugin entry point for :mod:`tests.live.cpu_plugin`), put first
on its ``PYTHONPATH``; SGLang itself is whatever this process imports (CI puts one release's folder on the path).

``GRAPHPOOL_LIVE_DEVICE=cuda`` runs the same servers on a GPU (``bash bench/gpu.sh live``): SGLang's own CUDA graphs for
the oracle, graphpool's for the target's DECODE and TARGET_VERIFY steps, its real ``sgl_kernel`` and Triton attention,
float32 (Triton's dots too: ``TRITON_F32_DEFAULT=ieee``); there the plugin keeps its test weights and forward counts
and puts SGLang's norms, activation and rotary embedding on their torch paths (:mod:`tests.live.cpu_plugin`).
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from tests.live.models import make_models

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
#: Seconds a server may take to answer /health (one start takes ~25 s on an idle 2-core machine).
START_TIMEOUT_S = float(os.environ.get("GRAPHPOOL_LIVE_START_TIMEOUT_S", "240"))
#: The module each kind of server runs: graphpool's launcher, or SGLang's own (the oracle).
ENTRIES = {True: "graphpool.integrations.sglang.launch", False: "sglang.launch_server"}
#: Seconds one request may take.
REQUEST_TIMEOUT_S = 120.0
#: The device the tier's servers run on: ``cpu`` (CI) or ``cuda`` (the GPU run, see the module's docstring).
DEVICE = os.environ.get("GRAPHPOOL_LIVE_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise ValueError(f"GRAPHPOOL_LIVE_DEVICE takes cpu or cuda, got {DEVICE!r}")
#: Arguments every live server gets (beside :data:`DEVICE_ARGS`: the device, float32 since greedy ties between verify
#: and decode arithmetic would be a coin toss in bf16, and the attention): the tiny target with random weights, no
#: warm-up request (the tests' first requests warm it up; a warm-up costs a few seconds per start), and
#: ``--sleep-on-idle``: without it SGLang's scheduler spins a whole core while it has no request (its idle checks,
#: the KV-leak one included, still run on each wake-up; a request wakes it at once), which on CI's 2 cores took the
#: CPU from the tier's other server and from CI's other lanes.
COMMON_ARGS = ("--load-format", "dummy", "--host", "127.0.0.1", "--skip-server-warmup", "--max-total-tokens", "6144",
               "--max-running-requests", "32", "--disable-overlap-schedule", "--sleep-on-idle", "--log-level", "info")
#: On a GPU: float32 as on CPU (the plugin puts SGLang's norms on their torch paths: sgl_kernel's take no float32; in
#: bfloat16 a verify step's rounding flips greedy tokens of the random model against plain decode), Triton
#: attention (FlashAttention 3, SGLang's Hopper default, is left out of the GPU carry), no grammar backend (the carry
#: has none), a small KV pool, graphs up to 32 requests.
DEVICE_ARGS = {"cpu": ("--device", "cpu", "--dtype", "float32", "--attention-backend", "intel_amx"),
               "cuda": ("--device", "cuda", "--dtype", "float32", "--attention-backend", "triton",
                        "--grammar-backend", "none", "--mem-fraction-static", "0.2", "--cuda-graph-max-bs-decode", "32")}
BASE_ARGS = (*COMMON_ARGS, *DEVICE_ARGS[DEVICE])


@dataclasses.dataclass(frozen=True)
class Request:
    """One ``/generate`` request: greedy unless told otherwise, ``ignore_eos`` so lengths are as asked."""

    text: str
    max_new_tokens: int = 16
    stop: Optional[List[str]] = None
    stop_token_ids: Optional[List[int]] = None
    json_schema: Optional[str] = None
    ignore_eos: bool = True

    def body(self, stream: bool = False) -> Dict[str, Any]:
        params: Dict[str, Any] = {"temperature": 0.0, "max_new_tokens": self.max_new_tokens,
                                  "ignore_eos": self.ignore_eos}
        for name in ("stop", "stop_token_ids", "json_schema"):
            if getattr(self, name) is not None:
                params[name] = getattr(self, name)
        return {"text": self.text, "sampling_params": params, "stream": stream}


@dataclasses.dataclass(frozen=True)
class Output:
    """What the server answered: the tokens, the finish reason, SGLang's per-request speculation counts."""

    output_ids: List[int]
    finish_reason: Any
    meta: Dict[str, Any]


class Client:
    """HTTP client of one server (``http://127.0.0.1:<port>``), standard library only."""

    def __init__(self, port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"

    def health(self, timeout: float = 10.0) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as answer:
                return answer.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def generate(self, request: Request) -> Output:
        data = json.dumps(request.body()).encode()
        post = urllib.request.Request(self.url + "/generate", data, {"content-type": "application/json"})
        with urllib.request.urlopen(post, timeout=REQUEST_TIMEOUT_S) as answer:
            out = json.loads(answer.read())
        meta = out["meta_info"]
        return Output(list(out["output_ids"]), meta.get("finish_reason"), meta)

    def generate_many(self, requests: Sequence[Request], concurrency: Optional[int] = None) -> List[Output]:
        """All ``requests`` at once (or ``concurrency`` at a time), in order."""
        with ThreadPoolExecutor(max_workers=concurrency or max(1, len(requests))) as pool:
            return list(pool.map(self.generate, requests))

    def stream_and_abort(self, request: Request, chunks: int) -> int:
        """Stream ``request``, close the connection after ``chunks`` chunks (SGLang aborts the request); returns
        the chunks read."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        try:
            conn.request("POST", "/generate", json.dumps(request.body(stream=True)), {"content-type": "application/json"})
            answer, read = conn.getresponse(), 0
            while read < chunks:
                line = answer.readline()
                if not line:
                    break
                if line.startswith(b"data:") and b"[DONE]" not in line:
                    read += 1
            return read
        finally:
            conn.close()


@dataclasses.dataclass
class ServerLog:
    """What a live server's log says about graphpool."""

    text: str

    def replays(self) -> Dict[str, int]:
        """graphpool's replays by mode, summed over its runners (SGLang's adaptive speculation builds one per step
        count). Each runner logs its own cumulative counts at every replay on live servers
        (``GRAPHPOOL_REPLAY_LOG_EVERY=1``), so each line is one runner's previous line plus one replay, or a new
        runner's first."""
        runners: List[Dict[str, int]] = []
        for line in re.findall(r"graphpool replays by mode: ([^;]*);", self.text):
            counts = {} if line == "none" else {m: int(n) for m, n in (item.split("=") for item in line.split())}
            for known in runners:
                grown = {m: counts.get(m, 0) - known.get(m, 0) for m in set(counts) | set(known)}
                if not any(grown.values()):  # the same counts again (a switch flip's line repeats them)
                    break
                if sorted(grown.values())[-1:] == [1] and sum(grown.values()) == 1:
                    known.update(counts)
                    break
            else:
                runners.append(counts)
        total: Dict[str, int] = {}
        for counts in runners:
            for mode, n in counts.items():
                total[mode] = total.get(mode, 0) + n
        return total

    def eager_fallbacks(self) -> str:
        """Eager fallbacks by reason, from any runner's line (``"none"`` when every line says none)."""
        found = [f.strip() for f in re.findall(r"graphpool replays by mode: [^;]*; eager fallbacks: (.*)", self.text)]
        return next((f for f in found if f != "none"), "none")

    def flips(self, state: str) -> int:
        """Switch flips to ``"ON"`` or ``"OFF"``."""
        return len(re.findall(rf"graphpool switch: speculation {state} at", self.text))

    def catch_ups(self) -> List[int]:
        """Requests caught up by each draft catch-up, in order."""
        return [int(n) for n in re.findall(r"graphpool draft catch-up: (\d+) requests", self.text)]

    def replays_by_forward_mode(self) -> Dict[str, int]:
        """:meth:`replays` summed per SGLang forward mode (a speculation tier's ``TARGET_VERIFY_<tier>`` counts as
        ``TARGET_VERIFY``)."""
        total: Dict[str, int] = {}
        for label, n in self.replays().items():
            mode = "TARGET_VERIFY" if label.startswith("TARGET_VERIFY") else label
            total[mode] = total.get(mode, 0) + n
        return total

    def captures(self) -> Dict[str, int]:
        """How many times graphpool captured each mode's graphs (``DECODE``, ``TARGET_VERIFY``, a tier's
        ``TARGET_VERIFY_<tier>``): one count per ``graphpool captured N graphs for [...]`` line naming it."""
        counts: Dict[str, int] = {}
        for modes in re.findall(r"graphpool captured \d+ graphs for \[([^\]]*)\]", self.text):
            for mode in re.findall(r"'([^']+)'", modes):
                counts[mode] = counts.get(mode, 0) + 1
        return counts

    def tier_changes(self) -> List[Tuple[str, str, int]]:
        """graphpool's tier changes, in order: (from, to, running requests)."""
        return [(a, b, int(n)) for a, b, n in re.findall(r"graphpool tiers: (\S+) -> (\S+) at (\d+) running", self.text)]

    def tier_first_verifies(self) -> List[Tuple[str, float, int]]:
        """The first verify step after each tier change: (tier, tokens committed per request, the tier's most)."""
        return [(t, float(mean), int(most)) for t, mean, most in re.findall(
            r"graphpool tiers: first verify step at (\S+) after a change: ([\d.]+) tokens per request \(at most (\d+)\)",
            self.text)]

    def tier_steps(self) -> Dict[str, Tuple[int, int]]:
        """The latest tier statistics: tier -> (verify steps that committed the tier's most for every request, all
        verify steps)."""
        found = re.findall(r"graphpool tiers: verify steps \(at their tier's most/all\) ([^;]*);", self.text)
        if not found:
            return {}
        return {tier: (int(most), int(steps)) for tier, most, steps in re.findall(r"(\S+)=(\d+)/(\d+)", found[-1])}

    def graph_captures(self) -> List[Tuple[str, float, float]]:
        """SGLang's own lines after each graph capture (a GPU server's): (what, seconds, GB of graph memory)."""
        return [(what, float(s), float(gb)) for what, s, gb in re.findall(
            r"Capture (\w+(?: \w+)*?) (?:CUDA|cuda) graph end\. (?:elapsed=|Time elapsed: )([\d.]+) ?s?,? mem usage="
            r"\s*(-?[\d.]+) ?GB", self.text)]

    def problems(self) -> List[str]:
        """Lines that must never appear: errors, tracebacks, SGLang's idle leak check. One traceback is SGLang's own
        and harmless: with ``--skip-server-warmup`` its HTTP server posts ``/freeze_gc`` to itself before it listens."""
        found, block = [], []
        for line in self.text.splitlines() + ["[end]"]:
            if block and line.startswith("["):  # a traceback (chained ones too) ends at the next log record
                if not any("_freeze_gc_after_server_warmup" in b for b in block):
                    found.append(block[0])
                block = []
            if block or "Traceback" in line:
                block.append(line)
            elif "memory leak detected" in line or re.search(r"\bERROR\b", line):
                found.append(line)
        return found


def first_error_line(text: str) -> str:
    """The first line of a server log that names an error (``XxxError: ...``, ``error: ...``), else its last line."""
    for line in text.splitlines():
        if re.search(r"^\s*[\w.]*(Error|Exception)\b.*:|\berror: |\bERROR\b", line) and "Ignore import error" not in line:
            return line.strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(empty log)"


#: Where a server's port is drawn from. A server binds its port only after loading its models, seconds later; a port
#: of the kernel's ephemeral range (32768 and up, what ``bind(0)`` hands out) may be taken in between by any outgoing
#: connection on the machine (CI, once: a server died with "address already in use"). So one below that range,
#: clear of SGLang's own draw for its rendezvous port (22000-29999) and of the live benchmarks' dry runs (32500+).
PORTS = range(30100, 32400)
#: Starts of one server on a fresh port when the last one found its port taken after all.
START_TRIES = 3


def free_port() -> int:
    """A port of :data:`PORTS` that binds now, drawn at random (by the OS's randomness: two test processes seeded
    alike must not draw alike)."""
    for port in random.SystemRandom().sample(PORTS, 64):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port among 64 drawn from {PORTS.start}-{PORTS.stop - 1}")


def models(root: Path) -> Dict[str, Path]:
    """The tiny target, drafts and tokenizer under ``root`` (made once)."""
    if not (root / "target" / "tokenizer.json").exists():
        make_models(root)
    return {name: root / name for name in ("target", "eagle", "eagle3")}


def server_env(counts_file: Path, extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The server's environment: on CPU the test tree's stand-ins and plugin first on the path, SGLang's CPU engine;
    on a GPU the plugin alone; then ``extra``."""
    path = [HERE / "stand_ins", HERE / "plugin", ROOT / "tests" / "stubs"] if DEVICE == "cpu" else [HERE / "plugin"]
    # Absolute: the server runs in the log folder, and CI puts the release's folder on the path relatively.
    inherited = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", GRAPHPOOL_NO_EXTENSION="1", GRAPHPOOL_REPLAY_LOG_EVERY="1",
               SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1", GRAPHPOOL_LIVE_COUNTS=str(counts_file),
               PYTHONPATH=os.pathsep.join([str(p) for p in path] + inherited + [str(ROOT)]))
    if DEVICE == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    else:
        # float32 all through, as the tier's dtype says: Triton's float32 dots would default to TF32 on a GPU. (It is
        # not what makes STANDALONE self-drafts miss on a GPU: 2 of 34 requests accepted every draft in TF32, run BR,
        # and 2 in IEEE, run BU; the CPU tier finds 5. (d) needs one such pair.)
        env["TRITON_F32_DEFAULT"] = "ieee"
    env.update(extra or {})
    return env


class LiveServer:
    """One running server (use :meth:`start`, as a context manager)."""

    def __init__(self, process: subprocess.Popen, port: int, log_path: Path, counts_file: Path):
        self.process, self.port, self.log_path, self.counts_file = process, port, log_path, counts_file
        self.client = Client(port)
        self.started_s = 0.0

    @classmethod
    def start(cls, args: Sequence[str], log_dir: Path, *, name: str = "server", graphpool: bool = True,
              model_root: Optional[Path] = None, timeout: float = START_TIMEOUT_S,
              env: Optional[Mapping[str, str]] = None) -> "LiveServer":
        """Start a server on the tiny target with :data:`BASE_ARGS` plus ``args`` (and ``env`` in its environment),
        through graphpool's launcher (``graphpool=False``: SGLang's own ``launch_server``, the oracle), and wait for
        ``/health``.

        A server that dies because its port was taken by the time it bound it starts again on another, up to
        :data:`START_TRIES` starts in all, within the one ``timeout``.

        Raises:
            RuntimeError: the server exited, or did not answer within ``timeout`` s; the message holds its first
                error line and the log's path.
        """
        paths = models(model_root or log_dir / "models")
        log_path, counts_file = log_dir / f"{name}.log", log_dir / f"{name}.forwards.json"
        entry = ENTRIES[graphpool]
        started, attempt = time.monotonic(), 1
        while True:
            port = free_port()
            command = [sys.executable, "-m", entry, "--model-path", str(paths["target"]), "--port", str(port),
                       *BASE_ARGS, *[str(a).format(**{k: str(v) for k, v in paths.items()}) for a in args]]
            with open(log_path, "wb") as log:
                process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           env=server_env(counts_file, env), cwd=str(log_dir), start_new_session=True)
            server = cls(process, port, log_path, counts_file)
            try:
                server._wait_ready(started + timeout)
            except RuntimeError:
                server.stop()
                if attempt == START_TRIES or not server.port_was_taken():
                    raise
                print(f"live server {name}: port {port} was taken before it bound it; starting again on another",
                      file=sys.stderr, flush=True)
                attempt += 1
                continue
            except BaseException:
                server.stop()
                raise
            server.started_s = time.monotonic() - started
            return server

    def port_was_taken(self) -> bool:
        """Whether the server's log says its port was in use when it bound it (uvicorn's and Python's words)."""
        return re.search(r"address already in use", self.log_text(), re.I) is not None

    def _wait_ready(self, deadline: float) -> None:
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"SGLang server exited ({self.process.returncode}) before /health: "
                                   f"{first_error_line(self.log_text())} (log: {self.log_path})")
            if self.client.health(timeout=5.0):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"SGLang server not healthy in time: {first_error_line(self.log_text())} "
                                   f"(log: {self.log_path})")
            time.sleep(1.0)

    def check_health(self) -> None:
        """``/health`` answers and the scheduler is alive; else the server's first error line."""
        if self.process.poll() is not None or not self.client.health(timeout=30.0):
            raise AssertionError(f"server unhealthy: {first_error_line(self.log_text())} (log: {self.log_path})")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log(self) -> ServerLog:
        return ServerLog(self.log_text())

    def forwards(self) -> Dict[str, int]:
        """Forwards by ``"<target|draft> <MODE>"`` so far, as the scheduler process counted them."""
        try:
            return json.loads(self.counts_file.read_text())
        except (OSError, ValueError):
            return {}

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the server: SIGKILL to its session's process group (the group's id is the server's own process id:
        the launcher, SGLang's scheduler and detokenizer), then reap the launcher. A test reads what it checks first;
        SGLang keeps nothing worth a graceful shutdown here, which would cost seconds per server (a SIGTERM to the
        group makes SGLang sleep 5 s for crash diagnostics)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"SGLang server {self.process.pid} did not stop in {timeout} s") from exc

    def __enter__(self) -> "LiveServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
