"""Live-tier stand-in for ``sgl_kernel``'s CPU ops, in plain torch (no wheel of SGLang's CPU build exists).

A real SGLang server on CPU (``SGLANG_USE_CPU_ENGINE=1``) calls a few ``sgl_kernel`` ops for a dense Llama with
EAGLE: the intel_amx attention (``torch.ops.sgl_kernel.decode_attention_cpu`` / ``extend_attention_cpu``), the
draft-tree and verify kernels, and the KV-slot bookkeeping. :mod:`.ops` writes each from SGLang's own semantics
(its Triton twins and the call sites); they are exported here by name and on the ``torch.ops.sgl_kernel``
namespace. Every other name imports and raises when called: the layers keep their ``forward_native`` paths
(no AMX in the server processes, so no packed weights).
"""
from __future__ import annotations

import torch as _torch

from . import ops as _ops

_EXPORTED = ("decode_attention_cpu", "extend_attention_cpu", "build_draft_decode_metadata_cpu",
             "build_tree_kernel_efficient_cpu", "verify_tree_greedy_cpu", "assign_req_to_token_pool_cpu",
             "assign_extend_cache_locs_cpu", "assign_draft_cache_locs_contiguous_cpu", "fill_bonus_tokens_cpu",
             "fill_accept_out_cache_loc_cpu", "copy_all_layer_kv_cache_cpu")

for _name in _EXPORTED:
    globals()[_name] = getattr(_ops, _name)
    setattr(_torch.ops.sgl_kernel, _name, getattr(_ops, _name))  # SGLang looks some up as torch ops


def __getattr__(name: str):
    """Any other kernel imports (SGLang imports some behind checks it passes on CPU) and fails when called."""
    if name.startswith("__"):
        raise AttributeError(name)

    def not_here(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name} is not in graphpool's live-tier stand-in (tests/live)")
    not_here.__name__ = name
    return not_here
