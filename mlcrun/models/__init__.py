"""Architecture families: config parsing, the relax module, and the weight map."""

from .. import _tvm  # noqa: F401  (TVM without torch)
