"""What every subcommand shares: error reporting, logging and rich progress."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from functools import wraps
from typing import Any

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from ..engine.config import DEFAULT_DRAFT_QUANTIZATION
from ..errors import MlcrunError

# soft_wrap: a message is one line however long its paths are (scripts grep it); the
# terminal wraps it, not rich at 80 columns when stderr is a pipe.
err_console = Console(stderr=True, soft_wrap=True)

# MODEL of chat, serve and bench: anything resolve_artifact accepts, or nothing.
MODEL_ARGUMENT = typer.Argument(
    None,
    metavar="MODEL",
    help="Artifact, HF folder, hub id, GGUF file; default: SmolLM2-135M-Instruct.",
    show_default=False,
)


def setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err_console, show_path=False)],
        force=True,
    )


def _first_line(err: BaseException) -> str:
    lines = str(err).strip().splitlines()
    return escape(lines[0] if lines else "")


def handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn library errors into one line on stderr and a non-zero exit, never a traceback."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except MlcrunError as err:
            err_console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False,
                              soft_wrap=True)  # fmt: skip
            raise typer.Exit(1) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None
        except (typer.Exit, typer.Abort, SystemExit):
            raise
        except Exception as err:  # a bug: still one line, with how to see more
            if logging.getLogger().isEnabledFor(logging.INFO):
                raise
            err_console.print(
                f"[bold red]internal error:[/] {type(err).__name__}: {_first_line(err)} "
                "(rerun with --verbose for the traceback)",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(2) from None

    return wrapper


class RichProgress:
    """compiler.progress.Progress drawn with rich, on stderr so stdout stays clean."""

    def __init__(self) -> None:
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err_console,
            transient=False,
            disable=not sys.stderr.isatty(),
        )
        self._task = None

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def phase(self, name: str, total: int | None = None) -> None:
        self._task = self._progress.add_task(name, total=total)
        logging.getLogger("mlcrun").info(name)

    def advance(self, steps: int = 1) -> None:
        if self._task is not None:
            self._progress.advance(self._task, steps)

    def done(self) -> None:
        if self._task is not None:
            task = self._progress.tasks[self._task]
            self._progress.update(self._task, total=task.total or 1, completed=task.total or 1)
            self._task = None


REVISION = typer.Option(
    None,
    "--revision",
    help="Branch, tag or commit of a MODEL downloaded from the Hugging Face Hub.",
)


def local_model(model: str, revision: str | None = None) -> str:
    """MODEL as a local path: a hub id (owner/name, or owner/name/file.gguf) that is not a
    local path is downloaded (unless cached) at `revision`."""
    from pathlib import Path

    from ..weights.hub import fetch, hub_reference

    if Path(model).expanduser().exists():
        if revision is not None:
            raise MlcrunError(f"--revision applies to a hub id, and {model} is a local path")
        return model
    if hub_reference(model) is None:
        if revision is not None:
            raise MlcrunError(f"--revision applies to a hub id (owner/name), not {model!r}")
        return model  # let the caller say what is wrong with it
    return str(fetch(model, revision))


def resolve_model(model: str | None, revision: str | None = None, **compile_options: Any):
    """The artifact folder for MODEL (default model when None; a hub id is downloaded first),
    compiling it into $MLCRUN_HOME with a progress bar when needed
    (default_model.resolve_artifact)."""
    from .. import env
    from ..default_model import resolve_artifact

    env.tvm_num_threads()  # read when the model loads: a bad value fails now, not after a compile
    if model is not None:
        model = local_model(model, revision)

    with RichProgress() as progress:
        return resolve_artifact(model, progress=progress, **compile_options)


# Speculative decoding, the same options on chat, serve and bench.
SPEC_MODE = typer.Option(
    "none",
    "--speculative-mode",
    help="Speculative decoding: none; ngram (prompt lookup, no extra model); draft (a smaller "
    "model, --draft-model); self (a low-bit copy of MODEL's own weights, for F32/F16/Q8 models).",
)
SPEC_DRAFT_LENGTH = typer.Option(
    0, "--spec-draft-length", help="Tokens drafted per step (0: adaptive, measured per machine)."
)
SPEC_TREE_WIDTH = typer.Option(
    1, "--spec-tree-width", help="W > 1: also verify the top-W alternatives of the first draft."
)
DRAFT_MODEL = typer.Option(
    None,
    "--draft-model",
    help="Draft model for --speculative-mode draft (artifact, HF folder, hub id or GGUF; it "
    "must share MODEL's tokenizer); compiled and cached like MODEL.",
)
NGRAM_MAX = typer.Option(4, "--ngram-max", help="Prompt lookup matches the last N..1 tokens.")
DRAFT_QUANTIZATION = typer.Option(
    DEFAULT_DRAFT_QUANTIZATION,
    "--draft-quantization",
    help="Preset of the self-draft (--speculative-mode self).",
)


def speculation_options(
    mode: str,
    draft_length: int,
    tree_width: int,
    draft_model: str | None,
    ngram_max: int,
    draft_quantization: str,
    device: str,
) -> dict[str, Any]:
    """EngineConfig fields for the speculative-decoding options; the draft model is resolved
    (and compiled if needed) like MODEL."""
    from ..engine.config import EngineConfig

    if mode == "draft" and not draft_model:
        raise MlcrunError("--speculative-mode draft needs --draft-model")
    if draft_model and mode != "draft":
        raise MlcrunError("--draft-model is only used with --speculative-mode draft")
    fields = dict(
        speculative_mode=mode,
        spec_draft_length=draft_length,
        spec_tree_width=tree_width,
        draft_model=draft_model,
        ngram_max=ngram_max,
        draft_quantization=draft_quantization,
    )
    try:
        EngineConfig(**fields)  # bad values fail now, before anything is compiled
    except MlcrunError as err:  # name the flags, not the fields
        message = str(err)
        for name in ("speculative_mode", "spec_draft_length", "spec_tree_width", "ngram_max"):
            message = message.replace(name, "--" + name.replace("_", "-"))
        raise MlcrunError(message) from None
    if draft_model:
        fields["draft_model"] = str(resolve_model(draft_model, device=device))
    return fields
