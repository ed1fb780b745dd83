"""A radix tree over token ids that remembers which KV-cache sequence holds which prefix.

Finished sequences stay in the KV cache ("retained") so a later request with the same prefix
forks them instead of recomputing; they are evicted least-recently-used when pages run short
or when more than `max_retained` are kept. Running sequences are indexed too (read-only).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _Node:
    # Edges are labelled with token runs (a radix tree): child key = first token of the run.
    children: dict[int, tuple[tuple[int, ...], _Node]] = field(default_factory=dict)
    seqs: set[int] = field(default_factory=set)  # sequences whose tokens pass through here


class PrefixTree:
    def __init__(self) -> None:
        self._root = _Node()
        self._tokens: dict[int, tuple[int, ...]] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tokens

    def insert(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Index `tokens` (the KV content of `seq_id`), replacing what it held before."""
        if seq_id in self._tokens:
            self.remove(seq_id)
        tokens = tuple(tokens)
        self._tokens[seq_id] = tokens
        node, i = self._root, 0
        node.seqs.add(seq_id)
        while i < len(tokens):
            edge = node.children.get(tokens[i])
            if edge is None:
                child = _Node(seqs={seq_id})
                node.children[tokens[i]] = (tokens[i:], child)
                return
            label, child = edge
            common = _common_prefix(label, tokens[i:])
            if common < len(label):  # split the edge
                middle = _Node(seqs=set(child.seqs))
                middle.children[label[common]] = (label[common:], child)
                node.children[tokens[i]] = (label[:common], middle)
                child = middle
            child.seqs.add(seq_id)
            node, i = child, i + common

    def remove(self, seq_id: int) -> None:
        tokens = self._tokens.pop(seq_id, None)
        if tokens is None:
            return
        node, i = self._root, 0
        node.seqs.discard(seq_id)
        while i < len(tokens):
            label, child = node.children[tokens[i]]
            child.seqs.discard(seq_id)
            if not child.seqs:
                del node.children[tokens[i]]
                return
            node, i = child, i + len(label)

    def longest_match(self, tokens: Sequence[int]) -> tuple[int | None, int]:
        """(a sequence holding the longest prefix of `tokens`, that prefix's length)."""
        node, i, best = self._root, 0, (None, 0)
        while i < len(tokens):
            edge = node.children.get(tokens[i])
            if edge is None:
                break
            label, child = edge
            common = _common_prefix(label, tokens[i:])
            i += common
            best = (next(iter(child.seqs)), i)
            if common < len(label):
                break
            node = child
        return best


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


class RetainedSequences:
    """Finished sequences kept in the KV cache, least recently used first."""

    def __init__(self, max_retained: int) -> None:
        self.max_retained = max_retained
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._lru

    def add(self, seq_id: int) -> list[int]:
        """Retain `seq_id`; returns the sequences to evict to respect the bound."""
        self._lru[seq_id] = None
        evicted = []
        while len(self._lru) > self.max_retained:
            evicted.append(self.pop_oldest())
        return evicted

    def touch(self, seq_id: int) -> None:
        self._lru.move_to_end(seq_id)

    def pop_oldest(self) -> int:
        seq_id, _ = self._lru.popitem(last=False)
        return seq_id

    def discard(self, seq_id: int) -> None:
        self._lru.pop(seq_id, None)
