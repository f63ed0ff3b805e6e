"""A newcomer's first ten minutes, scripted: the README's two commands, verbatim, in a fresh clone and venv.

1. Clone this repository (its committed HEAD) into a temporary folder and make a fresh virtual environment.
2. Take the commands from README.md itself: the lines of the ```bash block that follows the marker
   ``<!-- newcomer:commands -->`` (comments and blank lines dropped). There must be two: set-up + main job,
   then the tests.
3. Run them in order in the clone, the venv active; each must exit 0, the test command must collect with no
   errors and run tests, and ``git status --porcelain`` must be empty afterwards.
4. Print each command's wall time (and the set-up's and the main job's own, as they report them).

CI's machines reach PyPI alone, where the pinned torch (2.13.0) resolves to the CPU build, and not PyTorch's
CPU wheel index: the commands run with quickstart.sh's default index, as a newcomer's would, so the check also
sees the script meet an unreachable index. It must say so in one line, name the source it installs from, and
print none of pip's retry warnings. Usage: ``python .ci/newcomer_check.py`` (.ci/run calls it).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = "<!-- newcomer:commands -->"


def readme_commands(readme: str) -> list[str]:
    """The commands of the bash block after ``MARKER``, in order."""
    found = re.search(re.escape(MARKER) + r"\s*```bash\n(.*?)```", readme, re.S)
    if not found:
        raise SystemExit(f"newcomer check: README.md has no ```bash block after {MARKER!r}")
    lines = [line.split(" #")[0].strip() for line in found.group(1).splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def fresh_env(venv: Path) -> dict[str, str]:
    """This process's environment with the fresh venv active instead of any other, and nothing that
    would let the clone see this checkout or change what the tests require."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "GRAPHPOOL_REQUIRE_SGLANG", "PYTHONHOME")}
    outer = os.environ.get("VIRTUAL_ENV")
    path = [p for p in env.get("PATH", "").split(os.pathsep) if not (outer and p.startswith(outer))]
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    env["VIRTUAL_ENV"] = str(venv)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run(command: str, cwd: Path, env: dict[str, str]) -> tuple[int, str, float]:
    """Run ``command`` with bash, echoing its output as it comes; returns status, output and seconds."""
    print(f"\n$ {command}", flush=True)
    started = time.perf_counter()
    # A session of its own, so that the command's whole tree (quickstart.sh's pip, pytest) can be stopped below.
    proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    out = []
    try:
        for line in proc.stdout:
            out.append(line)
            print("  | " + line, end="", flush=True)
    except BaseException:  # SIGTERM's SystemExit too: nothing may go on writing into the folder main removes
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc.wait(), "".join(out), time.perf_counter() - started


def exit_on_sigterm() -> None:
    """Make SIGTERM (CI stopping the job's process group, or this process alone) a ``SystemExit``, so that the running
    command is stopped (:func:`run`) and ``main``'s ``finally`` removes the clone and the venv: Python's default on
    SIGTERM is to die at once, which left ~1.8 GB in the temp folder."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def main() -> int:
    exit_on_sigterm()
    commands = readme_commands((ROOT / "README.md").read_text())
    if len(commands) != 2:
        raise SystemExit(f"newcomer check: expected two README commands (set-up + main job, tests), got {commands}")
    print("newcomer check: the README's commands, verbatim:", *[f"  {c}" for c in commands], sep="\n")
    tmp = Path(tempfile.mkdtemp(prefix="graphpool-newcomer-"))
    problems: list[str] = []
    times: list[tuple[str, float]] = []
    try:
        clone, venv = tmp / "graphpool", tmp / "venv"
        started = time.perf_counter()
        subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        times.append(("fresh clone + venv", time.perf_counter() - started))
        env = fresh_env(venv)
        outputs = []
        for command in commands:
            status, output, seconds = run(command, clone, env)
            times.append((command, seconds))
            outputs.append(output)
            if status != 0:
                problems.append(f"{command!r} exited with status {status}")
                break
        if outputs:
            if "Retrying (Retry(" in outputs[0]:
                problems.append("the set-up printed pip's retry warnings (an unreachable index asked by pip)")
            if not re.search(r"installing the CPU build of \S+ from \S", outputs[0]):
                problems.append("the set-up did not say where it installed torch from")
        if len(outputs) == 2:
            summary = outputs[1].strip().splitlines()[-1] if outputs[1].strip() else ""
            if re.search(r"\berrors?\b", summary) or "ERROR collecting" in outputs[1]:
                problems.append(f"the test command reported collection errors: {summary!r}")
            if not re.search(r"\b[1-9]\d* passed\b", summary):
                problems.append(f"the test command ran no test: {summary!r}")
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
        if dirty.strip():
            problems.append("git status is not clean after the commands:\n" + dirty)
        for pattern, what in ((r"set-up done in (\d+) s", "set-up (quickstart.sh)"),
                              (r"CPU smoke run done in ([\d.]+) s", "main job (bench/decode_loop.py)")):
            hit = re.search(pattern, outputs[0]) if outputs else None
            if hit:
                times.append((f"  of which {what}, as it reports", float(hit.group(1))))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\nnewcomer check: wall times")
    for what, seconds in times:
        print(f"  {seconds:7.1f} s  {what}")
    if problems:
        print("newcomer check: FAILED\n" + "\n".join(f"  - {p}" for p in problems))
        return 1
    print("newcomer check: passed (both commands succeeded, the tests collected without errors, git status clean)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
