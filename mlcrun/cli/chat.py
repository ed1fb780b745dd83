"""`mlcrun chat [MODEL]`: one-shot (`--prompt`), piped (a turn per stdin line), or a REPL."""

from __future__ import annotations

import sys

import typer

from ..errors import MlcrunError
from .common import (
    DRAFT_MODEL,
    DRAFT_QUANTIZATION,
    MODEL_ARGUMENT,
    NGRAM_MAX,
    REVISION,
    SPEC_DRAFT_LENGTH,
    SPEC_MODE,
    SPEC_TREE_WIDTH,
    err_console,
    handle_errors,
    resolve_model,
    setup_logging,
    speculation_options,
)

CHAT_TEMPERATURE, CHAT_TOP_P = 0.7, 0.95  # when neither a flag nor the model says


@handle_errors
def chat_command(
    model: str = MODEL_ARGUMENT,
    revision: str = REVISION,
    prompt: str = typer.Option(None, "--prompt", "-p", help="Ask once, print the answer, exit."),
    system: str = typer.Option(None, "--system", help="System message."),
    raw: bool = typer.Option(
        False,
        "--raw",
        help="Continue each prompt as plain text, without the chat template or history "
        "(for base models).",
    ),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    quantization: str = typer.Option(
        None,
        "--quantization",
        "-q",
        help="Preset when compiling (default: auto, the checkpoint's own precision).",
    ),
    temperature: float = typer.Option(
        None,
        "--temperature",
        help=f"Default: the model's generation_config.json, else {CHAT_TEMPERATURE}.",
    ),
    top_p: float = typer.Option(
        None, "--top-p", help=f"Default: the model's generation_config.json, else {CHAT_TOP_P}."
    ),
    top_k: int = typer.Option(None, "--top-k", help="Default: the model's, else 0 (off)."),
    min_p: float = typer.Option(None, "--min-p", help="Default: the model's, else 0 (off)."),
    repetition_penalty: float = typer.Option(
        None, "--repetition-penalty", help="Default: the model's, else 1 (off)."
    ),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty"),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty"),
    seed: int = typer.Option(None, "--seed"),
    max_tokens: int = typer.Option(512, "--max-tokens"),
    stop: list[str] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    context_window: int = typer.Option(
        None, "--context-window", help="Max tokens per conversation when compiling MODEL."
    ),
    json_out: bool = typer.Option(False, "--json", help="One JSON object per answer."),
    speculative_mode: str = SPEC_MODE,
    spec_draft_length: int = SPEC_DRAFT_LENGTH,
    spec_tree_width: int = SPEC_TREE_WIDTH,
    draft_model: str = DRAFT_MODEL,
    ngram_max: int = NGRAM_MAX,
    draft_quantization: str = DRAFT_QUANTIZATION,
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Chat with a model: an interactive REPL, or one answer per --prompt / stdin line."""
    setup_logging(verbose)
    if raw and system:
        raise MlcrunError("--raw continues plain text: it takes no --system message")
    from ..chat import Conversation
    from ..engine.config import EngineConfig
    from ..engine.types import SamplingParams
    from ..llm import LLM

    given = dict(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        seed=seed,
        stop=tuple(stop or ()),
    )
    given = {k: v for k, v in given.items() if v is not None}
    SamplingParams(**given)  # bad values fail before the model loads
    spec = speculation_options(
        speculative_mode,
        spec_draft_length,
        spec_tree_width,
        draft_model,
        ngram_max,
        draft_quantization,
        device,
    )
    folder = resolve_model(
        model, revision, quantization=quantization, device=device, context_window=context_window
    )
    llm = LLM(folder, engine_config=EngineConfig(mode="interactive", **spec))
    fallback = {"temperature": CHAT_TEMPERATURE, "top_p": CHAT_TOP_P}  # a chat's usual sampling
    params = SamplingParams(**{**fallback, **llm.generation_defaults, **given})
    conv = Conversation(llm, params, system=system, raw=raw)
    if prompt is not None:
        _answer(conv, prompt, json_out)
    elif not sys.stdin.isatty():
        for line in sys.stdin:
            if line.strip():
                _answer(conv, line.rstrip("\n"), json_out)
    else:
        from ..repl import run_repl

        run_repl(conv)


def _answer(conv, text: str, json_out: bool) -> None:
    if json_out:
        for _ in conv.ask(text):
            pass
        print(conv.last.as_json(), flush=True)
        return
    for piece in conv.ask(text):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    for notice in conv.notices:
        err_console.print(f"[dim]{notice}[/]")
    conv.notices.clear()
