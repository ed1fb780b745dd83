"""The environment variables mlcrun reads, parsed in one place.

Set but empty (or blank) means unset, as in most shells' `VAR= cmd`; a value that cannot mean
anything is a one-line MlcrunError naming the variable, before any work is done.
"""

from __future__ import annotations

import os

from .errors import MlcrunError

TVM_NUM_THREADS = "TVM_NUM_THREADS"
MLCRUN_HOME = "MLCRUN_HOME"
MLCRUN_AMX = "MLCRUN_AMX"  # 0: compile without AMX kernels where the CPU has AMX


def value(name: str) -> str | None:
    """The variable's value, or None when it is unset or blank."""
    text = os.environ.get(name, "").strip()
    return text or None


def tvm_num_threads() -> int | None:
    """TVM_NUM_THREADS as a positive int, or None when unset."""
    text = value(TVM_NUM_THREADS)
    if text is None:
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n <= 0:
        raise MlcrunError(
            f"{TVM_NUM_THREADS} must be a positive number of CPU threads, got {text!r} "
            "(unset it to use every available core)"
        )
    return n


def amx_allowed() -> bool:
    """MLCRUN_AMX: 1 (the default) lets a compile use AMX where the CPU and the OS allow it,
    0 keeps AMX out of the library (e.g. for a machine that refuses the tile state)."""
    text = value(MLCRUN_AMX)
    if text is None or text == "1":
        return True
    if text == "0":
        return False
    raise MlcrunError(f"{MLCRUN_AMX} must be 0 or 1, got {text!r}")
