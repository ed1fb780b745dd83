"""A numpy stand-in for runtime.Model with the same KV-cache semantics, for engine tests.

Its "KV" is each sequence's token list, paged exactly like TVM's cache (forks share whole
pages; a fork inside a page copies that page). Logits at a position are a fixed random function
of the whole token history, so any KV mix-up changes the output. It raises on anything the real
cache would not survive: out of pages, too many sequences or tokens in one call, unknown ids, a
forward between a tree verify and its commit.

Token trees (`batch_verify`): every node takes a slot, and pages, as TVM's cache does; node i's
logits are those of the sequence's history followed by the path from the tree's root to i.
`commit_accepted_token_tree_nodes` keeps the path to the accepted leaf and frees the rest.
`fail_next` makes the next forward raise, for failure-isolation tests; `BrokenDecoder` is a
detokenizer stream that raises on a chosen token.
"""

from __future__ import annotations

import hashlib

import numpy as np


class FakeRunner:
    def __init__(
        self,
        vocab_size: int = 64,
        eos: int = 0,
        eos_after: int | None = None,
        script: list[int] | None = None,
        script_from: int = 0,
    ):
        self.vocab_size = vocab_size
        self.eos, self.eos_after = eos, eos_after
        # With a script, greedy decoding emits script[k] as the k-th token after `script_from`.
        self.script, self.script_from = script, script_from
        self.calls: list[tuple[str, list[int], list[int]]] = []
        self.fail_next: Exception | None = None
        self.failed_calls: list[list[int]] = []  # seq_ids of the forwards that fail_next broke

    def create_kv_cache(
        self, page_size, max_num_sequence, max_total_sequence_length, prefill_chunk_size
    ):
        self.page_size = page_size
        self.max_num_sequence = max_num_sequence
        self.prefill_chunk_size = prefill_chunk_size
        self.num_pages = max_total_sequence_length // page_size + 1  # as TVM allocates
        self.refcount = [0] * self.num_pages
        self.seqs: dict[int, list[int]] = {}
        self.pages: dict[int, list[int]] = {}
        self.trees: dict[int, tuple[int, list[int], list[int]]] = {}  # seq -> (len, parents, ids)

    # ---------------------------------------------------------------- pages
    def get_num_available_pages(self) -> int:
        return self.refcount.count(0)

    def _alloc(self) -> int:
        for i, c in enumerate(self.refcount):
            if c == 0:
                self.refcount[i] = 1
                return i
        raise RuntimeError("KV cache out of pages")

    def _grow(self, seq_id: int, n: int) -> None:
        tokens, pages = self.seqs[seq_id], self.pages[seq_id]
        for _ in range(n):
            if -(-(len(tokens) + 1) // self.page_size) > len(pages):
                pages.append(self._alloc())
            tokens.append(-1)  # placeholder, filled by the caller

    # ---------------------------------------------------------------- sequences
    def add_new_sequence(self, seq_id):
        assert seq_id not in self.seqs, f"sequence {seq_id} exists"
        self.seqs[seq_id], self.pages[seq_id] = [], []

    def fork_sequence(self, parent, child, fork_pos=-1):
        assert parent in self.seqs and child not in self.seqs
        tokens = self.seqs[parent]
        pos = len(tokens) if fork_pos < 0 else fork_pos
        assert 0 < pos <= len(tokens), (pos, len(tokens))
        full = pos // self.page_size
        shared = self.pages[parent][:full]
        for p in shared:
            self.refcount[p] += 1
        self.seqs[child], self.pages[child] = list(tokens[:pos]), list(shared)
        if pos % self.page_size:
            self.pages[child].append(self._alloc())

    def remove_sequence(self, seq_id):
        assert seq_id in self.seqs, f"unknown sequence {seq_id}"
        for p in self.pages.pop(seq_id):
            self.refcount[p] -= 1
        del self.seqs[seq_id]

    def sequence_length(self, seq_id):
        return len(self.seqs[seq_id])

    def popn(self, seq_id, n):
        tokens = self.seqs[seq_id]
        assert 0 <= n <= len(tokens)
        del tokens[len(tokens) - n :]
        keep = -(-len(tokens) // self.page_size)
        for p in self.pages[seq_id][keep:]:
            self.refcount[p] -= 1
        del self.pages[seq_id][keep:]

    # ---------------------------------------------------------------- compute
    def token_embed(self, token_ids):
        ids = [int(t) for t in token_ids]
        assert all(0 <= t < self.vocab_size for t in ids)
        return ids

    def _begin(self, kind, seq_ids, lengths):
        assert not self.trees, "a forward before the last verify was committed"
        assert len(seq_ids) <= self.max_num_sequence and len(set(seq_ids)) == len(seq_ids)
        assert all(s in self.seqs for s in seq_ids), seq_ids
        self.calls.append((kind, list(seq_ids), list(lengths)))
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            self.failed_calls.append(list(seq_ids))
            for seq_id, n in zip(seq_ids, lengths):  # TVM reserves the slots before it fails
                self._grow(seq_id, n)
            raise err

    def batch_prefill(self, embeddings, seq_ids, lengths):
        assert sum(lengths) == len(embeddings) <= self.prefill_chunk_size, lengths
        self._begin("prefill", seq_ids, lengths)
        out, offset = [], 0
        for seq_id, n in zip(seq_ids, lengths):
            self._append(seq_id, embeddings[offset : offset + n])
            offset += n
            out.append(self.logits(self.seqs[seq_id]))
        return np.stack(out)

    def batch_decode(self, embeddings, seq_ids):
        self._begin("decode", seq_ids, [1] * len(seq_ids))
        for seq_id, token in zip(seq_ids, embeddings):
            self._append(seq_id, [token])
        return np.stack([self.logits(self.seqs[s]) for s in seq_ids])

    def batch_verify(self, embeddings, seq_ids, lengths, token_tree_parent_ptr):
        assert sum(lengths) == len(embeddings) == len(token_tree_parent_ptr)
        assert sum(lengths) <= self.prefill_chunk_size and max(lengths) <= 256
        self._begin("verify", seq_ids, lengths)
        out, offset = [], 0
        for seq_id, n in zip(seq_ids, lengths):
            ids = list(embeddings[offset : offset + n])
            parents = list(token_tree_parent_ptr[offset : offset + n])
            assert parents[0] == -1 and all(-1 <= p < i for i, p in enumerate(parents)), parents
            base = len(self.seqs[seq_id])
            self._append(seq_id, ids)  # every node takes a slot until the commit
            self.trees[seq_id] = (base, parents, ids)
            for i in range(n):
                out.append(self.logits(self.seqs[seq_id][:base] + _path(parents, ids, i)))
            offset += n
        return np.stack(out)

    def commit_accepted_token_tree_nodes(self, seq_ids, accepted_leaf_indices):
        assert list(seq_ids) == list(self.trees), "commit must name the verified sequences"
        for seq_id, leaf in zip(seq_ids, accepted_leaf_indices):
            base, parents, ids = self.trees[seq_id]
            path = _path(parents, ids, leaf)
            self.popn(seq_id, len(self.seqs[seq_id]) - base)
            self._append(seq_id, path)
        self.trees = {}

    def _append(self, seq_id, tokens):
        start = len(self.seqs[seq_id])
        self._grow(seq_id, len(tokens))
        self.seqs[seq_id][start:] = tokens

    def logits(self, history) -> np.ndarray:
        """Deterministic in the full history; `eos_after` makes EOS likely after N tokens."""
        digest = hashlib.sha256(np.asarray(history, np.int64).tobytes()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        logits = rng.normal(0, 2, self.vocab_size).astype(np.float32)
        logits[self.eos] = -10.0
        if self.eos_after is not None and len(history) >= self.eos_after:
            logits[self.eos] = 20.0
        k = len(history) - self.script_from
        if self.script is not None and 0 <= k < len(self.script):
            logits[self.script[k]] = 50.0
        return logits


def _path(parents, ids, node):
    """Tokens from the tree's root to `node`."""
    path = []
    while node >= 0:
        path.append(ids[node])
        node = parents[node]
    return path[::-1]


class BrokenDecoder:
    """A detokenizer stream (an engine's decoder_factory product) whose `at`-th token raises
    UnicodeDecodeError (-1: none does)."""

    def __init__(self, at: int = -1):
        self.at, self.n = at, 0

    def add(self, token):
        self.n += 1
        if self.n == self.at:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return "x"

    def finish(self):
        return ""
