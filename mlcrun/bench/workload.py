"""What a serving benchmark sends: prompts with their output lengths and arrival times.

A workload is built from fixed or ranged lengths (random token ids, seeded) or from a dataset
file (JSONL: one prompt per line, or ShareGPT-style conversations), then given arrival times:
all at once (bounded by a concurrency limit) or a Poisson process at `request_rate`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..errors import MlcrunError

DEFAULT_OUTPUT_LEN = 128  # dataset prompts that say nothing about their output length
FIRST_TOKEN_ID = 3  # synthetic prompts avoid the special tokens usually at ids 0..2
HUMAN_ROLES = ("human", "user")
REPLY_ROLES = ("gpt", "assistant", "chatgpt")

_LEN_SPEC = re.compile(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?")
_JSON_SPACE = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. `prompt` is token ids (synthetic workloads) or text
    (datasets); `prompt_len` is its length in tokens as the benchmark's tokenizer counts it."""

    index: int
    prompt: list[int] | str
    prompt_len: int
    output_len: int
    arrival: float = 0.0  # seconds after the benchmark starts


def parse_len(spec: str | int, name: str) -> tuple[int, int]:
    """A length option: "128" -> (128, 128), "64:256" -> (64, 256), both ends inclusive."""
    match = None if isinstance(spec, bool) else _LEN_SPEC.fullmatch(str(spec))
    if match is not None:
        low = int(match[1])
        high = int(match[2]) if match[2] is not None else low
        if 0 < low <= high:
            return low, high
    raise MlcrunError(f"{name} must be a positive integer or MIN:MAX, got {str(spec)!r}")


def _draw_lens(rng: np.random.Generator, span: tuple[int, int], count: int) -> list[int]:
    return rng.integers(span[0], span[1] + 1, size=count).tolist()


def synthetic(
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """`num_prompts` prompts of random token ids in [3, vocab_size), lengths uniform in the
    given inclusive ranges; the same seed gives the same workload."""
    if num_prompts <= 0:
        raise MlcrunError(f"--num-prompts must be positive, got {num_prompts}")
    if vocab_size <= FIRST_TOKEN_ID:
        raise MlcrunError(f"synthetic prompts need a vocabulary above 3 tokens, got {vocab_size}")
    rng = np.random.default_rng(seed)
    prompt_lens = _draw_lens(rng, input_len, num_prompts)
    output_lens = _draw_lens(rng, output_len, num_prompts)
    return [
        BenchRequest(i, rng.integers(FIRST_TOKEN_ID, vocab_size, size=n).tolist(), n, out)
        for i, (n, out) in enumerate(zip(prompt_lens, output_lens))
    ]


def reseeded(
    requests: list[BenchRequest], vocab_size: int, seed: int, run: int
) -> list[BenchRequest]:
    """The workload for the `run`-th run of a sweep (0, 1, ...): run 0 is `requests` as is;
    later runs get fresh random token ids (seeded by `seed` and `run`) of the same lengths, with
    the same output lengths and arrivals, so that no prompt of an earlier run is sent again and
    a server's prefix cache cannot serve a later concurrency level from an earlier one's
    prompts. Text prompts (datasets) are kept: they cannot be redrawn."""
    if run == 0:
        return list(requests)
    rng = np.random.default_rng([seed, run])
    return [
        replace(r, prompt=rng.integers(FIRST_TOKEN_ID, vocab_size, size=r.prompt_len).tolist())
        if isinstance(r.prompt, list)
        else r
        for r in requests
    ]


def _jsonl_items(text: str, path: Path) -> Iterator[tuple[int, object]]:
    """(line number, value) of each non-empty line."""
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as e:
            raise MlcrunError(f"{path}:{number}: not valid JSON ({e.msg})") from None


def _array_items(text: str, path: Path) -> Iterator[tuple[int, object]]:
    """(line number where it starts, value) of each element of a top-level JSON array, decoded
    one at a time so that errors name their line and a prefix of a big file is enough."""
    decoder = json.JSONDecoder()
    pos = _JSON_SPACE.match(text, text.index("[") + 1).end()
    line, counted = 1, 0
    while text[pos : pos + 1] != "]":
        line, counted = line + text.count("\n", counted, pos), pos
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise MlcrunError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        yield line, value
        pos = _JSON_SPACE.match(text, pos).end()
        if text[pos : pos + 1] == ",":
            pos = _JSON_SPACE.match(text, pos + 1).end()
        elif text[pos : pos + 1] != "]":
            where = line + text.count("\n", counted, pos)
            raise MlcrunError(f"{path}:{where}: expected ',' or ']' after an array element")


def _read_items(path: Path) -> Iterator[tuple[int, object]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MlcrunError(f"dataset file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise MlcrunError(f"cannot read dataset {path}: {e}") from None
    if text.lstrip().startswith("["):
        return _array_items(text, path)
    return _jsonl_items(text, path)


def _first_exchange(turns: object, where: str) -> tuple[str, str] | None:
    """The first human turn and the first reply after it; None when there is no such pair."""
    if not isinstance(turns, list):
        raise MlcrunError(f'{where}: "conversations" must be a list')
    for i, turn in enumerate(turns):
        if not (
            isinstance(turn, dict)
            and isinstance(turn.get("from"), str)
            and isinstance(turn.get("value"), str)
        ):
            raise MlcrunError(
                f'{where}: conversations[{i}] must be an object with string "from" and "value"'
            )
    roles = [turn["from"].lower() for turn in turns]
    asked = next((i for i, role in enumerate(roles) if role in HUMAN_ROLES), len(roles))
    replied = next((i for i in range(asked + 1, len(roles)) if roles[i] in REPLY_ROLES), None)
    return None if replied is None else (turns[asked]["value"], turns[replied]["value"])


def _stated_output_len(item: dict, where: str) -> int | None:
    for key in ("output_len", "max_tokens"):
        if key in item:
            value = item[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MlcrunError(f'{where}: "{key}" must be a positive integer, got {value!r}')
            return value
    return None


def _entry(
    item: object, where: str, count_tokens: Callable[[str], int], counts_output: bool
) -> tuple[str, int | None] | None:
    """(prompt, output length or None) of one dataset entry; None to skip it. `counts_output`
    says whether a ShareGPT reply's length is needed (no --output-len override)."""
    if not isinstance(item, dict):
        raise MlcrunError(f"{where}: expected a JSON object, got {type(item).__name__}")
    if "conversations" in item:
        exchange = _first_exchange(item["conversations"], where)
        if exchange is None or not exchange[0]:
            return None
        prompt, reply = exchange
        if not counts_output:
            return prompt, None
        reply_len = count_tokens(reply)
        return (prompt, reply_len) if reply_len > 0 else None
    prompt = item.get("prompt")
    if prompt is None:
        raise MlcrunError(f'{where}: expected a "prompt" string or a ShareGPT "conversations" list')
    if not isinstance(prompt, str) or not prompt:
        raise MlcrunError(f'{where}: "prompt" must be a non-empty string')
    return prompt, _stated_output_len(item, where)


def load_dataset(
    path: str | Path,
    num_prompts: int | None,
    count_tokens: Callable[[str], int],
    output_len: tuple[int, int] | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """The first `num_prompts` usable entries (None: all) of a JSONL prompt file or a ShareGPT
    file (JSONL or one JSON array). Output lengths: `output_len` when given (drawn uniformly,
    seeded), else the entry's `output_len`/`max_tokens`, else the ShareGPT reply's token count,
    else 128. ShareGPT entries without a human turn and a reply after it are skipped, as vLLM
    does; fewer than `num_prompts` entries gives a shorter workload."""
    if num_prompts is not None and num_prompts <= 0:
        raise MlcrunError(f"--num-prompts must be positive, got {num_prompts}")
    path = Path(path)
    entries: list[tuple[str, int | None]] = []
    for line, item in _read_items(path):
        entry = _entry(item, f"{path}:{line}", count_tokens, counts_output=output_len is None)
        if entry is not None:
            entries.append(entry)
            if len(entries) == num_prompts:
                break
    if not entries:
        raise MlcrunError(f"dataset {path} has no usable prompts")
    if output_len is not None:
        drawn = _draw_lens(np.random.default_rng(seed), output_len, len(entries))
        entries = [(prompt, n) for (prompt, _), n in zip(entries, drawn)]
    return [
        BenchRequest(i, prompt, count_tokens(prompt), DEFAULT_OUTPUT_LEN if n is None else n)
        for i, (prompt, n) in enumerate(entries)
    ]


def with_arrivals(
    requests: list[BenchRequest], request_rate: float | None, seed: int = 0
) -> list[BenchRequest]:
    """Copies of `requests` with arrival times: all at 0 for no rate (None or inf), else a
    seeded Poisson process at `request_rate` per second (the first at its first gap)."""
    if request_rate is None or request_rate == math.inf:
        return [replace(r, arrival=0.0) for r in requests]
    if not request_rate > 0:  # also NaN
        raise MlcrunError(f"--request-rate must be positive, got {request_rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=len(requests))
    return [replace(r, arrival=float(t)) for r, t in zip(requests, np.cumsum(gaps))]
