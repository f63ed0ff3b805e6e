"""The files a benchmark run writes, all or none.

A run's JSON, CSV and plot are one set: a reader must never find this run's JSON beside the last run's plot,
or a plot cut short by an interrupt. :class:`OutputSet` checks at the start that the set can be written
(before minutes of measuring), has each file written under a temporary name beside its final path, and
renames them all into place at :meth:`OutputSet.commit`. A failure or interrupt before then leaves the
previous set as it was and no temporary file behind; a file of the set this run did not produce (a plot
skipped) is removed at commit, so a set never mixes runs.
"""
from __future__ import annotations

import os
from pathlib import Path


class OutputError(Exception):
    """An output path that cannot be written; the message names it and why."""


class OutputSet:
    """The final paths of one run's files (see the module docstring).

    Args:
        paths: every file the run may write; their folders are created if missing.

    Raises:
        OutputError: a folder cannot be created or written, or a path is an existing folder.
    """

    def __init__(self, *paths: Path | str):
        self.paths = [Path(p) for p in paths]
        self._staged: dict[Path, Path] = {}
        for path in self.paths:
            if path.is_dir():
                raise OutputError(f"output {path} is an existing folder, not a file: choose another --out")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                probe = path.parent / f".{path.name}.probe-{os.getpid()}"
                probe.write_bytes(b"")
                probe.unlink()
            except OSError as exc:
                raise OutputError(f"cannot write {path}: {exc.strerror or exc}; choose another --out") from None

    def temporary(self, path: Path | str) -> Path:
        """Where to write ``path`` now (same folder and suffix, so writers that infer a format from the name
        still do); :meth:`commit` moves it to ``path``."""
        path = Path(path)
        if path not in self.paths:
            raise ValueError(f"{path} is not one of this run's outputs {[str(p) for p in self.paths]}")
        tmp = path.with_name(f".{path.stem}.partial-{os.getpid()}{path.suffix}")
        self._staged[path] = tmp
        return tmp

    def commit(self) -> list[Path]:
        """Move every written file into place; remove the set's files this run did not write. Returns the
        paths written."""
        written = []
        for path in self.paths:
            tmp = self._staged.get(path)
            if tmp is not None and tmp.exists():
                os.replace(tmp, path)
                written.append(path)
            elif path.exists():
                path.unlink()  # the previous run's: it would be read as this run's
        self._staged.clear()
        return written

    def discard(self) -> None:
        """Remove what was written so far (the previous set stays as it was)."""
        for tmp in self._staged.values():
            tmp.unlink(missing_ok=True)
        self._staged.clear()

    def __enter__(self) -> "OutputSet":
        return self

    def __exit__(self, kind: type | None, *rest: object) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()
