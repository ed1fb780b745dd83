"""Find a checkpoint folder: a local path, or a hub id (downloaded unless cached)."""

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
    from .hub import fetch, hub_reference

    if hub_reference(model) is None:
        raise MlcrunError(f"{model}: no such folder")
    return fetch(model)  # a snapshot folder with config.json, downloaded unless cached
