"""The interactive chat REPL (rich): streaming answers, line editing, slash commands."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
from pathlib import Path

from rich.console import Console

from .chat import Conversation
from .engine.types import SamplingParams
from .errors import MlcrunError

HELP = """commands:
  /help                 this help
  /reset                forget the conversation
  /stats                speed of the last answer
  /set k=v;k=v          change sampling, e.g. /set temperature=0.7;top_p=0.9;max_tokens=256;
                        seed=1;stop=a,b
  /system TEXT          set the system message (clears the conversation)
  /save FILE            save the conversation as JSON
  /exit                 leave (or Ctrl-D); Ctrl-C stops an answer
multi-line input: end a line with \\ to continue it, or wrap a block in \"\"\" lines"""

_SETTABLE = {f.name: f.type for f in dataclasses.fields(SamplingParams)}


def _history_file() -> Path:
    from .paths import mlcrun_home

    return mlcrun_home() / "chat_history"


def _enable_line_editing() -> None:
    try:
        import readline  # noqa: F401  (input() gains editing and history)
    except ImportError:
        return
    path = _history_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            readline.read_history_file(path)
        import atexit

        readline.set_history_length(1000)
        atexit.register(readline.write_history_file, path)
    except OSError:
        pass


def run_repl(conv: Conversation) -> None:
    console = Console()
    _enable_line_editing()
    console.print("[bold]mlcrun chat[/] — /help for commands, Ctrl-D to leave")
    while True:
        try:
            text = _read(console)
        except EOFError:
            console.print()
            return
        except KeyboardInterrupt:
            console.print()
            continue
        if not text.strip():
            continue
        try:
            if text.startswith("/"):
                try:
                    if _command(console, conv, text.strip()):
                        return
                except MlcrunError as err:
                    console.print(f"[red]{err}[/]")
            else:
                _answer(console, conv, text)
        except KeyboardInterrupt:  # Ctrl-C outside an answer (just as one ends, say)
            console.print()


class _CtrlC:
    """While an answer streams, Ctrl-C asks it to stop at its next piece of text, rather than
    raising KeyboardInterrupt wherever the main thread happens to be (inside an engine step,
    say, leaving the engine half-updated). A second Ctrl-C interrupts at once."""

    def __init__(self) -> None:
        self.pressed = False
        self._installed = False
        self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
            self._installed = True
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)


def _answer(console: Console, conv: Conversation, text: str) -> None:
    answer = conv.ask(text)
    stopped = False
    with _CtrlC() as ctrl_c:
        try:
            for piece in answer:
                console.print(piece, end="", markup=False, highlight=False, soft_wrap=True)
                if ctrl_c.pressed:
                    stopped = True
                    break
        except KeyboardInterrupt:
            stopped = True
        except MlcrunError as err:
            console.print(f"[red]{err}[/]")
        finally:
            answer.close()  # aborts the request if it is still running
    if stopped:
        console.print("\n[dim](stopped)[/]")
    console.print()
    for notice in conv.notices:
        console.print(f"[dim]{notice}[/]")
    conv.notices.clear()


def _read(console: Console) -> str:
    first = console.input("[bold green]> [/]")
    if first.strip() == '"""':
        lines = []
        while (line := console.input("[bold green]. [/]")).strip() != '"""':
            lines.append(line)
        return "\n".join(lines)
    lines = [first]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(console.input("[bold green]. [/]"))
    return "\n".join(lines)


def parse_settings(arg: str, params: SamplingParams) -> SamplingParams:
    """`temperature=0.7;top_p=0.9;stop=a,b` -> new SamplingParams (validated)."""
    changes: dict[str, object] = {}
    for item in filter(None, (p.strip() for p in arg.split(";"))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in _SETTABLE:
            raise MlcrunError(
                f"/set: unknown setting {key!r}; settable: "
                "temperature, top_p, top_k, min_p, max_tokens, seed, stop, "
                "repetition_penalty, frequency_penalty, presence_penalty"
            )
        value = value.strip()
        if key == "stop":
            changes[key] = tuple(s for s in value.split(",") if s)
        elif key == "seed":
            changes[key] = None if value in ("", "none", "None") else int(value)
        elif key in ("max_tokens", "top_k", "n", "min_tokens", "logprobs"):
            changes[key] = int(value)
        else:
            try:
                changes[key] = float(value)
            except ValueError:
                raise MlcrunError(f"/set: {key} needs a number, got {value!r}") from None
    return dataclasses.replace(params, **changes)


def _command(console: Console, conv: Conversation, line: str) -> bool:
    name, _, arg = line.partition(" ")
    if name in ("/exit", "/quit"):
        return True
    if name == "/help":
        console.print(HELP, markup=False, highlight=False)
    elif name == "/reset":
        conv.reset()
        console.print("[dim]conversation cleared[/]")
    elif name == "/set":
        conv.params = parse_settings(arg, conv.params)
        shown = {
            k: getattr(conv.params, k)
            for k in ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop")
        }
        console.print(f"[dim]{shown}[/]", highlight=False)
    elif name == "/stats":
        t = conv.last
        if t is None:
            console.print("[dim]no answer yet[/]")
        else:
            console.print(
                f"prompt {t.prompt_tokens} tokens ({t.cached_tokens} cached), "
                f"prefill {t.prefill_tokens_per_s or 0:.1f} tok/s, "
                f"answer {t.completion_tokens} tokens at {t.decode_tokens_per_s or 0:.1f} tok/s, "
                f"first token after {t.ttft or 0:.3f}s"
                + (
                    f", drafts {t.accepted_tokens}/{t.draft_tokens} accepted "
                    f"({t.acceptance_rate:.0%}), {t.mean_accepted_length:.2f} tokens per step"
                    if t.draft_tokens
                    else ""
                ),
                highlight=False,
            )
    elif name == "/system":
        conv.system = arg or None
        conv.reset()
        console.print("[dim]system message set; conversation cleared[/]")
    elif name == "/save":
        if not arg:
            console.print("[red]usage: /save FILE[/]")
        else:
            conv.save(os.path.expanduser(arg))
            console.print(f"[dim]saved to {arg}[/]")
    else:
        console.print(f"[red]unknown command {name}[/] (/help lists them)")
    return False
