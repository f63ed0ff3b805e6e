"""Draft-tree selection and greedy tree acceptance against plain-Python oracles."""
from __future__ import annotations

import random

import torch

from bench.engine.tree import greedy_accept, select_tree

K, STEPS, N = 2, 3, 6


def random_candidates(seed: int):
    """Candidates as the engine generates them: level 1 = K children of the root; each later level =
    K children of each of the previous level's K best (the beam); scores are cumulative log-probs."""
    rnd = random.Random(seed)
    toks, scores, parents, depth = [], [], [], []
    beam = [(-1, 0.0)]
    for d in range(1, STEPS + 1):
        level = []
        for pid, pscore in beam:
            for t in rnd.sample(range(20), K):
                level.append((len(toks), pscore - rnd.random() * 2 - 1e-3))
                toks.append(t), scores.append(level[-1][1]), parents.append(pid), depth.append(d)
        beam = sorted(level, key=lambda x: -x[1])[:K]
    return toks, scores, parents, depth


def test_select_tree_keeps_best_ancestor_closed_nodes_and_their_mask():
    for seed in range(20):
        toks, scores, parents, depth = random_candidates(seed)
        def t(x):
            return torch.tensor([x])
        tree = select_tree(torch.tensor([99]), t(toks), t(scores).float(), t(parents), torch.tensor(depth), N, STEPS)
        best = sorted(sorted(range(len(scores)), key=lambda i: -scores[i])[:N - 1])
        assert tree.tokens[0].tolist() == [99] + [toks[i] for i in best]
        node = {c: i + 1 for i, c in enumerate(best)}
        want_par = [0] + [0 if parents[c] < 0 else node[parents[c]] for c in best]
        assert tree.parents[0].tolist() == want_par
        assert all(p < i for i, p in enumerate(want_par) if i)
        for i in range(N):
            anc, j = {i}, i
            while j:
                j = want_par[j]
                anc.add(j)
            assert tree.mask[0, i].nonzero().flatten().tolist() == sorted(anc)


def accept_oracle(tokens, parents, target):
    """Walk from the root: take the child whose token equals the target's choice at the current node."""
    path, cur = [0], 0
    while True:
        nxt = [i for i in range(1, len(tokens)) if parents[i] == cur and tokens[i] == target[cur]]
        if not nxt:
            return path, [tokens[i] for i in path[1:]] + [target[path[-1]]]
        path.append(nxt[0])
        cur = nxt[0]


def test_greedy_accept_matches_walk():
    rnd = random.Random(0)
    for seed in range(40):
        toks, scores, parents, depth = random_candidates(seed)
        def t(x):
            return torch.tensor([x])
        tree = select_tree(torch.tensor([7]), t(toks), t(scores).float(), t(parents), torch.tensor(depth), N, STEPS)
        tk, par = tree.tokens[0].tolist(), tree.parents[0].tolist()
        # Target choices: often follow a child (so paths get accepted), sometimes not.
        target = [rnd.choice([c for c in range(N) if par[c] == i and c] or [0]) for i in range(N)]
        target = [tk[c] if c and rnd.random() < 0.7 else 50 + i for i, c in enumerate(target)]
        acc = greedy_accept(tree, torch.tensor([target]), STEPS)
        path, committed = accept_oracle(tk, par, target)
        assert acc.accept_len.item() == len(path)
        assert acc.path[0, :len(path)].tolist() == path
        assert acc.new_tokens[0, :len(path)].tolist() == committed
        order = acc.order[0].tolist()
        assert order[:len(path)] == path and sorted(order) == list(range(N))
