"""Optional test dependencies: a test module that needs SGLang skips, with a one-line reason, where SGLang
is absent; with ``GRAPHPOOL_REQUIRE_SGLANG=1`` (set by .ci/run, which installs it) it fails instead, so CI
never skips them silently."""
from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_SGLANG = "GRAPHPOOL_REQUIRE_SGLANG"
SGLANG_HINT = ("needs SGLang 0.5.12.post1's classes: pip install -e '.[sglang-classes]' && "
               "pip install --no-deps sglang==0.5.12.post1 (as .ci/run does)")


def require_sglang() -> None:
    """Skip the calling test module (or test) without SGLang, or fail where CI demands SGLang."""
    if importlib.util.find_spec("sglang") is not None:
        return
    if os.environ.get(REQUIRE_SGLANG, "") not in ("", "0"):
        pytest.fail(f"{SGLANG_HINT} ({REQUIRE_SGLANG} is set: these tests must run)", pytrace=False)
    pytest.skip(SGLANG_HINT, allow_module_level=True)
