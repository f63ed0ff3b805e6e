"""One draft level's selection as one Triton kernel (bench/engine/draft_select.py) against the torch ops
it replaces; on CPU the kernel runs in Triton's interpreter, on the H200 for real (``-m gpu``)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
from bench.engine.config import ModelConfig, SpecConfig  # noqa: E402
from bench.engine import draft_select  # noqa: E402
from bench.engine.draft_select import DRAFT_SELECT, draft_level, resolve_draft_select  # noqa: E402
from bench.engine.identity import greedy_identity  # noqa: E402

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter), pytest.param("cuda", marks=pytest.mark.gpu)]


def distinct_logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Logits with no two equal values in a row, exactly representable in ``dtype`` (so both paths rank
    them the same; ties are tested on their own)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bfloat16:  # integers up to 256 are exact in bf16; /16 keeps them exact
        assert vocab <= 256
        return torch.stack([torch.randperm(vocab, generator=g) for _ in range(rows)]).to(dtype) / 16
    return torch.randn(rows, vocab, generator=g, dtype=dtype)


def assert_levels_equal(got, want) -> None:
    for name, w, g in zip(want._fields, want, got):
        if w is None:
            assert g is None, name
        elif w.is_floating_point():
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5, msg=name)
        else:
            assert torch.equal(g, w), (name, g, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,vocab,dtype", [(4, 512, torch.float32), (2, 100, torch.float32), (1, 64, torch.float32),
                                           (4, 200, torch.bfloat16), (3, 4096, torch.float32)])
@pytest.mark.parametrize("root", [True, False])
def test_fused_level_equals_the_torch_ops(device, k, vocab, dtype, root):
    bs = 3
    rows = 1 if root else k
    logits = distinct_logits(bs * rows, vocab, dtype, seed=vocab + k).to(device)
    beam = None if root else torch.randn(bs, rows, generator=torch.Generator().manual_seed(k)).to(device)
    got = draft_level(logits, beam, k, 0.1, 7, fused=True)
    assert_levels_equal(got, draft_level(logits, beam, k, 0.1, 7, fused=False))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs,rows,k,vocab", [
    (1, 1, 4, 4096),   # the root at batch 1 (one row, no padding)
    (1, 4, 4, 4096),   # a beam level as the medium model runs it at batch 1
    (1, 3, 3, 300),    # k = 3: 3 rows padded to 4, 9 candidates
    (2, 5, 2, 128),    # 5 rows padded to 8, more rows than k
    (4, 2, 3, 1000),   # fewer rows than k; vocabulary not a power of two
    (3, 7, 1, 64),     # k = 1: one pick per row
])
def test_fused_level_equals_the_torch_ops_for_any_rows_and_batch(device, bs, rows, k, vocab):
    """The kernel's [rows, vocab] tile, rows padded to a power of two: every shape gives the torch
    path's candidates and next beam, and the padding never shows up among them."""
    logits = distinct_logits(bs * rows, vocab, torch.float32, seed=bs * 100 + rows * 10 + k).to(device)
    root = rows == 1
    beam = None if root else torch.randn(bs, rows, generator=torch.Generator().manual_seed(rows)).to(device)
    got = draft_level(logits, beam, k, 0.25, 11, fused=True)
    assert_levels_equal(got, draft_level(logits, beam, k, 0.25, 11, fused=False))
    assert got.tokens.shape == (bs, rows * k) and bool((got.tokens < vocab).all())
    if not root:
        assert bool((got.best < rows * k).all()) and all(len(set(b)) == k for b in got.best.tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_equal_candidate_scores_enter_the_beam_lowest_slot_first(device):
    """Three rows with the same logits and the same score tie pairwise across rows: the beam takes the
    lowest candidate slot (row r, pick j is slot r * k + j) first, and never a padded row's."""
    k = 2
    row = distinct_logits(1, 64, torch.float32, seed=5)
    logits = row.repeat(3, 1).to(device)
    got = draft_level(logits, torch.zeros(1, 3, device=device), k, 0.0, 100, fused=True)
    want = draft_level(logits, torch.zeros(1, 3, device=device), k, 0.0, 100, fused=False)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=1e-5)
    assert got.best.tolist() == [[0, 2]]  # the top token of rows 0 and 1 (equal scores), lowest slot first
    assert got.beam_ids.tolist() == [[100, 102]]
    assert got.beam_tokens.tolist() == [[want.tokens[0, 0].item()] * 2]


@pytest.mark.parametrize("device", DEVICES)
def test_equal_logits_come_lowest_index_first(device):
    logits = torch.full((1, 16), -1.0)
    logits[0, [3, 9, 12]] = 2.0  # a three-way tie for the top
    logits[0, 5] = 1.0
    got = draft_level(logits.to(device), None, 4, 0.0, 0, fused=True)
    assert got.tokens.tolist() == [[3, 9, 12, 5]]
    want = draft_level(logits.to(device), None, 4, 0.0, 0, fused=False)
    torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=1e-6)
    assert sorted(want.tokens[0, :3].tolist()) == [3, 9, 12] and want.tokens[0, 3] == 5


def test_fused_selection_needs_triton_on_cuda_or_the_interpreter(monkeypatch):
    with pytest.raises(ValueError, match="one of"):
        resolve_draft_select("fast", "cpu")
    assert resolve_draft_select("torch", "cpu") is False
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA device"):
        resolve_draft_select("fused", "cpu")


def test_auto_selection_takes_the_kernel_on_cuda(monkeypatch):
    """``"auto"``: the kernel on CUDA with Triton, the torch ops elsewhere (also under the interpreter,
    which only ``"fused"`` takes); ``"fused"`` is an error where the kernel cannot run. Only the device's
    type is read, so no GPU is needed."""
    assert DRAFT_SELECT[0] == "auto"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert resolve_draft_select("auto", "cpu") is False
    with pytest.raises(ValueError, match="needs Triton and a CUDA device"):
        resolve_draft_select("fused", "cpu")
    assert resolve_draft_select("auto", "cuda") is True and resolve_draft_select("fused", "cuda:0") is True
    assert resolve_draft_select("torch", "cuda") is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_draft_select("auto", "cpu") is False and resolve_draft_select("fused", "cpu") is True
    monkeypatch.setattr(draft_select, "triton", None)  # Triton not installed
    assert resolve_draft_select("auto", "cuda") is False and resolve_draft_select("auto", "cpu") is False
    with pytest.raises(ValueError, match="Triton absent"):
        resolve_draft_select("fused", "cuda")


def test_warps_grow_with_the_tile():
    assert [draft_select._num_warps(n) for n in (64, 4096, 4097, 16384, 16385, 131072)] == [4, 4, 8, 8, 16, 16]


@pytest.mark.interpreter
def test_speculation_with_fused_selection_is_lossless_and_drafts_as_torch_does():
    """The whole loop in float32 on CPU: with the fused selection speculation and dynamic speculation
    still commit exactly plain decoding's tokens, and they accept what the torch selection accepts (same
    trees: logits of a float32 model do not tie)."""
    cfg = ModelConfig.tiny()
    runs = {}
    for select in ("torch", "fused"):
        spec = SpecConfig(topk=2, steps=3, num_draft_tokens=6, draft_noise=0.1, draft_select=select)
        runs[select] = greedy_identity(cfg, spec, "torch", "cpu", n_requests=4, concurrency=2, min_new=8, max_new=12)
    assert runs["fused"]["ok"] and runs["fused"]["switched"], runs["fused"]
    assert runs["fused"]["mean_accept"] == runs["torch"]["mean_accept"], runs


def test_spec_config_selects_automatically_by_default():
    assert SpecConfig().draft_select == "auto"
    assert dataclasses.replace(SpecConfig(), draft_select="fused").draft_select == "fused"
