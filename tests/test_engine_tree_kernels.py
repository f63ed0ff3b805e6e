"""The draft tree's selection and its acceptance + commit as Triton kernels (bench/engine/tree_kernels.py)
against the torch code they replace (bench/engine/tree.py and the commit of ``Engine.speculate``); on CPU
the kernels run in Triton's interpreter, on the H200 for real (``-m gpu``)."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
from bench.engine.config import ModelConfig, SpecConfig  # noqa: E402
from bench.engine.draft_select import draft_level  # noqa: E402
from bench.engine.identity import greedy_identity  # noqa: E402
from bench.engine.tree import DEPTH_PENALTY, Tree, select_tree  # noqa: E402
from bench.engine.tree_kernels import accept_and_commit_fused, select_tree_fused  # noqa: E402

DEVICES = [pytest.param("cpu", marks=pytest.mark.interpreter), pytest.param("cuda", marks=pytest.mark.gpu)]
# (topk, steps, num_draft_tokens): the engine's default, the identity test's, and small and odd ones.
SHAPES = [(4, 4, 16), (2, 3, 5), (2, 3, 6), (4, 4, 2), (1, 3, 4), (2, 4, 3), (3, 2, 13)]
VOCAB = 64


def candidates(bs: int, k: int, steps: int, seed: int, logits=None):
    """A step's candidates made as ``Engine._draft_tree`` makes them, by the engine's draft-level selection
    (torch path) on random logits: level 1 = the root's ``k`` best children, each later level = ``k``
    children of each of the previous level's ``k`` best. ``logits(rows)`` gives each level's logits."""
    g = torch.Generator().manual_seed(seed)
    logits = logits or (lambda rows: 4 * torch.randn(rows, VOCAB, generator=g))  # peaked: deep trees
    lv = draft_level(logits(bs), None, k, DEPTH_PENALTY, 0, fused=False)
    toks, scores, parents = [lv.tokens], [lv.scores], [torch.full((bs, k), -1)]
    beam_scores, beam_ids, offset = lv.beam_scores, torch.arange(k).expand(bs, k), k
    for _ in range(2, steps + 1):
        lv = draft_level(logits(bs * k), beam_scores, k, DEPTH_PENALTY, offset, fused=False)
        toks.append(lv.tokens), scores.append(lv.scores)
        parents.append(beam_ids[..., None].expand(bs, k, k).reshape(bs, k * k))
        beam_scores, beam_ids, offset = lv.beam_scores, lv.beam_ids, offset + k * k
    depth = torch.tensor([1] * k + [d for d in range(2, steps + 1) for _ in range(k * k)])
    return torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1), depth


def assert_trees_equal(got: Tree, want: Tree) -> None:
    for name in ("tokens", "parents", "depth", "mask"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        assert torch.equal(g, w), (name, g, w)
    assert got.mask.is_contiguous()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,steps,n", SHAPES)
def test_fused_selection_equals_select_tree(device, k, steps, n):
    bs = 3
    toks, scores, parents, depth = candidates(bs, k, steps, seed=100 * k + 10 * steps + n)
    for row in scores:  # distinct scores: the kept set is the same whichever way ties break
        assert row.unique().numel() == row.numel()
    args = [x.to(device) for x in (torch.tensor([5, 6, 7]), toks, scores, parents, depth)]
    want = select_tree(*args, n, steps)
    got = select_tree_fused(*args, n, steps, fused=True)
    assert_trees_equal(got, want)
    assert_trees_equal(select_tree_fused(*args, n, steps, fused=False), want)


def tie_rule_tree(root: int, toks: list, scores: list, parents: list, depth: list, n: int):
    """Plain-Python selection keeping the lowest indices among equal scores; nodes, parents and the
    ancestor sets by walking parents."""
    best = sorted(sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:n - 1])
    node = {c: i + 1 for i, c in enumerate(best)}
    par = [0] + [0 if parents[c] < 0 else node[parents[c]] for c in best]
    mask = []
    for i in range(n):
        anc, j = {i}, i
        while j:
            j = par[j]
            anc.add(j)
        mask.append([j in anc for j in range(n)])
    return [root] + [toks[c] for c in best], par, [0] + [depth[c] for c in best], mask, best


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,steps,n", [(4, 4, 16), (2, 3, 5), (3, 3, 9)])
def test_fused_selection_on_tied_scores_keeps_the_lowest_indices_and_a_valid_tree(device, k, steps, n):
    g = torch.Generator().manual_seed(k + n)
    # Logits on a coarse grid: many equal log-probs, so scores tie among siblings and across subtrees.
    toks, scores, parents, depth = candidates(2, k, steps, 0, lambda rows: torch.randint(0, 3, (rows, VOCAB),
                                                                                       generator=g).float())
    for row in scores:
        assert row.unique().numel() < row.numel()  # the test has ties
    got = select_tree_fused(*(x.to(device) for x in (torch.tensor([5, 6]), toks, scores, parents, depth)), n, steps,
                            fused=True)
    for b in range(2):
        tk, par, dep, mask, best = tie_rule_tree(5 + b, toks[b].tolist(), scores[b].tolist(), parents[b].tolist(),
                                                 depth.tolist(), n)
        assert got.tokens[b].tolist() == tk and got.parents[b].tolist() == par
        assert got.depth[b].tolist() == dep and got.mask[b].tolist() == mask
        # A valid tree: parents precede children one level up, and the kept scores are a top-(n-1) set.
        assert all(par[i] < i and dep[par[i]] == dep[i] - 1 for i in range(1, n))
        kept = sorted((scores[b, best]).tolist(), reverse=True)
        assert kept == scores[b].topk(n - 1).values.tolist()


def targets_for(tree: Tree, extra: list[int | None], seed: int) -> tuple[torch.Tensor, list[int]]:
    """Target choices under which sequence b accepts the path from the root to a random node of depth
    ``extra[b]`` (the deepest depth if the tree is shallower; ``None``: a deepest node, every node on the way
    matching); other nodes get random tokens. Returns the targets and the accept lengths they give."""
    rnd = random.Random(seed)
    bs, n = tree.tokens.shape
    target = torch.randint(0, VOCAB, (bs, n), generator=torch.Generator().manual_seed(seed))
    tk, par, dep = tree.tokens.tolist(), tree.parents.tolist(), tree.depth.tolist()
    lengths = []
    for b, want in enumerate(extra):
        d = max(dep[b]) if want is None else min(want, max(dep[b]))
        node = rnd.choice([i for i in range(n) if dep[b][i] == d])
        lengths.append(d + 1)
        if node in par[b][1:]:  # stop here: a choice none of its children carries
            target[b, node] = VOCAB + 1
        while node:
            target[b, par[b][node]] = tk[b][node]
            node = par[b][node]
    return target, lengths


def repeat_tree(tree: Tree, bs: int) -> Tree:
    return Tree(*(x.expand(bs, *x.shape[1:]).contiguous() for x in (tree.tokens, tree.parents, tree.depth, tree.mask)))


def commit_both_ways(tree: Tree, target: torch.Tensor, steps: int, device: str, seed: int):
    bs, n = tree.tokens.shape
    g = torch.Generator().manual_seed(seed)
    max_rows, max_context = bs + 3, n + steps + 12
    req_to_token = torch.randperm((max_rows + 1) * max_context, generator=g).view(max_rows + 1, max_context)
    token_table = torch.randint(0, VOCAB, (max_rows + 1, max_context), generator=g)
    rows = torch.randperm(max_rows, generator=g)[:bs] + 1  # distinct request rows (row 0 is the dummy)
    seq_lens = torch.randint(1, max_context - n - steps + 1, (bs,), generator=g)
    seq_lens[0] = 1  # the smallest: the root in column 0
    seq_lens[-1] = max_context - max(n, steps + 1)  # the tree or the commit reaching the last column
    out = {}
    for fused in (False, True):
        r2t, table = req_to_token.clone().to(device), token_table.clone().to(device)
        acc = accept_and_commit_fused(tree, target.to(device), steps, rows.to(device), seq_lens.to(device), r2t,
                                      table, torch.arange(n, device=device), torch.arange(steps + 1, device=device),
                                      fused=fused)
        out[fused] = acc, r2t, table
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,steps,n", SHAPES)
def test_fused_accept_and_commit_equals_the_torch_path(device, k, steps, n):
    toks, scores, parents, depth = candidates(1, k, steps, seed=7 * k + steps + n)
    extra = [0, 1, 2, 3, None, None, 5, 0]  # accepted nodes past the root (None: down to a deepest node)
    tree = repeat_tree(select_tree(torch.tensor([3]), toks, scores, parents, depth, n, steps), len(extra))
    target, lengths = targets_for(tree, extra, seed=n)
    out = commit_both_ways(Tree(*(x.to(device) for x in (tree.tokens, tree.parents, tree.depth, tree.mask))), target,
                           steps, device, seed=k + n)
    (want, r2t_want, table_want), (got, r2t_got, table_got) = out[False], out[True]
    assert want.tolist() == lengths  # the torch path accepts what the targets were made for
    assert got.dtype == torch.long and torch.equal(got, want), (got, want)
    assert torch.equal(r2t_got, r2t_want)
    assert torch.equal(table_got, table_want)
    assert lengths[0] == 1 and lengths[4] == int(tree.depth.max()) + 1  # nothing accepted; a deepest path


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("k,steps,n", [(4, 4, 16), (2, 3, 6)])
def test_fused_select_then_commit_equals_the_torch_step_tail(device, k, steps, n):
    """Both kernels back to back, as ``Engine.speculate`` runs them, against the torch code it ran before."""
    bs = 6
    toks, scores, parents, depth = candidates(bs, k, steps, seed=n)
    args = [x.to(device) for x in (torch.arange(bs) + 10, toks, scores, parents, depth)]
    trees = {fused: select_tree_fused(*args, n, steps, fused=fused) for fused in (False, True)}
    cpu_tree = Tree(*(x.cpu() for x in (trees[False].tokens, trees[False].parents, trees[False].depth,
                                         trees[False].mask)))
    target, lengths = targets_for(cpu_tree, [0, 1, 2, None, None, 1], seed=3)
    want = commit_both_ways(trees[False], target, steps, device, seed=1)[False]
    got = commit_both_ways(trees[True], target, steps, device, seed=1)[True]
    for w, g in zip(want, got):
        assert torch.equal(g, w)
    assert want[0].tolist() == lengths


@pytest.mark.interpreter
def test_engine_with_the_fused_tree_kernels_is_lossless_at_the_default_tree_shape():
    """The whole float32 loop at the engine's default tree (topk 4, steps 4, 16 nodes): with the fused
    selection and acceptance, speculation commits exactly plain decoding's tokens and accepts as torch does."""
    cfg = ModelConfig.tiny()
    runs = {}
    for select in ("torch", "fused"):
        spec = SpecConfig(draft_noise=0.1, draft_select=select)
        runs[select] = greedy_identity(cfg, spec, "torch", "cpu", n_requests=3, concurrency=2, min_new=6, max_new=10)
    assert runs["fused"]["ok"] and runs["fused"]["switched"], runs["fused"]
    assert runs["fused"]["mean_accept"] == runs["torch"]["mean_accept"] > 2, runs  # deep paths accepted
