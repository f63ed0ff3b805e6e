"""Launch an SGLang server with graphpool: ``python -m graphpool.integrations.sglang.launch``.

Takes SGLang's ``launch_server`` arguments unchanged, plus graphpool's:

``--graphpool-spec-off-above N``
    decode plainly (no speculation) once a decode batch has more than N sequences: SGLang's EAGLE v1
    worker (classic API, ``--disable-overlap-schedule``) or its spec-v2 worker (0.5.14+, any topk). The
    plain steps need graphpool's runner, so setups it does not serve are refused here.
``--graphpool-spec-on-at-or-below M``
    speculate again once the batch is at or below M (default N; M < N gives hysteresis).
``--graphpool-spec-min-accept A``
    classic API: also decode plainly while verify steps commit fewer than A tokens per sequence (a draft
    below break-even loses at every batch size); the switch probes again after 256 decode steps.
``--graphpool-tiers TABLE``
    speculation tiers (runner API, 0.5.14+; EAGLE, EAGLE3, STANDALONE at any topk): the draft shape of each decode
    step chosen by batch size, plain decode above the last bound. ``TABLE`` is ``TOPKxSTEPS:TOKENS@OFF_ABOVE[/ON]``
    per speculative tier, longest draft first, e.g. ``4x3:16@2,4x2:8@8/6,4x1:4@16/12``; the first tier is the
    server's own ``--speculative-eagle-topk``, ``--speculative-num-steps`` and ``--speculative-num-draft-tokens``
    (:mod:`.tier_table` has the rules; docs/sglang/tiers.md the mechanism).
``--graphpool-keep-sglang-runner``
    for tests and benchmarks only: install the switch but keep SGLang's own ``CudaGraphRunner``, which
    has TARGET_VERIFY graphs only, so the first plain step fails ("The size of tensor a (...) must
    match the size of tensor b (...)"): the crash graphpool's runner exists to fix.

SGLang starts its scheduler processes with ``spawn``, so a patch made in this process would not reach
them. This launcher hands SGLang a picklable scheduler entry point (:class:`SchedulerEntry`) that
installs graphpool inside each scheduler process before running SGLang's own ``run_scheduler_process``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from .tier_table import TierTable

log = logging.getLogger(__name__)

SGLANG_SCHEDULER = "sglang.srt.managers.scheduler:run_scheduler_process"
HELP = """graphpool's options (all other arguments go to SGLang's launch_server, listed below):
  --graphpool-spec-off-above N       decode plainly once a decode batch has more than N sequences (EAGLE,
                                     EAGLE3, STANDALONE: the classic API's EAGLE v1 worker with
                                     --disable-overlap-schedule, or 0.5.14+'s spec-v2 worker)
  --graphpool-spec-on-at-or-below M  speculate again at <= M sequences (default N; M < N: hysteresis)
  --graphpool-spec-min-accept A      classic API (EAGLE v1) only: also decode plainly while verify steps
                                     commit < A tokens per sequence (the draft's break-even); probes again
                                     after 256 decode steps
  --graphpool-tiers TABLE            speculation tiers by batch size (0.5.14+, any topk), plain decode above
                                     the last bound: TOPKxSTEPS:TOKENS@OFF_ABOVE[/ON_AT_OR_BELOW] per tier,
                                     longest draft first, e.g. 4x3:16@2,4x2:8@8/6,4x1:4@16/12; the first
                                     tier is the server's own --speculative-eagle-topk, --speculative-num-steps
                                     and --speculative-num-draft-tokens
"""

#: Why --graphpool-tiers is refused on the classic API.
TIERS_NEED_RUNNER_API = ("--graphpool-tiers swaps the tier states of SGLang's spec-v2 worker, which SGLang 0.5.14 and "
                         "later run; this SGLang has the classic API: use SGLang 0.5.14 to 0.5.23, or "
                         "--graphpool-spec-off-above for on/off speculation")

#: Why --graphpool-spec-min-accept is refused on the runner API (the launcher's check and apply() say it).
MIN_ACCEPT_NEEDS_CLASSIC = ("--graphpool-spec-min-accept drives the classic API's EAGLE v1 switch; this SGLang has "
                            "the runner API (0.5.14+), whose switch decides by batch size only")


@dataclass(frozen=True)
class GraphpoolOptions:
    """graphpool's launcher arguments."""

    spec_off_above: Optional[int] = None
    spec_on_at_or_below: Optional[int] = None
    keep_sglang_runner: bool = False
    #: SGLang's --speculative-adaptive is on: route its step 0 to plain steps (runner API only).
    adaptive_step0: bool = False
    #: also decode plainly while verify steps commit fewer tokens per sequence than this (classic API)
    spec_min_accept: Optional[float] = None
    #: graphpool's speculation tiers (runner API only)
    tiers: Optional[TierTable] = None

    def apply(self) -> None:
        """Install the runner patch (and the speculation switch, if asked for) in this process."""
        from . import versions

        runner_api = versions.runner_api() == versions.RUNNER
        if runner_api and self.spec_min_accept is not None:  # refused before anything is patched
            raise SystemExit(MIN_ACCEPT_NEEDS_CLASSIC)
        if self.tiers is not None and not runner_api:
            raise SystemExit(TIERS_NEED_RUNNER_API)
        if not self.keep_sglang_runner:
            from .patch import install

            install()
        # --- runner API (SGLang 0.5.14+): the tiers (issue 38), or the spec-v2 switch (issue 13) ---
        if runner_api:
            if self.tiers is not None:
                from .spec_tiers import install_speculation_tiers

                install_speculation_tiers(self.tiers)
            elif self.spec_off_above is not None or self.adaptive_step0:
                from .spec_switch_v2 import install_speculation_switch as install_v2

                install_v2(self.spec_off_above, self.spec_on_at_or_below)
            return
        # --- classic API ---
        if self.spec_off_above is not None:
            from .spec_switch import install_speculation_switch

            install_speculation_switch(self.spec_off_above, self.spec_on_at_or_below, min_accept=self.spec_min_accept)


@dataclass(frozen=True)
class SchedulerEntry:
    """A scheduler process target that survives ``spawn``: pickled by reference to this module, it
    installs graphpool in the new process, then calls ``target`` (SGLang's scheduler) with SGLang's args."""

    options: GraphpoolOptions
    target: str = SGLANG_SCHEDULER

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.options.apply()
        module, name = self.target.split(":")
        return getattr(importlib.import_module(module), name)(*args, **kwargs)


def split_args(argv: Sequence[str]) -> Tuple[GraphpoolOptions, List[str]]:
    """graphpool's options, and the remaining arguments for SGLang."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--graphpool-spec-off-above", type=int, default=None)
    parser.add_argument("--graphpool-spec-on-at-or-below", type=int, default=None)
    parser.add_argument("--graphpool-keep-sglang-runner", action="store_true")
    parser.add_argument("--graphpool-spec-min-accept", type=float, default=None)
    parser.add_argument("--graphpool-tiers", default=None)
    ours, rest = parser.parse_known_args(list(argv))
    tiers = None
    if ours.graphpool_tiers is not None:
        try:
            tiers = TierTable.parse(ours.graphpool_tiers)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        others = [flag for flag, value in (("--graphpool-spec-off-above", ours.graphpool_spec_off_above),
                                           ("--graphpool-spec-on-at-or-below", ours.graphpool_spec_on_at_or_below),
                                           ("--graphpool-spec-min-accept", ours.graphpool_spec_min_accept),
                                           ("--graphpool-keep-sglang-runner", ours.graphpool_keep_sglang_runner or None))
                  if value is not None]
        if others:
            raise SystemExit(f"--graphpool-tiers chooses every step's draft itself (plain decode above its last "
                             f"bound), so it takes no {', '.join(others)}: drop {'it' if len(others) == 1 else 'them'}")
    accept = ours.graphpool_spec_min_accept
    off, on = ours.graphpool_spec_off_above, ours.graphpool_spec_on_at_or_below
    if ours.graphpool_keep_sglang_runner and off is None:
        raise SystemExit("--graphpool-keep-sglang-runner only makes sense with the switch: add "
                         "--graphpool-spec-off-above N (it reproduces SGLang's crash on plain steps)")
    if on is not None and off is None:
        raise SystemExit("--graphpool-spec-on-at-or-below needs --graphpool-spec-off-above (the threshold to "
                         "switch speculation off at)")
    if off is not None and (off < 0 or (on is not None and not 0 <= on <= off)):
        raise SystemExit(f"need 0 <= --graphpool-spec-on-at-or-below <= --graphpool-spec-off-above, got "
                         f"on={on}, off={off}")
    # nan fails any comparison; inf would pause speculation for good after every probe
    if accept is not None and (off is None or not 1.0 < accept < math.inf):
        raise SystemExit(f"--graphpool-spec-min-accept needs --graphpool-spec-off-above and a finite value > 1 "
                         f"(tokens a verify step commits per sequence, at least 1 always), got {accept}")
    return GraphpoolOptions(off, on, ours.graphpool_keep_sglang_runner, spec_min_accept=accept, tiers=tiers), rest


def check_server_args(options: GraphpoolOptions, server_args: Any) -> None:
    """Refuse a speculation switch that SGLang's configuration would never reach. Reads the settings as SGLang
    resolved them (:func:`~.support.resolved_arg`): :func:`main` resolves ``server_args`` first (0.5.23)."""
    from .support import resolved_arg, server_args_refusals, switch_refusals

    if options.tiers is not None:
        check_tiers(options.tiers, server_args)
        return
    switch = "--graphpool-spec-off-above" if options.spec_off_above is not None else (
        "--speculative-adaptive with graphpool (its step 0 as plain steps)" if options.adaptive_step0 else None)
    if switch is None:
        return
    # The adaptive step-0 routing drives the same spec-v2 worker as the switch: the same workers refuse it.
    refused = switch_refusals(server_args)
    if refused:
        raise SystemExit(f"{switch} drives SGLang's EAGLEWorkerV2, which this server does not run: "
                         f"{', '.join(f'{flag} ({what})' for flag, what in refused)}; drop those or {switch}")
    if options.spec_off_above is None:
        return
    algorithm = str(resolved_arg(server_args, "speculative_algorithm") or "").upper()
    if algorithm not in ("EAGLE", "EAGLE3", "STANDALONE"):  # SGLang's EAGLE v1 worker and its STANDALONE subclass
        raise SystemExit(f"--graphpool-spec-off-above switches EAGLE speculation, but --speculative-algorithm is "
                         f"{server_args.speculative_algorithm!r} (resolved: {algorithm or None!r}); pass "
                         f"--speculative-algorithm EAGLE, EAGLE3 or STANDALONE")
    # Where graphpool's runner does not serve the server, install() gives it SGLang's, whose verify-only graphs
    # crash on the first plain step: refuse here what the arguments alone tell (DP attention included: the
    # plain step runs on one attention group).
    refused = server_args_refusals(server_args)
    if refused:
        raise SystemExit(f"--graphpool-spec-off-above needs graphpool's runner for its plain decode steps, which "
                         f"does not serve {', '.join(f'{flag} ({what})' for flag, what in refused)}; drop those or "
                         f"--graphpool-spec-off-above")
    from . import versions

    if versions.runner_api() == versions.RUNNER:  # spec v2 runs with or without the overlap scheduler
        if options.spec_min_accept is not None:
            raise SystemExit(MIN_ACCEPT_NEEDS_CLASSIC)
        return
    from .spec_switch import switch_support_problem

    problem = switch_support_problem()  # first: SGLang 0.5.13.x has no EAGLE v1 worker at all
    if problem:
        raise SystemExit(problem)
    if not server_args.disable_overlap_schedule:
        raise SystemExit("--graphpool-spec-off-above drives SGLang's EAGLE v1 worker, which SGLang uses only "
                         "without the overlap scheduler; add --disable-overlap-schedule")


def check_tiers(tiers: TierTable, server_args: Any) -> None:
    """Refuse, before SGLang loads anything, a server that ``--graphpool-tiers`` cannot serve: the classic API,
    SGLang's own ``--speculative-adaptive`` (a second chooser of the step's draft), a worker the tiers do not drive, a
    setup graphpool's runner does not serve (the plain steps and the tiers' one pool are its), and speculation
    settings other than the first tier's. Reads the settings as SGLang resolved them."""
    from . import versions
    from .support import resolved_arg, server_args_refusals, switch_refusals

    if versions.runner_api() != versions.RUNNER:
        raise SystemExit(TIERS_NEED_RUNNER_API)
    # The raw flag too: SGLang resolves it off where its adaptive mode refuses (topk > 1, STANDALONE) with a warning.
    if resolved_arg(server_args, "speculative_adaptive", False) or getattr(server_args, "speculative_adaptive", False):
        raise SystemExit("--graphpool-tiers chooses each step's draft shape itself; SGLang's --speculative-adaptive "
                         "would choose another (its own step count by batch size and acceptance): drop "
                         "--speculative-adaptive (the tiers cover its step counts, at any topk)")
    refused = switch_refusals(server_args) + server_args_refusals(server_args)
    if refused:
        raise SystemExit(f"--graphpool-tiers runs on SGLang's EAGLEWorkerV2 with graphpool's runner, which this server "
                         f"cannot have: {', '.join(f'{flag} ({what})' for flag, what in refused)}; drop those or "
                         f"--graphpool-tiers")
    problems = tiers.server_problems(
        str(resolved_arg(server_args, "speculative_algorithm") or "").upper(),
        resolved_arg(server_args, "speculative_eagle_topk"), resolved_arg(server_args, "speculative_num_steps"),
        resolved_arg(server_args, "speculative_num_draft_tokens"))
    if problems:
        raise SystemExit(f"--graphpool-tiers {tiers}: " + "; ".join(problems))


def sglang_missing_message(exc: ImportError) -> str:
    """One line saying what to install, for an SGLang server that does not import."""
    from .versions import sglang_version

    # The installed release when there is one (its dependencies are what is missing), else the one verified live.
    version = sglang_version()
    version = "0.5.12.post1" if version == "not installed" else version
    install = f"pip install sglang=={version} (the full install, with its CUDA dependencies, on a CUDA machine)"
    if "graphpool supports" in str(exc):  # an SGLang graphpool does not support: versions says which it does
        return f"graphpool's SGLang launcher: {exc}"
    if (exc.name or "").split(".")[0] == "sglang":  # SGLang itself (or a part of it) is not there
        return f"graphpool's SGLang launcher needs SGLang: {install}"
    return (f"SGLang is installed but its server does not import ({type(exc).__name__}: {exc}); it needs "
            f"SGLang's full dependencies: {install}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Parse, install graphpool here and in every scheduler process, and run SGLang's HTTP server."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        from sglang.srt.entrypoints.http_server import launch_server
        from sglang.srt.server_args import prepare_server_args
        from sglang.srt.utils import kill_process_tree

        from . import versions
        from .support import resolved_arg

        versions.runner_api()  # an SGLang graphpool does not know is refused here, before anything starts
    except ImportError as exc:
        print(sglang_missing_message(exc), file=sys.stderr)
        raise SystemExit(2) from None
    try:
        from sglang.srt.plugins import load_plugins  # SGLang 0.5.11+
    except ImportError:
        load_plugins = None
    if "-h" in argv or "--help" in argv:
        print(HELP)  # graphpool's options first; SGLang's parser prints its own below and exits
    options, rest = split_args(argv)
    untested = versions.untested_release_warning()
    if untested:
        log.warning("%s", untested)

    if load_plugins is not None:
        load_plugins()
    server_args = prepare_server_args(rest)
    # SGLang 0.5.23 resolves the arguments when the server starts (resolve_once, idempotent): resolve them
    # now, so that the checks below read what the server will run (a model can turn multi-layer EAGLE on).
    getattr(server_args, "resolve_once", lambda: None)()
    if resolved_arg(server_args, "speculative_adaptive", False):  # runner API: its step 0 on DECODE graphs
        options = dataclasses.replace(options, adaptive_step0=True)
    check_server_args(options, server_args)
    options.apply()  # this process too, for an in-process engine
    try:
        launch_server(server_args, run_scheduler_process_func=SchedulerEntry(options))
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main()
