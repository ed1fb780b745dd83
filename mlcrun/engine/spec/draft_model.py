"""Drafting with a second, smaller model (or a low-bit copy of the target: the same code).

The draft model's KV cache holds the same sequences as the target's (the KV manager applies
every sequence operation to both), but it may lag: it holds a request's tokens up to
`Request.num_draft_computed`. Prompts are prefilled into both in the same step when drafting
is expected to pay at the running batch size (the engine decides); otherwise, e.g. at large
batch sizes, the draft costs nothing until a request drafts. A draft step first feeds what
the draft lacks (at least the pending token) in ragged prefills, then decodes the chain one
token per forward. A request whose catch-up does not fit the draft cache's free pages does
not draft this step. Greedy requests take the draft's argmax; sampled requests
draw from the draft's distribution under their own sampling parameters (the q of the
acceptance rule). After the verify, drafted tokens the target rejected are popped from the
draft cache only.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..kv_manager import KVManager
from ..request import Request
from ..runner import ModelRunner
from ..sampler import draw, probabilities
from .tree import DraftTree


class ModelDrafter:
    def __init__(
        self,
        runner: ModelRunner,
        kv: KVManager,
        chunk_size: int,
        vocab_size: int,
        max_num_sequence: int = 1,
    ):
        self.runner = runner
        self.kv = kv
        self.chunk_size = chunk_size
        # Draft pages kept free for this step's prefill (a chunk, one partial page per request)
        self.reserve = kv.pages(chunk_size) + max_num_sequence
        self.vocab_size = vocab_size  # the target's: draft rows are cut or padded to it
        self._fed: dict[Request, int] = {}  # drafted tokens fed to the draft cache this step

    def propose(
        self, batch: Sequence[Request], lengths: dict[Request, int], width: int
    ) -> dict[Request, DraftTree]:
        """A tree per request of `batch` whose length is > 0: a chain of that length, plus
        width - 1 alternatives at the first position."""
        reqs = self._fitting([r for r in batch if lengths.get(r, 0) > 0], lengths)
        self._fed = {}
        if not reqs:
            return {}
        trees = {r: DraftTree() for r in reqs}
        logits = self._catch_up(reqs)  # [b, vocab]: the distribution after the pending token
        tips = {r: 0 for r in reqs}  # the chain's last node
        for depth in range(max(lengths[r] for r in reqs)):
            active = [r for r in reqs if lengths[r] > depth]
            if depth:  # feed the chain's previous token
                prev = [trees[r].tokens[tips[r] - 1] for r in active]
                rows = self.runner.batch_decode(self.runner.token_embed(prev), _seq_ids(active))
                for r in active:
                    r.num_draft_computed += 1
                    self._fed[r] = self._fed.get(r, 0) + 1
                logits = rows
            else:
                logits = logits[[reqs.index(r) for r in active]]
            self._choose(active, self._fit(logits), trees, tips, width if depth == 0 else 1)
        return trees

    def _fitting(self, reqs: list[Request], lengths: dict[Request, int]) -> list[Request]:
        """The requests that may draft: those level with the target (the scheduler reserved
        their pages), and, oldest first, those whose catch-up fits the draft cache's free
        pages beside this step's prefill."""
        free = self.runner.get_num_available_pages() - self.reserve
        out = []
        for r in sorted(reqs, key=lambda r: r.order):
            if r.num_draft_computed == r.num_computed:
                out.append(r)
                continue
            grow = len(r.tokens) - r.num_draft_computed + lengths[r] - 1
            need = self.kv.new_pages(r.num_draft_computed, grow)
            if need <= free:
                out.append(r)
                free -= need
        return out

    def _fit(self, logits: np.ndarray) -> np.ndarray:
        """Draft rows over the target's vocabulary (padded vocabularies may differ)."""
        v = self.vocab_size
        if logits.shape[1] >= v:
            return logits[:, :v]
        pad = np.full((logits.shape[0], v - logits.shape[1]), -np.inf, dtype=logits.dtype)
        return np.concatenate([logits, pad], axis=1)

    def _choose(self, reqs, logits, trees, tips, width) -> None:
        """The next chain token of each request, and alternatives when width > 1."""
        greedy = [i for i, r in enumerate(reqs) if r.params.temperature == 0]
        sampled = [i for i, r in enumerate(reqs) if r.params.temperature != 0]
        for i in greedy:
            req, row = reqs[i], logits[i]
            order = [int(row.argmax())]
            if width > 1:  # the next best, best first (a partition, not a sort of the vocab)
                top = np.argpartition(-row, width)[:width]
                order += [
                    int(t) for t in top[np.argsort(-row[top], kind="stable")] if t != order[0]
                ]
                order = order[:width]
            tips[req] = trees[req].add(tips[req], int(order[0]))
            trees[req].chain.append(tips[req])
            for token in order[1:]:
                trees[req].add(0, int(token))
        if not sampled:
            return
        rs = [reqs[i] for i in sampled]
        probs = probabilities(logits[sampled], [r.params for r in rs], [r.sampler for r in rs])
        for req, q in zip(rs, probs):
            parent = tips[req]
            left = q.astype(np.float64)
            token = draw(left, req.sampler.rng)
            trees[req].q[parent] = q
            tips[req] = trees[req].add(parent, token)
            trees[req].chain.append(tips[req])
            for _ in range(width - 1):  # alternatives: drawn from q without replacement
                left[token] = 0.0
                if not left.sum() > 0:
                    break
                token = draw(left, req.sampler.rng)
                trees[req].add(parent, token)

    def _catch_up(self, reqs: list[Request]) -> np.ndarray:
        """Feed each request's tokens the draft cache lacks; the logits after the last one."""
        todo = {r: r.num_draft_computed for r in reqs}
        last: dict[Request, np.ndarray] = {}
        while todo:
            plan, budget = [], self.chunk_size
            for r, start in todo.items():
                take = min(len(r.tokens) - start, budget)
                if take <= 0:
                    break
                plan.append((r, take))
                budget -= take
            tokens = [t for r, n in plan for t in r.tokens[todo[r] : todo[r] + n]]
            rows = self.runner.batch_prefill(
                self.runner.token_embed(tokens),
                _seq_ids([r for r, _ in plan]),
                [n for _, n in plan],
            )
            for row, (r, n) in enumerate(plan):
                todo[r] += n
                r.num_draft_computed = todo[r]
                if todo[r] == len(r.tokens):
                    last[r] = rows[row]
                    del todo[r]
        return np.stack([last[r] for r in reqs])

    def prefill(self, plan: Sequence[tuple[Request, int]]) -> None:
        """The target prefilled these chunks: the draft does too (same tokens, same step),
        for the requests it is level with (the others catch up when they draft)."""
        plan = [(r, n) for r, n in plan if r.num_draft_computed == r.num_computed]
        if not plan:
            return
        tokens = [
            t for r, n in plan for t in r.tokens[r.num_draft_computed : r.num_draft_computed + n]
        ]
        self.runner.batch_prefill(
            self.runner.token_embed(tokens), _seq_ids([r for r, _ in plan]), [n for _, n in plan]
        )
        for r, n in plan:
            r.num_draft_computed += n

    def verified(self, req: Request, tree: DraftTree, accepted: Sequence[int]) -> None:
        """After the verify: keep the drafted tokens the target accepted along the chain the
        draft cache holds, pop the rest from the draft cache only."""
        fed = self._fed.get(req, 0)  # the chain's first `fed` nodes are in the draft cache
        keep = 0
        for node, chain_node in zip(accepted, tree.chain[:fed]):
            if node != chain_node:
                break
            keep += 1
        if fed > keep:
            self.kv.popn(req.seq_id, fed - keep, caches=[self.runner])
            req.num_draft_computed -= fed - keep


def _seq_ids(reqs: Sequence[Request]) -> list[int]:
    return [r.seq_id for r in reqs]
