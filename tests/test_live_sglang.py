"""The live tier: real SGLang servers on CPU, through graphpool's launcher, runner and speculation switch.

Opt-in (``pytest --live``; CI runs it for every SGLang release from 0.5.16 to 0.5.23, one after the other, each
release's folder on ``PYTHONPATH``, see ``.ci/sglang-live.sh``). Each server is SGLang itself (HTTP server, tokenizer manager, scheduler, spec-v2 worker,
ModelRunner) on a tiny random Llama made at test time (:mod:`tests.live.models`), with graphpool's own runner serving
the target's DECODE and TARGET_VERIFY steps (what a CPU server needs for that lives in :mod:`tests.live.cpu_plugin`).

The oracle is SGLang's own server without speculation (``python -m sglang.launch_server``, eager on CPU): every
configuration's greedy outputs must equal its outputs token for token. Configurations (one server start each):

* ``eagle``: EAGLE topk 1, the switch off above 4 and on at <= 2, under waves of 1 -> 16 -> 1 concurrent requests
  that cross the threshold both ways several times (a); in one wave, while the switch flips, a JSON-schema request,
  stop strings, stop token ids and streams the client closes mid-way (f);
* ``eagle_topk4``: EAGLE topk 4 with the switch (b; SGLang 0.5.19 and later: before, SGLang's own CPU attention reads
  one length per sequence for ``bs * topk`` draft queries and fails at topk > 1);
* ``eagle3``: EAGLE3 topk 1 with the switch (c); from 0.5.18 on with SGLang's ``--speculative-adaptive`` too, whose table
  has 3, 2 and 0 draft steps at 1, 2 and 3+ running requests: the step-0 steps are plain steps on graphpool's DECODE
  graphs with no draft forward (e), and the three states' target runners share graphpool's one pool: DECODE graphs
  captured once (4a);
* ``standalone``: STANDALONE with the target as its own draft (the same dummy weights): requests whose draft is right
  at every position when they run alone, caught up after plain steps, accept ``steps`` drafts at every verify step
  after the resume (d);
* ``real``: a real checkpoint, SmolLM2-135M-Instruct, drafting for itself (STANDALONE) through the switch, chat
  questions in waves, against SGLang's own server on the same checkpoint: real text and a real acceptance (g);
* ``tiers``: graphpool's own tiers (``--graphpool-tiers``: 3, 2 and 1 draft steps by batch size, plain decode above),
  STANDALONE at topk 4 (before 0.5.19: topk 1), which SGLang's adaptive mode refuses: waves that visit every tier in both
  directions, each tier's verify steps accepting its most after every change and resume (4b);

Each also checks: every request not aborted completes, ``/health`` after every wave, graphpool's replays by mode
with no eager fallback, the switch's OFF/ON flips and catch-ups, and SGLang's own idle KV-leak check (strict: a leak
kills the scheduler, and is never in the log). A summary line per configuration goes to the test's output.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Sequence

import pytest

from tests.live.models import CORPUS, real_checkpoint
from tests.live.server import DEVICE, ROOT, LiveServer, Output, Request, ServerLog, models

pytestmark = [pytest.mark.live, pytest.mark.timeout(600)]

try:
    RELEASE = importlib.metadata.version("sglang")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("the live tier needs SGLang (CI: .ci/sglang-live.sh)", allow_module_level=True)
VERSION = tuple(int(p) for p in RELEASE.split(".")[:3] if p.isdigit())
#: What a release serves here on CPU beyond 0.5.16 and 0.5.17 (each found by serving 0.5.16 to 0.5.23 with it on):
#: topk > 1 from 0.5.19 (SGLang's own CPU attention before), structured output and --speculative-adaptive from 0.5.18
#: (4a, e: 0.5.17's CPU ramp once never crossed the switch). On a GPU: topk > 1 and adaptive; no grammar backend there.
GPU = DEVICE == "cuda"
TOPK4 = VERSION >= (0, 5, 19) or GPU
ADAPTIVE = VERSION >= (0, 5, 18) or GPU
STRUCTURED = VERSION >= (0, 5, 18) and not GPU

STEPS = 3
#: The switch: off above 4 running requests, on again at <= 2.
SWITCH = ("--graphpool-spec-off-above", "4", "--graphpool-spec-on-at-or-below", "2")
SPEC = ("--speculative-num-steps", str(STEPS), "--speculative-draft-load-format", "dummy")
CONFIGS: Dict[str, Sequence[str]] = {
    "eagle": ("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "{eagle}", *SPEC,
              "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(STEPS + 1), *SWITCH),
    "eagle_topk4": ("--speculative-algorithm", "EAGLE", "--speculative-draft-model-path", "{eagle}", *SPEC,
                    "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8", *SWITCH),
    "eagle3": ("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "{eagle3}", *SPEC,
               "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(STEPS + 1), *SWITCH),
    "standalone": ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "{target}", *SPEC,
                   "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(STEPS + 1), *SWITCH),
}
#: --speculative-adaptive's table: 3 draft steps at 1 running request, 2 at 2, step 0 from 3 on (where the switch, off
#: only above 4, still speculates: those plain steps are the adaptive step 0's). Three states, so three target runners,
#: all over graphpool's one pool (4a).
ADAPTIVE_TABLE = {str(bs): {"candidate_steps": [steps], "up_hysteresis": 0.0, "down_hysteresis": 0.0, "ceiling_coeff": 0}
                  for bs, steps in ((1, STEPS), (2, STEPS - 1), (3, 0))}
#: The verify graphs of each --speculative-adaptive state that speculates (steps s, s + 1 tokens, topk 1).
ADAPTIVE_VERIFY = {f"TARGET_VERIFY_1x{s}:{s + 1}": s for s in (STEPS, STEPS - 1)}
#: Why the live tier sends no structured-output request to SGLang 0.5.16 and 0.5.17: SGLang's own server (the oracle
#: too) dies on the first JSON-schema request. 0.5.17's xgrammar backend allocates the token bitmask with
#: ``pin_memory=True``, which a CPU-only torch refuses ("pin_memory=True requires a CUDA or other accelerator
#: backend"); 0.5.16's applies the mask on CUDA only ("Unsupported device: cpu"). 0.5.18 serves it.
NO_STRUCTURED_OUTPUT = f"SGLang {RELEASE}'s xgrammar backend cannot mask logits on CPU"
NO_GRAMMAR_ON_GPU = "the GPU carry holds no grammar backend (--grammar-backend none)"
#: Concurrency of each wave: 1 -> 16 -> 1, crossing the switch's threshold up and down in each wave above 4.
RAMP = (1, 6, 16, 2, 8, 1)


def prompt(i: int) -> str:
    """Prompt ``i``: 40 to 46 words of the corpus (long enough that a STANDALONE draft, which never sees the first token,
    mostly predicts what the target does: see the STANDALONE test)."""
    words = 40 + i % 7
    return " ".join(CORPUS[(i * 5 + k) % len(CORPUS)] for k in range(words))


def tier_candidates() -> List[Request]:
    """4b's candidate requests: 300-word prompts (a STANDALONE draft, which never sees a sequence's first token, agrees
    with the target more often the longer the context: about 9 in 16 at every position here, 1 in 16 at 45 words)."""
    return [Request(" ".join(CORPUS[(i * 5 + k * 3) % len(CORPUS)] for k in range(300)), max_new_tokens=TIER_CUT)
            for i in range(16)]


def wave(start: int, n: int) -> List[Request]:
    """``n`` requests of different lengths (the batch shrinks one request at a time, crossing the threshold)."""
    return [Request(prompt(start + j), max_new_tokens=6 + (7 * j + start) % 17) for j in range(n)]


def same_length_wave() -> List[Request]:
    """4 requests of one length: every decode step runs at 4 requests (adaptive step 0, the switch on)."""
    return [Request(prompt(300 + j), max_new_tokens=12) for j in range(4)]


def ramp_waves() -> List[List[Request]]:
    waves, start = [], 0
    for n in RAMP:
        waves.append(wave(start, n))
        start += n
    return waves


# ----------------------------------------------------------------------------------- the oracle
@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp(f"live-{RELEASE}")


@pytest.fixture(scope="module")
def oracle(work: Path) -> Dict[str, object]:
    """SGLang's own server without speculation: the outputs of every wave, and of the requests of (f), whose stop
    strings and stop token ids are taken from its own unconstrained outputs (so they do stop mid-way)."""
    from transformers import AutoTokenizer

    with LiveServer.start([], work, name="oracle", graphpool=False) as server:
        ramp = [server.client.generate_many(w) for w in ramp_waves()]
        flat = server.client.generate_many(same_length_wave())
        tiers = server.client.generate_many(tier_candidates())
        free = server.client.generate_many([Request(prompt(100 + j), max_new_tokens=24) for j in range(2)])
        tokenizer = AutoTokenizer.from_pretrained(str(models(work / "models")["target"]))
        special = special_requests(free, tokenizer)
        answers = server.client.generate_many(special)
        server.check_health()
    for request, answer in zip(special, answers):  # the stops do stop, mid-way
        if request.stop or request.stop_token_ids:
            assert answer.finish_reason["type"] == "stop" and len(answer.output_ids) < request.max_new_tokens, answer
    return {"ramp": ramp, "flat": flat, "tiers": tiers, "special": special, "special_out": answers}


def special_requests(free: List[Output], tokenizer: object) -> List[Request]:
    """(f)'s requests: a JSON schema, a stop string and stop token ids seen in the oracle's own free outputs."""
    stop_id = free[0].output_ids[len(free[0].output_ids) // 2]
    texts = [tokenizer.decode([t]) for t in free[1].output_ids[4:]]
    stop_text = next((t for t in texts if t.strip()), None)
    schema = json.dumps({"type": "object", "properties": {"fox": {"type": "integer"}}, "required": ["fox"]})
    # ignore_eos off for the stops: SGLang's ignore_eos disregards stop token ids too.
    out = [Request(prompt(100), max_new_tokens=24, stop_token_ids=[stop_id], ignore_eos=False)]
    if STRUCTURED:  # see NO_STRUCTURED_OUTPUT
        out.append(Request(prompt(102), max_new_tokens=32, json_schema=schema, ignore_eos=False))
    if stop_text is not None:
        out.append(Request(prompt(101), max_new_tokens=24, stop=[stop_text], ignore_eos=False))
    return out


# ----------------------------------------------------------------------------------- checks
def same_tokens(got: List[Output], want: List[Output], what: str) -> int:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.output_ids == w.output_ids, f"{what}, request {i}: {g.output_ids} != plain server's {w.output_ids}"
    return len(got)


def check_log(log: ServerLog, *, modes: Sequence[str]) -> Dict[str, int]:
    assert not log.problems(), f"server log: {log.problems()[:3]}"
    replays = log.replays_by_forward_mode()
    for mode in modes:
        assert replays.get(mode, 0) > 0, f"no {mode} replay by graphpool's runner: {replays}"
    assert log.eager_fallbacks() == "none", f"eager fallbacks: {log.eager_fallbacks()}"
    return replays


def run_ramp(server: LiveServer, oracle: Dict[str, object], special_at: int = -1) -> Dict[str, int]:
    """The ramp's waves (with (f)'s requests and two aborted streams in wave ``special_at``), each checked against
    the oracle and followed by a health check. Returns counts for the summary."""
    served = aborted = 0
    for k, requests in enumerate(ramp_waves()):
        if k == special_at:
            special = oracle["special"]
            with ThreadPoolExecutor(max_workers=4) as pool:
                streams = [pool.submit(server.client.stream_and_abort, Request(prompt(200 + j), max_new_tokens=64), 3)
                           for j in range(2)]
                outs = server.client.generate_many(list(requests) + list(special))
                assert all(s.result(timeout=120) == 3 for s in streams), "a stream ended before the client closed it"
            aborted += len(streams)
            served += same_tokens(outs[:len(requests)], oracle["ramp"][k], f"wave {k}")
            served += same_tokens(outs[len(requests):], oracle["special_out"], "structured output / stop requests")
        else:
            served += same_tokens(server.client.generate_many(requests), oracle["ramp"][k], f"wave {k}")
        server.check_health()
    return {"served": served, "identical": served, "aborted": aborted}


def summary(name: str, server: LiveServer, counts: Dict[str, int], started: float, **more: object) -> None:
    log = server.log()
    print(f"\nlive {RELEASE} {name}: served {counts['served']}, identical {counts['identical']}, aborted "
          f"{counts['aborted']}; replays {log.replays()}; captures {log.captures()}; eager fallbacks "
          f"{log.eager_fallbacks()}; switch OFF "
          f"{log.flips('OFF')} ON {log.flips('ON')}; catch-ups {len(log.catch_ups())}; forwards {server.forwards()}; "
          + "".join(f"{k} {v}; " for k, v in more.items())
          + f"start {server.started_s:.0f} s, wall {time.monotonic() - started:.0f} s")


# ----------------------------------------------------------------------------------- the configurations
def test_eagle_switch_under_a_ramp_with_structured_output_stops_and_aborts(work, oracle):
    """(a) and (f)."""
    started = time.monotonic()
    with LiveServer.start(CONFIGS["eagle"], work, name="eagle") as server:
        counts = run_ramp(server, oracle, special_at=3)
        log = server.log()
        check_log(log, modes=("DECODE", "TARGET_VERIFY"))
        assert log.flips("OFF") >= 3 and log.flips("ON") >= 3, f"OFF {log.flips('OFF')}, ON {log.flips('ON')}"
        assert log.catch_ups(), "speculation resumed without a draft catch-up"
        no_schema = {} if STRUCTURED else {"no JSON schema": NO_GRAMMAR_ON_GPU if GPU else NO_STRUCTURED_OUTPUT}
        summary("eagle (a, f)", server, counts, started, **no_schema)


def test_eagle_topk4_switch(work, oracle):
    """(b)."""
    if not TOPK4:
        pytest.skip(f"SGLang {RELEASE}'s own CPU attention (intel_amx forward_decode) reads one length per sequence for "
                    f"bs * topk draft queries and fails at topk > 1; 0.5.19 fixed it")
    started = time.monotonic()
    with LiveServer.start(CONFIGS["eagle_topk4"], work, name="eagle_topk4") as server:
        counts = run_ramp(server, oracle)
        log = server.log()
        check_log(log, modes=("DECODE", "TARGET_VERIFY"))
        assert log.flips("OFF") >= 3 and log.catch_ups()
        summary("eagle topk 4 (b)", server, counts, started)


def test_eagle3_switch_and_adaptive_step0_on_decode_graphs(work, oracle):
    """(c), and from 0.5.18 on (e) and (4a) on the same server: SGLang's ``--speculative-adaptive`` chooses 3 draft steps at
    1 running request, 2 at 2 and 0 from 3 on (:data:`ADAPTIVE_TABLE`), where the switch still speculates; graphpool
    serves step 0 as plain steps on DECODE graphs, and the draft model runs no forward for them (e). Its three states'
    target runners are views of graphpool's one pool: the DECODE graphs captured once, each speculating state's verify
    graphs once (4a; before, each state's runner captured DECODE and verify graphs of its own). 0.5.17 served the same
    in two runs of three (tests/test_sglang_tiers.py checks its one pool against SGLang's own classes); in the third,
    the ramp's 8-request wave never ran more than 4 requests at once (its prefills came apart while the other release's
    servers ran beside it), so the switch did not flip 3 times: 0.5.16 and 0.5.17 keep the switch alone here."""
    started = time.monotonic()
    args = CONFIGS["eagle3"]
    if ADAPTIVE:
        table = work / "adaptive.json"
        table.write_text(json.dumps(ADAPTIVE_TABLE))
        args = (*args, "--speculative-adaptive", "--speculative-adaptive-config", str(table))
    with LiveServer.start(args, work, name="eagle3") as server:
        counts = run_ramp(server, oracle)
        more: Dict[str, object] = {}
        if ADAPTIVE:
            more = adaptive_step0_and_one_pool(server, oracle, counts)
        log = server.log()
        check_log(log, modes=("DECODE", "TARGET_VERIFY"))
        assert log.flips("OFF") >= 3 and log.catch_ups()
        summary("eagle3 (c" + (", e, 4a)" if ADAPTIVE else ")"), server, counts, started, **more)


def adaptive_step0_and_one_pool(server: LiveServer, oracle: Dict[str, object], counts: Dict[str, int]) -> Dict[str, object]:
    """(e) and (4a) of the EAGLE3 server under --speculative-adaptive (see its test); returns what the summary says."""
    before, verified = server.forwards(), server.log().replays()  # this wave decodes at 4 requests: step 0
    counts["served"] += same_tokens(server.client.generate_many(same_length_wave()), oracle["flat"], "at step 0")
    counts["identical"] = counts["served"]
    after, replays = server.forwards(), server.log().replays()
    server.check_health()
    grew = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    # A verify step of s draft steps (topk 1) costs s - 1 draft decodes and 1 draft extend; a prefill or a catch-up a
    # draft EXTEND. Any other draft forward would be a step 0's: there must be none.
    verify = {s: replays.get(m, 0) - verified.get(m, 0) for m, s in ADAPTIVE_VERIFY.items()}
    decode = grew.get("target DECODE", 0)
    draft = {k: v for k, v in grew.items() if k.startswith("draft") and k != "draft EXTEND"}
    assert sum(verify.values()) == grew.get("target TARGET_VERIFY", 0), (verify, grew)
    assert draft.get("draft DECODE", 0) == sum((s - 1) * n for s, n in verify.items()) and \
        sum(draft.values()) == sum(s * n for s, n in verify.items()), \
        f"draft forwards at adaptive step 0: {draft} for verify steps {verify} (by draft steps)"
    assert decode >= 8, f"{decode} of the wave's steps were adaptive step 0's plain steps: {grew}"
    # (4a) three adaptive states, one pool: DECODE captured once, each speculating state's verify graphs once
    log = server.log()
    captures = log.captures()
    assert captures == {"DECODE": 1, **dict.fromkeys(ADAPTIVE_VERIFY, 1)}, captures
    assert all(log.replays().get(m, 0) > 0 for m in ADAPTIVE_VERIFY), log.replays()
    return {"adaptive step 0 (e): plain steps on DECODE graphs": decode, "their draft forwards": 0,
            "verify steps by draft steps (at < 3 running)": verify, "captures of the 3 adaptive states (4a)": captures}


@pytest.mark.gpu
def test_adaptive_graph_memory_and_capture_time_against_stock(work, oracle):
    """(4a) on a GPU: SGLang's ``--speculative-adaptive`` (:data:`ADAPTIVE_TABLE`, EAGLE3) served by SGLang's own graph
    runners and by graphpool's one pool, same flags: each server's graph memory and capture time as SGLang logs them
    (its ``Capture ... CUDA graph end`` lines: target, draft and draft-extend runners of every adaptive state), and
    graphpool's server serving the oracle's tokens with its DECODE graphs captured once.

    The stock server only captures: SGLang 0.5.17's own step 0 on CUDA dies on its first switch to it (its verify
    hands ``verify_tree_greedy`` int32 candidates where the kernel wants int64; seen on an H100, 2026-12-05), where
    graphpool runs step 0 as plain DECODE with no verify at all."""
    table = work / "adaptive.json"
    table.write_text(json.dumps(ADAPTIVE_TABLE))
    args = (*CONFIGS["eagle3"][:CONFIGS["eagle3"].index(SWITCH[0])], "--speculative-adaptive",
            "--speculative-adaptive-config", str(table))
    figures = {}
    for name, graphpool in (("stock", False), ("graphpool", True)):
        with LiveServer.start(args, work, name=f"adaptive-{name}", graphpool=graphpool) as server:
            if graphpool:
                outs = server.client.generate_many(same_length_wave())
                same_tokens(outs, oracle["flat"], f"adaptive, {name}'s runners")
                for k, requests in enumerate(ramp_waves()[:3]):
                    same_tokens(server.client.generate_many(requests), oracle["ramp"][k], f"adaptive, {name}, wave {k}")
            server.check_health()
            log = server.log()
            assert not log.problems(), f"{name} server log: {log.problems()[:3]}"
            captures = log.graph_captures()
            assert captures, f"{name}: no SGLang capture line in its log"
            figures[name] = {"graphs GB": round(sum(gb for _, _, gb in captures), 2),
                             "capture s": round(sum(s for _, s, _ in captures), 2),
                             "by runner (what, s, GB)": captures}
            if graphpool:
                assert log.captures() == {"DECODE": 1, **dict.fromkeys(ADAPTIVE_VERIFY, 1)}, log.captures()
    print(f"\nlive {RELEASE} adaptive graph memory and capture time (4a, {DEVICE}): {figures}")
    # SGLang rounds each runner's memory to 10 MB: graphpool's one pool may not take more than stock's runners
    rounding = 0.01 * len(figures["stock"]["by runner (what, s, GB)"])
    assert figures["graphpool"]["graphs GB"] <= figures["stock"]["graphs GB"] + rounding, figures


#: (d)'s most waves of 6 (each until two of them resumed at their pair).
STANDALONE_WAVES = 5
#: (d) on a GPU: SGLang's draft-extend graphs off. SGLang's own STANDALONE bookkeeping (0.5.17, also in 0.5.23's
#: code) breaks when they run: they return draft hidden states (captured in LAST mode) where a STANDALONE draft keeps
#: none, a prefill merged into that running batch adds no rows to them (``EagleDraftInput.merge_batch`` concatenates
#: only when both sides have some), and the next filter gathers rows that are not there: on an H100 (run BN) a
#: device-side "index out of bounds" once a request joined two running ones, as (d)'s requests do. graphpool serves
#: only the target's steps; this is the draft's path, which a stock server takes too (not yet run so on a GPU).
STANDALONE_GPU_ENV = {"SGLANG_DISABLE_DRAFT_EXTEND_CUDA_GRAPH": "1"}


def test_standalone_self_draft_accepts_every_draft_after_each_resume(work, oracle):
    """(d): the target as its own draft proposes what the target decodes, so a verify step accepts all ``STEPS`` drafts,
    the first one after a catch-up included: the catch-up rebuilt the draft's KV as SGLang's own draft steps would.

    Not every request qualifies: SGLang feeds an EAGLE-family draft its inputs shifted by one (position p sees token
    p + 1), so a STANDALONE draft never sees a sequence's first token, which changes some predictions. So every request
    of the ramp first runs alone (SGLang's own path: at most 2 running, the switch never off, no catch-up); one whose
    verify steps all accept every draft there has a draft that is right at every position of its sequence. Then waves
    of 6 (the switch goes off) whose two longest requests are such ones: speculation resumes at 2 running requests,
    which are exactly those two, caught up after their plain steps, and each of their verify steps must accept every
    draft. The radix cache is off, so each run of a request computes its own KV.

    A wave proves the resume only where it had one: on a loaded machine a wave's requests can reach the scheduler so far
    apart that its pair ends with the fillers (no resume at 2). Such a wave's pair is still checked (it ran clean), and
    another wave is sent (pairs reused, new fillers) until two waves resumed, at most :data:`STANDALONE_WAVES`."""
    started = time.monotonic()
    requests = [r for w in ramp_waves() for r in w]
    want = [o for w in oracle["ramp"] for o in w]
    with LiveServer.start((*CONFIGS["standalone"], "--disable-radix-cache"), work, name="standalone",
                          env=STANDALONE_GPU_ENV if GPU else None) as server:
        alone = server.client.generate_many(requests, concurrency=2)
        counts = {"served": same_tokens(alone, want, "alone"), "aborted": 0}
        assert server.log().flips("OFF") == 0
        by_length = sorted(range(len(requests)), key=lambda i: -requests[i].max_new_tokens)
        clean = [i for i in by_length if not any(accepted(alone[i])[:STEPS]) and requests[i].max_new_tokens >= 10]
        others = [i for i in by_length if i not in clean]
        # One pair proves a resume; more pairs vary the waves (the CPU tier finds 5 clean of 34; a GPU finds 2, with
        # Triton's float32 dots in TF32, run BR, and in IEEE, run BU).
        assert len(clean) >= 2, f"{len(clean)} of {len(requests)} requests clean alone"
        resumed, verify_steps, waves = 0, 0, 0
        pairs = len(clean) // 2
        while resumed < 4 and waves < STANDALONE_WAVES:
            k, w, waves = waves % pairs, waves, waves + 1
            pair = clean[2 * k:2 * k + 2]
            flips, catch_ups = server.log().flips("ON"), len(server.log().catch_ups())
            # Four more, cut 5 tokens shorter than the pair (greedy: their outputs are the oracle's, cut): the pair
            # outlasts them, so speculation resumes at exactly the pair, after its plain steps.
            cut = min(requests[i].max_new_tokens for i in pair) - 5
            # (from the requests at least ``cut`` long: the oracle has their first ``cut`` tokens), new ones each wave
            longer = [i for i in others if requests[i].max_new_tokens >= cut]
            fill = [longer[(4 * w + j) % len(longer)] for j in range(4)]
            fillers = [dataclasses.replace(requests[i], max_new_tokens=cut) for i in fill]
            outs = server.client.generate_many([requests[i] for i in pair] + fillers)
            counts["served"] += same_tokens(outs[:2], [want[i] for i in pair], f"wave {w}")
            counts["served"] += same_tokens(outs[2:], [dataclasses.replace(want[i], output_ids=want[i].output_ids[:cut])
                                                       for i in fill], f"wave {w}, cut")
            server.check_health()
            for i, out in zip(pair, outs[:2]):
                histogram = accepted(out)
                assert not any(histogram[:STEPS]), f"request {i} accepted fewer than {STEPS} drafts after a resume: " \
                                                   f"{histogram} (alone: {accepted(alone[i])})"
                verify_steps += histogram[STEPS] if len(histogram) > STEPS else 0
            log = server.log()
            if log.flips("ON") > flips:  # this wave resumed: its one catch-up was the pair's
                assert log.flips("ON") == flips + 1 and log.catch_ups()[catch_ups:] == [2], log.catch_ups()
                resumed += 2
        counts["identical"] = counts["served"]
        log = server.log()
        check_log(log, modes=("DECODE", "TARGET_VERIFY"))
        assert resumed >= 4 and log.catch_ups() == [2] * log.flips("ON"), (waves, log.catch_ups())
        assert verify_steps >= resumed, "each caught-up request verified at least once after its resume"
        summary("standalone (d)", server, counts, started,
                **{"requests clean alone": f"{len(clean)} of {len(requests)}", "waves": waves,
                   "caught up and checked": resumed,
                   f"their verify steps after resume, all accepting {STEPS} (length {STEPS + 1})": verify_steps})


#: (g)'s questions, asked through the checkpoint's own chat template.
QUESTIONS = ("What is the capital of France?", "Name three primary colours.", "Why is the sky blue?",
             "Write a haiku about the sea.", "What is 12 times 12?", "Who wrote Romeo and Juliet?",
             "Give one tip for learning to cook.", "What do bees make?", "Explain what a CPU does.",
             "Translate 'good morning' into French.", "What is the boiling point of water?",
             "Describe a cat in one sentence.", "What is a prime number?", "Name a planet with rings.",
             "How many days are in a leap year?", "What language is spoken in Brazil?")
#: (g)'s waves: 1 -> 8 -> 1 running requests, crossing the switch (off above 4, on at <= 2) both ways.
REAL_RAMP = (1, 6, 8, 2, 1)
#: (g): the mean drafts accepted per verify step (of :data:`STEPS`) a model drafting for itself must reach.
REAL_MIN_ACCEPTED = 1.5


def test_a_real_checkpoint_drafting_for_itself_through_the_switch(work):
    """(g): real weights and real text. SmolLM2-135M-Instruct (the transformers tests' checkpoint) served by SGLang's
    own server without speculation (the oracle), then through graphpool's launcher with STANDALONE speculation, the
    model its own draft, and the switch: chat questions in waves of 1 -> 8 -> 1. Greedy output identical to the
    oracle's, the switch off and on with a catch-up each time, every step on graphpool's runner, and a real
    model's acceptance: its drafts mostly right (the tier's random models accept all or nothing). CI runs it on the
    newest release and on 0.5.17, the GPU machines' (about 2 minutes each: the other releases share their code paths
    with one of them, and serve the random models above)."""
    if RELEASE not in ("0.5.23", "0.5.17"):
        pytest.skip("run on SGLang 0.5.23 and 0.5.17 (two servers of a 30-layer model: ~2 minutes a release)")
    from tests.hf_models import require_smollm2  # skips, or fails where GRAPHPOOL_REQUIRE_SMOLLM2 is set
    require_smollm2()
    checkpoint = real_checkpoint(ROOT)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
             for q in QUESTIONS]
    waves, k = [], 0
    for n in REAL_RAMP:
        waves.append([Request(texts[(k + j) % len(texts)], max_new_tokens=12 + (5 * (k + j)) % 13) for j in range(n)])
        k += n
    real = ("--model-path", str(checkpoint), "--load-format", "auto")
    started = time.monotonic()
    with LiveServer.start(real, work, name="real-oracle", graphpool=False) as server:
        want = [server.client.generate_many(w) for w in waves]
        server.check_health()
    spec = ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(checkpoint),
            "--speculative-num-steps", str(STEPS), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(STEPS + 1), *SWITCH)
    with LiveServer.start((*real, *spec), work, name="real-standalone") as server:
        served, histogram = 0, [0] * (STEPS + 1)  # verify steps by the drafts they accepted (0 to STEPS)
        for i, (requests, oracle) in enumerate(zip(waves, want)):
            outs = server.client.generate_many(requests)
            served += same_tokens(outs, oracle, f"SmolLM2, wave {i}")
            for out in outs:
                for accepted_drafts, steps in enumerate(accepted(out)):
                    histogram[accepted_drafts] += steps
            server.check_health()
        log = server.log()
        check_log(log, modes=("DECODE", "TARGET_VERIFY"))
        assert log.flips("OFF") >= 1 and log.flips("ON") >= 1 and len(log.catch_ups()) == log.flips("ON"), \
            (log.flips("OFF"), log.flips("ON"), log.catch_ups())
        verify_steps = sum(histogram)
        mean = sum(n * steps for n, steps in enumerate(histogram)) / max(verify_steps, 1)
        assert verify_steps and mean >= REAL_MIN_ACCEPTED, f"drafts accepted per verify step {mean:.2f}: {histogram}"
        answer = tokenizer.decode(want[0][0].output_ids, skip_special_tokens=True)
        summary("real checkpoint, STANDALONE (g)", server, {"served": served, "identical": served, "aborted": 0},
                started, **{"drafts accepted per verify step": f"{mean:.2f} of {STEPS} ({histogram})",
                            "first answer": repr(answer)})


#: graphpool's tiers (4b), STANDALONE: the server's own shape first (3 steps of topk 4, 8 tokens), then 2 and 1 steps,
#: plain decode above 4 running requests (back at <= 3). SGLang before 0.5.19 runs the same step counts as chains (topk
#: 1): its own CPU attention fails at topk > 1 (see test_eagle_topk4_switch).
TIERS = "4x3:8@1,4x2:6@2,4x1:4@4/3" if TOPK4 else "1x3:4@1,1x2:3@2,1x1:2@4/3"
TIERS_TOPK = 4 if TOPK4 else 1
#: Each tier's most tokens committed per request and verify step (steps + 1: every tier's tree reaches its depth).
TIER_MOST = {tier.split("@")[0]: int(tier.split("x")[1].split(":")[0]) + 1 for tier in TIERS.split(",")}
#: The waves of 4b (running requests at their start), each shrinking one request at a time: 5 visits plain decode, the
#: hysteresis at 4, the resume at 3 (a catch-up) and every speculative tier up to the longest; 2 and 3 start from the
#: longest tier (where the wave before ended) and change to shorter ones first.
TIER_WAVES = (5, 2, 3)
#: The longest request of each wave of 4b (the others 3, 6, ... tokens shorter; the shortest of 5 is 8 tokens long, so
#: the wave still reaches 5 running requests where SGLang prefills one request apart and decodes it a step first).
TIER_CUT = 20
#: At most this many rounds of :data:`TIER_WAVES`, until the waves entered every tier and plain decode: on a loaded
#: machine a wave's requests can reach the scheduler so far apart that the wave of 5 never runs 5 at once (CI, SGLang
#: 0.5.22, once in its first two runs), as (d)'s waves can miss their resume.
TIER_ROUNDS = 3


def test_standalone_tiers_at_topk_4_accept_their_most_after_every_change(work, oracle):
    """(4b): graphpool's tiers (``--graphpool-tiers``) at topk 4, which SGLang's own ``--speculative-adaptive`` refuses,
    with STANDALONE (the target as its own draft): every verify step of a request whose draft is right at every
    position commits its tier's most (steps + 1 tokens), the first step after each tier change included, and the
    first after plain steps (a catch-up) too. So the draft's state survives every change: the exact check.

    As in (d), the candidates (:func:`tier_candidates`) first run alone (the longest tier, 1 running) to find those
    whose draft is right at every position (every verify step accepts all 3 drafts); the waves use only such ones, cut
    to staggered lengths (greedy: their outputs are the oracle's, cut). The logit scale of the test weights
    (``tests/live/cpu_plugin.py``) keeps each draft's greedy chain in its tree at every depth."""
    started = time.monotonic()
    requests, want = tier_candidates(), oracle["tiers"]
    args = ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "{target}", *SPEC,
            "--speculative-eagle-topk", str(TIERS_TOPK), "--speculative-num-draft-tokens", TIERS.split(":")[1].split("@")[0],
            "--disable-radix-cache", "--graphpool-tiers", TIERS)
    with LiveServer.start(args, work, name="tiers") as server:
        alone = server.client.generate_many(requests, concurrency=1)
        counts = {"served": same_tokens(alone, want, "alone"), "aborted": 0}
        clean = [i for i in range(len(requests)) if not any(accepted(alone[i])[:STEPS])]
        assert len(clean) >= 3, f"{len(clean)} of {len(requests)} requests clean alone"
        before = len(server.log_text())
        for rounds in range(1, TIER_ROUNDS + 1):
            for n in TIER_WAVES:
                # Each request a wave (a clean one may come twice: two requests, each with its own KV), the shortest
                # first: the batch shrinks one at a time, by 3 tokens, a verify step or more of each tier.
                picked = [clean[k % len(clean)] for k in range(n)]
                cuts = [TIER_CUT - 3 * (n - 1 - k) for k in range(n)]
                outs = server.client.generate_many([dataclasses.replace(requests[i], max_new_tokens=c)
                                                    for i, c in zip(picked, cuts)])
                counts["served"] += same_tokens(outs, [dataclasses.replace(want[i], output_ids=want[i].output_ids[:c])
                                                       for i, c in zip(picked, cuts)], f"round {rounds}, wave of {n}")
                server.check_health()
            if {b for _, b, _ in ServerLog(server.log_text()[before:]).tier_changes()} >= {*TIER_MOST, "decode"}:
                break
        counts["identical"] = counts["served"]
        log, waves = server.log(), ServerLog(server.log_text()[before:])
        check_log(log, modes=("DECODE", "TARGET_VERIFY"))
        changes, firsts, steps = waves.tier_changes(), waves.tier_first_verifies(), log.tier_steps()
        entered = {b for _, b, _ in changes}
        assert entered == {*TIER_MOST, "decode"}, f"tiers entered: {changes}"
        assert all(mean == most == TIER_MOST[t] for t, mean, most in firsts) and len(firsts) == len(changes) - \
            sum(b == "decode" for _, b, _ in changes), f"first verify steps after the changes {changes}: {firsts}"
        waves_steps = {t: (most - alone_most, all_ - alone_all) for t, (most, all_) in steps.items()
                       for alone_most, alone_all in [ServerLog(server.log_text()[:before]).tier_steps().get(t, (0, 0))]}
        assert all(most == all_ > 0 for most, all_ in waves_steps.values()), f"verify steps at their most: {waves_steps}"
        assert waves.catch_ups() and log.captures() == {"DECODE": 1, **{f"TARGET_VERIFY_{t}": 1 for t in TIER_MOST}}, \
            (waves.catch_ups(), log.captures())
        summary("standalone tiers (4b)", server, counts, started, **{
            "requests clean alone": f"{len(clean)} of {len(requests)}", "rounds of waves": rounds, "tier changes": changes,
            "first verify after each change (tier, committed, most)": firsts,
            "verify steps at their most/all in the waves": waves_steps, "catch-ups (requests)": waves.catch_ups()})


def accepted(output: Output) -> List[int]:
    """SGLang's per-request histogram: verify steps by the number of drafts they accepted (plain steps are none)."""
    return output.meta.get("spec_correct_drafts_histogram") or []


def test_an_option_graphpool_refuses_stops_the_launcher_before_the_weights_load(live_server, tmp_path):
    """Bad input: the launcher refuses an option it cannot honour on this SGLang before SGLang loads anything, and the
    live tier reports the server's own message instead of waiting (one release is enough: the launcher's code)."""
    if VERSION < (0, 5, 23):
        pytest.skip("run on SGLang 0.5.23 (the launcher's check is release-independent; a start costs ~15 s)")
    args = (*CONFIGS["eagle"], "--graphpool-spec-min-accept", "1.5")
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="spec-min-accept drives the classic API") as refused:
        live_server(args, name="refused", timeout=120)
    log = (tmp_path / "refused.log").read_text()
    assert "Load weight begin" not in log and time.monotonic() - started < 120, str(refused.value)
