"""Loading a compiled artifact and running it (the counterpart of MLC-LLM's serve/model.h)."""

from .. import _tvm  # noqa: F401  (first: TVM without torch)
from .model import Model

__all__ = ["Model"]
