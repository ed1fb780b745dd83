"""The engine: continuous batching over a ModelRunner, one `step()` at a time.

A step is: schedule (scheduler.py decides which requests decode and which prompt chunks are
prefilled), run (one batched forward for each kind), post-process (sample every request whose
logits are ready, detokenize, check stops, hand out outputs, release finished sequences).

Failures stay where they belong: a problem of one request (its sampling, grammar or text)
fails that request alone; a failed forward fails the requests of that forward; the others
go on and produce exactly what they would have produced alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import MlcrunError
from .config import EngineConfig
from .kv_manager import KVManager
from .output import OutputStream
from .request import Request
from .runner import ModelRunner
from .sampler import check_vocab, plain_greedy, sample_batch
from .scheduler import Scheduler
from .spec.adaptive import (
    PRIOR_ACCEPTANCE,
    PROBE_LENGTH,
    CostModel,
    batch_depth,
    best_draft_length,
    verify_pays,
)
from .spec.cost import measure_costs
from .spec.decoder import SpeculativeDecoder
from .spec.draft_model import ModelDrafter
from .spec.ngram import NgramDrafter
from .types import RequestOutput, SamplingParams, TokenConstraint

log = logging.getLogger(__name__)


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
    failed: int = 0  # requests that ended with an error
    step_sizes: dict[int, int] = field(default_factory=dict)  # sequences in a step -> steps
    # Speculative decoding: (request, step) pairs that drafted, tokens drafted and accepted,
    # seconds spent drafting and verifying.
    spec_steps: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def snapshot(self) -> EngineStats:
        copy = object.__new__(EngineStats)  # what replace() gives, without re-running __init__
        copy.__dict__.update(self.__dict__)
        copy.step_sizes = dict(self.step_sizes)
        return copy


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        config: EngineConfig,
        *,
        eos_token_ids: Sequence[int] = (),
        context_window: int,
        decoder_factory: Callable[[list[int]], object] | None = None,
        draft_runner: ModelRunner | None = None,
        cost_model: CostModel | None = None,
    ) -> None:
        """`draft_runner`: the draft model of speculative modes "draft" and "self".
        `cost_model`: measured step costs for the adaptive draft length (measured here, once,
        when it is needed and not given)."""
        self.runner = runner
        self.config = config  # resolved: every field set
        self.eos_token_ids = frozenset(eos_token_ids)
        capacity = config.max_total_sequence_length
        if context_window > capacity:
            log.warning(
                "the KV cache holds %d tokens, fewer than the context window (%d): "
                "the context window is capped at %d",
                capacity,
                context_window,
                capacity,
            )
        self.context_window = min(context_window, capacity)
        self.decoder_factory = decoder_factory
        nodes = 1 + config.draft_length_bound + config.spec_tree_width - 1
        if config.speculating and nodes > config.prefill_chunk_size:
            raise MlcrunError(
                f"spec_draft_length/spec_tree_width: a tree of {nodes} nodes is over the "
                f"{config.prefill_chunk_size} tokens one forward takes (the prefill chunk)"
            )
        caches = [runner] if draft_runner is None else [runner, draft_runner]
        for cache in caches:  # a draft cache mirrors the target's, page for page
            cache.create_kv_cache(
                page_size=config.kv_cache_page_size,
                max_num_sequence=config.max_num_sequence,
                max_total_sequence_length=capacity,
                prefill_chunk_size=config.prefill_chunk_size,
            )
        self.kv = KVManager(
            caches,
            config.kv_cache_page_size,
            prefix_cache=config.prefix_cache,
            max_retained=config.prefix_cache_max_retained,
        )
        self.drafter = self._drafter(draft_runner)
        self.spec = (
            SpeculativeDecoder(self, self.drafter, config.spec_tree_width) if self.drafter else None
        )
        self.scheduler = Scheduler(
            config,
            self.kv,
            context_window=self.context_window,
            draft_lengths=self._draft_lengths if self.spec else None,
        )
        self.requests: dict[str, list[Request]] = {}  # unfinished requests by id
        self._streams: dict[Request, OutputStream] = {}
        self._step_time = 0.0  # when this step's tokens were produced
        self.stats = EngineStats(total_pages=self.kv.total_pages)
        self.costs = cost_model
        self._pays: dict[tuple, bool] = {}  # _drafting_pays by (batch, rate, depth bucket)
        self.probes: set[Request] = set()  # the requests drafting this step to probe
        if self.spec and not config.spec_draft_length and cost_model is None:
            self.costs = self.measure_costs()
        self._update_stats()

    def _drafter(self, draft_runner: ModelRunner | None):
        mode = self.config.speculative_mode
        if mode == "ngram":
            return NgramDrafter(self.config.ngram_max)
        if mode in ("draft", "self"):
            if draft_runner is None:
                raise MlcrunError(f"speculative_mode {mode!r} needs a draft model")
            return ModelDrafter(
                draft_runner,
                self.kv,
                self.config.prefill_chunk_size,
                self.runner.vocab_size,
                self.config.max_num_sequence,
            )
        return None

    def measure_costs(self) -> CostModel:
        """What verifies and draft steps cost at each batch size, on this machine."""
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < self.config.max_num_sequence]
        draft = self.drafter.runner if isinstance(self.drafter, ModelDrafter) else None
        return measure_costs(
            self.runner,
            self.kv,
            [*sizes, self.config.max_num_sequence],
            draft=draft,
            max_tokens=1 + self.config.draft_length_bound + self.config.spec_tree_width - 1,
            chunk=self.config.prefill_chunk_size,
            context_window=self.context_window,
        )

    # ------------------------------------------------------------------ requests
    def check_request(self, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list of ints, or an MlcrunError naming what is wrong. Reads no
        mutable state, so any thread may call it."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise MlcrunError("prompt: must not be empty")
        if len(prompt) >= self.context_window:
            raise MlcrunError(
                f"prompt: {len(prompt)} tokens do not fit the context window "
                f"({self.context_window} tokens, including at least one generated)"
            )
        vocab = self.runner.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise MlcrunError(f"prompt: token ids must be in [0, {vocab})")
        check_vocab(params, vocab)
        return prompt

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        params: SamplingParams,
        constraint: Callable[[], TokenConstraint] | None = None,  # one per choice: a grammar
        *,
        stream: bool = True,
    ) -> None:
        """`stream`: step() returns this request's outputs as it progresses (else only its
        final one, which spares building a cumulative output every step)."""
        if request_id in self.requests:
            raise MlcrunError(f"request_id {request_id!r} is already in use")
        prompt = self.check_request(prompt, params)
        group: list[Request] = []
        for index in range(params.n):
            p = params
            if index and params.seed is not None:
                p = replace(params, seed=params.seed + index)
            req = Request(request_id, prompt, p, index=index)
            req.constraint = constraint() if constraint is not None else None
            req.fork_from = group[0] if group else None
            decoder = self.decoder_factory(prompt) if self.decoder_factory else None
            self._streams[req] = OutputStream(req, decoder, stream=stream)
            group.append(req)
            self.scheduler.add(req)
        self.requests[request_id] = group
        self._update_stats()

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Stop a request now (waiting or running) and free its KV pages."""
        outputs = []
        for req in self.requests.pop(request_id, []):
            if not req.finished:
                req.finish("abort")
                outputs.append(self._retire(req))
        self._update_stats()
        return outputs

    def reset_prefix_cache(self) -> int:
        """Drop every finished sequence kept for prefix reuse; returns how many."""
        count = self.kv.clear_retained()
        self._update_stats()
        return count

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Schedule, run, post-process; returns an output for every request that progressed
        (that finished, for requests added with stream=False)."""
        plan = self.scheduler.schedule()
        ready: list[tuple[Request, np.ndarray]] = []  # requests with logits to sample
        matrix = None  # the rows of `ready` as one array, when they are (no copy to stack)
        if plan.decode and not (self.spec and self.spec.step(plan.decode, plan.drafts)):
            ready, matrix = self._run_decode(plan.decode)
        if plan.prefill:
            prefilled = self._run_prefill(plan.prefill)
            if prefilled:
                ready, matrix = ready + prefilled, None
        self._sample(ready, logits=matrix)
        touched = [*plan.decode, *(r for r, _ in plan.prefill), *plan.finished]
        sizes = self.stats.step_sizes
        sizes[len(touched)] = sizes.get(len(touched), 0) + 1
        if len(touched) > 1:
            touched = list(dict.fromkeys(touched))
        outputs = [out for req in touched if (out := self._output(req))]
        self._update_stats()
        return outputs

    # ------------------------------------------------------------------ run
    def _run_decode(
        self, batch: list[Request]
    ) -> tuple[list[tuple[Request, np.ndarray]], np.ndarray | None]:
        """(request, its logits row) for each request, and the rows as one [b, vocab] array."""
        tokens = [r.tokens[r.num_computed] for r in batch]  # each one's single pending token
        seq_ids = [r.seq_id for r in batch]
        logits = self._forward(
            batch, lambda: self.runner.batch_decode(self._embed(tokens), seq_ids)
        )
        if logits is None:
            return [], None
        self.stats.decode_tokens += len(batch)
        for req in batch:
            req.num_computed += 1
        return list(zip(batch, logits)), logits

    def _run_prefill(self, plan: list[tuple[Request, int]]) -> list[tuple[Request, np.ndarray]]:
        batch = [r for r, _ in plan]
        tokens = [t for r, n in plan for t in r.tokens[r.num_computed : r.num_computed + n]]
        seq_ids, lengths = [r.seq_id for r in batch], [n for _, n in plan]
        start = time.perf_counter()
        logits = self._forward(
            batch, lambda: self.runner.batch_prefill(self._embed(tokens), seq_ids, lengths)
        )
        if logits is None:
            return []
        elapsed = time.perf_counter() - start
        self.stats.prefill_tokens += len(tokens)
        if isinstance(self.drafter, ModelDrafter) and self._feeding_the_draft_pays(
            depth=sum(r.num_computed + n for r, n in plan) // len(plan)
        ):
            # the draft cache takes the same chunks now, else it catches up when it drafts
            self._forward(batch, lambda: self.drafter.prefill(plan))  # failing fails them
        ready = []
        for row, (req, n) in enumerate(plan):
            if req.finished:
                continue
            req.num_computed += n
            self._streams[req].metrics.prefill_seconds += elapsed * n / len(tokens)
            if req.num_computed <= len(req.prompt):
                self.kv.index(req.seq_id, req.tokens[: req.num_computed])
            if req.pending == 0:
                ready.append((req, logits[row]))
        return ready

    def _embed(self, tokens: list[int]) -> object:
        return self.runner.token_embed(tokens)

    def _forward(self, batch: list[Request], forward: Callable[[], np.ndarray]):
        """Logits of one batched forward, or None when it failed: then its requests fail (their
        KV sequences may hold anything) and the engine goes on with the others."""
        try:
            return forward()
        except Exception as err:
            log.exception("a model forward of %d request(s) failed", len(batch))
            for req in batch:
                self._fail(req, f"the model forward failed: {type(err).__name__}: {err}")
            return None

    # ------------------------------------------------------------------ post-process
    def _sample(
        self,
        ready: list[tuple[Request, np.ndarray]],
        drafts: list[tuple[list[int], np.ndarray | None] | None] | None = None,
        now: float | None = None,
        logits: np.ndarray | None = None,
    ) -> dict[Request, int | None]:
        """Sample the next token of every ready request, in one batch, and append it; a
        request whose own sampling fails (its grammar, its text) fails alone. drafts[i]: the
        candidates drafted for ready[i]'s position (sample_batch's rule keeps the
        distribution). Returns, per request that got a token, which candidate it is (None:
        a fresh draw). `now`: the step's time, shared by the tokens of one step. `logits`:
        the rows of `ready`, in order, as one array (else they are stacked here)."""
        self._step_time = time.perf_counter() if now is None else now
        batch, rows, masks, candidates = [], [], [], []
        for i, (req, row) in enumerate(ready):
            try:
                masks.append(self._mask(req))
            except Exception as err:
                self._fail_alone(req, "its constraint failed", err)
                continue
            batch.append(req)
            rows.append(row)
            candidates.append(drafts[i] if drafts is not None else None)
        if not batch:
            return {}
        if logits is None or len(batch) != len(ready):
            logits = rows[0][None] if len(rows) == 1 else np.stack(rows)
        results = sample_batch(
            logits,
            [r.params for r in batch],
            [r.sampler for r in batch],
            masks if any(m is not None for m in masks) else None,
            candidates if drafts is not None else None,
        )
        accepted = {}
        for req, res in zip(batch, results):
            try:
                if res.error is not None:
                    raise MlcrunError(res.error)
                self._accept(req, res.token, res.top_logprobs)
            except Exception as err:
                self._fail_alone(req, "sampling failed", err)
                continue
            accepted[req] = res.accepted
        return accepted

    def _accept(self, req: Request, token: int, logprobs: dict[int, float] | None) -> None:
        """Append a sampled token and finish the request if it ends here."""
        req.append(token)
        stopped = self._streams[req].add([token], [logprobs], now=self._step_time)
        complete = req.constraint is not None and req.constraint.accept(token)
        reason = "stop" if stopped else self._finish_reason(req, token)
        if reason or complete:
            req.finish(reason or "stop")

    def _argmax_only(self, req: Request) -> bool:
        """Whether each next token of the request is its logits' argmax and nothing else: plain
        greedy (no penalties, logit_bias or logprobs), no grammar, min_tokens reached (the mask
        stays empty: tokens only add to num_output)."""
        return (
            req.constraint is None
            and req.num_output >= req.params.min_tokens
            and plain_greedy(req.params)
        )

    def _take(self, req: Request, token: int, now: float) -> bool:
        """Append a token chosen without the sampler (an `_argmax_only` request's argmax), as
        `_sample` appends a sampled one; False when the request failed on it."""
        self._step_time = now
        try:
            self._accept(req, token, None)
        except Exception as err:
            self._fail_alone(req, "sampling failed", err)
            return False
        return True

    def _mask(self, req: Request) -> np.ndarray | None:
        """The allowed tokens: the request's grammar, and min_tokens (stops masked until
        then); None when every token is allowed."""
        if req.constraint is None and req.params.min_tokens == 0:
            return None
        vocab = self.runner.vocab_size
        mask = None if req.constraint is None else np.asarray(req.constraint.allowed(vocab))
        if req.num_output < req.params.min_tokens:
            stops = [t for t in (*self.eos_token_ids, *req.params.stop_token_ids) if t < vocab]
            keep = np.ones(vocab, dtype=bool) if mask is None else mask.copy()
            keep[stops] = False
            mask = keep if keep.any() else mask  # the grammar wins if only a stop may follow
        return mask

    def _draft_lengths(self, batch: list[Request]) -> dict[Request, int]:
        """How many tokens each decoding request may draft this step (before the scheduler
        clamps them to pages, max_tokens and the context window). Constrained requests decode
        plainly: their grammar would have to be rolled back on rejection. At a batch size
        where even drafts that are always right would not pay, nothing is looked up and the
        step does not count as idle for the requests' acceptance (no probe could run). A draft
        model that lags catches up first (`_catch_up_pays`), for a probe too: a request whose
        acceptance is only the prior would otherwise never measure it."""
        self.probes = set()
        depth = batch_depth(batch)
        if not self._drafting_pays(len(batch), 1.0, depth):
            return {}
        able = [  # may draft, after a catch-up that is not too long where the draft lags
            r
            for r in batch
            if r.constraint is None and not (self._draft_lags(r) and self._catch_up_too_long(r))
        ]
        kind = getattr(self.drafter, "kind", None)  # prompt lookup: the match length, or None
        if kind is not None:  # keyed acceptance (Request.acceptance); no match, no draft
            for req in able:
                req.draft_kind = kind(req)
            able = [r for r in able if r.draft_kind is not None]
        k = self.config.spec_draft_length
        free = [r for r in able if not self._draft_lags(r) or self._catch_up_pays(r)]
        if not k:
            # the others are one-node trees in the same verify: rate 0 yields 1 token each
            rates = [r.acceptance.rate if r in free else 0.0 for r in batch]
            k = best_draft_length(rates, self.costs, self.config.spec_max_draft_length, depth)
            if not k:  # plain decoding pays more; requests idle long enough probe
                due = [
                    r
                    for r in able
                    if r.acceptance.probe_due
                    and (not self._draft_lags(r) or self._feeding_the_draft_pays(1.0, depth))
                ]
                for req in able:
                    req.acceptance.idle()
                if not (due and self._probe_pays(len(batch), len(due), depth)):
                    return {}
                self.probes = set(due)
                return dict.fromkeys(due, PROBE_LENGTH)
        return {r: k for r in free}

    def _probe_pays(self, batch: int, probes: int, depth: int) -> bool:
        """Whether `probes` requests of the batch drafting PROBE_LENGTH tokens that are all
        kept would make the verify pay, their drafting included: the premise of a probe, and
        what the step's verify is asked (`SpeculativeDecoder._worth_verifying`), so that no
        probe is drafted only to be dropped."""
        drafted = probes * PROBE_LENGTH
        drafting = PROBE_LENGTH * self.costs.draft_cost(probes, depth)
        return verify_pays(self.costs, batch, batch + drafted, batch + drafted, depth, drafting)

    def _catch_up_pays(self, req: Request) -> bool:
        """Whether a request whose draft model lags should catch up and draft: where drafting
        pays at the batch that decodes soon with the request's own acceptance (the prior
        until it has drafted). Not the prior alone: where it says no (a verify dear against a
        plain step), a draft that is nearly always right would stop after its first step, as
        a verify that keeps every drafted token leaves the draft a token behind."""
        return self._feeding_the_draft_pays(round(req.acceptance.rate, 2), req.num_computed)

    def _feeding_the_draft_pays(
        self, rate: float = PRIOR_ACCEPTANCE, depth: int | None = None
    ) -> bool:
        """Whether the draft model should take tokens now (a prefill's chunks in lockstep, or a
        lagging request's catch-up): only where drafting with acceptance `rate` pays at the
        batch that decodes soon, running and waiting requests together. While a batch fills,
        its first requests decode alone for a few steps; feeding the draft then buys drafts
        the grown batch never makes. `depth`: where the requests will decode (priced at the
        cost table's shallow depth, long prompts fed a draft model that then never drafted:
        16 requests 300-550 tokens deep, SmolLM2 F32 with its q4 self-draft, 0.93x plain
        decoding without one drafted token)."""
        soon = len(self.scheduler.running) + len(self.scheduler.waiting)
        return self._drafting_pays(soon, rate, depth)

    def _catch_up_too_long(self, req: Request) -> bool:
        """A lagging draft model that lacks more tokens than the request has left to generate:
        its catch-up (a prefill of them) would cost more than drafting could save."""
        left = req.params.max_tokens - req.num_output
        return req.num_computed - req.num_draft_computed > left

    def _draft_lags(self, req: Request) -> bool:
        """A draft model that lacks more than the pending token: probing would pay its
        catch-up (a prefill) to measure what the model's acceptance already says."""
        model = isinstance(self.drafter, ModelDrafter)
        return model and req.num_draft_computed < req.num_computed

    def _drafting_pays(self, batch: int, rate: float, depth: int | None = None) -> bool:
        """Whether requests drafting with acceptance `rate` at this batch size and depth (None:
        the cost table's) would draft (always, with a fixed draft length). Asked every step:
        memoized by depth bucket."""
        if self.config.spec_draft_length:
            return True
        key = (batch, rate, self.costs.depth_bucket(depth))
        pays = self._pays.get(key)
        if pays is None:
            max_k = self.config.spec_max_draft_length
            pays = best_draft_length([rate] * max(batch, 1), self.costs, max_k, depth) > 0
            self._pays[key] = pays
        return pays

    def _finish_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            return "stop"
        if req.num_output >= p.max_tokens or len(req.tokens) >= self.context_window:
            return "length"
        return None

    def _fail(self, req: Request, message: str) -> None:
        req.finish("error", error=message)
        self.stats.failed += 1

    def _fail_alone(self, req: Request, what: str, err: Exception) -> None:
        if isinstance(err, MlcrunError):
            log.warning("request %s: %s: %s", req.request_id, what, err)
        else:  # not a validation message: keep the traceback
            log.exception("request %s: %s", req.request_id, what)
        self._fail(req, f"{what}: {err}")

    def _output(self, req: Request) -> RequestOutput | None:
        """What is new for the caller since the last step; finished requests are retired."""
        if req.finished:
            group = self.requests.get(req.request_id, [])
            if all(r.finished for r in group):
                self.requests.pop(req.request_id, None)
            return self._retire(req)
        stream = self._streams[req]
        if not stream.streaming:
            return None
        out = stream.take(req)
        return out if out.delta_token_ids or out.delta_text else None

    def _retire(self, req: Request) -> RequestOutput:
        """The final output of a finished request; its sequence is released (kept for prefix
        reuse when it ended normally)."""
        self.scheduler.release(req, keep=req.finish_reason in ("stop", "length"))
        stream = self._streams.pop(req)
        stream.finish()
        return stream.take(req)

    def _update_stats(self) -> None:
        s = self.stats
        s.running, s.waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        s.free_pages, s.cached_sequences = self.kv.free_pages(), self.kv.num_retained
        s.preemptions = self.scheduler.preemptions
