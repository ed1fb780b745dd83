"""The synchronous public API: `LLM(artifact).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .engine.generate import generate
from .engine.types import RequestOutput, SamplingParams
from .errors import MlcrunError
from .runtime import Model
from .tokenizer import Tokenizer

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | Path, *, num_threads: int | None = None):
        self.model = Model(model, num_threads=num_threads)
        art = self.model.artifact
        self.tokenizer = (
            Tokenizer.from_dir(self.model.folder)
            if "tokenizer.json" in art.tokenizer_files
            else None
        )
        eos = set(self.model.config.eos_token_ids)
        if self.tokenizer is not None:
            eos |= set(self.tokenizer.eos_token_ids)
        self.eos_token_ids = tuple(sorted(eos))

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids), all batched together."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        prompts = [self._encode(p) for p in prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise MlcrunError("give one SamplingParams, or one per prompt")
        art = self.model.artifact
        outputs = generate(
            self.model,
            prompts,
            sampling_params,
            eos_token_ids=self.eos_token_ids,
            max_batch=art.max_batch,
            prefill_chunk=art.prefill_chunk,
            context_window=art.context_window,
        )
        if self.tokenizer is not None:
            for out in outputs:
                out.text = self.tokenizer.decode(out.token_ids)
        return outputs

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise MlcrunError("this artifact has no tokenizer; pass token ids instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise MlcrunError("empty prompt")
        window = self.model.artifact.context_window
        if len(ids) >= window:
            raise MlcrunError(
                f"prompt of {len(ids)} tokens does not fit the context window ({window})"
            )
        return ids
