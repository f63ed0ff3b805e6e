"""Prompt lookup: drafts found by n-gram lookup in a sequence's own history (prompt and output), no draft model.

When the last ``n`` tokens of a sequence occurred earlier in it, the tokens that followed that occurrence
are proposed as the next ones (code edits and summaries quote their input; greedy models repeat their own
output). The longest ``n`` that matches wins, its most recent earlier occurrence. Each sequence keeps a
dictionary from n-gram to where it last ended, updated with each committed token, so a lookup is a few
dictionary reads however long the history is.
"""
from __future__ import annotations


class NgramIndex:
    """The n-gram index of one sequence's history, and its lookups.

    Args:
        tokens: the history so far (the prompt); extend it with :meth:`extend`.
        max_ngram: the longest n-gram matched.
        min_ngram: the shortest n-gram matched (1: a single repeated token can propose drafts).
    """

    def __init__(self, tokens: list[int], max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.tokens: list[int] = []
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._ends: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token, latest occurrence
        self._indexed = 0  # n-grams ending before this index are in _ends
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append committed tokens to the history."""
        self.tokens.extend(tokens)

    def _index_up_to(self, stop: int) -> None:
        """Index every n-gram ending before ``stop`` (the suffix itself stays out, so that a lookup of the
        suffix finds an *earlier* occurrence, one with tokens after it)."""
        tokens, ends = self.tokens, self._ends
        for end in range(self._indexed, stop):
            for n in range(self.min_ngram, min(self.max_ngram, end + 1) + 1):
                ends[tuple(tokens[end - n + 1:end + 1])] = end
        self._indexed = max(self._indexed, stop)

    def propose(self, count: int) -> list[int]:
        """Up to ``count`` draft tokens continuing the history (``[]`` when no n-gram of the suffix occurred
        earlier). Fewer than ``count`` when the match lies close to the end."""
        tokens = self.tokens
        last = len(tokens) - 1
        self._index_up_to(last)
        for n in range(min(self.max_ngram, len(tokens)), self.min_ngram - 1, -1):
            end = self._ends.get(tuple(tokens[last - n + 1:]))
            if end is not None:
                return tokens[end + 1:end + 1 + count]
        return []
