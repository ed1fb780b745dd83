"""What the routes share: one AsyncEngine, admission control, prompt checks, and one merged
stream of outputs for a request's prompts (each prompt is one engine request with `n` choices).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from ..engine.async_engine import AsyncEngine, EngineDeadError
from ..engine.sampler import check_vocab
from ..engine.types import RequestOutput, SamplingParams, TokenConstraint
from ..errors import MlcrunError
from ..tokenizer import Tokenizer
from .grammar import Grammars
from .metrics import Metrics
from .protocol import APIError, bad_value

log = logging.getLogger(__name__)

_END = object()


@dataclass(frozen=True)
class ServeOptions:
    model_name: str
    api_key: str | None = None
    max_queue: int = 256  # sequences waiting beyond the running batch before 429
    max_request_bytes: int = 4 * 2**20  # bodies over this get 413
    shutdown_timeout: float = 10.0  # seconds in-flight requests get to finish on SIGTERM
    default_max_tokens: int = 16  # /v1/completions without max_tokens, as OpenAI


@dataclass
class Prompt:
    ids: list[int]
    text: str | None  # as given (echo); None for token ids until decoded


class Ticket:
    """Admission of `seqs` sequences; released once, whichever path ends the request."""

    def __init__(self, service: Service, seqs: int) -> None:
        self.service, self.seqs, self.released = service, seqs, False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.service.in_flight -= self.seqs
            self.service.metrics.in_flight -= 1


@dataclass(frozen=True)
class ModelInfo:
    """What the routes need to know of the model, without the model itself (a Ray Serve
    ingress has only these; the model runs in the engine replicas)."""

    tokenizer: Tokenizer | None
    context_window: int
    vocab_size: int
    max_num_sequence: int
    eos_token_ids: tuple[int, ...]
    generation_defaults: dict

    @classmethod
    def of(cls, llm) -> ModelInfo:
        return cls(llm.tokenizer, **model_facts(llm))


def model_facts(llm) -> dict:
    """ModelInfo's fields but the tokenizer: plain values, for another process."""
    return {
        "context_window": llm.engine.context_window,
        "vocab_size": llm.engine.runner.vocab_size,
        "max_num_sequence": llm.engine_config.max_num_sequence,
        "eos_token_ids": tuple(llm.eos_token_ids),
        "generation_defaults": dict(llm.generation_defaults),
    }


class Service:
    """`engine`: an AsyncEngine, or anything with its interface (healthy, error, generate,
    abort_all, reset_prefix_cache, stats, shutdown), such as the Ray Serve replicas' handle."""

    def __init__(self, info: ModelInfo, engine, options: ServeOptions) -> None:
        self.info = info
        self.options = options
        self.engine = engine
        self.tokenizer = info.tokenizer
        self.context_window: int = info.context_window
        self.vocab_size: int = info.vocab_size
        self.capacity = info.max_num_sequence + options.max_queue
        self.grammars = Grammars(self.tokenizer, self.vocab_size, info.eos_token_ids)
        threading.Thread(target=self.grammars.warm_up, name="mlcrun-grammar", daemon=True).start()
        self.metrics = Metrics(options.model_name)
        self.created = int(time.time())
        self.in_flight = 0  # admitted sequences, all requests together
        self.draining = False

    @classmethod
    def local(cls, llm, options: ServeOptions) -> Service:
        """One process: the routes over an AsyncEngine that steps `llm`'s engine."""
        return cls(ModelInfo.of(llm), AsyncEngine(llm.engine), options)

    # ------------------------------------------------------------------ checks
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.options.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves "
                f"`{self.options.model_name}`",
                param="model",
                code="model_not_found",
            )

    def need_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise APIError(400, f"{what} needs a tokenizer; this model has none")
        return self.tokenizer

    def encode(self, prompt, param: str = "prompt") -> list[Prompt]:
        """/v1/completions prompts: a string, strings, token ids, or lists of token ids."""
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, f"{param} must not be empty", param=param)
        if isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        for p in prompt:
            if isinstance(p, str):
                ids = self.need_tokenizer("a text prompt").encode(p)
                if not ids:
                    raise APIError(400, f"{param}: the prompt encodes to no tokens", param=param)
                out.append(Prompt(ids, p))
            else:
                out.append(Prompt(self.check_ids(p, param), None))
        return out

    def check_ids(self, ids: Sequence[int], param: str) -> list[int]:
        if not ids:
            raise APIError(400, f"{param}: a token-id prompt must not be empty", param=param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(
                400,
                f"{param}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                param=param,
            )
        return list(ids)

    def max_tokens(
        self,
        prompts: list[Prompt],
        asked: int | None,
        default: int | None,
        param: str = "max_tokens",
    ) -> int:
        """The max_tokens to use; a 400 naming the limits (and `param`, the field that asked)
        when the request cannot fit."""
        window, longest = self.context_window, max(len(p.ids) for p in prompts)
        if longest >= window:
            raise APIError(
                400,
                f"This model's maximum context length is {window} tokens. However, your prompt "
                f"is {longest} tokens, which leaves no room for a completion. Please shorten it.",
                param="messages" if default is None else "prompt",
                code="context_length_exceeded",
            )
        if asked is None:
            return min(default or window, window - longest)
        if asked >= 1 and longest + asked > window:
            raise APIError(
                400,
                f"This model's maximum context length is {window} tokens. However, you requested "
                f"{longest + asked} tokens ({longest} in the prompt, {asked} for the "
                f"completion). Please reduce the prompt or {param}.",
                param=param,
                code="context_length_exceeded",
            )
        return asked

    def check_alive(self) -> None:
        if not self.engine.healthy:
            raise unavailable(self.engine.error)

    def check_params(self, params: SamplingParams) -> None:
        try:
            check_vocab(params, self.vocab_size)
        except MlcrunError as err:
            raise bad_value(err) from None
        if params.stop and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; this model has none", param="stop")

    def admit(self, prompts: int, n: int) -> Ticket:
        """Refuse (429/503) when the queue is full or the server is stopping."""
        seqs = prompts * n
        if self.draining:
            self.metrics.rejected += 1
            raise APIError(503, "The server is shutting down", type="server_error", code="draining")
        self.check_alive()
        if seqs > self.capacity:
            raise APIError(
                400,
                f"{prompts} prompt(s) x n={n} is {seqs} sequences, more than this server "
                f"queues at once ({self.capacity})",
                param="n",
            )
        if self.in_flight + seqs > self.capacity:
            self.metrics.rejected += 1
            raise APIError(
                429,
                "The server's queue is full; retry later",
                type="rate_limit_error",
                code="queue_full",
            )
        self.in_flight += seqs
        self.metrics.in_flight += 1
        return Ticket(self, seqs)

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams,
        constraint: Callable[[], TokenConstraint] | None,
        ticket: Ticket,
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as the engine produces them, for all prompts together.
        Leaving early (an error, a cancelled task: the client went away) aborts whatever is
        still running and so frees its KV pages."""
        queue: asyncio.Queue = asyncio.Queue()
        base = uuid.uuid4().hex

        async def pump(i: int, ids: list[int]) -> None:
            try:
                stream = self.engine.generate(ids, params, f"{base}-{i}", constraint)
                async with aclosing(stream) as outputs:
                    async for out in outputs:
                        queue.put_nowait((i, out))
            except EngineDeadError as err:
                queue.put_nowait((i, unavailable(err)))
            except Exception as err:
                queue.put_nowait((i, err))
            finally:
                queue.put_nowait((i, _END))

        for p in prompts:
            self.metrics.record_prompt(len(p.ids), 0)
        tasks = [asyncio.create_task(pump(i, p.ids)) for i, p in enumerate(prompts)]
        remaining, finished = len(tasks), 0
        tokens: dict[tuple[int, int], int] = {}  # unfinished choice -> tokens it produced
        try:
            while remaining:
                i, item = await queue.get()
                if item is _END:
                    remaining -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                if item.finish_reason == "error":  # this request failed alone
                    finished += 1
                    tokens.pop((i, item.index), None)
                    self._record(item)
                    raise APIError(
                        500,
                        f"generation failed: {item.error}",
                        type="server_error",
                        code="generation_failed",
                    )
                if item.finished:
                    finished += 1
                    tokens.pop((i, item.index), None)
                    self._record(item)
                else:
                    tokens[i, item.index] = len(item.token_ids)
                yield i, item
        finally:
            for task in tasks:
                task.cancel()
            # choices that did not finish here were aborted (the client left, or an error)
            self.metrics.record_aborted(len(prompts) * params.n - finished, sum(tokens.values()))
            ticket.release()

    def _record(self, out: RequestOutput) -> None:
        self.metrics.record_choice(out.finish_reason, out.metrics)
        if out.index == 0 and out.metrics is not None:
            self.metrics.cached_tokens += out.metrics.cached_tokens

    async def drain(self) -> None:
        """SIGTERM: refuse new requests, give those in flight `shutdown_timeout` seconds to
        finish, then abort the rest (their streams end with finish_reason "abort")."""
        self.draining = True
        deadline = time.monotonic() + self.options.shutdown_timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            log.warning("aborting %d sequence(s) still running at shutdown", self.in_flight)
            await self.engine.abort_all()


def unavailable(err: BaseException | None) -> APIError:
    """503 for every request once the engine thread has stopped."""
    return APIError(
        503,
        f"The model engine is not running ({err}); the server must be restarted",
        type="server_error",
        code="engine_dead",
    )


def usage(prompts: list[Prompt], finals: Sequence[RequestOutput]) -> dict:
    """OpenAI usage, plus cached prompt tokens and timings (TTFT, decode/prefill tokens/s)."""
    prompt_tokens = sum(len(p.ids) for p in prompts)
    completion = sum(len(o.token_ids) for o in finals)
    metrics = [o.metrics for o in finals if o.metrics is not None]
    cached = sum(o.metrics.cached_tokens for o in finals if o.index == 0 and o.metrics)
    ttfts = [m.ttft for m in metrics if m.ttft is not None]
    decode = [m.decode_tokens_per_s for m in metrics if m.decode_tokens_per_s]
    prefill = [m.prefill_tokens_per_s for m in metrics if m.prefill_tokens_per_s]
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "timings": {
            "ttft_s": min(ttfts) if ttfts else None,
            "decode_tokens_per_s": sum(decode) / len(decode) if decode else None,
            "prefill_tokens_per_s": sum(prefill) / len(prefill) if prefill else None,
        },
    }
