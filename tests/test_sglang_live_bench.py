"""bench/sglang_live.py on a CPU machine: its log parser on SGLang's and graphpool's own log lines, the
client's answer checks, and a dry run of the whole benchmark against stand-in servers
(tests/live_fake_server.py) that answer and log like SGLang."""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests import sglang_harness  # noqa: F401,I001  (puts the test stand-ins on sys.path first)

from sglang.srt.model_executor.forward_batch_info import ForwardMode

from bench.live import logs
from bench.live.client import Answer, Request, check
from graphpool.integrations.sglang import SpeculationSwitch
from graphpool.integrations.sglang.replay_log import ReplayLog
from graphpool.integrations.sglang.spec_switch import _log_flip

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Lines as SGLang 0.5.12.post1 prints them (from the live runs of SGLANG_LIVE.md and the CPU scheduler test).
SGLANG_LINES = """\
[2026-11-30 01:02:03] Capture cuda graph bs [1, 2, 4, 8, 12, 16]
[2026-11-30 01:02:32] Capture cuda graph end. Time elapsed: 28.85 s. mem usage=0.05 GB. avail mem=70.31 GB.
[2026-11-30 01:02:44] Capture draft cuda graph end. Time elapsed: 11.54 s. mem usage=0.01 GB. avail mem=70.30 GB.
[2026-11-30 01:03:00] Decode batch, #running-req: 4, #token: 164, token usage: 0.00, accept len: 1.00, accept rate: 0.00, cuda graph: True, gen throughput (token/s): 512.20, #queue-req: 0
[2026-11-30 01:03:01] Decode batch, #running-req: 8, #token: 108, token usage: 0.03, cuda graph: True, gen throughput (token/s): 19.67, #queue-req: 0
[2026-11-30 01:03:02] Decode batch, #running-req: 40, #token: 900, token usage: 0.10, cuda graph: False, gen throughput (token/s): 9.00, #queue-req: 3
[2026-11-30 01:03:03] The server is fired up and ready to roll!
graph-probe: target MultiModeCudaGraphRunner captured in 2.31 s: torch reserved +44.0 MiB, device +46.0 MiB
[2026-11-30 01:03:04] RuntimeError: The size of tensor a (160) must match the size of tensor b (2) at non-singleton dimension 0
Traceback (most recent call last):
"""


def test_log_parser_reads_sglang_lines_and_graphpools_own(caplog):
    refusals = {"decode bs 40 > 32": 2}
    replays = ReplayLog(refusals, every=1)
    with caplog.at_level(logging.INFO):
        for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DECODE):
            replays.count(mode)
        switch = SpeculationSwitch(8, 4)
        worker = SimpleNamespace(target_worker=SimpleNamespace(model_runner=SimpleNamespace(
            graph_runner=SimpleNamespace(replay_log=replays))))
        _log_flip(worker, False, 9, switch)
        logging.getLogger("graphpool.integrations.sglang.common").info(
            "graphpool captured %d graphs for %s at batch sizes %s", 24, ["DECODE", "TARGET_VERIFY"], [1, 2, 4])
    text = SGLANG_LINES + "\n".join(r.getMessage() for r in caplog.records)
    facts = logs.parse(text)
    assert facts.fired_up and facts.target_capture == {"seconds": 28.85, "gb": 0.05}
    assert facts.capture["draft cuda graph"] == [{"seconds": 11.54, "gb": 0.01}]
    assert facts.target_probe == {"role": "target", "runner": "MultiModeCudaGraphRunner", "seconds": 2.31,
                                  "reserved_mib": 44.0, "device_mib": 46.0}
    assert facts.decode_lines == 3 and facts.decode_eager == [40] and facts.decode_accept_by_bs == {4: [1.0]}
    assert facts.crash == "The size of tensor a (160) must match the size of tensor b (2)" and facts.tracebacks == 1
    assert facts.gp_graphs == 24 and facts.gp_modes == ["DECODE", "TARGET_VERIFY"] and facts.gp_batch_sizes == [1, 2, 4]
    assert facts.replays == {"DECODE": 2, "TARGET_VERIFY": 1}
    assert facts.gp_fallbacks == "decode bs 40 > 32: 2"
    assert facts.flips == [{"speculation": "OFF", "running": 9}]


def test_a_flip_the_acceptance_gate_holds_back_is_logged_as_such(caplog):
    switch = SpeculationSwitch(8, 4, min_accept=1.5, pause_steps=100)
    worker = SimpleNamespace(target_worker=SimpleNamespace(model_runner=SimpleNamespace(graph_runner=None)))
    with caplog.at_level(logging.INFO):
        for _ in range(switch.gate.window):  # a draft that never hits: the gate pauses speculation
            assert switch.speculate(2)
            switch.verified(2, 0)
        for bs in (9, 2):  # off by size, then on by size while the gate still holds it off
            flips = switch.switches
            decision = switch.speculate(bs)
            assert switch.switches == flips + 1 and not decision
            _log_flip(worker, decision, bs, switch)
    lines = [r.getMessage() for r in caplog.records if "switch:" in r.getMessage()]
    assert "paused for 100 decode steps: verify steps commit 1.00 tokens per sequence" in lines[0]
    assert "speculation OFF at 9 running requests" in lines[1] and "gate" not in lines[1]
    assert "speculation ON at 2 running requests" in lines[2] and lines[2].endswith(
        "but paused by the acceptance gate; target runner: SGLang's own")
    assert logs.parse("\n".join(lines)).flips == [{"speculation": "OFF", "running": 9},
                                                   {"speculation": "ON", "running": 2}]


def test_answers_are_checked_against_what_was_asked():
    length = Request("a", (5, 6), 4)
    assert check(length, Answer("a", 200, 0.1, [1, 2, 3, 4], {"type": "length", "length": 4}, 4)) == ""
    assert "3 of 4" in check(length, Answer("a", 200, 0.1, [1, 2, 3], {"type": "length", "length": 4}, 3))
    assert "HTTP 0" in check(length, Answer("a", 0, 0.1, error="ConnectionResetError"))
    assert "finish reason" in check(length, Answer("a", 200, 0.1, [1, 2], {"type": "stop", "matched": 2}, 2))
    stop = Request("b", (5, 6), 8, ignore_eos=False, stop_token_ids=(9,))
    assert check(stop, Answer("b", 200, 0.1, [1, 9], {"type": "stop", "matched": 9}, 2)) == ""
    assert check(stop, Answer("b", 200, 0.1, [1, 2], {"type": "stop", "matched": 2}, 2)) == ""  # EOS
    assert "completion_tokens" in check(stop, Answer("b", 200, 0.1, [1, 9], {"type": "stop", "matched": 9}, 5))


def test_dry_run_against_stand_in_servers(tmp_path):
    """The whole benchmark, short workloads, five stand-in servers: the crash configuration dies on its
    first request, the others serve; the table and the JSON come out."""
    out = tmp_path / "live"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "sglang_live.py"), "--server-module", "tests.live_fake_server",
           "--quick", "--dtype", "bfloat16", "--deadline-s", "240", "--out", str(out), "--port", "32500"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    assert summary in p.stdout
    rows = {line.split()[0]: line.split()[1] for line in summary.splitlines()[3:8]}
    assert rows == {"stock": "served", "gp-switch": "served", "sgl-switch": "crashed", "stock-spec": "served",
                    "gp-nospec": "served"}
    assert "[PASS] 2 switch over SGLang's runner: The size of tensor a (64)" in summary
    assert "[PASS] 3 greedy" in summary and "graph memory gp" in summary
    data = json.loads((out / "sglang_live.json").read_text())
    assert data["configs"]["gp-switch"]["log"]["replays"]["DECODE"] > 0
    assert len(os.listdir(out)) <= 8, "the GPU machine returns at most 8 files"


@pytest.fixture(autouse=True)
def _no_switch_left_installed():
    yield
    from graphpool.integrations.sglang import uninstall_speculation_switch

    uninstall_speculation_switch()


def test_dry_run_settles_dtype_and_speculation_on_the_first_server(tmp_path):
    """float32 and STANDALONE never ran live before: when the first (speculative) server does not start
    with them, the benchmark falls back to bfloat16, then to EAGLE3, for every server."""
    out = tmp_path / "live"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "sglang_live.py"), "--server-module", "tests.live_fake_server",
           "--quick", "--dtype", "float32", "--configs", "stock-spec,stock", "--deadline-s", "200", "--out", str(out),
           "--port", "32600"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, FAKE_SERVER_FAIL="float32,standalone"))
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "trying dtype bfloat16, speculation standalone" in p.stdout
    assert "trying dtype bfloat16, speculation eagle3" in p.stdout
    summary = (out / "summary.txt").read_text()
    assert "dtype bfloat16, speculation eagle3" in summary
    assert [line.split()[:2] for line in summary.splitlines()[3:5]] == [["stock-spec", "served"], ["stock", "served"]]


def test_probe_times_each_replay_and_the_report_compares_the_runners(capsys):
    """The probe's replay timer passes calls through unchanged, logs the median host time per window in a
    line the log parser reads, and the report puts every server's runner cost side by side."""
    import importlib.util
    from bench.live.logs import LogFacts
    from bench.live.report import ConfigResult, verdicts

    spec = importlib.util.spec_from_file_location("graph_probe", os.path.join(ROOT, "bench", "live", "probe",
                                                                              "sitecustomize.py"))
    probe = importlib.util.module_from_spec(spec)
    before = list(sys.meta_path)
    spec.loader.exec_module(probe)
    sys.meta_path[:] = before  # only its timer is under test here, not the import hook

    class Runner:
        calls = 0

        def replay(self, batch, skip_attn_backend_init=False):
            Runner.calls += 1
            return batch * 2

    runner = Runner()
    probe.time_replays(runner, "target", every=3)
    assert [runner.replay(i, skip_attn_backend_init=True) for i in range(7)] == [i * 2 for i in range(7)]
    assert Runner.calls == 7
    lines = [line for line in capsys.readouterr().err.splitlines() if "replay host us" in line]
    assert len(lines) == 2 and all(line.startswith("graph-probe: target Runner replay host us: median ") and
                                   line.endswith(" over 3 calls") for line in lines)
    facts = logs.parse("\n".join(lines + ["graph-probe: draft Runner replay host us: median 999.0 p90 999.0 over 3 calls"]))
    assert len(facts.replay_host_us) == 2 and all(0 <= v < 999 for v in facts.replay_host_us)  # the draft's not kept

    results = {}
    for name, windows in (("stock", [80.0, 90.0, 85.0]), ("gp-nospec", [40.0, 42.0])):
        results[name] = ConfigResult(name, name)
        results[name].log = LogFacts(replay_host_us=windows)
    line = [v for v in verdicts(results) if "host us per replay" in v]
    assert line == ["[INFO] target graph runner host us per replay (median of the probe's windows): "
                    "stock 85.0 (3 windows), gp-nospec 41.0 (2 windows)"]


def test_servers_run_on_the_cpus_asked_for(tmp_path):
    """``--cpus`` pins a server and every process it starts; a list outside this process's CPUs is refused."""
    from bench.live.servers import Server, ServerSpec, parse_cpus

    allowed = sorted(os.sched_getaffinity(0))
    cpu = allowed[-1]
    assert parse_cpus(f"{cpu}") == {cpu} and parse_cpus(f"{cpu}-{cpu},{cpu}") == {cpu}
    for bad in ("x", "3-", "", f"{allowed[-1] + 1000}"):
        with pytest.raises(ValueError):
            parse_cpus(bad)
    (tmp_path / "affinity_probe.py").write_text(
        "import os, subprocess, sys\n"
        "print('self', sorted(os.sched_getaffinity(0)), flush=True)\n"
        "child = [sys.executable, '-c', 'import os; print(sorted(os.sched_getaffinity(0)))']\n"
        "print('child', subprocess.run(child, capture_output=True, text=True).stdout.strip(), flush=True)\n")
    spec = ServerSpec("probe", "probe", "affinity_probe", [])
    server = Server(spec, sys.executable, str(tmp_path / "probe.log"), dict(os.environ), cwd=str(tmp_path), cpus={cpu})
    server.proc.wait(timeout=60)
    log = server.log_text()
    server.stop()
    assert f"self [{cpu}]" in log and f"child [{cpu}]" in log, log


# The throughput phase's dry run (four stand-in servers resident, timed windows) is the long one: CI runs it.
@pytest.mark.parametrize("phase", ["flashinfer", pytest.param("throughput", marks=pytest.mark.slow)])
def test_runner_api_bench_dry_run_of_a_phase(tmp_path, phase):
    """bench/sglang_live_v2.py (SGLang 0.5.17's live run) against stand-in servers: a ramp phase with aborts
    mid-stream, the adaptive side by side (flashinfer phase; it shares the ramp code with correctness), the
    resident A/B/C/D windows (throughput); the table comes last, the files fit what the GPU machine returns."""
    out = tmp_path / phase
    # Ports below Linux's ephemeral range (32768-60999), which any outgoing connection on the machine draws from: a
    # port held so made a stand-in die at its bind and its config lose all its windows (CI, once).
    port = 32700 if phase == "flashinfer" else 32740
    cmd = [sys.executable, os.path.join(ROOT, "bench", "sglang_live_v2.py"), "--phase", phase, "--quick",
           "--server-module", "tests.live_fake_server", "--deadline-s", "200", "--start-s", "20", "--out", str(out),
           "--port", str(port)]
    # throughput: the third server's port is taken (held here, or by whatever holds it already): it serves on another
    try:
        held = socket.create_server(("127.0.0.1", port + 2)) if phase == "throughput" else None
    except OSError:
        held = None
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    finally:
        if held is not None:
            held.close()
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    summary = (out / f"summary_{phase}.txt").read_text()
    assert p.stdout.rstrip().endswith(summary.rstrip()), "the table is printed last"
    data = json.loads((out / f"sglang_live_v2_{phase}.json").read_text())
    assert len(os.listdir(out)) <= 8, "the GPU machine returns at most 8 files"
    if phase == "flashinfer":
        rows = {line.split()[0]: line.split() for line in summary.splitlines()[3:6]}
        assert {name: row[1] for name, row in rows.items()} == {"stock-fi": "served", "gp-fi-k1": "served",
                                                                "gp-fi-k4": "served"}
        assert rows["gp-fi-k1"][3] == "1/1", "the ramp's abort came back aborted mid-stream"
        assert summary.count("[PASS]") == 4 and "graphpool plain DECODE step 9000 us (0.818x)" in summary
        assert data["configs"]["gp-adaptive"]["windows"][0]["concurrency"] == 32
    else:
        # stand-ins of one speed: which side of 0.97x a 0.15 s window lands is noise, the six verdicts are not
        assert len(re.findall(r"^\[(?:PASS|FAIL)\] C=(?:1|8|32) graphpool", summary, re.M)) == 6, summary
        windows = [w for c in data["configs"].values() for w in c["windows"]]
        assert sorted({(w["config"], w["concurrency"], w["round"]) for w in windows}) == sorted(
            (name, c, r) for name in ("stock", "gp-nospec", "stock-spec", "gp-switch") for c in (1, 8, 32) for r in (0, 1)
        ), summary
        assert "[MISSING]" not in summary, summary
        assert re.fullmatch(rf"port {port + 2} in use: served on \d+", data["configs"]["stock-spec"]["notes"][0]), \
            data["configs"]["stock-spec"]["notes"]


def test_runner_api_bench_names_every_window_it_did_not_measure():
    """The throughput table names each window it lacks and why (a server that did not start, the deadline): a
    config missing from the comparison is never silent."""
    from bench.live.report import ConfigResult
    from bench.live.window import Window
    from bench.sglang_live_v2 import Bench, Outcome

    every = [(c, r) for c in (1, 8, 32) for r in (0, 1)]
    bench = Bench(SimpleNamespace(deadline_s=100.0))
    bench.out = {
        "stock": Outcome(ConfigResult("stock", "", "served"), [Window("stock", c, r) for c, r in every]),
        "stock-spec": Outcome(ConfigResult("stock-spec", "", "did not start",
                                           notes=["its log ends: OSError: [Errno 98] Address already in use"])),
        "gp-switch": Outcome(ConfigResult("gp-switch", "", "served", notes=["C=32 round 2 not measured: deadline"]),
                             [Window("gp-switch", c, r) for c, r in every[:-1]])}
    assert [line for line in bench.throughput_table() if line.startswith("[MISSING]")] == [
        "[MISSING] stock-spec: 6 of 6 windows not measured (C=1 round 1, C=1 round 2, C=8 round 1, C=8 round 2, "
        "C=32 round 1, C=32 round 2): did not start; its log ends: OSError: [Errno 98] Address already in use",
        "[MISSING] gp-switch: 1 of 6 windows not measured (C=32 round 2): C=32 round 2 not measured: deadline"]


def test_the_switch_is_judged_against_the_better_stock_that_ran_and_names_it():
    """The switch's verdict at each C is against the faster of the stock servers measured, named with how many
    ran: run in pairs (``--configs stock-spec,gp-switch`` on an H100), "the better stock" is the only one."""
    from bench.live.client import Answer
    from bench.live.report import ConfigResult
    from bench.live.window import Window
    from bench.sglang_live_v2 import Bench, Outcome

    def windows(name, tok_s):  # per C and round, a 10 s window of tok_s[c] 10-token requests: tok_s[c] tok/s
        return [Window(name, c, r, 10.0, [Answer(f"{name}{i}", 200, 0.1, list(range(10)))
                                          for i in range(tok_s[c])]) for c in (1, 8, 32) for r in (0, 1)]

    def verdicts(names):
        speeds = {"stock": {1: 15, 8: 100, 32: 400}, "stock-spec": {1: 11, 8: 80, 32: 230},
                  "gp-switch": {1: 11, 8: 81, 32: 430}}
        bench = Bench(SimpleNamespace(deadline_s=100.0))
        bench.out = {n: Outcome(ConfigResult(n, "", "served"), windows(n, speeds[n])) for n in names}
        return [line for line in bench.throughput_table() if "graphpool switch" in line]

    assert verdicts(["stock", "stock-spec", "gp-switch"]) == [
        "[FAIL] C=1 graphpool switch 0.733x the better stock of 2, stock (11 vs 15 tok/s)",
        "[FAIL] C=8 graphpool switch 0.810x the better stock of 2, stock (81 vs 100 tok/s)",
        "[PASS] C=32 graphpool switch 1.075x the better stock of 2, stock (430 vs 400 tok/s)"]
    assert verdicts(["stock-spec", "gp-switch"])[0] == (
        "[PASS] C=1 graphpool switch 1.000x the better stock of 1, stock-spec (11 vs 11 tok/s)")


def test_the_throughput_phase_refuses_a_gpu_its_resident_servers_do_not_fit(monkeypatch):
    """Four servers of 26 GiB resident do not fit an H100's 79 GiB free: the phase says so before starting any (and
    names --configs), where its last servers would otherwise die at start minutes in; fewer servers go on."""
    from bench.sglang_live_v2 import Bench, phase_configs

    started = []
    bench = Bench(SimpleNamespace(deadline_s=100.0, port=30000, quick=True, window_s=10.0, server_module=None))
    monkeypatch.setattr(bench, "free_gib", lambda: 79.0)
    monkeypatch.setattr(bench, "start", lambda cfg, port: started.append(cfg.name))  # None: not started
    configs = phase_configs("throughput", "m")
    with pytest.raises(SystemExit) as e:
        bench.run_throughput(configs)
    assert "about 104 GiB" in str(e.value) and "79 GiB are free" in str(e.value) and "--configs" in str(e.value)
    assert "gp-switch" in str(e.value) and started == []
    bench.run_throughput(configs[:3])  # 78 GiB: each is started in turn
    assert started == [c.name for c in configs[:3]]


def test_runner_api_bench_runs_only_the_configs_named_and_the_reference(capsys):
    """``--configs`` picks servers of a phase (e.g. the overlap-off pair left by a deadline); the greedy reference
    always stays, and a name not in the phase stops the run before any server starts, naming the phase's own."""
    from bench.sglang_live_v2 import main, phase_configs

    assert [c.name for c in phase_configs("correctness", "m", ["gp-k4-sync", "gp-k1-sync"])] == [
        "stock", "gp-k1-sync", "gp-k4-sync"]
    assert len(phase_configs("correctness", "m")) == 5
    with pytest.raises(SystemExit) as e:
        main(["--phase", "correctness", "--configs", "gp-k1-sync,gp-fi-k1", "--out", "/nonexistent/never"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "gp-fi-k1 not in phase correctness" in err and "gp-k4-sync" in err
