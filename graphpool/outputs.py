"""A step's outputs: what a step may return, which outputs have rows, and a fresh result per run.

A step returns a tensor, or a tuple, namedtuple, list or dict (subclasses included, e.g. transformers'
``ModelOutput``; nested as deep as you like) whose leaves are tensors or ``None``.

**The output rule.** Which outputs are indexed by row is *declared* at capture
(``pool.capture(step, outputs=...)``), never guessed from shapes:

* ``"token"``: the output has one row per token (``bs * tokens_per_seq`` rows in a graph); a run returns
  the real tokens' rows.
* ``"seq"``: one row per sequence (``bs`` rows); a run returns the real sequences' rows.
* undeclared (or ``None``): returned whole, whatever its shape (a ``[vocab]`` vector, per-layer
  statistics, a table of fixed size).

``outputs`` is ``None`` (every output whole), one rule for every leaf (``"token"`` or ``"seq"``), or a
mapping from output *paths* to rules.

**The path rule.** An output's path is its list of *components*: the dict keys, namedtuple field names and
tuple/list indices from the root down to it; a declared path is those components joined by dots
(``"logits"``, ``"hidden.0"``; ``""`` is the root). A declaration names the one output (leaf or container)
whose components join to it, whole components only: ``"hidden"`` names the key ``"hidden"``, never a
sibling key ``"hidden.layer_norms"`` (a dict key may hold dots; it stays one component). A container's rule
applies to every leaf below it, and the nearest declared container wins. A declaration that cannot hold (a
path that names no output, or two; a ``"token"`` output whose first dimension is not the graph's token
count) is a :class:`StepOutputError` at capture; on the eager miss path the same rule is checked against
the real sizes.

Every run hands back a new container of the step's own type around *new tensor objects* (views of the
graph's output memory, or private copies with ``copy=True``): changing one result's keys or its tensors'
metadata (``unsqueeze_``) never touches the next result. The memory is the graph's: the next run
overwrites the values.
"""
from __future__ import annotations

import copy as _copy
import functools
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from .errors import StepOutputError

Outputs = Any  # a Tensor, or a tuple/namedtuple/list/dict (or subclass) of Tensors (or None), nested
OutputRules = Union[None, str, Mapping[str, Optional[str]]]
ROWS = ("token", "seq")
_detach = torch.Tensor.detach


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _children(out: Any) -> Optional[list[tuple[str, Any]]]:
    """(path component, child) of a container, ``None`` for a leaf."""
    if isinstance(out, dict):
        return [(str(k), v) for k, v in out.items()]
    if _is_namedtuple(out):
        return list(zip(type(out)._fields, out))
    if isinstance(out, (tuple, list)):
        return [(str(i), v) for i, v in enumerate(out)]
    return None


Path = tuple[str, ...]  # an output's components, root first (the path rule, module docstring)


def _dotted(path: Path) -> str:
    """How a declaration spells ``path``: its components joined by dots."""
    return ".".join(path)


def _describe_rule(rule: str, rows: int, what: str) -> str:
    return f"declared per {rule}, so its first dimension must be the {what} ({rows})"


class OutputLayout:
    """The structure of a step's outputs and the row rule of each leaf, checked once at capture.

    Args:
        out: what the step returned.
        rules: the ``outputs`` declaration (see the module docstring).
        where: names the graph in error messages.

    Raises:
        StepOutputError: the step returned something other than tensors (and ``None``) in tuples,
            namedtuples, lists and dicts, or a declared path names none of its outputs (or two).
    """

    def __init__(self, out: Outputs, rules: OutputRules, where: str, fresh: Optional[FreshViews] = None):
        if out is None or _children(out) is None and not isinstance(out, torch.Tensor):
            raise StepOutputError(f"{where}: the step function returned {type(out).__name__}; return a tensor, or a "
                                  f"tuple, namedtuple, list or dict of tensors (graph outputs must be tensors)")
        self.paths: list[Path] = []
        self.leaves: list[Optional[torch.Tensor]] = []
        self.build: Callable[[Sequence[Any]], Outputs] = self._compile(out, (), where)
        self.rules: list[Optional[str]] = _resolve(rules, self.paths, where)
        self._views, self._dict = fresh or PYTHON_FRESH
        self._fast = self._fast_builder(out)

    @staticmethod
    def check_declaration(rules: OutputRules) -> None:
        """Refuse an ``outputs`` declaration of the wrong kind before anything is captured."""
        if rules is None or isinstance(rules, str):
            _check_rule(rules, "outputs")
            return
        if not isinstance(rules, Mapping):
            raise TypeError(f"outputs must be None, 'token', 'seq' or a mapping of output paths to those, got "
                            f"{type(rules).__name__}")
        for path, rule in rules.items():
            if not isinstance(path, str):
                raise TypeError(f"outputs: paths are strings (dict keys, fields, indices joined by dots), got {path!r}")
            _check_rule(rule, f"outputs[{path!r}]")

    # ----------------------------------------------------------------------------------- structure
    def _compile(self, out: Outputs, path: Path, where: str) -> Callable[[Sequence[Any]], Outputs]:
        if out is None or isinstance(out, torch.Tensor):
            i = len(self.leaves)
            self.leaves.append(out)
            self.paths.append(path)
            return lambda leaves: leaves[i]
        children = _children(out)
        if children is None:
            raise StepOutputError(f"{where}: the step's output {_dotted(path) or '(root)'!r} is a "
                                  f"{type(out).__name__}; every leaf must be a tensor or None (return Python values "
                                  f"outside the graph)")
        parts = [self._compile(child, (*path, name), where) for name, child in children]
        kind = type(out)
        if isinstance(out, dict):
            keys = list(out)
            if kind is dict:
                return lambda leaves: {k: part(leaves) for k, part in zip(keys, parts)}
            template = out  # a subclass (OrderedDict, ModelOutput): copied, then every entry replaced

            def rebuild_mapping(leaves: Sequence[Any]) -> Outputs:
                new = _copy.copy(template)
                for k, part in zip(keys, parts):
                    new[k] = part(leaves)
                return new
            return rebuild_mapping
        if _is_namedtuple(out):
            return lambda leaves: kind._make([part(leaves) for part in parts])
        if kind in (tuple, list):
            return lambda leaves: kind([part(leaves) for part in parts])
        try:  # another tuple or list subclass: it must rebuild from its items
            kind(list(out))
        except Exception as exc:
            raise StepOutputError(f"{where}: the step's output {_dotted(path) or '(root)'!r} is a {kind.__name__}, "
                                  f"which cannot be rebuilt from its items ({type(exc).__name__}: {exc}); return a "
                                  f"tuple, list, namedtuple or dict") from None
        return lambda leaves: kind([part(leaves) for part in parts])

    def _fast_builder(self, out: Outputs) -> Optional[Callable[[Sequence[Any]], Outputs]]:
        """One C-level call per run for the common cases: a tensor, or a plain dict, tuple, list or namedtuple
        of tensors. ``None`` where the general builder is needed (nesting, ``None`` leaves, subclasses)."""
        fresh_views, fresh_dict = self._views, self._dict
        if isinstance(out, torch.Tensor):
            return lambda views: fresh_views(views)[0]
        children = _children(out)
        if any(not isinstance(child, torch.Tensor) for _, child in children):
            return None
        kind = type(out)
        if kind is dict:
            return functools.partial(fresh_dict, tuple(out))  # a partial: no Python frame of ours per run
        if _is_namedtuple(out):
            return lambda views: kind._make(fresh_views(views))
        if kind is tuple:
            return lambda views: tuple(fresh_views(views))
        if kind is list:
            return fresh_views
        return None

    # ----------------------------------------------------------------------------------- rows
    def check_rows(self, leaves: Sequence[Optional[torch.Tensor]], num_tokens: int, bs: int, where: str) -> None:
        """Raise :class:`StepOutputError` for a declared output whose rows do not fit ``num_tokens`` / ``bs``."""
        for path, rule, t in zip(self.paths, self.rules, leaves):
            if rule is None or t is None:
                continue
            rows, what = (num_tokens, "token count, bs x tokens_per_seq") if rule == "token" else (bs, "batch size")
            if t.dim() == 0 or t.shape[0] != rows:
                other = ("seq" if rule == "token" else "token") if t.dim() and t.shape[0] in (num_tokens, bs) else None
                hint = (f"declare it {other!r}" if other else "leave it undeclared (returned whole)")
                raise StepOutputError(
                    f"{where}: output {_dotted(path) or '(the tensor)'!r} has shape {tuple(t.shape)}, "
                    f"{_describe_rule(rule, rows, what)}; {hint}, or return it with {rows} rows")

    def views(self, real_tokens: int, real_bs: int) -> tuple[Optional[torch.Tensor], ...]:
        """The captured leaves cut to the real rows by their rules (made once per real batch size)."""
        cut = {"token": real_tokens, "seq": real_bs}
        return tuple(t if t is None or rule is None else t[:cut[rule]] for t, rule in zip(self.leaves, self.rules))

    # ----------------------------------------------------------------------------------- results
    def fresh(self, views: tuple[Optional[torch.Tensor], ...]) -> Outputs:
        """A new result around new tensor objects viewing ``views`` (the hot path of a graph run)."""
        fast = self._fast
        if fast is not None:
            return fast(views)
        return self.build(self._views(views))

    @property
    def fresh_function(self) -> Callable[[tuple], Outputs]:
        """:meth:`fresh` itself, minus a call level where a one-call builder exists (the pool's hot path)."""
        return self._fast or self.fresh

    def copied(self, views: Sequence[Optional[torch.Tensor]]) -> Outputs:
        """A new result holding private copies of ``views``."""
        return self.build([None if t is None else t.clone() for t in views])


def _python_fresh_views(views: tuple[Optional[torch.Tensor], ...]) -> list[Optional[torch.Tensor]]:
    return [None if t is None else _detach(t) for t in views]


def _python_fresh_dict(keys: tuple[str, ...], views: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    return dict(zip(keys, map(_detach, views)))


#: How a result's new tensor objects are made: ``(fresh_views(views) -> list, fresh_dict(keys, views) -> dict)``.
#: ``detach`` in Python (~0.8 us per tensor on the H200's host); CUDA pools use the C++ checker's own pair.
FreshViews = tuple[Callable[[tuple], list], Callable[[tuple, tuple], dict]]
PYTHON_FRESH: FreshViews = (_python_fresh_views, _python_fresh_dict)


def leaves_of(out: Outputs) -> list[Any]:
    """Every tensor (or ``None``) leaf of a step's outputs, in :class:`OutputLayout`'s order."""
    children = _children(out)
    if children is None:
        return [out]
    return [leaf for _, child in children for leaf in leaves_of(child)]


def _resolve(rules: OutputRules, paths: list[Path], where: str) -> list[Optional[str]]:
    """Each leaf's rule from the declaration, by the path rule (module docstring): the rule of the nearest
    declared output at or above it, matched component by component."""
    OutputLayout.check_declaration(rules)
    if rules is None or isinstance(rules, str):
        return [rules] * len(paths)
    # Every output (leaf or container) is a prefix of a leaf's path: the declarations name some of them.
    outputs = {leaf[:depth] for leaf in paths for depth in range(len(leaf) + 1)}
    declared: dict[Path, Optional[str]] = {}
    for spelled, rule in rules.items():
        named = [p for p in outputs if _dotted(p) == spelled]
        if not named:
            raise StepOutputError(f"{where}: outputs declares {spelled!r}, which is not among the step's outputs "
                                  f"{[_dotted(p) for p in paths]}; paths are dict keys, namedtuple fields and "
                                  f"indices joined by dots, each a whole component")
        if len(named) > 1:
            raise StepOutputError(f"{where}: outputs declares {spelled!r}, which names {len(named)} outputs "
                                  f"(components {sorted(named)}): a dict key holding a dot sits beside a nested "
                                  f"output spelled the same; rename that key")
        declared[named[0]] = rule
    resolved = []
    for leaf in paths:
        nearest = next((leaf[:depth] for depth in range(len(leaf), -1, -1) if leaf[:depth] in declared), None)
        resolved.append(None if nearest is None else declared[nearest])
    return resolved


def _check_rule(rule: Any, what: str) -> None:
    if rule is not None and rule not in ROWS:
        raise ValueError(f"{what} must be 'token' (rows per token), 'seq' (rows per sequence) or None (returned "
                         f"whole), got {rule!r}")
