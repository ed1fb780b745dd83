"""A batched generation loop: prefill every prompt, then decode the batch until all stop.

The continuous-batching scheduler (issue: engine) replaces this; the contract stays the same:
each request gets exactly what it would get alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from .sampler import make_rng, sample, top_logprobs
from .types import ModelRunner, RequestOutput, SamplingParams


def generate(
    model: ModelRunner,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    *,
    eos_token_ids: Sequence[int],
    max_batch: int,
    prefill_chunk: int,
    context_window: int,
) -> list[RequestOutput]:
    outputs = [RequestOutput(prompt_token_ids=list(p)) for p in prompts]
    for start in range(0, len(prompts), max_batch):
        group = range(start, min(start + max_batch, len(prompts)))
        _run_group(
            model,
            [prompts[i] for i in group],
            [params[i] for i in group],
            [outputs[i] for i in group],
            eos_token_ids,
            prefill_chunk,
            context_window,
        )
    return outputs


def _run_group(model, prompts, params, outputs, eos_token_ids, prefill_chunk, context_window):
    seq_ids = list(range(len(prompts)))
    rngs = [make_rng(p) for p in params]
    for seq_id in seq_ids:
        model.add_new_sequence(seq_id)
    try:
        last_logits = _prefill(model, seq_ids, prompts, prefill_chunk)
        active = list(seq_ids)
        while active:
            next_tokens = []
            for seq_id in list(active):
                out, p = outputs[seq_id], params[seq_id]
                token = sample(last_logits[seq_id], p, rngs[seq_id])
                out.token_ids.append(token)
                if p.logprobs is not None:
                    out.logprobs = out.logprobs or []
                    out.logprobs.append(top_logprobs(last_logits[seq_id], token, p.logprobs))
                reason = _finish_reason(out, p, token, eos_token_ids, context_window)
                if reason:
                    out.finish_reason = reason
                    active.remove(seq_id)
                else:
                    next_tokens.append(token)
            if active:
                logits = model.batch_decode(model.token_embed(next_tokens), active)
                last_logits = dict(zip(active, logits))
    finally:
        for seq_id in seq_ids:
            model.remove_sequence(seq_id)


def _prefill(model, seq_ids, prompts, prefill_chunk) -> dict[int, object]:
    """Chunked ragged prefill of all prompts; returns the last logits of each sequence."""
    last = {}
    pending = {s: list(p) for s, p in zip(seq_ids, prompts)}
    while pending:
        batch, lengths, tokens, budget = [], [], [], prefill_chunk
        for seq_id, rest in pending.items():
            if budget == 0:
                break
            take = min(len(rest), budget)
            batch.append(seq_id)
            lengths.append(take)
            tokens += rest[:take]
            budget -= take
        logits = model.batch_prefill(model.token_embed(tokens), batch, lengths)
        for row, (seq_id, n) in enumerate(zip(batch, lengths)):
            pending[seq_id] = pending[seq_id][n:]
            if not pending[seq_id]:
                last[seq_id] = logits[row]
                del pending[seq_id]
    return last


def _finish_reason(out, p, token, eos_token_ids, context_window) -> str | None:
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        return "stop"
    if len(out.token_ids) >= p.max_tokens:
        return "length"
    if len(out.prompt_token_ids) + len(out.token_ids) >= context_window:
        return "length"
    return None
