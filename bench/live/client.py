"""A concurrent client for a live SGLang server started with ``--skip-tokenizer-init``: token ids in,
token ids out, greedy, over ``POST /generate`` (standard library only: the GPU machine has no extra
packages). Every request of a workload is a :class:`Request`; every answer a :class:`Answer`, checked
against what was asked (:func:`check`)."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Request:
    """One ``/generate`` request: a stable id (the same request across servers), its prompt and sampling."""

    rid: str
    input_ids: Tuple[int, ...]
    max_new_tokens: int
    ignore_eos: bool = True
    stop_token_ids: Tuple[int, ...] = ()

    def body(self) -> Dict[str, Any]:
        params: Dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": 0,
                                  "ignore_eos": self.ignore_eos}
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return {"input_ids": list(self.input_ids), "sampling_params": params}


@dataclass
class Answer:
    """What the server returned for a request (``status`` 0: no HTTP answer at all)."""

    rid: str
    status: int
    seconds: float
    output_ids: List[int] = field(default_factory=list)
    finish_reason: Optional[Dict[str, Any]] = None
    completion_tokens: int = 0
    e2e_latency: Optional[float] = None
    spec_verify_ct: Optional[int] = None
    spec_num_correct_drafts: Optional[int] = None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def post_generate(url: str, request: Request, timeout: float) -> Answer:
    """Send one request and parse SGLang's answer; never raises (errors land in ``Answer.error``)."""
    data = json.dumps(request.body()).encode()
    req = urllib.request.Request(url + "/generate", data=data, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return Answer(request.rid, e.code, time.perf_counter() - t0, error=e.read().decode(errors="replace")[:300])
    except Exception as e:  # connection refused / reset: the server died
        return Answer(request.rid, 0, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}"[:300])
    seconds = time.perf_counter() - t0
    try:
        js = json.loads(text)
        js = js[0] if isinstance(js, list) else js
        meta = js.get("meta_info", {})
        if "error" in js or "output_ids" not in js:
            return Answer(request.rid, status, seconds, error=text[:300])
        return Answer(request.rid, status, seconds, output_ids=list(js["output_ids"]),
                      finish_reason=meta.get("finish_reason"), completion_tokens=meta.get("completion_tokens", 0),
                      e2e_latency=meta.get("e2e_latency"), spec_verify_ct=meta.get("spec_verify_ct"),
                      spec_num_correct_drafts=meta.get("spec_num_correct_drafts"))
    except (ValueError, AttributeError) as e:
        return Answer(request.rid, status, seconds, error=f"unparsed ({e}): {text[:200]}")


def wait_healthy(url: str, alive: Any, timeout: float) -> Optional[float]:
    """Poll ``/health`` until it answers 200; ``None`` if ``alive()`` turns false or time runs out."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if not alive():
            return None
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return time.perf_counter() - t0
        except Exception:
            pass
        time.sleep(0.2)  # a local GET: polling often costs nothing and times the start-up to 0.2 s
    return None


@dataclass
class PhaseResult:
    """A workload phase run at one concurrency: answers in request order and the wall time."""

    name: str
    concurrency: int
    wall_s: float
    answers: List[Answer]

    @property
    def tokens(self) -> int:
        return sum(len(a.output_ids) for a in self.answers if a.ok)

    def as_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "concurrency": self.concurrency, "wall_s": self.wall_s,
                "answers": [asdict(a) for a in self.answers]}


def run_phase(url: str, name: str, requests: Sequence[Request], concurrency: int, timeout: float) -> PhaseResult:
    """``requests`` through ``concurrency`` workers (each takes the next request when its last one ends)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda r: post_generate(url, r, timeout), requests))
    return PhaseResult(name, concurrency, time.perf_counter() - t0, answers)


def check(request: Request, answer: Answer) -> str:
    """Empty when the answer is what was asked: HTTP 200, and either exactly ``max_new_tokens`` tokens
    (length) or, without ``ignore_eos``, at most that many ending at a stop token; else the problem."""
    if not answer.ok:
        return f"HTTP {answer.status} {answer.error}".strip()
    n, reason = len(answer.output_ids), (answer.finish_reason or {}).get("type")
    if n != answer.completion_tokens:
        return f"{n} output ids but completion_tokens {answer.completion_tokens}"
    if reason == "length":
        return "" if n == request.max_new_tokens else f"length finish after {n} of {request.max_new_tokens} tokens"
    if reason == "stop" and not request.ignore_eos:
        matched = (answer.finish_reason or {}).get("matched")
        if n > request.max_new_tokens:
            return f"{n} tokens, more than {request.max_new_tokens}"
        if request.stop_token_ids and matched not in request.stop_token_ids and answer.output_ids[-1:] != [matched]:
            return f"stopped on {matched}, not a stop token"
        return ""
    return f"finish reason {answer.finish_reason} for ignore_eos={request.ignore_eos}"
