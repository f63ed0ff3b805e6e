"""The next token after every input token, as ``generate()`` would choose it, and exact speculative sampling.

Runs inside the step (on the graphs): every per-row setting is a step input (:data:`PARAMS`), so a new
temperature or top-p needs no new capture, and greedy and sampled rows share one step.

For each token the logits (in float32, as ``generate`` casts them) go through ``generate``'s processors in its
order: the repetition penalty over the row's history (prompt, output and the drafts before the token), EOS
suppressed while a row is short of ``min_new_tokens``; a greedy row takes the argmax of that. A sampled row then
applies the warpers (temperature, top-k, top-p, min-p) and draws from the resulting distribution ``p`` by
inverse CDF with one uniform per token (the host draws the uniforms from the request's generator).

Speculation stays exact for sampled rows. A prompt-lookup draft is deterministic (its distribution is a point
mass on the drafted token ``d``), so the rule of speculative sampling (accept with ``min(1, p(d) / q(d))``,
resample from ``max(0, p - q)`` on rejection) becomes: accept ``d`` with probability ``p(d)``, and on rejection
draw from ``p`` with ``d``'s mass removed and the rest renormalised. Every committed token then has the law of
plain sampling. For a greedy row ``p`` is a point mass on the argmax, and the rule is "accept while the draft is
the argmax".
"""
from __future__ import annotations

import torch

#: Columns of the per-sequence ``sampling`` step input, in order.
PARAMS = ("do_sample", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "eos_from", "drafts")
SAMPLE, TEMPERATURE, TOP_K, TOP_P, MIN_P, PENALTY, EOS_FROM, DRAFTS = range(len(PARAMS))
#: The neutral value of each column (a greedy row without penalties or drafts): the padded rows' fill.
NEUTRAL = (0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0)
#: Columns of the step's ``out`` output: the token committed if the row stops at this token, whether the next
#: input token (the draft) is accepted here, and the log-probabilities of both under ``p``.
OUT = ("next", "accept", "logprob", "draft_logprob")


def process(logits: torch.Tensor, seen: torch.Tensor, params: torch.Tensor, positions: torch.Tensor,
            eos: torch.Tensor) -> torch.Tensor:
    """``generate``'s logits processors: the repetition penalty, then EOS suppressed before ``min_new_tokens``.

    Args:
        logits: ``[N, V]`` float32.
        seen: ``[N, V]`` bool, the tokens in each token's history.
        params: ``[N, len(PARAMS)]`` each token's row's settings.
        positions: ``[N]`` each token's position; EOS is suppressed where it is below the ``eos_from`` column.
        eos: ``[V]`` bool, the EOS tokens.
    """
    penalty = params[:, PENALTY:PENALTY + 1]
    # penalty 1.0 leaves every score exactly as it is (x * 1.0 == x / 1.0 == x).
    scores = torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
    suppress = (positions < params[:, EOS_FROM])[:, None] & eos[None, :]
    return scores.masked_fill(suppress, -float("inf"))


def warp(scores: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """``generate``'s warpers for sampling, in its order: temperature, top-k, top-p, min-p (each neutral where its
    column holds the neutral value); returns the warped scores ``[N, V]``, ``-inf`` where removed."""
    scores = scores / params[:, TEMPERATURE:TEMPERATURE + 1]
    ordered, order = scores.sort(dim=-1, descending=True)
    vocab = scores.shape[-1]
    # top-k: remove scores below the k-th largest (ties with it stay).
    k = params[:, TOP_K].long()
    kth = ordered.gather(1, (k.clamp(1, vocab) - 1)[:, None])
    ordered = ordered.masked_fill((ordered < kth) & (k > 0)[:, None], -float("inf"))
    # top-p: from the smallest up, remove tokens while their cumulative probability stays <= 1 - top_p; keep the top.
    top_p = params[:, TOP_P:TOP_P + 1]
    ascending = ordered.flip(-1)
    remove = (ascending.softmax(-1).cumsum(-1) <= 1 - top_p) & (top_p < 1)
    remove[:, -1] = False
    ordered = ordered.masked_fill(remove.flip(-1), -float("inf"))
    # min-p: remove tokens less likely than min_p times the most likely one; keep the top.
    probs = ordered.softmax(-1)
    remove = probs < params[:, MIN_P:MIN_P + 1] * probs[:, :1]
    remove[:, 0] = False
    ordered = ordered.masked_fill(remove, -float("inf"))
    return torch.empty_like(scores).scatter_(1, order, ordered)


def draw(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row from unnormalised ``weights`` ``[N, V]`` by inverse CDF with ``uniform`` ``[N]`` in
    ``[0, 1)``: the first token whose cumulative weight exceeds ``uniform`` times the total."""
    cdf = weights.cumsum(-1)
    index = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp_(max=weights.shape[-1] - 1)
    # Rounding can land past the last token of nonzero weight: take the likeliest one there instead.
    return torch.where(weights.gather(1, index) > 0, index, weights.argmax(-1, keepdim=True)).squeeze(1)


def accept_draft(p_draft: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Accept a deterministic draft token with probability ``p(draft)`` (speculative sampling's rule)."""
    return uniform < p_draft


def choose(logits: torch.Tensor, seen: torch.Tensor, params: torch.Tensor, positions: torch.Tensor,
           eos: torch.Tensor, drafts: torch.Tensor, has_draft: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The step's choice for every token: ``[N, 4]`` float64 with the columns of :data:`OUT`.

    Args:
        logits, seen, params, positions, eos: as for :func:`process`.
        drafts: ``[N]`` the next input token of the same row (the draft this token verifies).
        has_draft: ``[N]`` bool, whether that draft is real (a row's drafts end at its ``drafts`` column).
        uniforms: ``[N, 2]`` in ``[0, 1)``: column 0 draws the token, column 1 decides the draft.

    ``next`` is a token drawn from ``p`` (from ``p`` without the draft where a real draft follows: the token to
    commit when the draft is rejected); ``accept`` is 1.0 where the draft is accepted.
    """
    scores = process(logits.float(), seen, params, positions, eos)
    greedy = scores.argmax(-1)
    greedy_logp = scores.log_softmax(-1)
    probs = warp(scores, params).softmax(-1)
    p_draft = probs.gather(1, drafts[:, None]).squeeze(1)
    residual = probs.scatter(1, drafts[:, None], torch.where(has_draft, 0.0, p_draft)[:, None])
    sampled = draw(residual, uniforms[:, 0])
    sample = params[:, SAMPLE] > 0
    token = torch.where(sample, sampled, greedy)
    accept = torch.where(sample, accept_draft(p_draft, uniforms[:, 1]), drafts == greedy)
    log_probs = torch.where(sample[:, None], probs.log(), greedy_logp)
    return torch.stack([token.double(), accept.double(), log_probs.gather(1, token[:, None]).squeeze(1).double(),
                        log_probs.gather(1, drafts[:, None]).squeeze(1).double()], dim=1)


def seen_tokens(history: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[N, V]`` bool: the tokens at positions ``<= positions[n]`` of each token's row history.

    Args:
        history: ``[N, kv_len]`` each token's row's token ids by position.
        positions: ``[N]``.
    """
    visible = torch.arange(history.shape[1], device=history.device)[None, :] <= positions[:, None]
    index = torch.where(visible, history, vocab)  # hidden positions go to a spare column, dropped below
    seen = torch.zeros(history.shape[0], vocab + 1, dtype=torch.bool, device=history.device)
    return seen.scatter_(1, index, True)[:, :vocab]
