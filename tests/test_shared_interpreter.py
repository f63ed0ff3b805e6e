"""The interpreter that a test module's snippets share (tests/shared_interpreter.py) behaves as ``python -c``
would for each: modules named fresh are imported anew, output and exit status come back per snippet."""
from __future__ import annotations

import pytest

from tests.shared_interpreter import SharedInterpreter


@pytest.fixture
def shared():
    interpreter = SharedInterpreter(fresh=["probe_mod"])
    yield interpreter
    interpreter.close()


def test_each_snippet_imports_the_fresh_modules_from_its_own_path(shared, tmp_path):
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "probe_mod.py").write_text(f"WHO = {name!r}\n")
    code = "import probe_mod, sys; print(probe_mod.WHO); print('err', file=sys.stderr)"
    first, second = shared.run(code, path=[tmp_path / "one"]), shared.run(code, path=[tmp_path / "two"])
    assert (first.stdout, first.stderr, first.returncode) == ("one\n", "err\n", 0)
    assert second.stdout == "two\n"


def test_exit_status_and_traceback_as_python_c_reports_them(shared):
    raised = shared.run("raise ImportError('no module named xyz')")
    assert raised.returncode == 1 and raised.stderr.splitlines()[-1] == "ImportError: no module named xyz"
    assert shared.run("import sys; sys.exit(2)").returncode == 2
    assert shared.run("print('still alive')").stdout == "still alive\n"
