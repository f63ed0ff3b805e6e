"""Start and stop one live SGLang server at a time (its own process group, its log in a file)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Set


@dataclass
class ServerSpec:
    """One configuration: a name, the Python module that serves, its arguments, extra environment."""

    name: str
    title: str
    module: str
    args: List[str]
    env: Dict[str, str] = field(default_factory=dict)
    speculative: bool = False
    switch: bool = False
    expect_crash: bool = False


class Server:
    """A running server: ``python -m module args`` in a new session, stdout and stderr to ``log_path``;
    with ``cpus``, it and every process it starts (SGLang's scheduler, detokenizer) run on those CPUs only,
    so that servers compared one after another get the same cores."""

    def __init__(self, spec: ServerSpec, python: str, log_path: str, env: Dict[str, str], cwd: Optional[str] = None,
                 cpus: Optional[Set[int]] = None):
        self.spec, self.log_path = spec, log_path
        self.started = time.perf_counter()
        self._log = open(log_path, "w")
        pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
        self.proc = subprocess.Popen([python, "-m", spec.module, *spec.args], stdout=self._log,
                                     stderr=subprocess.STDOUT, env={**env, **spec.env}, cwd=cwd or None,
                                     start_new_session=True, preexec_fn=pin)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 5.0) -> Optional[int]:
        """SIGTERM the whole process group (SGLang's scheduler and detokenizer processes too), then
        SIGKILL what is left after ``grace_s``; returns the server's exit code."""
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.perf_counter() + wait_s
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None and not _group_alive(self.proc.pid):
                    break
                time.sleep(0.2)
            else:
                continue
            break
        self._log.close()
        return self.proc.poll()

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def free_port(port: int, tries: int = 20, host: str = "127.0.0.1") -> Optional[int]:
    """The first of ``port``, ``port + 1``, ... (``tries`` of them) that a server could listen on now, bound as HTTP
    servers bind (``SO_REUSEADDR``: the TIME_WAIT left by a stopped server's own connections does not count); None
    when all are taken. Any socket holding the port blocks a listener there: a server's, or an outgoing connection
    of any process that drew it as its ephemeral port (TIME_WAIT keeps that one for 60 s after it closed)."""
    for candidate in range(port, port + tries):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, candidate))
            except OSError:
                continue
            return candidate
    return None


def parse_cpus(text: str) -> Set[int]:
    """``"0-7,12"`` -> {0, ..., 7, 12}; every CPU must be one this process may run on."""
    cpus: Set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"--cpus takes a list like 0-7,12; got {text!r}")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus or not cpus <= allowed:
        raise ValueError(f"--cpus {text!r}: CPUs {sorted(cpus - allowed) or 'none'} are not among this process's "
                         f"{len(allowed)} ({min(allowed)}-{max(allowed)})")
    return cpus
