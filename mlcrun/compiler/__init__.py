"""Checkpoint -> TVM library. Import the submodules you need; this package only sets up TVM."""

from .. import _tvm  # noqa: F401  (TVM without torch)
