"""Loading a compiled artifact and running it (the counterpart of MLC-LLM's serve/model.h).

Only TVM's runtime is loaded (ffi.py: tvm_ffi and libtvm_runtime.so, without torch), never
its compiler."""

from . import ffi  # noqa: F401  (first: the TVM runtime)
from .model import Model

__all__ = ["Model"]
