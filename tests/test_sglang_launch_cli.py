"""The SGLang launcher without a working SGLang: one line saying what to install, exit status 2.

Runs the real command, ``python -m graphpool.integrations.sglang.launch --help``, in a subprocess whose
imports cannot see SGLang (or, with SGLang installed, cannot see torchvision, as in CI's venv, where
SGLang's classes import but its server does not).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch_help(hidden: str) -> subprocess.CompletedProcess:
    """``launch --help`` with module ``hidden`` unimportable (a ``None`` entry in ``sys.modules``)."""
    code = (f"import sys, runpy; sys.modules[{hidden!r}] = None; sys.argv = ['launch', '--help']; "
            "runpy.run_module('graphpool.integrations.sglang.launch', run_name='__main__', alter_sys=True)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_without_sglang_says_what_to_install_and_exits_2():
    proc = launch_help("sglang")
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no traceback
    assert "needs SGLang" in lines[0] and "pip install sglang==0.5.12.post1" in lines[0]


def test_sglang_without_its_server_dependencies_says_so_and_exits_2():
    if importlib.util.find_spec("sglang") is None:
        from tests.optional import require_sglang
        require_sglang()
    proc = launch_help("torchvision")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "SGLang is installed but its server does not import" in lines[0] and "torchvision" in lines[0]
    assert "pip install sglang==0.5.12.post1" in lines[0]


def test_the_package_imports_without_sglang():
    """``graphpool.integrations.sglang`` itself imports without SGLang; its names load on first use."""
    code = ("import sys; sys.modules['sglang'] = None; import graphpool.integrations.sglang as s; "
            "print(sorted(s.__all__)[:2]);\ntry:\n    s.MultiModeCudaGraphRunner\nexcept ImportError as e:\n"
            "    print('lazy', e.name)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    listed, lazy = proc.stdout.splitlines()
    assert listed == "['MODE_NAMES', 'MultiModeCudaGraphRunner']" and lazy.startswith("lazy sglang")
