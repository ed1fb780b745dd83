"""The compiled-model folder: schema, version, read/write and validation.

DIR/mlcrun-config.json   everything the runtime needs to know (this module's Artifact)
DIR/params/*.safetensors converted weights, named by our param names
DIR/lib/<target>.so      the TVM library (it carries its own metadata, see abi.METADATA)
DIR/tokenizer files
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import MlcrunError

FORMAT_VERSION = 1
CONFIG_FILE = "mlcrun-config.json"
PARAMS_DIR = "params"
LIB_DIR = "lib"


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Artifact:
    model: dict[str, Any]  # ModelConfig.to_dict()
    quantization: str
    device: str
    target: str
    library: str  # relative path of the .so
    context_window: int
    prefill_chunk: int
    max_batch: int
    page_size: int
    param_files: tuple[str, ...]
    params: tuple[TensorInfo, ...]
    params_sha256: str
    abi_version: int
    mlcrun_version: str
    source_fingerprint: str
    tokenizer_files: tuple[str, ...] = ()
    chat_template: str | None = None
    generation: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        data = asdict(self)
        data["params"] = [asdict(p) for p in self.params]
        return json.dumps(data, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Artifact:
        data = json.loads(text)
        data["params"] = tuple(
            TensorInfo(p["name"], tuple(p["shape"]), p["dtype"]) for p in data["params"]
        )
        data["param_files"] = tuple(data["param_files"])
        data["tokenizer_files"] = tuple(data.get("tokenizer_files", ()))
        return cls(**data)

    def library_metadata(self) -> dict[str, Any]:
        """What the .so embeds about itself; checked against this file at load."""
        return {
            "abi_version": self.abi_version,
            "arch": self.model["arch"],
            "quantization": self.quantization,
            "target": self.target,
            "context_window": self.context_window,
            "prefill_chunk": self.prefill_chunk,
            "page_size": self.page_size,
            "params": [[p.name, list(p.shape), p.dtype] for p in self.params],
        }


def read(folder: Path) -> Artifact:
    """Read and validate the config of an artifact folder (not the params hash: see verify)."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.exists():
        raise MlcrunError(f"{folder} is not an mlcrun artifact (no {CONFIG_FILE})")
    try:
        version = json.loads(path.read_text()).get("format_version")
    except ValueError as err:
        raise MlcrunError(f"{path}: not valid JSON ({err})") from None
    if version != FORMAT_VERSION:
        raise MlcrunError(
            f"{folder}: artifact format {version} is not supported by this mlcrun "
            f"(needs {FORMAT_VERSION}); recompile it with `mlcrun compile --force`"
        )
    try:
        art = Artifact.from_json(path.read_text())
    except (TypeError, KeyError) as err:
        raise MlcrunError(f"{path}: malformed artifact config ({err})") from None
    if not (folder / art.library).exists():
        raise MlcrunError(f"{folder}: library {art.library} is missing")
    return art


def hash_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with file.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def verify_params(folder: Path, art: Artifact) -> None:
    files = [Path(folder) / PARAMS_DIR / name for name in art.param_files]
    for file in files:
        if not file.exists():
            raise MlcrunError(f"{folder}: params file {file.name} is missing")
    if hash_files(files) != art.params_sha256:
        raise MlcrunError(
            f"{folder}: params were modified after compile (hash mismatch); recompile the model"
        )
