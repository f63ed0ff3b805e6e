"""examples/two_modes.py, the README's API example: the README shows it verbatim, it runs as written,
and the pool it builds returns what the model computes eagerly (the oracle)."""
from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "two_modes.py")


def example_body() -> str:
    """The example without its docstring: what the README shows."""
    text = open(EXAMPLE).read()
    return text[text.index('"""', 3) + 3:].strip()


def test_readme_shows_the_example_verbatim():
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"<!-- example: examples/two_modes.py -->\s*```python\n(.*?)```", readme, re.S)
    assert block, "README.md needs the example block after '<!-- example: examples/two_modes.py -->'"
    assert block.group(1).strip() == example_body(), "README's example differs from examples/two_modes.py"


def test_runs_as_written_and_switches_modes_by_batch_size():
    env = {**os.environ, "PYTHONPATH": ROOT}  # graphpool from this checkout, installed or not
    proc = subprocess.run([sys.executable, EXAMPLE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    steps = [line.split(":")[1].split()[0] for line in proc.stdout.splitlines() if line.startswith("bs ")]
    # SpeculationPolicy(off_above=4, on_at_or_below=2) over batch sizes 1, 3, 6, 8, 5, 3, 2.
    assert steps == ["verify", "verify", "decode", "decode", "decode", "decode", "verify"]
    assert "8 graphs, 7 replays" in proc.stdout and "padded rows" in proc.stdout


def check_against_eager() -> None:
    ns = runpy.run_path(EXAMPLE, run_name="example")
    pool, model, make_inputs = ns["pool"], ns["model"], ns["make_inputs"]
    torch.manual_seed(1)
    with torch.inference_mode():
        for name, mode in pool.modes.items():
            for bs in range(1, 9):
                inputs = make_inputs(mode, bs)
                loc = inputs["out_cache_loc"]
                got = pool.run(name, copy=True, **inputs)
                written = model.kv_cache[loc].clone()  # the KV rows the pool's step wrote
                model.kv_cache[loc] = 0
                want = model(inputs["input_ids"], inputs["positions"], loc, inputs["seq_lens"], mode.tokens_per_seq)
                torch.testing.assert_close(got["logits"], want["logits"], rtol=1e-4, atol=1e-4)
                assert torch.equal(got["next_token"], want["next_token"]), (name, bs)
                torch.testing.assert_close(written, model.kv_cache[loc], rtol=1e-5, atol=1e-5)
    assert sum(pool.stats.misses.values()) == 0


def test_pool_outputs_equal_the_eager_model_on_cpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("the GPU variant below covers CUDA machines")
    check_against_eager()


@pytest.mark.gpu
def test_pool_outputs_equal_the_eager_model_with_cuda_graphs(capsys):
    check_against_eager()
