"""Every relative link in the repository's markdown files, and every file the packaging metadata names, exists.

A link is ``[text](target)`` or ``<img src="target">``; web addresses are not followed. A target's ``#anchor``,
when it points into a markdown file, must name one of that file's headings (GitHub's slug: lower case, spaces to
hyphens, punctuation other than ``-`` and ``_`` dropped). The metadata (pyproject.toml, setup.py) is checked for
the file names it cites, in values and comments alike: a comment that sends a reader to a file is a link too.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|<img[^>]*\bsrc=\"([^\"]+)\"")
FENCED = re.compile(r"```.*?```", re.S)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)
# (Not .cpp: "llama.cpp" is a project's name; the one C++ file is named by a glob.)
CITED_FILE = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:md|py|sh|txt|toml|json))\b")
METADATA = ("pyproject.toml", "setup.py")


def _tracked(suffix: str) -> list[Path]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout (the links of the committed files are checked)")
    names = subprocess.run(["git", "ls-files", f"*{suffix}"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return [ROOT / name for name in names if (ROOT / name).exists()]


def _slug(heading: str) -> str:
    text = re.sub(r"[`*]{1,2}([^`*]+)[`*]{1,2}", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading keeps its text only
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(markdown: Path) -> set[str]:
    text = FENCED.sub("", markdown.read_text())  # a "# comment" in a code block is no heading
    return {_slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


def _broken_links(markdown: Path) -> list[str]:
    broken = []
    text = CODE.sub("", markdown.read_text())  # links shown as code are examples, not links
    for match in LINK.finditer(text):
        target = match.group(1) or match.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        resolved = (markdown.parent / path).resolve() if path else markdown
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor.lower() not in _anchors(resolved):
            broken.append(f"{target} (no heading #{anchor} in {resolved.name})")
    return broken


def test_every_relative_link_in_the_markdown_resolves():
    files = _tracked(".md")
    assert files, "no markdown file found"
    broken = {str(f.relative_to(ROOT)): b for f in files if (b := _broken_links(f))}
    assert not broken, f"links that do not resolve: {broken}"


def test_the_packaging_metadata_cites_only_files_that_exist():
    tracked = {p.relative_to(ROOT).as_posix() for p in _tracked("")}
    basenames = {Path(p).name for p in tracked}
    missing = {}
    for name in METADATA:
        for cited in CITED_FILE.findall((ROOT / name).read_text()):
            if "*" in cited or "<" in cited:
                continue
            found = cited in tracked if "/" in cited else cited in basenames
            if not found:
                missing.setdefault(name, []).append(cited)
    assert not missing, f"files the metadata names that the repository lacks: {missing}"


def test_the_link_check_sees_a_broken_link_and_a_wrong_anchor(tmp_path):
    """The checker itself: a missing file and a missing heading are reported; a good link and a web link are not."""
    (tmp_path / "other.md").write_text("# Title\n\n## The `run` step: padding\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#the-run-step-padding) [web](https://example.org/x) [top](#intro)\n# Intro\n"
                    "[gone](missing.md) [bad](other.md#nowhere) `[shown](as-code.md)`\n")
    assert _broken_links(page) == ["missing.md (no such file)", "other.md#nowhere (no heading #nowhere in other.md)"]
