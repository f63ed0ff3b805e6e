"""Which SGLang runner API graphpool detects, on fake SGLang layouts (no SGLang needed).

Each layout is a package tree of empty modules in a folder put first on ``sys.path`` of an interpreter that
has imported neither SGLang nor graphpool's integration yet, with a ``.dist-info`` giving its version, as pip
installs one. The module's tests share one such interpreter (tests/shared_interpreter.py), which forgets
both between tests.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.shared_interpreter import SharedInterpreter

ROOT = Path(__file__).resolve().parent.parent

CLASSIC = ["srt/model_executor/cuda_graph_runner.py", "srt/speculative/eagle_worker.py"]
RUNNER = ["srt/model_executor/runner/decode_cuda_graph_runner.py"]
BETWEEN = ["srt/model_executor/cuda_graph_runner.py", "srt/speculative/eagle_worker_v2.py"]  # 0.5.13.x


def _fake_sglang(root: Path, version: str, modules: list[str], srt_init: str = "") -> None:
    (root / f"sglang-{version}.dist-info").mkdir(parents=True)
    (root / f"sglang-{version}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    (root / "sglang").mkdir()
    (root / "sglang" / "__init__.py").write_text("")
    for module in modules:
        path = root / "sglang" / module
        for parent in reversed(path.relative_to(root).parents[:-1]):
            (root / parent).mkdir(exist_ok=True)
            init = root / parent / "__init__.py"
            if not init.exists():
                init.write_text(srt_init if parent == Path("sglang/srt") else "")
        path.write_text("")


@pytest.fixture(scope="module")
def interpreter():
    # graphpool as a whole is forgotten too: run from a checkout (no install), graphpool.integrations exists only
    # as graphpool's import registers it (graphpool/_layout.py), so forgetting the subpackage alone loses it.
    shared = SharedInterpreter(fresh=["sglang", "graphpool"],
                               env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    yield shared
    shared.close()


def _runner_api(interpreter: SharedInterpreter, root: Path):
    code = "from graphpool.integrations.sglang import versions; print('API', versions.runner_api())"
    return interpreter.run(code, path=[root])


@pytest.mark.parametrize("version, modules, api", [("0.5.9", CLASSIC, "classic"), ("0.5.12.post1", CLASSIC, "classic"),
                                                   ("0.5.14", RUNNER, "runner"), ("0.5.23", RUNNER + CLASSIC, "runner")])
def test_each_generation_is_told_by_its_modules(interpreter, tmp_path, version, modules, api):
    _fake_sglang(tmp_path, version, modules)
    done = _runner_api(interpreter, tmp_path)
    assert done.stdout.strip() == f"API {api}", done.stderr


def test_an_sglang_between_the_apis_is_classic_without_eagle_v1(interpreter, tmp_path):
    """0.5.13.x keeps the classic CudaGraphRunner (graphpool's classic runner serves it, driving the new
    attention hooks) but has no EAGLE v1 worker, which the classic speculation switch needs."""
    _fake_sglang(tmp_path, "0.5.13.post1", BETWEEN)
    code = ("from graphpool.integrations.sglang import versions; "
            "print('API', versions.runner_api(), 'EAGLE v1', versions.has_eagle_v1())")
    done = interpreter.run(code, path=[tmp_path])
    assert done.stdout.strip() == "API classic EAGLE v1 False", done.stderr


def test_a_missing_dependency_is_named_not_taken_for_a_missing_api(interpreter, tmp_path):
    _fake_sglang(tmp_path, "0.5.18", RUNNER, srt_init="import xgrammar_not_installed\n")
    done = _runner_api(interpreter, tmp_path)
    assert "SGLang 0.5.18 is installed but does not import (No module named 'xgrammar_not_installed')" in done.stderr, \
        done.stderr


def test_an_sglang_with_neither_api_says_which_are_supported(interpreter, tmp_path):
    _fake_sglang(tmp_path, "0.4.0", ["srt/managers/scheduler.py"])
    done = _runner_api(interpreter, tmp_path)
    assert "SGLang 0.4.0 has neither the classic CudaGraphRunner nor the runner package" in done.stderr, done.stderr


@pytest.mark.parametrize("version, warned", [("0.5.24", True), ("0.5.23.post1", True), ("0.5.15.post1", False),
                                             ("0.5.20", False), ("0.5.23", False)])
def test_a_release_outside_the_tested_set_gets_one_warning_naming_them(interpreter, tmp_path, version, warned):
    """The launcher warns once (issue 35) when the installed SGLang is a release of a served API that CI does not test."""
    _fake_sglang(tmp_path, version, RUNNER)
    code = "from graphpool.integrations.sglang import versions; print(repr(versions.untested_release_warning()))"
    said = interpreter.run(code, path=[tmp_path]).stdout.strip()
    if warned:
        assert f"SGLang {version} is not a release graphpool is tested against" in said
        assert "0.5.14, 0.5.15, 0.5.15.post1, 0.5.16" in said and "runner graph-runner API" in said
    else:
        assert said == "None"
