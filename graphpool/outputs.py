"""Slicing a step's outputs to the real rows, and copying them out of graph memory."""
from __future__ import annotations

from typing import Any, Callable

import torch

Outputs = Any  # a Tensor, a tuple/list of Tensors, or a dict str -> Tensor


def map_outputs(out: Outputs, fn: Callable[[torch.Tensor], torch.Tensor]) -> Outputs:
    """Apply ``fn`` to every tensor of a step's outputs, keeping their structure."""
    if isinstance(out, torch.Tensor):
        return fn(out)
    if isinstance(out, dict):
        return {k: map_outputs(v, fn) for k, v in out.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(map_outputs(v, fn) for v in out)
    return out


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
