"""Which requests run in the next step: admission, the prefill token budget and chunking,
preemption. It decides and keeps the queues; it never runs the model.

Each step: (1) the running requests that have one token to feed decode; when their new pages
do not fit, retained prefix-cache sequences are evicted, then the newest running requests
preempted (recomputed later from prompt + output, so their output is unchanged); (2) the
`prefill_chunk_size` budget is filled with chunks, first of prompts under way, then of waiting
requests admitted in arrival order (forking the longest cached prefix).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import EngineConfig
from .kv_manager import KVManager
from .request import RUNNING, WAITING, Request

log = logging.getLogger(__name__)


@dataclass
class Schedule:
    decode: list[Request] = field(default_factory=list)  # one token each
    drafts: dict[Request, int] = field(default_factory=dict)  # decodes that draft: how many
    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens)
    # Finished here with "length": alone in the cache and still too large for it.
    finished: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill or self.finished)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVManager,
        *,
        context_window: int,
        draft_lengths: Callable[[list[Request]], dict[Request, int]] | None = None,
    ) -> None:
        """`draft_lengths`: how many tokens the decoding requests would like to draft (then
        clamped here)."""
        self.config = config
        self.kv = kv
        self.context_window = context_window
        self.draft_lengths = draft_lengths
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self._order = itertools.count()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def release(self, req: Request, keep: bool) -> None:
        """Take `req` out of the queues and off its sequence; with `keep`, the sequence stays
        cached for prefix reuse (its content is exactly req.tokens[:num_computed])."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.seq_id is not None:
            seq_id, req.seq_id = req.seq_id, None
            self.kv.close(seq_id, req.tokens[: req.num_computed] if keep else None)

    # ------------------------------------------------------------------ the decision
    def schedule(self) -> Schedule:
        plan = Schedule()
        decode = [r for r in self.running if r.pending == 1 and r.num_computed > 0]
        plan.decode = self._make_room(decode, plan)
        reserved = self._pages_for(plan.decode)
        if self.draft_lengths is not None and plan.decode:
            plan.drafts, reserved = self._reserve_drafts(plan.decode, reserved)
        plan.prefill = self._schedule_prefill(reserved)
        if plan.empty and self.has_unfinished():
            self._unstick(plan)
        return plan

    def _pages_for(self, decode: list[Request]) -> int:
        return sum(self.kv.new_pages(r.num_computed, 1) for r in decode)

    def _make_room(self, decode: list[Request], plan: Schedule) -> list[Request]:
        """Evict retained sequences, then preempt the newest requests, until decodes fit."""
        while decode and self._pages_for(decode) > self.kv.free_pages():
            if self.kv.evict_oldest():
                continue
            victim = max(self.running, key=lambda r: r.order)
            if victim in decode and len(self.running) == 1:
                self._finish_too_large(victim, plan)
                return []
            self._preempt(victim)
            decode = [r for r in decode if r is not victim]
        return decode

    def _reserve_drafts(
        self, decode: list[Request], reserved: int
    ) -> tuple[dict[Request, int], int]:
        """Draft lengths that fit: a verify writes the pending token and every tree node, so
        each drafting request needs pages for 1 + K + (W - 1) tokens. K is clamped to
        max_tokens and the context window and shrunk (to 0) when pages are short; nothing is
        preempted for drafts. Returns the lengths and the pages now reserved."""
        wanted = self.draft_lengths(decode)
        extra = self.config.spec_tree_width - 1  # alternatives at the first position
        nodes = len(decode)  # every request's root; all nodes of a verify share the chunk
        out = {}
        for req in sorted(decode, key=lambda r: r.order):
            k = min(
                wanted.get(req, 0),
                req.params.max_tokens - req.num_output - 1,  # the target adds one more
                self.context_window - len(req.tokens) - extra,
                self.config.prefill_chunk_size - nodes - extra,
            )
            while k > 0:
                grow = self.kv.new_pages(req.num_computed, 1 + k + extra)
                more = grow - self.kv.new_pages(req.num_computed, 1)
                if more <= self.kv.free_pages() - reserved:
                    out[req] = k
                    nodes += k + extra
                    reserved += more
                    break
                k -= 1
        return out, reserved

    def _unstick(self, plan: Schedule) -> None:
        """Nothing could run: free pages so that the next step can; never hang."""
        if len(self.running) > 1:
            self._preempt(max(self.running, key=lambda r: r.order))
        else:  # alone in an otherwise empty cache and still no room
            self._finish_too_large(self.running[0] if self.running else self.waiting[0], plan)

    def _finish_too_large(self, req: Request, plan: Schedule) -> None:
        log.warning("%s needs more KV pages than the cache has: finished", req.request_id)
        req.finish("length")
        self.release(req, keep=False)
        plan.finished.append(req)

    def _preempt(self, req: Request) -> None:
        log.info("preempting %s (KV cache full)", req.request_id)
        self.release(req, keep=False)
        req.status, req.num_computed, req.num_draft_computed = WAITING, 0, 0
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ prefill
    def _schedule_prefill(self, reserved: int) -> list[tuple[Request, int]]:
        """Chunks that fill the token budget with the pages the decodes (`reserved`) leave."""
        budget = self.config.prefill_chunk_size
        plan: list[tuple[Request, int]] = []
        planned = reserved  # pages spoken for

        def free() -> int:  # read live: evictions and forks change it
            return self.kv.free_pages() - planned

        def fit(req: Request, want: int) -> int:
            # The prefix cache yields to prompts under way.
            while self.kv.fit(req.num_computed, want, free()) < want and self.kv.evict_oldest():
                pass
            return self.kv.fit(req.num_computed, want, free())

        def take(req: Request, tokens: int) -> None:
            nonlocal budget, planned
            plan.append((req, tokens))
            budget -= tokens
            planned += self.kv.new_pages(req.num_computed, tokens)

        for req in self.running:  # prompts already under way
            if budget and (req.pending > 1 or req.num_computed == 0):
                n = fit(req, min(req.pending, budget))
                if n:
                    take(req, n)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_sequence:
            req = self.waiting[0]
            if req.fork_from is not None and not _sibling_ready(req):
                break
            need = self.kv.pages(min(req.pending, budget)) + 1  # +1: a fork copies a page
            while need > free() and self.kv.evict_oldest():
                pass
            if need > free():
                break  # wait for pages to free up
            self.waiting.popleft()
            self._admit(req)
            n = fit(req, min(req.pending, budget))
            if n:
                take(req, n)
        return plan

    def _admit(self, req: Request) -> None:
        limit = len(req.tokens) - 1  # always compute the last token: its logits are needed
        first = req.fork_from
        sibling = None
        if first is not None and first.seq_id is not None:
            sibling = (first.seq_id, min(len(first.prompt) - 1, limit))
        req.seq_id, req.num_computed, req.num_draft_computed = self.kv.open(
            req.tokens[:limit], sibling
        )
        if req.num_computed and not req.preemptions:
            req.cached_tokens = min(req.num_computed, len(req.prompt))
        req.order = next(self._order)
        req.status = RUNNING
        self.running.append(req)


def _sibling_ready(req: Request) -> bool:
    """n > 1: the other choices wait until the first has computed its prompt, then fork it."""
    first = req.fork_from
    return first.finished or (
        first.seq_id is not None and first.num_computed >= len(first.prompt) - 1
    )
