"""The synchronous public API: `LLM(artifact).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path

from . import speculation
from .abi import local_chunk
from .engine.config import EngineConfig
from .engine.engine import Engine
from .engine.types import RequestOutput, SamplingParams
from .errors import MlcrunError
from .runtime import Model
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]

# generation_config.json keys that become sampling defaults -> SamplingParams fields
GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def generation_defaults(generation: dict) -> dict:
    """The sampling defaults in an artifact's generation settings (values SamplingParams
    refuses are skipped with a warning, not fatal: the checkpoint's file is not the user's)."""
    defaults = {}
    for key, field in GENERATION_KEYS.items():
        value = generation.get(key)
        if value is None or isinstance(value, bool):
            continue
        try:
            SamplingParams(**{field: value})
        except MlcrunError as err:
            log.warning("generation_config.json: ignoring %s (%s)", key, err)
            continue
        defaults[field] = value
    return defaults


def artifact_tokenizer(folder: str | Path, art) -> Tokenizer | None:
    """The tokenizer an artifact carries (None when it has none), with the chat template the
    compile recorded."""
    if "tokenizer.json" not in art.tokenizer_files:
        return None
    tokenizer = Tokenizer.from_dir(folder)
    if art.chat_template is not None:
        tokenizer.chat_template = art.chat_template
    return tokenizer


class LLM:
    def __init__(
        self,
        model: str | Path,
        *,
        engine_config: EngineConfig | None = None,
        num_threads: int | None = None,
    ):
        self.model = Model(model, num_threads=num_threads)
        art = self.model.artifact
        self.tokenizer = artifact_tokenizer(self.model.folder, art)
        eos = set(self.model.config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = tuple(sorted(eos))
        # Gemma 3: a forward's chunk must fit in the sliding window (`local_chunk`)
        local = local_chunk(self.model.config.local_window)
        config = (engine_config or EngineConfig()).resolve(
            context_window=art.context_window,
            max_batch=art.max_batch,
            prefill_chunk=art.prefill_chunk,
            page_size=art.page_size,
            kv_bytes_per_token=self.model.kv_bytes_per_token,
            chunk_limit=local,
        )
        if self.model.config.sliding_window or local:
            # windowed sequences cannot be forked (Gemma 3: forks past the window go wrong)
            config = replace(config, prefix_cache=False)
        self.engine_config = config
        self.draft = None
        context_window, costs, costs_path = art.context_window, None, None
        if config.speculating:
            speculation.check_target(self.model, config)
            self.draft = speculation.load_draft(self.model, self.tokenizer, config, num_threads)
            if self.draft is not None:  # the draft's forwards must reach every position too
                context_window = min(context_window, self.draft.artifact.context_window)
            if not config.spec_draft_length:
                costs_path, costs = speculation.cached_costs(self.model, self.draft, config)
                if costs is None:
                    log.warning("speculative decoding: measuring step costs (once per machine)")
        self.engine = Engine(
            self.model,
            config,
            eos_token_ids=self.eos_token_ids,
            context_window=context_window,
            decoder_factory=self._decoder if self.tokenizer is not None else None,
            draft_runner=self.draft,
            cost_model=costs,
        )
        if costs_path is not None and costs is None:
            speculation.save_costs(costs_path, self.engine.costs)
        self._ids = itertools.count()
        self.generation_defaults = generation_defaults(art.generation)

    def sampling_params(self, **given) -> SamplingParams:
        """SamplingParams from what the caller gives (None: not given), else the checkpoint's
        generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, as
        vLLM's `--generation-config auto`), else SamplingParams' own defaults."""
        given = {k: v for k, v in given.items() if v is not None}
        return SamplingParams(**{**self.generation_defaults, **given})

    def _decoder(self, prompt: list[int]):
        return self.tokenizer.stream(prefix_ids=prompt[-4:])

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids), all batched together. Returns one
        output per prompt (per prompt and choice, in order, when n > 1)."""
        outputs: dict[str, list[RequestOutput]] = {}
        order = self._submit(prompts, sampling_params, stream=False)
        for out in self._drain(order):
            if out.finished:
                outputs.setdefault(out.request_id, []).append(out)
        return [o for rid in order for o in sorted(outputs[rid], key=lambda o: o.index)]

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of {"role", "content"} messages) or several, with
        the model's chat template; returns one output per conversation (and choice)."""
        if self.tokenizer is None:
            raise MlcrunError("messages: this artifact has no tokenizer; chat needs one")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(list(c)) for c in conversations]
        return self.generate(prompts, sampling_params)

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Outputs as they are produced: `delta_text` / `delta_token_ids` hold what is new."""
        yield from self._drain(self._submit(prompts, sampling_params))

    def _submit(self, prompts, sampling_params, stream: bool = True) -> dict[str, int]:
        """Add the prompts as engine requests; returns request id -> number of choices.
        stream=False: the engine hands out only their final outputs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        encoded = [self._encode(p) for p in prompts]
        if sampling_params is None:
            sampling_params = self.sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(encoded)
        if len(sampling_params) != len(encoded):
            raise MlcrunError("sampling_params: give one, or one per prompt")
        if sampling_params and any(p.stop for p in sampling_params) and self.tokenizer is None:
            raise MlcrunError("stop: stop strings need a tokenizer in the artifact")
        for prompt, params in zip(encoded, sampling_params):  # all valid before any is added
            self.engine.check_request(prompt, params)
        ids = {}
        for prompt, params in zip(encoded, sampling_params):
            rid = f"llm-{next(self._ids)}"
            self.engine.add_request(rid, prompt, params, stream=stream)
            ids[rid] = params.n
        return ids

    def _drain(self, requests: dict[str, int]) -> Iterator[RequestOutput]:
        """Step the engine until every choice of `requests` has finished."""
        pending = dict(requests)  # request id -> choices not finished yet
        try:
            while pending:
                if not self.engine.has_unfinished():  # an engine bug: never wait forever
                    raise MlcrunError(f"the engine lost request(s) {', '.join(pending)}")
                for out in self.engine.step():
                    yield out
                    if out.finished and out.request_id in pending:
                        pending[out.request_id] -= 1
                        if not pending[out.request_id]:
                            del pending[out.request_id]
        finally:  # an abandoned iterator must not leave requests holding KV pages
            for rid in pending:
                self.engine.abort(rid)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise MlcrunError("prompt: this artifact has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]
