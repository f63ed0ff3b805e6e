"""CI's newcomer check (.ci/newcomer_check.py) leaves nothing behind when CI stops it mid-run.

It clones the repository and makes a venv in a temporary folder (~1.8 GB once quickstart.sh has installed torch);
a CI run stopped by SIGTERM used to leave that folder in the temp directory for good.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                                reason="needs git and a checkout")


def _start(tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # tempfile.mkdtemp makes its folder here
    return subprocess.Popen([sys.executable, str(ROOT / ".ci" / "newcomer_check.py")], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _stop_and_check(proc: subprocess.Popen, tmp_path: Path, kill) -> None:
    """Stop the check with ``kill()``; it must exit as SIGTERM's status and, a moment later, have left nothing."""
    try:
        kill()
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM
    time.sleep(2)  # a command left running would write into the venv again
    assert not list(tmp_path.glob("graphpool-newcomer-*")), "the clone and venv were left behind"


def test_sigterm_to_the_group_while_the_venv_is_made_removes_the_clone_and_the_venv(tmp_path):
    proc = _start(tmp_path)
    deadline = time.monotonic() + 120
    # stopped once the venv exists: the clone is done and the folder holds real work
    while not list(tmp_path.glob("graphpool-newcomer-*/venv/bin/python")):
        assert proc.poll() is None, f"the check ended before its venv was made (status {proc.returncode})"
        assert time.monotonic() < deadline, "no venv within 120 s"
        time.sleep(0.2)
    _stop_and_check(proc, tmp_path, lambda: os.killpg(proc.pid, signal.SIGTERM))  # as CI stops a job


def test_sigterm_to_the_check_alone_stops_the_readme_command_it_runs(tmp_path):
    proc = _start(tmp_path)
    for line in proc.stdout:  # until it runs the README's first command (quickstart.sh, which installs torch)
        if line.startswith("$ "):
            break
    else:
        pytest.fail(f"the check ended before it ran a README command (status {proc.wait()})")
    time.sleep(2)
    _stop_and_check(proc, tmp_path, lambda: os.kill(proc.pid, signal.SIGTERM))
