"""A drafted token tree for one request: the nodes after the root (the request's pending token,
which the verify feeds first), each with its parent (0 = the root)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)  # node i + 1
    parents: list[int] = field(default_factory=list)  # parent of node i + 1 (0 = the root)
    # Per node (0 = root): the draft distribution its children were drawn from, without
    # replacement and in order; absent when they were chosen deterministically (one-hot q).
    q: dict[int, np.ndarray] = field(default_factory=dict)
    chain: list[int] = field(default_factory=list)  # the drafter's own chain of nodes, in order

    @property
    def size(self) -> int:
        """Drafted nodes (the root not counted)."""
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        return [i + 1 for i, p in enumerate(self.parents) if p == node]

    def add(self, parent: int, token: int) -> int:
        self.tokens.append(int(token))
        self.parents.append(parent)
        return len(self.tokens)

    @classmethod
    def of_chain(cls, tokens) -> DraftTree:
        tree = cls()
        node = 0
        for token in tokens:
            node = tree.add(node, token)
            tree.chain.append(node)
        return tree
