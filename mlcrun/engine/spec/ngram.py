"""Prompt lookup (n-gram drafting): no extra model. The last n tokens of a request (n from
`ngram_max` down to 1, longest first) are searched earlier in its prompt and output; the
tokens that followed the match are the draft. Pays off when the output quotes its input
(editing, summarising, code), costs nothing when there is no match.

Where the n-gram occurred several times, the draft continues the occurrence whose earlier
tokens agree longest with the request's last ones (past the n-gram, up to CONTEXT_MAX),
then the one whose next token followed the most occurrences (as llama.cpp's n-gram cache
counts continuations), then the one with the most tokens after it, then the most recent.
Replayed on speculative.py's answers (benchmarks/spec_replay.py), against the most recent
occurrence with k tokens after it: SmolLM2 q4 1.28x -> 1.31x on input-grounded prompts and
1.41x -> 1.48x on open ones, F32 1.47x -> 1.49x and 1.54x -> 1.58x.

Each request keeps an index of where every n-gram of its tokens was followed (`NgramIndex`),
extended by the tokens appended since the last step, so a lookup is ngram_max dictionary
probes instead of a scan of the whole history (which, at a few hundred tokens, cost a
sizeable share of a small model's step)."""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Sequence

from ..request import Request
from .tree import DraftTree

CONTEXT_MAX = 16  # tokens of agreement that rank an earlier occurrence
CANDIDATES = 16  # the most recent occurrences ranked


class NgramIndex:
    """For one growing token sequence: each n-gram (n = 1..ngram_max) -> the positions of
    the tokens that followed its occurrences, ascending. An occurrence that ends at the last
    token has no follower yet; it is indexed when the next token arrives."""

    def __init__(self, ngram_max: int) -> None:
        self.ngram_max = ngram_max
        self.follows: dict[tuple[int, ...], list[int]] = {}
        self.indexed = 0  # occurrences ending before this position are indexed

    def extend(self, tokens: Sequence[int]) -> None:
        end = len(tokens) - 1  # the last token has no follower yet
        for i in range(self.indexed, end):
            for n in range(1, min(self.ngram_max, i + 1) + 1):
                self.follows.setdefault(tuple(tokens[i - n + 1 : i + 1]), []).append(i + 1)
        self.indexed = max(self.indexed, end)

    def longest(self, tokens: Sequence[int]) -> tuple[int, list[int]]:
        """(n, follows) of the longest matching suffix of `tokens`: follows are where the
        tokens after its earlier occurrences begin, ascending; (0, []) when not even the last
        token occurred before."""
        for n in range(min(self.ngram_max, len(tokens) - 1), 0, -1):
            follows = self.follows.get(tuple(tokens[-n:]))
            if follows:
                return n, follows
        return 0, []


class NgramDrafter:
    def __init__(self, ngram_max: int) -> None:
        self.ngram_max = ngram_max
        self._indexes: weakref.WeakKeyDictionary[Request, NgramIndex] = (
            weakref.WeakKeyDictionary()
        )  # a finished request's index goes with it

    def kind(self, req: Request) -> int | None:
        """The kind of draft `req` would get now: the length n of its longest matching
        suffix, or None without a match (nothing to draft). The engine keeps a request's
        acceptance per n: a match of 4 tokens is far likelier to go on as before than a
        match of one, so one running rate would draft too much after the one and too little
        after the other."""
        if len(req.tokens) < 2:
            return None
        index = self._index(req)
        index.extend(req.tokens)
        return index.longest(req.tokens)[0] or None

    def propose(
        self, batch: Sequence[Request], lengths: dict[Request, int], width: int
    ) -> dict[Request, DraftTree]:
        return {
            req: self._lookup(self._index(req), req.tokens, lengths.get(req, 0), width)
            for req in batch
        }

    def _index(self, req: Request) -> NgramIndex:
        index = self._indexes.get(req)
        if index is None:
            index = self._indexes[req] = NgramIndex(self.ngram_max)
        return index

    def lookup(self, tokens: Sequence[int], k: int, width: int = 1) -> DraftTree:
        """A chain of up to k tokens after the longest earlier match of the suffix; with
        width > 1, up to width - 1 other tokens that followed other matches, as alternatives
        at the first position."""
        return self._lookup(NgramIndex(self.ngram_max), tokens, k, width)

    @staticmethod
    def _lookup(index: NgramIndex, tokens: Sequence[int], k: int, width: int) -> DraftTree:
        if k <= 0 or len(tokens) < 2:
            return DraftTree()
        index.extend(tokens)
        n, follows = index.longest(tokens)
        if not follows:
            return DraftTree()
        best = best_occurrence(tokens, n, follows[-CANDIDATES:], k)
        tree = DraftTree.of_chain(tokens[best : best + k])
        if width > 1:
            seen = {tree.tokens[0]}
            for pos in reversed(follows):  # most recent first
                token = tokens[pos]
                if token not in seen:
                    seen.add(token)
                    tree.add(0, token)
                    if len(seen) == width:
                        break
        return tree


def best_occurrence(tokens: Sequence[int], n: int, follows: Sequence[int], k: int) -> int:
    """Of the positions `follows` after earlier occurrences of `tokens`' last n tokens, the
    one to draft from (see the module doc): by the agreement of the tokens before it with
    `tokens`' end (n at least, CONTEXT_MAX at most), then by how many occurrences the token at
    it followed, then by min(tokens after it, k), then the latest."""
    end = len(tokens)
    votes = Counter(tokens[p] for p in follows)

    def rank(p: int) -> tuple[int, int, int, int]:
        agree = n
        while (
            agree < CONTEXT_MAX and agree < p and tokens[p - 1 - agree] == tokens[end - 1 - agree]
        ):
            agree += 1
        return agree, votes[tokens[p]], min(end - p, k), p

    return max(follows, key=rank)
