"""The one owner of KV-cache sequences: their ids, page arithmetic, the prefix tree and the
finished sequences retained for prefix reuse.

Every sequence operation is applied to each cache in `caches`, in order (the target model's,
then e.g. a draft model's), so that they always hold the same sequences. The first cache holds
a sequence's tokens (its request's `num_computed`; retained sequences are known by the prefix
tree); the others ("followers", a draft model's) may hold only a prefix of them, since a draft
catches up when it drafts: a fork takes from a follower only what it holds.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Protocol

from .prefix_cache import PrefixTree, RetainedSequences

log = logging.getLogger(__name__)


class KVCache(Protocol):
    """The sequence operations of a paged KV cache (runtime.Model has them)."""

    def add_new_sequence(self, seq_id: int) -> None: ...
    def fork_sequence(self, parent_seq_id: int, child_seq_id: int, fork_pos: int = -1) -> None: ...
    def remove_sequence(self, seq_id: int) -> None: ...
    def popn(self, seq_id: int, num_tokens: int) -> None: ...
    def sequence_length(self, seq_id: int) -> int: ...
    def get_num_available_pages(self) -> int: ...


class KVManager:
    def __init__(
        self,
        caches: Sequence[KVCache],
        page_size: int,
        *,
        prefix_cache: bool,
        max_retained: int,
    ) -> None:
        self.caches = list(caches)
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self.tree = PrefixTree()  # running sequences' prompts and retained sequences
        self.retained = RetainedSequences(max_retained if prefix_cache else 0)
        self._ids = itertools.count()
        self.total_pages = self.free_pages()

    # ------------------------------------------------------------------ pages
    def pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def new_pages(self, length: int, tokens: int) -> int:
        """Pages that appending `tokens` to a sequence of `length` tokens takes."""
        return self.pages(length + tokens) - self.pages(length)

    def fit(self, length: int, want: int, free: int) -> int:
        """How many of `want` tokens fit after `length` tokens with `free` pages."""
        room = (self.pages(length) + free) * self.page_size - length
        return max(0, min(want, room))

    def free_pages(self) -> int:
        return min(cache.get_num_available_pages() for cache in self.caches)

    # ------------------------------------------------------------------ sequences
    def open(
        self, tokens: Sequence[int], sibling: tuple[int, int] | None = None
    ) -> tuple[int, int, int]:
        """A new sequence for a request whose next tokens are `tokens`: a fork of the
        `sibling` (sequence, length) when given, else of the longest cached prefix of `tokens`.
        Returns (sequence id, tokens the first cache holds, tokens every follower holds)."""
        seq_id = next(self._ids)
        parent, length = sibling if sibling is not None else self._longest_prefix(tokens)
        held = []
        for i, cache in enumerate(self.caches):
            n = length if parent is not None else 0
            if i and n:  # a follower forks what it holds of the parent's prefix
                n = min(n, cache.sequence_length(parent))
            if n > 0:
                cache.fork_sequence(parent, seq_id, n)
            else:
                cache.add_new_sequence(seq_id)
            held.append(n)
        return seq_id, held[0], min(held)

    def _longest_prefix(self, tokens: Sequence[int]) -> tuple[int | None, int]:
        if not self.prefix_cache or not tokens:
            return None, 0
        seq_id, length = self.tree.longest_match(tokens)
        if seq_id is not None and seq_id in self.retained:
            self.retained.touch(seq_id)
        return seq_id, length

    def index(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Offer the computed `tokens` of a running sequence for prefix reuse."""
        if self.prefix_cache:
            self.tree.insert(seq_id, tokens)

    def close(self, seq_id: int, keep: Sequence[int] | None = None) -> None:
        """A request is done with its sequence. With `keep` (its computed tokens) and the
        prefix cache on, the sequence is retained for reuse, else removed from the caches."""
        if keep is not None and self.retained.max_retained > 0:
            self.tree.insert(seq_id, keep)
            for old in self.retained.add(seq_id):
                self._remove(old)
        else:
            self._remove(seq_id)

    def popn(self, seq_id: int, num_tokens: int, caches: Sequence[KVCache] | None = None) -> None:
        """Drop the last tokens of a sequence (rejected drafts), from `caches` (default: all)."""
        for cache in self.caches if caches is None else caches:
            cache.popn(seq_id, num_tokens)

    def _remove(self, seq_id: int) -> None:
        self.tree.remove(seq_id)
        for cache in self.caches:
            cache.remove_sequence(seq_id)

    # ------------------------------------------------------------------ retained
    @property
    def num_retained(self) -> int:
        return len(self.retained)

    def evict_oldest(self) -> bool:
        """Free the least recently used retained sequence; False when there is none."""
        if not len(self.retained):
            return False
        self._remove(self.retained.pop_oldest())
        return True

    def clear_retained(self) -> int:
        count = 0
        while self.evict_oldest():
            count += 1
        return count
