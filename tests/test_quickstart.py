"""quickstart.sh's set-up where everything but graphpool is installed and pip cannot install it.

A fresh virtual environment that sees this Python's packages (torch, pytest, ...) through a ``.pth`` file, with
pip made to refuse (``PIP_CONSTRAINT`` naming no file, as an old setuptools without ``bdist_wheel`` refuses): the
script must say what pip said and still leave ``import graphpool`` working from any folder (the README's example
runs from ``examples/``).
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What a checkout holds beside its sources and must not be copied: CI's virtual environment alone is 3 GB.
BUILT = {".git", "out", ".sgl", ".whl", "__pycache__", ".pytest_cache", "build", "dist"}


def _sources_only(folder: str, names: list[str]) -> list[str]:
    """copytree's ignore: build outputs, caches and any virtual environment, whatever its name."""
    return [name for name in names if name in BUILT or name.endswith(".egg-info")
            or (Path(folder) / name / "pyvenv.cfg").exists()]


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("git") is None, reason="needs bash and git")
def test_a_refused_editable_install_links_graphpool_so_the_example_imports_it(tmp_path):
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # this Python's torch, pytest, ...
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT, checkout, ignore=_sources_only)
    done = subprocess.run(["bash", "quickstart.sh", "--setup-only"], cwd=checkout, capture_output=True, text=True,
                          env={"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "PYTHON": str(python), "HOME": str(tmp_path),
                               "PIP_CONSTRAINT": str(tmp_path / "no-such-file")},
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    said = re.search(r"pip could not install graphpool: (.+)", done.stdout)
    assert said and said.group(1).strip(), done.stdout  # what pip said, whatever its words in this pip version
    assert "import graphpool works from anywhere" in done.stdout
    probe = "import graphpool, graphpool.kernels, graphpool.integrations; print(graphpool.kernels.__file__)"
    found = subprocess.check_output([python, "-c", probe], cwd=tmp_path, text=True).strip()
    assert Path(found) == checkout / "kernels" / "__init__.py"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_an_unreachable_cpu_index_is_said_once_and_the_fallback_named(tmp_path):
    """No torch, no GPU, and PyTorch's CPU index unreachable (a closed port here): the script asks the index
    once, says in one line that it falls back on pip's own sources, and names that source when it installs.
    This venv has no pip, so the install itself then fails at once: what is checked is what came before it."""
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    index = "http://127.0.0.1:9/whl/cpu"  # port 9 (discard): nothing listens, the connection is refused
    done = subprocess.run(["bash", str(ROOT / "quickstart.sh"), "--setup-only"], capture_output=True, text=True,
                          env={"PATH": f"{env_dir / 'bin'}:/usr/bin:/bin", "PYTHON": str(env_dir / "bin" / "python"),
                               "HOME": str(tmp_path), "TORCH_CPU_INDEX": index},
                          timeout=60)
    said = done.stdout + done.stderr
    assert done.returncode != 0, said  # no pip in this venv: the install cannot succeed
    assert said.count("cannot be reached") == 1 and index in said, said
    assert "installing the CPU build of torch==2.13.0 from pip's own configured sources" in said, said
    assert "--index-url" not in said and "Retrying" not in said, said
