"""PoolGenerator(compile=...): the decode and verify steps compiled with ``torch.compile`` before the pool captures
them. Oracles: ``model.generate(do_sample=False)`` per prompt (greedy), and the same generator uncompiled with the
same seed (sampled: the draws are step inputs, so both choose from the same uniforms).

CPU: Dynamo with its ``eager`` backend (the tracing through the slot cache, the attention hook and the sampling,
in seconds). GPU (``-m gpu``): Inductor's kernels inside the pool's real CUDA graphs, float32."""
from __future__ import annotations

import pytest
import torch

import graphpool as gp
from tests.hf_models import one_thread  # noqa: F401 (a fixture)
from tests.hf_models import needs_transformers, reference, tfm, tiny_model

pytestmark = needs_transformers

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8], [11, 12, 13], [3] * 11]
MAX_NEW = [12, 16, 7]
SETTINGS = [pytest.param("cpu", {"backend": "eager"}, id="cpu-dynamo"),
            pytest.param("cuda", True, id="cuda-inductor", marks=pytest.mark.gpu)]


def generator(model: torch.nn.Module, compile) -> tfm.PoolGenerator:
    return tfm.PoolGenerator(model, max_len=48, max_batch=3, batch_sizes=(1, 2, 4), num_draft_tokens=3, compile=compile)


def generate(generator: tfm.PoolGenerator, **options) -> tfm.GenerationResult:
    # prompt lookup while <= 2 requests run: both modes' graphs serve
    return generator.generate(PROMPTS, max_new_tokens=MAX_NEW, eos_token_id=[], seed=7,
                              policy=gp.SpeculationPolicy(off_above=2), **options)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: Dynamo's caches hold the previous test's generator."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("device,compile", SETTINGS)
def test_compiled_steps_keep_generate_tokens_and_sample_as_the_eager_step(device: str, compile):
    """Greedy, then sampled on the same compiled generator (the settings are step inputs: no new compile)."""
    model = tiny_model("llama", device)
    compiled, eager = generator(model, compile), generator(model, False)
    try:
        greedy = generate(compiled, do_sample=False)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert graphs > 0  # the steps did go through the compiler
        assert greedy.tokens == reference(model, PROMPTS, MAX_NEW, [])
        assert {s.mode for s in greedy.steps} == {"decode", "verify"} and greedy.misses == 0
        sampled = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
        got, want = generate(compiled, **sampled), generate(eager, **sampled)
        assert got.tokens == want.tokens and got.steps_by_mode == want.steps_by_mode
        assert got.tokens != greedy.tokens  # the sampled run did sample
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # and compiled nothing new
    finally:
        compiled.close()
        eager.close()


@pytest.mark.gpu
def test_compiled_generator_samples_top_p_over_a_real_vocabulary_on_the_gpu():
    """Llama 3's vocabulary (128256) at the benchmark's padded verify shape (32 rows of 5 tokens): Inductor splits a
    cumsum this long, and torch 2.11 failed to generate top-p's split cumsum (run BQ: every capture of
    ``hf_decode.py --sample --compile`` refused). The sampler stays eager; tokens equal the uncompiled generator's."""
    model = tiny_model("llama", "cuda", vocab_size=128256)
    compiled, eager = (tfm.PoolGenerator(model, max_len=48, max_batch=32, batch_sizes=(32,), num_draft_tokens=4,
                                         compile=compile) for compile in (True, False))
    try:
        sampled = dict(do_sample=True, temperature=0.6, top_p=0.9)
        got, want = generate(compiled, **sampled), generate(eager, **sampled)
        assert got.tokens == want.tokens and got.steps_by_mode == want.steps_by_mode and got.misses == 0
        assert set(got.steps_by_mode) == {"decode", "verify"}
    finally:
        compiled.close()
        eager.close()


@pytest.mark.parametrize("bad", [{"mode": "reduce-overhead"}, {"mode": "max-autotune"},
                                 {"options": {"triton.cudagraphs": True}}])
def test_compile_modes_with_graphs_of_their_own_are_refused(bad: dict):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="captures CUDA graphs of its own.*max-autotune-no-cudagraphs"):
        tfm.PoolGenerator(model, max_len=32, batch_sizes=(1,), compile=bad)
    with pytest.raises(TypeError, match="compile takes True, False or a dict"):
        tfm.PoolGenerator(model, max_len=32, batch_sizes=(1,), compile="default")
