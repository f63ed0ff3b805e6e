"""bench/ holds what users run (issue 39), and the front page stays one screen.

* Every file under bench/ is run by a command docs/benchmarks.md names or by CI (a .ci script, a test), itself or
  as what such a file imports or names (a module of the engine, a script gpu.sh runs). bench/RESULTS.md and
  bench/RESULTS_HISTORY.md are the record; every data file under bench/results/ is cited there (a name, or a
  pattern with ``*`` or ``{a,b}``).
* Every bench/ path the README, docs/, the integrations' guides and bench/RESULTS.md name exists (RESULTS_HISTORY.md
  cites removed files on purpose, with the commit that had them).
* bench/gpu.sh, the GPU runs' one entry point, lists its runs and refuses an unknown one; its ``tiers`` run (issue
  40's) goes end to end on a CPU.
* README.md stays within 10 KiB, the SGLang guide (integrations/sglang/README.md) within 12 KiB.
"""
from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH_PATH = re.compile(r"(?<![\w/.:-])bench/[\w./-]*[\w-]")  # not `git show <commit>:bench/...`
RECORD = ("bench/RESULTS.md", "bench/RESULTS_HISTORY.md")


def _tracked(*paths: str) -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout (the committed files are checked)")
    out = subprocess.run(["git", "ls-files", "--", *paths], cwd=ROOT, capture_output=True, text=True, check=True)
    return [name for name in out.stdout.split() if (ROOT / name).exists()]


def _named(text: str) -> set[str]:
    """The bench/ paths a text names (``bench/engine/`` names the folder: nothing in it)."""
    return {m.rstrip(".") for m in BENCH_PATH.findall(text)}


def _module_file(module: str) -> str | None:
    """``bench.engine.gemv`` -> ``bench/engine/gemv.py`` (or the package's ``__init__.py``), where it exists."""
    base = module.replace(".", "/")
    for name in (f"{base}.py", f"{base}/__init__.py"):
        if (ROOT / name).is_file():
            return name
    return None


def _imports(path: str) -> set[str]:
    """The bench files a Python file imports (absolute ``bench.*`` and relative imports), with their packages'
    ``__init__.py``."""
    tree = ast.parse((ROOT / path).read_text(), path)
    package = path.rsplit("/", 1)[0].replace("/", ".")
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            modules.add(base)
            modules.update(f"{base}.{alias.name}" for alias in node.names)
    files = set()
    for module in modules:
        if module == "bench" or module.startswith("bench."):
            parts = module.split(".")
            for i in range(1, len(parts) + 1):  # importing a module runs its packages' __init__ first
                found = _module_file(".".join(parts[:i]))
                if found:
                    files.add(found)
    return files


def _run_by_docs_or_ci() -> set[str]:
    """Every bench file reached from docs/benchmarks.md, the .ci scripts and the tests."""
    reached: set[str] = set()
    todo = _named((ROOT / "docs" / "benchmarks.md").read_text())
    for name in _tracked(".ci"):
        todo |= _named((ROOT / name).read_text())
    for name in _tracked("tests"):
        if name.endswith(".py"):
            todo |= _imports(name) | _named((ROOT / name).read_text())
    while todo:
        path = todo.pop()
        if path in reached or not (ROOT / path).is_file():
            continue
        reached.add(path)
        if path.endswith(".py"):
            todo |= _imports(path)
        if path.endswith((".py", ".sh")):
            todo |= _named((ROOT / path).read_text())
    return reached


def test_every_bench_file_is_run_by_a_documented_command_or_by_ci():
    files = [f for f in _tracked("bench") if not f.startswith("bench/results/") and f not in RECORD]
    assert files
    reached = _run_by_docs_or_ci()
    orphans = sorted(set(files) - reached)
    assert not orphans, (f"files under bench/ that no command of docs/benchmarks.md and nothing CI runs uses: "
                         f"{orphans}. Name each in docs/benchmarks.md with the command that runs it, or, if it "
                         f"answered its question once, remove it and keep its finding in bench/RESULTS_HISTORY.md "
                         f"with the commit that had it")


def _expand(pattern: str) -> list[str]:
    """``a_{x,y}_b`` -> ``a_x_b``, ``a_y_b`` (nested and repeated braces too)."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if not match:
        return [pattern]
    return [p for alt in match.group(1).split(",")
            for p in _expand(pattern[:match.start()] + alt + pattern[match.end():])]


def test_every_results_file_is_cited_by_the_record():
    text = "\n".join((ROOT / name).read_text() for name in RECORD)
    cited = {p for token in re.findall(r"results/[\w./{},*-]+", text) for p in _expand(token.rstrip(".,"))}
    exact = {c for c in cited if "*" not in c}
    patterns = cited - exact
    data = [f for f in _tracked("bench/results")]
    assert data
    uncited = [f for f in data if (rel := f.removeprefix("bench/")) not in exact
               and not any(fnmatch.fnmatchcase(rel, p) for p in patterns)]
    assert not uncited, f"files under bench/results/ that RESULTS.md and RESULTS_HISTORY.md never cite: {uncited}"


def test_the_docs_name_only_bench_files_that_exist():
    docs = ["README.md", "bench/RESULTS.md", *[f for f in _tracked("docs", "integrations") if f.endswith(".md")]]
    missing = {doc: sorted(p for p in _named((ROOT / doc).read_text()) if not (ROOT / p).exists())
               for doc in docs}
    missing = {doc: paths for doc, paths in missing.items() if paths}
    assert not missing, f"bench/ paths named in the docs that do not exist: {missing}"


def test_the_readme_stays_within_10_kib():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 10 * 1024, f"README.md is {size} bytes, over 10,240: the front page is one screen; link the rest"


def test_the_sglang_guide_stays_within_12_kib():
    size = len((ROOT / "integrations" / "sglang" / "README.md").read_bytes())
    assert size <= 12 * 1024, (f"integrations/sglang/README.md is {size} bytes, over 12,288: it is the guide (what, "
                               f"how to run, releases, refusals); mechanisms go to docs/sglang/")


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_entry_point_lists_its_runs_and_refuses_an_unknown_one(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    listed = subprocess.run(["bash", "bench/gpu.sh", "help"], cwd=ROOT, capture_output=True, text=True, env=env)
    assert listed.returncode == 0
    runs = re.findall(r"^\| `([\w-]+)", (ROOT / "docs" / "benchmarks.md").read_text().split("## `bench/gpu.sh`")[1],
                      re.M)
    assert {"tests", "decode", "tiers", "hf", "sglang-live", "sglang-classic", "sglang-tests", "tp"} <= set(runs)
    for run in runs:
        assert re.search(rf"^  {run}\b", listed.stdout, re.M), f"`bash bench/gpu.sh help` does not list {run}"
    unknown = subprocess.run(["bash", "bench/gpu.sh", "no-such-run"], cwd=ROOT, capture_output=True, text=True,
                             env=env)
    assert unknown.returncode == 2 and "unknown run 'no-such-run'" in unknown.stdout


@pytest.mark.slow  # ~10 s: CI runs it (--runslow)
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_entry_points_tiers_run_goes_end_to_end_on_a_cpu(tmp_path):
    """Issue 40's tiers run as `bash bench/gpu.sh tiers` runs it, shortened to two C on the CPU twin: every tier
    and the schedule ran, their output is plain decoding's, the log ends with the run's table."""
    env = {**os.environ, "OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "bench/gpu.sh", "tiers", "--device", "cpu", "--concurrency", "1,2", "--steps", "2"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "decode_tiers.json").read_text())
    variants = {r["variant"] for r in data["results"]}
    assert {"plain", "spec", "spec_8", "spec_4", "dynamic", "tiers"} <= variants
    assert data["identity"]["ok"] is True and data["meta"]["tiers"].keys() == {"verify", "verify_8", "verify_4"}
    assert done.stdout.splitlines()[-1].startswith("== decode_loop --tiers 4x2:8,4x1:4")
    assert "steps by mode at each concurrency C" in done.stdout and (tmp_path / "tiers.log").is_file()


def test_the_live_carrys_stand_ins_and_model_configs_are_well_formed(tmp_path):
    sys.path.insert(0, str(ROOT / "bench" / "live"))
    try:
        import carry
    finally:
        sys.path.remove(str(ROOT / "bench" / "live"))
    for release, models in (("0.5.12", {"tiny-llama", "tiny-eagle3"}),
                            ("0.5.17", {"llama-3.1-8b", "eagle3-llama-3.1-8b"})):
        files = carry.files(release)
        for name, text in files.items():
            if name.endswith(".py"):
                compile(text, name, "exec")
            else:
                json.loads(text)
        assert {n.split("/")[1] for n in files if n.endswith("config.json")} == models
        assert json.loads(files[f"models/{min(models, key=len)}/config.json"])["architectures"] == ["LlamaForCausalLM"]
    with pytest.raises(SystemExit, match="no carry for SGLang '0.5.9'"):
        carry.files("0.5.9")
