"""Where mlcrun keeps what it derives from models: `$MLCRUN_HOME`, default ~/.cache/mlcrun."""

from __future__ import annotations

from pathlib import Path

from . import env
from .errors import MlcrunError


def mlcrun_home() -> Path:
    text = env.value(env.MLCRUN_HOME)
    if text is None:
        return Path.home() / ".cache" / "mlcrun"
    home = Path(text).expanduser()  # a quoted "~/x" is not expanded by the shell
    if home.exists() and not home.is_dir():
        raise MlcrunError(f"{env.MLCRUN_HOME}={text} is not a directory")
    return home


def drafts_dir() -> Path:
    """Self-drafts built on demand from compiled models (compiler/draft.py), by params hash."""
    return mlcrun_home() / "drafts"
