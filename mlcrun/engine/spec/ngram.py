"""Prompt lookup (n-gram drafting): no extra model. The last n tokens of a request (n from
`ngram_max` down to 1, longest first) are searched earlier in its prompt and output; the
tokens that followed the match are the draft. Pays off when the output quotes its input
(editing, summarising, code), costs nothing when there is no match."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..request import Request
from .tree import DraftTree


class NgramDrafter:
    def __init__(self, ngram_max: int) -> None:
        self.ngram_max = ngram_max

    def propose(
        self, batch: Sequence[Request], lengths: dict[Request, int], width: int
    ) -> dict[Request, DraftTree]:
        return {r: self.lookup(r.tokens, lengths.get(r, 0), width) for r in batch}

    def lookup(self, tokens: Sequence[int], k: int, width: int = 1) -> DraftTree:
        """A chain of up to k tokens after the longest earlier match of the suffix; with
        width > 1, up to width - 1 other tokens that followed other matches, as alternatives
        at the first position."""
        if k <= 0 or len(tokens) < 2:
            return DraftTree()
        history = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.ngram_max, len(history) - 1), 0, -1):
            windows = sliding_window_view(history[:-1], n)  # match s..s+n-1, s + n <= len - 1
            starts = np.flatnonzero((windows == history[-n:]).all(axis=1))
            if starts.size:
                return self._tree(history, starts + n, k, width)
        return DraftTree()

    @staticmethod
    def _tree(history: np.ndarray, follows: np.ndarray, k: int, width: int) -> DraftTree:
        """follows: where the tokens after each match begin (ascending)."""
        # The most recent match that has k tokens after it, else the longest continuation.
        room = len(history) - follows
        full = follows[room >= k]
        best = int(full[-1]) if full.size else int(follows[np.argmax(room)])
        tree = DraftTree.of_chain(history[best : best + k].tolist())
        if width > 1:
            first = tree.tokens[0]
            seen = {first}
            for pos in follows[::-1]:  # most recent first
                token = int(history[pos])
                if token not in seen:
                    seen.add(token)
                    tree.add(0, token)
                    if len(seen) == width:
                        break
        return tree
