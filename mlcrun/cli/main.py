"""The `mlcrun` entry point."""

from __future__ import annotations

import typer

from .. import __version__
from .bench import bench_command
from .chat import chat_command
from .compile import compile_command
from .serve import serve_command

app = typer.Typer(
    name="mlcrun",
    help="Compile Hugging Face LLM checkpoints into TVM libraries and run them fast.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("compile")(compile_command)
app.command("chat")(chat_command)
app.command("serve")(serve_command)
app.command("bench")(bench_command)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mlcrun {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    pass


def main() -> None:
    app()
