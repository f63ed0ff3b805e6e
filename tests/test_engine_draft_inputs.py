"""The speculative step's index arithmetic (bench/engine/draft_inputs.py) and the engine's fused draft
levels (bench/engine/draft_select.py ``draft_level_into``) against the torch code they replace; on CPU the
kernels run in Triton's interpreter, on the H200 for real (``-m gpu``)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from bench.engine.config import ModelConfig, SpecConfig  # noqa: E402
from bench.engine.draft_inputs import draft_inputs  # noqa: E402
from bench.engine.harness import build  # noqa: E402
from bench.engine.loop import DecodeLoop, make_requests  # noqa: E402

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter), pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,steps,topk", [(5, 4, 4), (4, 3, 2), (3, 1, 3), (6, 2, 1)])
def test_fused_draft_inputs_equal_the_torch_ops(device, window, steps, topk):
    """Every output, on rows in any order, with lengths below the window (clamped starts) and the padded
    rows' n = 1."""
    g = torch.Generator().manual_seed(window * 10 + steps)
    table = torch.randint(0, 1000, (7, 40), generator=g).to(device)
    rows = torch.tensor([5, 0, 3, 6, 2], device=device)
    lens = torch.tensor([30, 2, window, 1, 17], device=device)
    cols = torch.arange(window, device=device)
    want = draft_inputs(table, rows, lens, window, steps, topk, cols, fused=False)
    got = draft_inputs(table, rows, lens, window, steps, topk, cols, fused=True)
    for name in ("start", "window_ids", "window_pos", "root", "last"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert len(got.level_pos) == len(want.level_pos) == steps - 1
    for g_pos, w_pos in zip(got.level_pos, want.level_pos):
        assert torch.equal(g_pos, w_pos)
    assert want.start.tolist() == [30 - window, 0, 0, 0, 17 - window]  # the oracle itself: clamped at 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("topk,steps,n", [(4, 4, 16), (2, 3, 5), (3, 2, 7), (1, 3, 4), (2, 2, 4)])
def test_fused_draft_tree_equals_the_torch_levels(device, topk, steps, n):
    """``Engine._draft_tree`` with the fused levels (one launch each: candidates in place, parents, the next
    beam's ancestors) builds the same tree as the torch loop (draft_level, expand, gather, |= eye, cat), for
    three sequences at different lengths, the draft's KV written by the same forwards."""
    cfg = ModelConfig.tiny()
    trees = {}
    for select in ("torch", "fused"):
        spec = SpecConfig(topk=topk, steps=steps, num_draft_tokens=n, draft_noise=0.3, draft_select=select)
        engine, pool = build(cfg, spec, [3], 12, 24, device, backend="eager")
        loop = DecodeLoop(engine, pool, "plain")
        rows = torch.from_numpy(loop._admit(make_requests(3, 12, cfg.vocab_size, 24, 24, seed=7))).to(device)
        lens = torch.tensor([12, 12, 12], device=device)
        for _ in range(3):  # plain steps, so the sequences differ in length and content
            engine.decode(lens, rows)
            lens = lens + torch.tensor([1, 0, 1], device=device)
        c = engine._consts["verify"]
        inputs = draft_inputs(engine.token_table, rows, lens, spec.window, spec.steps, spec.topk, c.window_cols,
                              engine.fused_draft_select)
        trees[select] = engine._draft_tree(lens, rows, inputs, spec, c)
    assert torch.equal(trees["fused"].tokens, trees["torch"].tokens)
    assert torch.equal(trees["fused"].parents, trees["torch"].parents)
    assert torch.equal(trees["fused"].depth, trees["torch"].depth)
    assert torch.equal(trees["fused"].mask, trees["torch"].mask)
    assert trees["torch"].depth.max() > 1  # the test reaches beyond the root's children


@pytest.mark.parametrize("select", ["torch", pytest.param("fused", marks=pytest.mark.interpreter)])
def test_a_one_level_draft_tree_decodes_losslessly(select):
    """steps = 1 (only the root's children are drafted), a shape SpecConfig accepts: the engine builds and
    speculation commits exactly plain decoding's tokens (it failed to build: the beams' ancestor columns
    were sized for the levels after the first, none here, while the root's beam writes k of them)."""
    from bench.engine.identity import greedy_identity
    spec = SpecConfig(topk=3, steps=1, num_draft_tokens=3, draft_noise=0.1, draft_select=select)
    run = greedy_identity(ModelConfig.tiny(), spec, "torch", "cpu", n_requests=3, concurrency=2, min_new=6, max_new=10)
    assert run["ok"] and run["switched"], run
    assert run["mean_accept"] > 1, run  # the drafts were accepted sometimes: the tree did its job
