"""A compile source: a folder with config.json and tokenizer files, plus its tensors.

Hugging Face folders (and hub ids, downloaded unless cached: weights/hub.py) are used as they
are. A GGUF file is
turned once into such a folder (config.json and tokenizer files from its metadata) under
`$MLCRUN_HOME/gguf/`, and its tensors are read from the GGUF itself.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import MlcrunError
from ..paths import mlcrun_home
from .mapping import TensorSource
from .resolve import resolve_checkpoint


@dataclass(frozen=True)
class Checkpoint:
    folder: Path  # config.json, tokenizer files
    open_source: Callable[[], TensorSource]
    fingerprint_files: tuple[Path, ...]  # what a compile's result depends on


def open_checkpoint(model: str) -> Checkpoint:
    path = Path(model).expanduser()
    if not path.exists() and model.lower().endswith(".gguf"):
        from .hub import fetch, hub_reference

        if hub_reference(model) is not None:  # owner/name/file.gguf: one file of a hub repo
            path = fetch(model)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return Checkpoint(_materialized(path), lambda: _gguf_source(path), (path,))
    if path.is_file():
        raise MlcrunError(f"{model}: expected a checkpoint folder or a .gguf file")
    folder = resolve_checkpoint(model)
    from .safetensors_source import SafetensorsSource

    files = tuple(sorted(f for f in folder.iterdir() if f.is_file()))
    return Checkpoint(folder, lambda: SafetensorsSource(folder), files)


def _gguf_source(path: Path) -> TensorSource:
    from .gguf_source import GGUFSource  # imported when a compile reads the tensors

    return GGUFSource(path)


def _materialized(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    folder = mlcrun_home() / "gguf" / f"{gguf.stem[:48]}-{key.hexdigest()[:12]}"
    if (folder / "config.json").exists():
        return folder
    from .gguf_source import materialize_gguf  # (the gguf package: 0.1 s to import)

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        materialize_gguf(gguf, tmp)
        tmp.rename(folder)
    except FileExistsError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
