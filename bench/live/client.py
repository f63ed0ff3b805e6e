"""A concurrent client for a live SGLang server started with ``--skip-tokenizer-init``: token ids in,
token ids out, greedy, over ``POST /generate`` (streamed, then aborted, for requests that ask for an abort;
standard library only: the GPU machine has no extra packages). Every request of a workload is a
:class:`Request`; every answer an :class:`Answer`, checked against what was asked (:func:`check`)."""
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
    """One ``/generate`` request: a stable id (the same request across servers), its prompt and sampling.
    ``abort_after`` > 0: streamed, and aborted (``POST /abort_request``) once that many tokens came back."""

    rid: str
    input_ids: Tuple[int, ...]
    max_new_tokens: int
    ignore_eos: bool = True
    stop_token_ids: Tuple[int, ...] = ()
    abort_after: int = 0

    def body(self) -> Dict[str, Any]:
        params: Dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": 0,
                                  "ignore_eos": self.ignore_eos}
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        body: Dict[str, Any] = {"input_ids": list(self.input_ids), "sampling_params": params}
        if self.abort_after:  # the server's id of the request, for the abort
            body.update(rid=self.rid, stream=True)
        return body


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
    if request.abort_after:
        return _post_and_abort(url, request, timeout)
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


def _post_and_abort(url: str, request: Request, timeout: float) -> Answer:
    """Stream ``request``; once ``abort_after`` tokens came back, ask the server to abort it and read the stream
    to its end (SGLang then closes it with ``finish_reason`` ``abort``)."""
    req = urllib.request.Request(url + "/generate", data=json.dumps(request.body()).encode(),
                                 headers={"Content-Type": "application/json"})
    t0, last, ids, aborted = time.perf_counter(), None, [], False
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status = resp.status
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                last = json.loads(line[5:])
                if "error" in last:
                    return Answer(request.rid, status, time.perf_counter() - t0, error=str(last["error"])[:300])
                ids = _stream_ids(ids, last)
                if not aborted and len(ids) >= request.abort_after:
                    aborted = True
                    abort = urllib.request.Request(url + "/abort_request",
                                                   data=json.dumps({"rid": request.rid}).encode(),
                                                   headers={"Content-Type": "application/json"})
                    urllib.request.urlopen(abort, timeout=10).read()
    except urllib.error.HTTPError as e:
        return Answer(request.rid, e.code, time.perf_counter() - t0, error=e.read().decode(errors="replace")[:300])
    except Exception as e:  # connection refused / reset: the server died
        return Answer(request.rid, 0, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}"[:300])
    if last is None:
        return Answer(request.rid, status, time.perf_counter() - t0, error="empty stream")
    meta = last.get("meta_info", {})
    return Answer(request.rid, status, time.perf_counter() - t0, output_ids=ids,
                  finish_reason=meta.get("finish_reason"), completion_tokens=meta.get("completion_tokens", len(ids)),
                  e2e_latency=meta.get("e2e_latency"), spec_verify_ct=meta.get("spec_verify_ct"),
                  spec_num_correct_drafts=meta.get("spec_num_correct_drafts"))


def _stream_ids(ids: List[int], chunk: Dict[str, Any]) -> List[int]:
    """The output so far after a streamed chunk: SGLang sends all ids so far (its default), or only the new
    ones (``--incremental-streaming-output``); the chunk's ``completion_tokens`` tells which."""
    new = list(chunk.get("output_ids") or [])
    done = chunk.get("meta_info", {}).get("completion_tokens")
    return new if done is None or len(new) == done else ids + new


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
    if request.abort_after:  # aborted once it had streamed that many, unless it had finished first
        if reason == "abort" and request.abort_after <= n < request.max_new_tokens:
            return ""
        return "" if reason == "length" and n == request.max_new_tokens else (
            f"asked to abort after {request.abort_after} tokens; got {n}, finish reason {answer.finish_reason}")
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
