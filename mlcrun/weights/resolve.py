"""Find a checkpoint folder: a local path, or a hub id already in the local HF cache."""

from __future__ import annotations

from pathlib import Path

from ..errors import MlcrunError


def resolve_checkpoint(model: str) -> Path:
    path = Path(model).expanduser()
    if path.exists():
        if path.is_file():
            raise MlcrunError(f"{model}: expected a checkpoint folder, got a file")
        if not (path / "config.json").exists():
            raise MlcrunError(f"{model}: no config.json in this folder")
        return path
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        raise MlcrunError(f"{model}: no such folder")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(model, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        raise MlcrunError(
            f"{model} is not in the local Hugging Face cache and mlcrun does not download; "
            f"fetch it first (e.g. `hf download {model}`) or pass a local folder"
        ) from None
    if not (folder / "config.json").exists():
        raise MlcrunError(f"{model}: the cached snapshot has no config.json")
    return folder
