"""Where mlcrun keeps what it derives from models: `$MLCRUN_HOME`, default ~/.cache/mlcrun."""

from __future__ import annotations

import os
from pathlib import Path


def mlcrun_home() -> Path:
    return Path(os.environ.get("MLCRUN_HOME") or Path.home() / ".cache" / "mlcrun")
