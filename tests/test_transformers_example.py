"""examples/transformers_decode.py runs as written, and its tokens are ``model.generate(do_sample=False)``'s
for each prompt (the oracle); the snippet in integrations/transformers/README.md stays short and in step."""
from __future__ import annotations

import os
import runpy

import pytest
import torch

from tests.hf_models import one_thread  # noqa: F401 (a fixture)
from tests.hf_models import needs_transformers, tfm
from tests.hf_models import reference

pytestmark = needs_transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "transformers_decode.py")


def check_example(capsys: pytest.CaptureFixture) -> None:
    ns = runpy.run_path(EXAMPLE, run_name="example")
    result, prompts = ns["result"], ns["prompts"]
    counts = [len(t) for t in result.tokens]
    assert counts == [24, 40, 16, 32] and result.finish == ["length"] * 4
    assert result.tokens == reference(ns["model"], prompts, counts, [])
    assert {s.mode for s in result.steps} == {"decode", "verify"} and result.misses == 0
    out = capsys.readouterr().out
    assert "tokens per sequence per verify step" in out and "8 graphs" in out


def test_example_tokens_equal_generate(capsys: pytest.CaptureFixture):
    if torch.cuda.is_available():
        pytest.skip("the GPU variant below covers CUDA machines")
    check_example(capsys)


@pytest.mark.gpu
def test_example_tokens_equal_generate_with_cuda_graphs(capsys: pytest.CaptureFixture):
    check_example(capsys)  # the example picks CUDA where there is one: real graphs, float32


def test_readme_snippet_is_short_and_names_what_exists():
    text = open(os.path.join(ROOT, "integrations", "transformers", "README.md")).read()
    section = text.split("\n<!--")[0].split("\n## ")[0]  # the section, without the note below it
    assert len(section.strip().splitlines()) <= 14, "the README section must read in a minute"
    for name in ("PoolGenerator", "SpeculationPolicy", "generate"):
        assert name in section and (hasattr(tfm, name) or name == "SpeculationPolicy")
    assert "examples/transformers_decode.py" in section and "docs/transformers.md" in section
