"""Packaging: what a non-editable ``pip install .`` ships, and which tree a checkout's subpackages come from.

The wheel is built from a copy of the sources with one integration added that no file names, so the test
shows that pyproject.toml + setup.py find every package under ``integrations/`` (and ``kernels/``) by itself.
The built wheel is then imported from a folder of its own, away from the checkout.
"""
from __future__ import annotations

import ast
import importlib.metadata
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGED = ("graphpool", "kernels", "integrations")  # the folders pyproject.toml maps, and their installed names
INSTALLED = {"graphpool": "graphpool", "kernels": "graphpool/kernels", "integrations": "graphpool/integrations"}


def _setuptools_builds_spdx_licences() -> bool:
    """Whether the installed setuptools is >= 77 (pyproject.toml's build requirement), so that the wheel can be
    built offline with --no-build-isolation."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return major >= 77


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if not _setuptools_builds_spdx_licences():
        pytest.skip("needs setuptools >= 77 installed (torch 2.13 brings it) to build the wheel offline")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.so", "build")
    for folder in PACKAGED:
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    probe = src / "integrations" / "probe_only_here"
    probe.mkdir()
    (probe / "__init__.py").write_text('"""An integration no packaging file names."""\nNAME = "probe"\n')
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    (found,) = (tmp / "dist").glob("graphpool-*.whl")
    return found


def test_the_wheel_ships_every_module_under_graphpool_and_nothing_else(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    src = wheel.parent.parent / "src"
    want = {f"{INSTALLED[folder]}/{path.relative_to(src / folder).as_posix()}"
            for folder in PACKAGED for path in (src / folder).rglob("*.py") if "__pycache__" not in path.parts}
    assert "graphpool/integrations/probe_only_here/__init__.py" in want  # the folder the finder must find
    shipped = {n for n in names if n.endswith(".py")}
    assert shipped == want, f"missing {sorted(want - shipped)}, unexpected {sorted(shipped - want)}"
    assert "graphpool/csrc/input_check.cpp" in names  # the C++ checker's source, built at run time
    assert not [n for n in names if n.split("/")[0] in ("kernels", "integrations", "tests", "bench")]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata and any(n.endswith("licenses/LICENSE") for n in names)
    from graphpool import __version__

    assert f"\nVersion: {__version__}\n" in metadata


def test_the_installed_wheel_imports_its_subpackages_away_from_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)  # what pip install does with a pure-Python wheel
    code = textwrap.dedent("""
        import graphpool, graphpool.kernels.stage, graphpool.integrations.probe_only_here as probe
        import graphpool.integrations.sglang.versions
        print(graphpool.__file__, graphpool.kernels.stage.__file__, probe.NAME)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    package, stage, name = done.stdout.split()
    assert Path(package).parent == site / "graphpool" and Path(stage).parent == site / "graphpool" / "kernels"
    assert name == "probe"


def test_a_checkout_maps_its_own_folders_even_where_another_checkout_is_installed(tmp_path):
    """A shared venv with an editable install of another checkout must not lend this checkout's graphpool its
    kernels (the package and its subpackages came from two trees)."""
    decoy = tmp_path / "other_checkout" / "kernels"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("FROM = 'the other checkout'\n")
    code = textwrap.dedent(f"""
        import importlib.abc, importlib.util, sys

        class OtherCheckout(importlib.abc.MetaPathFinder):  # as an editable install's finder maps it
            def find_spec(self, name, path=None, target=None):
                if name == "graphpool.kernels":
                    return importlib.util.spec_from_file_location(
                        name, {str(decoy / "__init__.py")!r}, submodule_search_locations=[{str(decoy)!r}])
                return None

        sys.meta_path.insert(0, OtherCheckout())  # ahead of any real install of this checkout
        import graphpool, graphpool.kernels
        print(graphpool.kernels.__file__)
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == ROOT / "kernels" / "__init__.py"


def _relative_imports(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package folder it imports (``from . import x``, ``from .x import y``),
    wherever in the file the import stands (a deferred import inside a function closes a cycle too)."""
    modules = {path.stem for path in package.glob("*.py")}
    edges: dict[str, set[str]] = {}
    for path in package.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        edges[path.stem] = (found & modules) - {path.stem, "__init__"}
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``edges`` as a path (first module repeated at its end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    return next((c for start in sorted(edges) if start not in state and (c := visit(start, [start]))), None)


def test_cycle_finder_finds_a_deferred_import_cycle(tmp_path):
    (tmp_path / "a.py").write_text("from .b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import g\n")
    (tmp_path / "c.py").write_text("from . import a\n")
    assert _cycle(_relative_imports(tmp_path)) == ["a", "b", "a"]


@pytest.mark.parametrize("folder", ["graphpool", "kernels", *sorted(
    p.relative_to(ROOT).as_posix() for p in (ROOT / "integrations").iterdir() if (p / "__init__.py").is_file())])
def test_no_package_imports_itself_in_a_cycle(folder):
    cycle = _cycle(_relative_imports(ROOT / folder))
    assert cycle is None, f"{folder}: import cycle {' -> '.join(cycle)}; move what the lower module needs below it"
