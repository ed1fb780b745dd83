"""mlcrun: compile Hugging Face LLM checkpoints into TVM libraries and run them fast.

from mlcrun import LLM, SamplingParams
llm = LLM("artifact-folder")
llm.generate(["Once upon a time"], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncEngine", "EngineConfig", "SamplingParams", "MlcrunError", "__version__"]

if TYPE_CHECKING:
    from .engine.async_engine import AsyncEngine
    from .engine.config import EngineConfig
    from .engine.types import SamplingParams
    from .errors import MlcrunError
    from .llm import LLM


def __getattr__(name: str):
    # Lazy, so that `import mlcrun` (and the CLI's --help) does not load TVM.
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .engine.types import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from .engine.config import EngineConfig

        return EngineConfig
    if name == "AsyncEngine":
        from .engine.async_engine import AsyncEngine

        return AsyncEngine
    if name == "MlcrunError":
        from .errors import MlcrunError

        return MlcrunError
    raise AttributeError(name)
