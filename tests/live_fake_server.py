"""A stand-in for a live SGLang server, for dry runs of bench/sglang_live.py on a CPU machine.

It takes the servers' command lines (only ``--port``, ``--speculative-algorithm`` and graphpool's flags
matter), prints the log lines the benchmark parses in SGLang's and graphpool's formats, and answers
``/health`` and ``/generate`` (token ids in, deterministic token ids out, SGLang's JSON layout). With
``--graphpool-keep-sglang-runner`` it dies on its first request, printing the shape error that SGLang's
own runner raises there. Usage: ``python -m tests.live_fake_server ARGS``.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ARGS = sys.argv[1:]


def _arg(name: str, default: str = "") -> str:
    return ARGS[ARGS.index(name) + 1] if name in ARGS else default


SPEC = bool(_arg("--speculative-algorithm"))
# graphpool's launcher (runner API: flagged by the bench's module name; classic: its --graphpool options)
GRAPHPOOL = any(a.startswith("--graphpool") for a in ARGS) or os.environ.get("FAKE_SERVER_GRAPHPOOL") == "1"
CRASH = "--graphpool-keep-sglang-runner" in ARGS
RUNNER_API = "--cuda-graph-max-bs-decode" in ARGS  # SGLang 0.5.14+'s flags: the runner-API probe's lines
LOCK, STATE = threading.Lock(), {"replays": 0, "aborted": set()}


def say(line: str) -> None:
    print(f"[2026-12-01 00:00:00] {line}", flush=True)


def tokens(input_ids, n):
    """A deterministic continuation that depends on the prompt only (greedy is greedy)."""
    seed = sum((i + 1) * t for i, t in enumerate(input_ids)) % 9973
    return [(seed * 31 + 17 * k) % 1000 + 3 for k in range(n)]


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/abort_request":
            with LOCK:
                STATE["aborted"].add(body.get("rid"))
            self.send_response(200)
            self.end_headers()
            return
        if CRASH:
            say("Scheduler hit an exception: Traceback (most recent call last):")
            say("RuntimeError: The size of tensor a (64) must match the size of tensor b (16) at non-singleton dimension 0")
            os._exit(1)
        params = body["sampling_params"]
        out = tokens(body["input_ids"], params["max_new_tokens"])
        reason = {"type": "length", "length": params["max_new_tokens"]}
        if not params.get("ignore_eos", False):
            hit = next((i for i, t in enumerate(out) if t in params.get("stop_token_ids", [])), None)
            if hit is not None:
                out, reason = out[:hit + 1], {"type": "stop", "matched": out[hit]}
        time.sleep(0.0002 * len(out))
        meta = {"finish_reason": reason, "prompt_tokens": len(body["input_ids"]), "completion_tokens": len(out),
                "e2e_latency": 0.0002 * len(out) + 0.001}
        if SPEC:
            meta.update(spec_verify_ct=max(1, len(out) // 4), spec_num_correct_drafts=3 * max(1, len(out) // 4))
        with LOCK:
            STATE["replays"] += len(out)
            if GRAPHPOOL and STATE["replays"] % 50 < len(out):
                say(f"graphpool replays by mode: DECODE={STATE['replays']}" + (f" TARGET_VERIFY={STATE['replays'] // 3}"
                    if SPEC else "") + "; eager fallbacks: none")
        say(f"Decode batch, #running-req: 1, #token: 10, token usage: 0.00, {'accept len: 3.50, ' if SPEC else ''}"
            f"cuda graph: True, gen throughput (token/s): 100.00, #queue-req: 0")
        if body.get("stream"):
            self.stream(body.get("rid"), out, meta)
            return
        data = json.dumps({"output_ids": out, "meta_info": meta}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def stream(self, rid, out, meta):
        """SGLang's event stream: every chunk holds all ids so far; an abort ends it with finish_reason abort."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for n in range(1, len(out) + 1):
            with LOCK:
                aborted = rid in STATE["aborted"]
            done = aborted or n == len(out)
            chunk_meta = dict(meta, completion_tokens=n, finish_reason=(
                {"type": "abort", "message": "Abort in waiting queue"} if aborted else meta["finish_reason"]) if done else None)
            self.wfile.write(b"data: " + json.dumps({"output_ids": out[:n], "meta_info": chunk_meta}).encode() + b"\n\n")
            self.wfile.flush()
            if done:
                break
            time.sleep(0.002)
        self.wfile.write(b"data: [DONE]\n\n")


def main() -> None:
    # Dry runs of the benchmark's fallbacks: FAKE_SERVER_FAIL=float32,standalone fails those starts.
    fail = os.environ.get("FAKE_SERVER_FAIL", "")
    if ("float32" in fail and _arg("--dtype") == "float32") or ("standalone" in fail and _arg("--speculative-algorithm") == "STANDALONE"):
        say("RuntimeError: stand-in start failure for " + fail)
        sys.exit(1)
    say("Capture cuda graph bs [1, 2, 4, 8, 12, 16, 24, 32]")
    if GRAPHPOOL and not CRASH:
        modes = "['DECODE', 'TARGET_VERIFY']" if SPEC else "['DECODE']"
        say(f"graphpool captured {16 if SPEC else 8} graphs for {modes} at batch sizes [1, 2, 4, 8, 12, 16, 24, 32]")
    runner = "MultiModeCudaGraphRunner" if GRAPHPOOL and not CRASH else "CudaGraphRunner"
    if RUNNER_API:
        runner = "MultiModeDecodeRunner" if GRAPHPOOL else "DecodeCudaGraphRunner"
        print(f"graph-probe: target init_cuda_graphs {runner} in 1.20 s: torch reserved +{41.5 if GRAPHPOOL else 40.0} "
              f"MiB, device +44.0 MiB", file=sys.stderr, flush=True)
        if SPEC:
            adaptive = "--speculative-adaptive" in ARGS
            print(f"graph-probe: spec init_cuda_graphs EAGLEWorkerV2 in 2.00 s: torch reserved "
                  f"+{(90.0 if GRAPHPOOL else 80.0) if adaptive else 20.0} MiB, device +21.0 MiB", file=sys.stderr, flush=True)
            step = 9000.0 if GRAPHPOOL else 11000.0  # a plain step; adaptive's step 0 adds a draft extend
            print(f"graph-probe: step gpu us: bs=32 tok=1 median {step} p90 {step + 200} n=150", file=sys.stderr,
                  flush=True)
    else:
        print(f"graph-probe: target {runner} captured in 1.20 s: torch reserved +{41.5 if GRAPHPOOL else 40.0} MiB, "
              f"device +44.0 MiB", file=sys.stderr, flush=True)
    say("Capture cuda graph end. Time elapsed: 1.20 s. mem usage=0.04 GB. avail mem=70.00 GB.")
    if GRAPHPOOL and SPEC and not CRASH:
        say("graphpool switch: speculation OFF at 9 running requests (off above 8, on at <= 4); graphpool replays "
            "by mode: DECODE=0 TARGET_VERIFY=12; eager fallbacks: none")
    ThreadingHTTPServer.request_queue_size = 256  # 32 concurrent clients, like uvicorn's backlog
    server = ThreadingHTTPServer(("127.0.0.1", int(_arg("--port", "30000"))), Handler)
    say("The server is fired up and ready to roll!")
    server.serve_forever()


if __name__ == "__main__":
    main()
