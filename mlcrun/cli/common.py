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
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from ..errors import MlcrunError

err_console = Console(stderr=True)

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


def handle_errors(func: Callable[..., Any]) -> Callable[..., Any]:
    """Turn library errors into one line on stderr and a non-zero exit, never a traceback."""

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except MlcrunError as err:
            err_console.print(f"[bold red]error:[/] {err}", highlight=False, soft_wrap=True)
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
                f"[bold red]internal error:[/] {type(err).__name__}: {err} "
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


def resolve_model(model: str | None, **compile_options: Any):
    """The artifact folder for MODEL (default model when None), compiling it into
    $MLCRUN_HOME with a progress bar when needed (default_model.resolve_artifact)."""
    from .. import env
    from ..default_model import resolve_artifact

    env.tvm_num_threads()  # read when the model loads: a bad value fails now, not after a compile

    with RichProgress() as progress:
        return resolve_artifact(model, progress=progress, **compile_options)
