"""Import TVM without torch.

tvm_ffi imports torch whenever it is installed (for DLPack interop that mlcrun never uses):
about a second of start-up and 200 MB of resident memory in every process that loads a
model. The packages that compile (compiler, models, quant.modules) import this module first;
torch stays importable afterwards, and a process that already imported it keeps it.

Running a compiled model needs none of this: runtime/ffi.py loads only tvm_ffi and
libtvm_runtime.so (torch blocked the same way), never the `tvm` package and its compiler.
"""

from __future__ import annotations

import sys

if "tvm" not in sys.modules:
    _blocked = "torch" not in sys.modules
    if _blocked:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` fails
    try:
        import tvm  # noqa: F401
    finally:
        if _blocked and sys.modules.get("torch", False) is None:
            del sys.modules["torch"]
