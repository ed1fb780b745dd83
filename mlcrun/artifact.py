"""The compiled-model folder: schema, version, read/write and validation.

DIR/mlcrun-config.json   everything the runtime needs to know (this module's Artifact)
DIR/params/*.safetensors converted weights, named by our param names
DIR/lib/<target>.so      the TVM library (it carries its own metadata, see abi.METADATA)
DIR/tokenizer files      TOKENIZER_FILES, those the checkpoint has
DIR/draft-<q>/           optional: a self-draft, itself a complete artifact (compiler/draft.py)

The library is native code that loading runs, so the config may only name files inside the
folder (checked by `read`) and the library's bytes must hash to `library_sha256` (checked by
`verify_library` before it is loaded).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import MlcrunError

# 2: library_sha256. Older artifacts get read's "recompile" message rather than loading a
# library nothing vouches for.
FORMAT_VERSION = 2
CONFIG_FILE = "mlcrun-config.json"
PARAMS_DIR = "params"
LIB_DIR = "lib"

# What a compile copies from the checkpoint, when present, so that `Tokenizer.from_dir` works
# on the artifact.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
)


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
    library_sha256: str  # sha256 of the .so's bytes, as `sha256sum` prints it
    abi_version: int
    mlcrun_version: str
    source_fingerprint: str
    tokenizer_files: tuple[str, ...] = ()
    chat_template: str | None = None
    generation: dict[str, Any] = field(default_factory=dict)
    # A self-draft (compiler/draft.py): the params_sha256 of the artifact its weights came from.
    draft_of: str | None = None
    format_version: int = FORMAT_VERSION
    # `mlcrun compile --activations`, resolved: "int8" (q4/q8 matmuls on int8 activations, their
    # params in the int8 kernels' layout), "bf16" (q0bf16 matmuls on bf16 activations, weights
    # in panels) or "exact" (float32 activations; older artifacts).
    activations: str = "exact"
    # `mlcrun compile --kv-dtype`: the paged KV cache's dtype ("float32" for older artifacts).
    kv_dtype: str = "float32"

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
        """What the .so embeds about itself; checked at load. `activations` and `kv_dtype` are
        named only when not "exact" / "float32", so libraries compiled before the options
        existed still match."""
        extra = {} if self.activations == "exact" else {"activations": self.activations}
        if self.kv_dtype != "float32":
            extra["kv_dtype"] = self.kv_dtype
        return {
            **extra,
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
    """Read and validate the config of an artifact folder (not the hashes: see verify_*)."""
    folder = Path(folder)
    path = folder / CONFIG_FILE
    if not path.exists():
        raise MlcrunError(f"{folder} is not an mlcrun artifact (no {CONFIG_FILE})")
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise MlcrunError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise MlcrunError(f"{path}: malformed artifact config (not a JSON object)")
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise MlcrunError(
            f"{folder}: artifact format {version} is not supported by this mlcrun "
            f"(needs {FORMAT_VERSION}); recompile it with `mlcrun compile --force`"
        )
    try:
        art = Artifact.from_json(path.read_text())
    except (TypeError, KeyError) as err:
        raise MlcrunError(f"{path}: malformed artifact config ({err})") from None
    _check_inside(folder, folder, art.library, "library")
    for name in art.param_files:
        _check_inside(folder, folder / PARAMS_DIR, name, "param_files")
    for name in art.tokenizer_files:
        _check_inside(folder, folder, name, "tokenizer_files")
    if not (folder / art.library).is_file():
        raise MlcrunError(f"{folder}: library {art.library} is missing")
    return art


def _check_inside(folder: Path, base: Path, entry: Any, key: str) -> None:
    """Refuse a config entry naming a file outside the artifact folder: the config must not
    be able to make us load (and, for the library, run) anything but what was compiled."""
    where = f"{folder}: {CONFIG_FILE} entry {key} {entry!r}"
    if not isinstance(entry, str) or not entry:
        raise MlcrunError(f"{where} is not a file name")
    rel = Path(entry)
    # Checked on the text first: `..` is refused even where it would land back inside.
    if rel.is_absolute() or ".." in rel.parts:
        raise MlcrunError(f"{where} points outside the artifact folder")
    resolved = (base / rel).resolve()
    if folder.resolve() not in resolved.parents:  # a symlink leading out, or the folder itself
        raise MlcrunError(f"{where} resolves outside the artifact folder (to {resolved})")


def verify_library(folder: Path, art: Artifact) -> Path:
    """The library's path, once its bytes are those compiled; call before loading it."""
    path = Path(folder) / art.library
    try:
        digest = hash_file(path)
    except OSError as err:
        raise MlcrunError(f"{path}: cannot read the library ({err.strerror})") from None
    if digest != art.library_sha256:
        raise MlcrunError(
            f"{path}: the library's sha256 does not match library_sha256 in {CONFIG_FILE} "
            "(modified after compile); recompile the model"
        )
    return path


def hash_file(path: Path) -> str:
    """sha256 of one file's bytes (what `sha256sum` prints)."""
    digest = hashlib.sha256()
    _feed(digest, Path(path))
    return digest.hexdigest()


def hash_files(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        _feed(digest, file)
    return digest.hexdigest()


def _feed(digest: Any, path: Path) -> None:
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):  # in chunks: libraries and params can be GBs
            digest.update(chunk)


def verify_params(folder: Path, art: Artifact) -> None:
    files = [Path(folder) / PARAMS_DIR / name for name in art.param_files]
    for file in files:
        if not file.exists():
            raise MlcrunError(f"{folder}: params file {file.name} is missing")
    if hash_files(files) != art.params_sha256:
        raise MlcrunError(
            f"{folder}: params were modified after compile (hash mismatch); recompile the model"
        )


def read_chat_template(folder: str | Path) -> str | None:
    """The chat template a checkpoint or artifact folder defines: chat_template.jinja, then
    tokenizer_config.json's, then chat_template.json's ("default" of a named list). The
    compile records it in the artifact, and the runtime uses that record."""
    folder = Path(folder)
    config_file = folder / "tokenizer_config.json"
    try:
        config = (
            json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        )
    except (OSError, ValueError) as exc:
        raise MlcrunError(f"cannot read {config_file}: {exc}") from exc
    return chat_template_in(folder, config if isinstance(config, dict) else {})


def chat_template_in(folder: Path, config: dict[str, Any]) -> str | None:
    """read_chat_template with tokenizer_config.json already read (`config`)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        path = folder / "chat_template.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, ValueError) as exc:
            raise MlcrunError(f"cannot read {path}: {exc}") from exc
        template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
