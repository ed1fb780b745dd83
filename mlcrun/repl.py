"""The interactive chat REPL (rich): streaming answers and a few slash commands."""

from __future__ import annotations

from rich.console import Console

from .chat import Conversation

HELP = """commands:
  /help           this help
  /reset          forget the conversation
  /stats          speed of the last answer
  /system TEXT    set the system message (resets the conversation)
  /save FILE      save the conversation as JSON
  /exit           leave (or Ctrl-D); Ctrl-C stops an answer
end a line with \\ to continue on the next line"""


def run_repl(conv: Conversation) -> None:
    console = Console()
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
        if text.startswith("/"):
            if _command(console, conv, text.strip()):
                return
            continue
        try:
            for piece in conv.ask(text):
                console.print(piece, end="", markup=False, highlight=False, soft_wrap=True)
        except KeyboardInterrupt:
            console.print("\n[dim](stopped)[/]")
            continue
        console.print()
        for notice in conv.notices:
            console.print(f"[dim]{notice}[/]")
        conv.notices.clear()


def _read(console: Console) -> str:
    lines = [console.input("[bold green]> [/]")]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(console.input("[bold green]. [/]"))
    return "\n".join(lines)


def _command(console: Console, conv: Conversation, line: str) -> bool:
    name, _, arg = line.partition(" ")
    if name in ("/exit", "/quit"):
        return True
    if name == "/help":
        console.print(HELP, markup=False)
    elif name == "/reset":
        conv.reset()
        console.print("[dim]conversation cleared[/]")
    elif name == "/stats":
        t = conv.last
        if t is None:
            console.print("[dim]no answer yet[/]")
        else:
            console.print(
                f"prompt {t.prompt_tokens} tokens ({t.cached_tokens} cached), "
                f"prefill {t.prefill_tokens_per_s or 0:.1f} tok/s, "
                f"answer {t.completion_tokens} tokens at {t.decode_tokens_per_s or 0:.1f} tok/s, "
                f"first token after {t.ttft or 0:.2f}s"
            )
    elif name == "/system":
        conv.system = arg or None
        conv.reset()
        console.print("[dim]system message set; conversation cleared[/]")
    elif name == "/save":
        if not arg:
            console.print("[red]usage: /save FILE[/]")
        else:
            conv.save(arg)
            console.print(f"[dim]saved to {arg}[/]")
    else:
        console.print(f"[red]unknown command {name}[/] (/help lists them)")
    return False
