"""What the engine needs from a model. runtime.Model implements it over a compiled library;
tests/unit/fake_runner.py implements it in numpy with the same paging rules, so every engine
path is testable without compiling."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from .kv_manager import KVCache


class ModelRunner(KVCache, Protocol):
    vocab_size: int

    def create_kv_cache(
        self,
        page_size: int,
        max_num_sequence: int,
        max_total_sequence_length: int,
        prefill_chunk_size: int,
    ) -> None: ...

    def token_embed(self, token_ids: Sequence[int]) -> object:
        """[n] ids -> embeddings, in whatever form the forwards take."""
        ...

    def batch_prefill(
        self, embeddings: object, seq_ids: Sequence[int], lengths: Sequence[int]
    ) -> np.ndarray:
        """Append ragged chunks to their sequences -> logits after each chunk [b, vocab]."""
        ...

    def batch_decode(self, embeddings: object, seq_ids: Sequence[int]) -> np.ndarray:
        """One token per sequence -> logits [b, vocab]."""
        ...

    def batch_verify(
        self,
        embeddings: object,
        seq_ids: Sequence[int],
        lengths: Sequence[int],
        token_tree_parent_ptr: Sequence[int],
    ) -> np.ndarray:
        """A token tree per sequence (parent indices local to each tree, -1 for its root) ->
        logits for every node [sum(lengths), vocab]. Must be followed by a commit before the
        next forward."""
        ...

    def commit_accepted_token_tree_nodes(
        self, seq_ids: Sequence[int], accepted_leaf_indices: Sequence[int]
    ) -> None:
        """Keep root -> accepted leaf of each tree of the last verify, drop the other nodes."""
        ...
