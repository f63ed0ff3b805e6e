"""Step costs (bench/engine/costs.py) against torch's own FLOP counter and the model's parameters, and the
decode loop's acceptance against the drafts whose acceptance is known."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bench.engine.attention import key_len
from bench.engine.config import ModelConfig, SpecConfig
from bench.engine.costs import attention_flops, device_roof, plain_step, spec_step, total_params
from bench.engine.harness import build
from bench.engine.loop import DecodeLoop, make_requests
from bench.engine.model import LlamaModel

CFG, PROMPT = ModelConfig.tiny(), 12


@pytest.mark.parametrize("cfg", [ModelConfig.tiny(), ModelConfig.small(), ModelConfig.medium()])
def test_total_params_counts_every_parameter(cfg):
    with torch.device("meta"):
        model = LlamaModel(cfg)
    assert total_params(cfg) == sum(p.numel() for p in model.parameters())


def _gemm_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()  # matmuls only: the CPU attention kernel is not counted


def test_plain_and_spec_step_flops_match_torch_flop_counter():
    spec = SpecConfig(topk=2, steps=3, num_draft_tokens=6)
    engine, pool = build(CFG, spec, [4], PROMPT, 24)
    loop = DecodeLoop(engine, pool, "plain")
    rows = torch.from_numpy(loop._admit(make_requests(4, PROMPT, CFG.vocab_size, 24, 24)))
    lens = torch.full((4,), PROMPT)
    keys = key_len(engine.max_context, 1)
    want = plain_step(CFG, 4, keys).flops - attention_flops(CFG, 4, keys, CFG.num_layers)
    assert _gemm_flops(lambda: engine.decode(lens, rows)) == want
    # The spec step's forwards have slightly different key lengths; the matmuls do not depend on them.
    spec_cost = spec_step(CFG, spec, 4, keys)
    tokens = 4 * (spec.window + (spec.steps - 1) * spec.topk)
    attn = (attention_flops(CFG, tokens, keys, spec.draft_layers)
            + attention_flops(CFG, 4 * spec.num_draft_tokens, keys + spec.num_draft_tokens, CFG.num_layers))
    assert _gemm_flops(lambda: engine.speculate(lens, rows)) == spec_cost.flops - attn


def test_each_gpu_is_judged_on_its_own_roofline():
    """An H100 timed against the H200's bandwidth read 1.6x its roofline at C = 1 (run CH): a GPU's roofline takes
    that GPU's figures, by the name CUDA gives it, and a GPU without figures gets none rather than another's."""
    cfg = ModelConfig.medium()
    h200, h100 = device_roof("NVIDIA H200"), device_roof("NVIDIA H100 80GB HBM3")
    assert device_roof("NVIDIA A100-SXM4-80GB") is None and device_roof("NVIDIA H100 PCIe") is None
    assert h200 == {"peak": 790e12, "bandwidth": 4.3e12}  # what every H200 run's roofline used
    on_h200, on_h100 = plain_step(cfg, 1, 256, **h200), plain_step(cfg, 1, 256, **h100)
    assert plain_step(cfg, 1, 256) == on_h200  # the default stays the H200's
    # A plain step at C = 1 streams its weights: the same bytes, over each GPU's own bandwidth.
    assert on_h100.bytes == on_h200.bytes and on_h100.seconds == pytest.approx(on_h100.bytes / h100["bandwidth"])
    assert on_h100.seconds > 1.4 * on_h200.seconds


def test_medium_model_regime_on_the_roofline():
    """The benchmark's default on an H200's roofline: plain decode weights-bound through C = 128 (its time
    barely moves), a speculative step compute-bound from C = 16, ~11 x a plain step at C = 128."""
    cfg, spec = ModelConfig.medium(), SpecConfig()
    plain = {c: plain_step(cfg, c, 256) for c in (1, 128)}
    assert plain[128].seconds < 1.2 * plain[1].seconds
    assert plain[128].flops / 790e12 < plain[128].bytes / 4.3e12
    spec_s = {c: spec_step(cfg, spec, c, 256).seconds for c in (1, 10, 16, 32, 128)}
    assert spec_s[10] < 1.05 * spec_s[1] < spec_s[16] < spec_s[32] / 1.5
    assert spec_s[128] / plain[128].seconds > 10


def test_perfect_draft_accepts_every_level_and_noise_lowers_acceptance():
    # topk 1: the tree is the draft's greedy chain, so a draft that IS the target matches at every level.
    spec = SpecConfig(topk=1, steps=3, num_draft_tokens=4, draft_layers=CFG.num_layers)
    got = {}
    for noise in (0.0, 0.3, 3.0):
        engine, pool = build(CFG, replace(spec, draft_noise=noise), [4], PROMPT, 32)
        reqs = make_requests(8, PROMPT, CFG.vocab_size, 32, 32)
        got[noise] = DecodeLoop(engine, pool, "spec").run(reqs, 4, max_steps=6, keep_outputs=False).mean_accept
    assert got[0.0] == spec.steps + 1  # every draft token plus the bonus token
    assert got[0.0] > got[0.3] > got[3.0] and got[3.0] < 1.5
