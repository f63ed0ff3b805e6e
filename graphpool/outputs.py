"""A step's outputs: what a step may return, slicing to the real rows, and fresh containers per run.

A step returns a tensor, or a tuple, namedtuple, list or dict (nested as deep as you like) whose leaves
are tensors or ``None``. :class:`OutputLayout` records that structure once, at capture, as a flat list of
leaves plus a builder, so a CUDA-graph run hands back a *fresh container* around pre-made, pre-sliced
views: the caller may pop or rebind keys of one result without touching the next, and no tensor is made
per run. (A flat tuple or namedtuple is immutable, so the same one is handed out every run.)
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from .errors import StepOutputError

Outputs = Any  # a Tensor, or a tuple/namedtuple/list/dict of Tensors (or None), nested
Builder = Callable[[Sequence[Any]], Outputs]


def _is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def map_outputs(out: Outputs, fn: Callable[[torch.Tensor], torch.Tensor]) -> Outputs:
    """Apply ``fn`` to every tensor of a step's outputs, keeping their structure (namedtuples included)."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, dict):
        return {k: map_outputs(v, fn) for k, v in out.items()}
    if _is_namedtuple(out):
        return type(out)(*(map_outputs(v, fn) for v in out))
    if isinstance(out, (tuple, list)):
        return type(out)(map_outputs(v, fn) for v in out)
    return out


def tensor_leaves(out: Outputs) -> list[Any]:
    """Every tensor (or ``None``) leaf of a step's outputs, in :class:`OutputLayout`'s order."""
    if out is None or isinstance(out, torch.Tensor):
        return [out]
    children = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    return [leaf for child in children for leaf in tensor_leaves(child)]


def slice_outputs(out: Outputs, num_tokens: int, bs: int, real_tokens: int, real_bs: int) -> Outputs:
    """Cut padded rows off: a first dim of ``num_tokens`` becomes ``real_tokens``, of ``bs`` becomes
    ``real_bs``; any other tensor is returned whole."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0:
            return t
        if t.shape[0] == num_tokens:
            return t[:real_tokens]
        if t.shape[0] == bs:
            return t[:real_bs]
        return t
    return map_outputs(out, cut)


def clone_outputs(out: Outputs) -> Outputs:
    """Private copies of every output tensor (graph outputs are overwritten by the next replay)."""
    return map_outputs(out, torch.Tensor.clone)


class OutputLayout:
    """The structure of a step's outputs, checked once: leaves in order and how to rebuild the container.

    Raises:
        StepOutputError: the step returned something other than tensors (and ``None``) in tuples,
            namedtuples, lists and dicts.
    """

    def __init__(self, out: Outputs, where: str):
        if out is None or not isinstance(out, (torch.Tensor, tuple, list, dict)):
            raise StepOutputError(f"{where}: the step function returned {type(out).__name__}; return a tensor, or a "
                                  f"tuple, namedtuple, list or dict of tensors (graph outputs must be tensors)")
        self.leaves: list[Any] = []
        self.renew: Callable[[Any], Outputs] | None = None  # set by _flat for flat containers
        self.nested = True
        self.build: Builder = self._compile(out, where, root=True)
        if isinstance(out, torch.Tensor):
            self.nested = False

    def prepare(self, leaves: Sequence[Any]) -> Any:
        """What :meth:`fresh` takes for one real batch size: the built outputs, or (nested) the leaves."""
        return leaves if self.nested else self.build(leaves)

    def fresh(self, prepared: Any) -> Outputs:
        """The outputs a run hands back: a new container around the pre-made views (immutable ones shared)."""
        if self.nested:
            return self.build(prepared)
        return prepared if self.renew is None else self.renew(prepared)

    def _compile(self, out: Outputs, where: str, root: bool = False) -> Builder:
        if out is None or isinstance(out, torch.Tensor):
            i = len(self.leaves)
            self.leaves.append(out)
            return lambda leaves: leaves[i]
        children = list(out.values()) if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else None
        if children is not None and root and all(c is None or isinstance(c, torch.Tensor) for c in children):
            return self._flat(out)  # the common case, rebuilt by one C-level call per run
        if isinstance(out, dict):
            keys = list(out)
            parts = [self._compile(out[k], where) for k in keys]
            return lambda leaves: {k: part(leaves) for k, part in zip(keys, parts)}
        if isinstance(out, (tuple, list)):
            parts = [self._compile(v, where) for v in out]
            if _is_namedtuple(out):
                make = type(out)._make
                return lambda leaves: make([part(leaves) for part in parts])
            kind = type(out)
            return lambda leaves: kind([part(leaves) for part in parts])
        raise StepOutputError(f"{where}: the step's outputs hold a {type(out).__name__}; every leaf must be a tensor "
                              f"or None (return Python values outside the graph)")

    def _flat(self, out: Outputs) -> Builder:
        """A container whose children are all leaves: built once per real batch size, then renewed per
        run by one shallow copy (C speed); immutable tuples and namedtuples are handed out as they are."""
        self.nested = False
        if isinstance(out, dict):
            self.leaves.extend(out.values())
            keys = tuple(out)
            self.renew = dict.copy
            return lambda leaves: dict(zip(keys, leaves))
        self.leaves.extend(out)
        if _is_namedtuple(out):
            return type(out)._make
        kind = type(out)
        if kind is not tuple:
            self.renew = kind.copy if hasattr(kind, "copy") else kind
        return kind

    def sliced_leaves(self, num_tokens: int, bs: int, real_tokens: int, real_bs: int) -> tuple[Any, ...]:
        """The leaves cut to the real rows (made once per real batch size, at capture)."""
        return tuple(None if t is None else slice_outputs(t, num_tokens, bs, real_tokens, real_bs)
                     for t in self.leaves)
