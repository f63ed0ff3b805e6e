"""One Python interpreter that several tests of a module share, instead of one fresh interpreter each.

Starting an interpreter that imports graphpool costs ~1.5-2.5 s (torch); a test module that runs many short
snippets, each in a clean interpreter of its own, paid that per snippet. The worker here starts once, then
runs each snippet in turn as a fresh interpreter would see it for the modules that matter: before each run
it drops the modules named by ``fresh`` (and their submodules) from ``sys.modules``, puts the snippet's
folders first on ``sys.path``, and clears the import caches. It answers with what the snippet printed on
stdout and stderr and its exit status (1 and the traceback on stderr for an uncaught exception, as
``python -c`` does). Use it only where that is all a snippet needs; a snippet that must start without some
module already imported (torch, say) needs an interpreter of its own.
"""
from __future__ import annotations

import json
import select
import subprocess
import sys
from dataclasses import dataclass
from typing import Sequence

_WORKER = r'''
import contextlib, importlib, io, json, sys, traceback
base_path = list(sys.path)
for line in sys.stdin:
    job = json.loads(line)
    for name in [m for m in sys.modules if any(m == p or m.startswith(p + ".") for p in job["fresh"])]:
        del sys.modules[name]
    sys.path[:] = job["path"] + base_path
    importlib.invalidate_caches()
    out, err, status = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            exec(compile(job["code"], "<snippet>", "exec"), {"__name__": "__main__"})
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
    print(json.dumps({"stdout": out.getvalue(), "stderr": err.getvalue(), "returncode": status}), flush=True)
'''


@dataclass
class Result:
    """What a snippet did, as ``subprocess.run(..., capture_output=True, text=True)`` reports it."""

    stdout: str
    stderr: str
    returncode: int


class SharedInterpreter:
    """A worker interpreter (see the module docstring); ``close()`` it when the tests are done."""

    def __init__(self, fresh: Sequence[str], env: dict[str, str] | None = None, timeout_s: float = 120.0):
        self.fresh, self.timeout_s = list(fresh), timeout_s
        self._proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, env=env)

    def run(self, code: str, path: Sequence[str] = ()) -> Result:
        """Run ``code`` with ``path`` first on ``sys.path`` and the ``fresh`` modules not yet imported."""
        if self._proc.poll() is not None:
            raise RuntimeError(f"the shared interpreter exited with status {self._proc.returncode}")
        self._proc.stdin.write(json.dumps({"code": code, "path": [str(p) for p in path], "fresh": self.fresh}) + "\n")
        self._proc.stdin.flush()
        ready, _, _ = select.select([self._proc.stdout], [], [], self.timeout_s)
        if not ready:
            self._proc.kill()
            raise TimeoutError(f"the shared interpreter ran {code!r} for more than {self.timeout_s:.0f} s")
        line = self._proc.stdout.readline()  # the worker answers each job with one line, written at once
        if not line:
            raise RuntimeError(f"the shared interpreter died running {code!r} (status {self._proc.wait()})")
        return Result(**json.loads(line))

    def close(self) -> None:
        self._proc.stdin.close()  # the worker's loop ends with its input
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
