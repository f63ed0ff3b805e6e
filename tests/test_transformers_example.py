"""examples/transformers_decode.py runs as written, and its tokens are ``model.generate(do_sample=False)``'s
for each prompt (the oracle); the README's transformers section stays short, repeated in
integrations/transformers/README.md, and its links exist (its snippet runs in test_transformers_real.py)."""
from __future__ import annotations

import os
import re
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


def readme_section() -> str:
    """The top README's transformers section (its heading on), as integrations/transformers/README.md repeats it."""
    text = open(os.path.join(ROOT, "README.md")).read()
    return text[text.index("## Custom decode loops"):text.index("## SGLang")]


def test_readme_section_is_short_repeated_and_links_what_exists():
    section = readme_section()
    assert len(section.strip().splitlines()) <= 22, "the README section must read in a minute"
    mirror = open(os.path.join(ROOT, "integrations", "transformers", "README.md")).read().split("\n<!--")[0]
    mirror = mirror.replace("](../../", "](")  # its links are relative to its own folder
    assert mirror.strip() == section.replace("## Custom decode loops", "## Hugging Face transformers", 1).strip()
    for link in re.findall(r"\]\(([^)#]+)\)", section):
        assert os.path.exists(os.path.join(ROOT, link)), link
    assert "import graphpool as gp" in section and "GenerationResult" in section
    for name in ("PoolGenerator", "load_smollm2"):
        assert name in section and hasattr(tfm, name)
    assert len(open(os.path.join(ROOT, "README.md"), "rb").read()) <= 10 * 1024, "README.md must stay <= 10 KB"
