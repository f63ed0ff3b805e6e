"""CI's newcomer check (.ci/newcomer_check.py) leaves nothing behind when CI stops it mid-run.

It clones the repository and makes a venv in a temporary folder (~1.8 GB once quickstart.sh has installed torch);
a CI run stopped by its process group's SIGTERM used to leave that folder in the temp directory for good.
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


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a checkout")
def test_sigterm_mid_run_removes_the_clone_and_the_venv(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # tempfile.mkdtemp makes its folder here
    proc = subprocess.Popen([sys.executable, str(ROOT / ".ci" / "newcomer_check.py")], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        # stopped once the venv exists: the clone is done and the folder holds real work
        while not list(tmp_path.glob("graphpool-newcomer-*/venv/bin/python")):
            assert proc.poll() is None, f"the check ended before its venv was made (status {proc.returncode})"
            assert time.monotonic() < deadline, "no venv within 120 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)  # as CI stops a job: the whole process group
        status = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert status == 128 + signal.SIGTERM
    assert not list(tmp_path.glob("graphpool-newcomer-*")), "the clone and venv were left behind"
