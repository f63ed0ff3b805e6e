"""graphpool for SGLang: a multi-mode ``CudaGraphRunner``, its install patch, and the dynamic speculation
switch (EAGLE v1 plain-decode fallback above a batch-size threshold).

Import name ``graphpool.integrations.sglang``; needs SGLang (tested against 0.5.12.post1). See README.md
beside this file for running a server with it.
"""
from .patch import install, installed, uninstall
from .runner import MODE_NAMES, MultiModeCudaGraphRunner
from .spec_switch import (SpeculationSwitch, install_speculation_switch, plain_decode_batch,
                          uninstall_speculation_switch)
from .support import capture_batch_sizes, unsupported_reasons

__all__ = ["MultiModeCudaGraphRunner", "install", "uninstall", "installed", "MODE_NAMES", "capture_batch_sizes",
           "unsupported_reasons", "SpeculationSwitch", "install_speculation_switch", "uninstall_speculation_switch",
           "plain_decode_batch"]
