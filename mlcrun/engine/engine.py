"""The engine: continuous batching over a ModelRunner, one `step()` at a time.

Each step (1) makes room: evicts cached finished sequences, then preempts the newest running
requests, until the decodes fit in the free KV pages; (2) decodes every running request that
has a sampled token to feed; (3) fills the prefill token budget with chunks of prompts, running
ones first, then waiting ones (admitted in arrival order, reusing the longest cached prefix).
A preempted request is recomputed later from its prompt and the tokens it already produced.
Speculative decoding plugs in at (2): draft, `batch_verify` a tree per sequence, then
`popn` / commit the accepted nodes; the request bookkeeping below stays the same.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from ..errors import MlcrunError
from .config import EngineConfig
from .prefix_cache import PrefixTree, RetainedSequences
from .request import RUNNING, WAITING, Request, RequestOutput, TokenConstraint
from .sampler import sample_batch
from .types import SamplingParams

log = logging.getLogger(__name__)


class ModelRunner(Protocol):
    """What the engine needs from a model: runtime.Model implements it, tests use FakeRunner."""

    vocab_size: int

    def create_kv_cache(
        self,
        page_size: int,
        max_num_sequence: int,
        max_total_sequence_length: int,
        prefill_chunk_size: int,
    ) -> None: ...
    def token_embed(self, token_ids: Sequence[int]) -> object: ...
    def batch_prefill(
        self, embeddings: object, seq_ids: Sequence[int], lengths: Sequence[int]
    ) -> np.ndarray: ...
    def batch_decode(self, embeddings: object, seq_ids: Sequence[int]) -> np.ndarray: ...
    def add_new_sequence(self, seq_id: int) -> None: ...
    def fork_sequence(self, parent_seq_id: int, child_seq_id: int, fork_pos: int = -1) -> None: ...
    def remove_sequence(self, seq_id: int) -> None: ...
    def get_num_available_pages(self) -> int: ...


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    free_pages: int = 0
    total_pages: int = 0
    cached_sequences: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    step_sizes: dict[int, int] = field(default_factory=dict)  # sequences in a step -> steps


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        *,
        eos_token_ids: Sequence[int] = (),
        context_window: int,
        decoder_factory: Callable[[list[int]], object] | None = None,
    ) -> None:
        self.runner = runner
        self.config = config  # resolved: every field set
        self.page_size = config.kv_cache_page_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.context_window = context_window
        self.decoder_factory = decoder_factory
        runner.create_kv_cache(
            page_size=config.kv_cache_page_size,
            max_num_sequence=config.max_num_sequence,
            max_total_sequence_length=config.max_total_sequence_length,
            prefill_chunk_size=config.prefill_chunk_size,
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, list[Request]] = {}
        self.tree = PrefixTree()
        self.retained = RetainedSequences(
            config.prefix_cache_max_retained if config.prefix_cache else 0
        )
        self._seq_ids = itertools.count()
        self._order = itertools.count()
        self.stats = EngineStats(total_pages=runner.get_num_available_pages())

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        constraint: Callable[[], TokenConstraint] | None = None,  # one per choice: a grammar
    ) -> None:
        if request_id in self.requests:
            raise MlcrunError(f"request_id {request_id!r} is already in use")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise MlcrunError("prompt: must not be empty")
        if len(prompt) >= self.context_window:
            raise MlcrunError(
                f"prompt: {len(prompt)} tokens do not fit the context window "
                f"({self.context_window} tokens, including at least one generated)"
            )
        if any(not 0 <= t < self.runner.vocab_size for t in prompt):
            raise MlcrunError(f"prompt: token ids must be in [0, {self.runner.vocab_size})")
        group = []
        for index in range(params.n):
            p = params
            if index and params.seed is not None:
                p = replace(params, seed=params.seed + index)
            decoder = self.decoder_factory(prompt) if self.decoder_factory else None
            req = Request(request_id, prompt, p, index=index, decoder=decoder)
            req.constraint = constraint() if constraint is not None else None
            if index:
                req.fork_from = group[0]
            group.append(req)
            self.waiting.append(req)
        self.requests[request_id] = group

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request now (waiting or running) and free its KV pages."""
        outputs = []
        for req in self.requests.get(request_id, []):
            if req.finished:
                continue
            if req in self.waiting:
                self.waiting.remove(req)
            req.finish("abort")
            self._release(req, keep=False)
            outputs.append(req.take_output())
        self.requests.pop(request_id, None)
        self._update_stats()
        return outputs

    def reset_prefix_cache(self) -> int:
        """Drop every finished sequence kept for prefix reuse; returns how many."""
        count = len(self.retained)
        for _ in range(count):
            self._evict_oldest()
        self._update_stats()
        return count

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns an output for every request that progressed."""
        touched: list[Request] = []
        decode = [r for r in self.running if r.pending == 1 and r.num_computed > 0]
        decode = self._make_room(decode)
        if decode:
            self._decode(decode)
            touched += decode
        prefill = self._schedule_prefill()
        if prefill:
            self._prefill(prefill)
            touched += [r for r, _ in prefill]
        if not touched and self.has_unfinished():
            touched += self._unstick()
        outputs = []
        touched = list(dict.fromkeys(touched))  # keep order, drop duplicates
        self.stats.step_sizes[len(touched)] = self.stats.step_sizes.get(len(touched), 0) + 1
        for req in touched:
            if req.finished or req.output:
                out = req.take_output()
                if out.delta_token_ids or out.delta_text or out.finished:
                    outputs.append(out)
            if req.finished:
                self._drop_finished(req)
        self._update_stats()
        return outputs

    # ------------------------------------------------------------------ memory
    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _new_pages(self, req: Request, tokens: int) -> int:
        return self._pages(req.num_computed + tokens) - self._pages(req.num_computed)

    def _free_pages(self) -> int:
        return self.runner.get_num_available_pages()

    def _make_room(self, decode: list[Request]) -> list[Request]:
        """Evict cached sequences, then preempt the newest requests, until decodes fit."""
        while decode:
            need = sum(self._new_pages(r, 1) for r in decode)
            if need <= self._free_pages():
                return decode
            if len(self.retained):
                self._evict_oldest()
                continue
            victim = max(self.running, key=lambda r: r.order)
            if victim in decode and len(self.running) == 1:
                # Alone and still no room: the KV budget is smaller than this sequence.
                victim.finish("length")
                self._release(victim, keep=False)
                return []
            self._preempt(victim)
            decode = [r for r in decode if r is not victim]
        return decode

    def _unstick(self) -> list[Request]:
        """Nothing could run this step: free pages so that the next step can, never hang."""
        if len(self.running) > 1:
            self._preempt(max(self.running, key=lambda r: r.order))
            return []
        # Alone (or nothing admitted) in an otherwise empty cache and still no room: the KV
        # budget is smaller than this request needs.
        req = self.running[0] if self.running else self.waiting.popleft()
        req.finish("length")
        self._release(req, keep=False)
        return [req]

    def _evict_oldest(self) -> None:
        seq_id = self.retained.pop_oldest()
        self.tree.remove(seq_id)
        self.runner.remove_sequence(seq_id)

    def _preempt(self, req: Request) -> None:
        log.info("preempting %s (KV cache full)", req.request_id)
        self.running.remove(req)
        self._release(req, keep=False)
        req.status, req.num_computed = WAITING, 0
        req.metrics.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request, keep: bool) -> None:
        """Take `req` off its KV sequence; with keep, retain it for the prefix cache."""
        if req in self.running:
            self.running.remove(req)
        if req.seq_id is None:
            return
        seq_id, req.seq_id = req.seq_id, None
        if keep and self.retained.max_retained > 0:
            self.tree.insert(seq_id, req.tokens[: req.num_computed])
            for old in self.retained.add(seq_id):
                self.tree.remove(old)
                self.runner.remove_sequence(old)
        else:
            self.tree.remove(seq_id)
            self.runner.remove_sequence(seq_id)

    def _drop_finished(self, req: Request) -> None:
        self._release(req, keep=True)
        group = self.requests.get(req.request_id, [])
        if all(r.finished for r in group):
            self.requests.pop(req.request_id, None)

    # ------------------------------------------------------------------ prefill
    def _schedule_prefill(self) -> list[tuple[Request, int]]:
        budget = self.config.prefill_chunk_size
        plan: list[tuple[Request, int]] = []
        planned = 0  # pages the plan will take when it runs

        def free() -> int:
            return self._free_pages() - planned

        for req in self.running:  # chunked prompts already under way
            if budget == 0:
                break
            if req.pending > 1 or req.num_computed == 0:
                while self._fit(req, free()) < min(req.pending, budget) and len(self.retained):
                    self._evict_oldest()  # the prefix cache yields to prompts under way
                take = min(req.pending, budget, self._fit(req, free()))
                if take:
                    plan.append((req, take))
                    budget -= take
                    planned += self._new_pages(req, take)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_sequence:
            req = self.waiting[0]
            if req.fork_from is not None and not self._sibling_ready(req):
                break
            # +1: a fork inside a page copies that page
            while self._pages(min(req.pending, budget)) + 1 > free() and len(self.retained):
                self._evict_oldest()
            if self._pages(min(req.pending, budget)) + 1 > free():
                break  # wait for pages to free up
            self.waiting.popleft()
            self._admit(req)
            take = min(req.pending, budget, self._fit(req, free()))
            if take:
                plan.append((req, take))
                budget -= take
                planned += self._new_pages(req, take)
        return plan

    def _fit(self, req: Request, free: int) -> int:
        """How many of req's pending tokens fit in `free` pages."""
        room = (self._pages(req.num_computed) + free) * self.page_size - req.num_computed
        return max(0, min(req.pending, room))

    def _sibling_ready(self, req: Request) -> bool:
        first = req.fork_from
        return first.finished or (
            first.seq_id is not None and first.num_computed >= len(first.prompt) - 1
        )

    def _admit(self, req: Request) -> None:
        req.seq_id = next(self._seq_ids)
        req.order = next(self._order)
        req.status = RUNNING
        self.running.append(req)
        parent, length = self._fork_source(req)
        if parent is not None and length > 0:
            self.runner.fork_sequence(parent, req.seq_id, length)
            req.num_computed = length
            if req.metrics.cached_tokens == 0:
                req.metrics.cached_tokens = min(length, len(req.prompt))
        else:
            self.runner.add_new_sequence(req.seq_id)

    def _fork_source(self, req: Request) -> tuple[int | None, int]:
        limit = len(req.tokens) - 1  # always compute the last token: its logits are needed
        first = req.fork_from
        if first is not None and first.seq_id is not None:
            return first.seq_id, min(len(first.prompt) - 1, limit)
        if not self.config.prefix_cache or limit <= 0:
            return None, 0
        seq_id, length = self.tree.longest_match(req.tokens[:limit])
        if seq_id is not None and seq_id in self.retained:
            self.retained.touch(seq_id)
        return seq_id, length

    def _prefill(self, plan: list[tuple[Request, int]]) -> None:
        tokens, seq_ids, lengths = [], [], []
        for req, take in plan:
            tokens += req.tokens[req.num_computed : req.num_computed + take]
            seq_ids.append(req.seq_id)
            lengths.append(take)
        start = time.perf_counter()
        logits = self.runner.batch_prefill(self.runner.token_embed(tokens), seq_ids, lengths)
        elapsed = time.perf_counter() - start
        self.stats.prefill_tokens += len(tokens)
        ready, rows = [], []
        for row, (req, take) in enumerate(plan):
            req.num_computed += take
            req.metrics.prefill_seconds += elapsed * take / len(tokens)
            if self.config.prefix_cache and req.num_computed <= len(req.prompt):
                self.tree.insert(req.seq_id, req.tokens[: req.num_computed])
            if req.pending == 0:
                ready.append(req)
                rows.append(row)
        if ready:
            self._sample(ready, logits[rows])

    # ------------------------------------------------------------------ decode
    def _decode(self, batch: list[Request]) -> None:
        tokens = [r.tokens[r.num_computed] for r in batch]  # each one's single pending token
        logits = self.runner.batch_decode(
            self.runner.token_embed(tokens), [r.seq_id for r in batch]
        )
        self.stats.decode_tokens += len(batch)
        for req in batch:
            req.num_computed += 1
        self._sample(batch, logits)

    def _sample(self, batch: list[Request], logits: np.ndarray) -> None:
        results = sample_batch(
            logits, [r.params for r in batch], [r.sampler for r in batch], self._allowed(batch)
        )
        for req, res in zip(batch, results):
            req.append(res.token, res.top_logprobs)
            done = req.constraint is not None and req.constraint.accept(res.token)  # complete
            if not req.finished:
                reason = self._finish_reason(req, res.token) or ("stop" if done else None)
                if reason:
                    req.finish(reason)

    def _allowed(self, batch: list[Request]) -> list[np.ndarray | None] | None:
        """Masks per row: the request's grammar, and min_tokens (stop tokens masked until then)."""
        masks: list[np.ndarray | None] = []
        vocab = self.runner.vocab_size
        for req in batch:
            mask = None if req.constraint is None else np.asarray(req.constraint.allowed(vocab))
            if len(req.output) < req.params.min_tokens:
                stops = [t for t in (*self.eos_token_ids, *req.params.stop_token_ids) if t < vocab]
                keep = np.ones(vocab, dtype=bool) if mask is None else mask.copy()
                keep[stops] = False
                mask = keep if keep.any() else mask  # the grammar wins if only a stop may follow
            masks.append(mask)
        return masks if any(m is not None for m in masks) else None

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if len(req.output) >= p.max_tokens or len(req.tokens) >= self.context_window:
            return "length"
        return None

    def _update_stats(self) -> None:
        s = self.stats
        s.running, s.waiting = len(self.running), len(self.waiting)
        s.free_pages, s.cached_sequences = self._free_pages(), len(self.retained)
