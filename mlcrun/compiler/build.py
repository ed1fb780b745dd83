"""`mlcrun compile`: checkpoint folder -> artifact folder, written atomically."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import tvm

from .. import __version__, abi, artifact
from ..artifact import read_chat_template
from ..errors import MlcrunError
from ..models import registry
from ..models.config import ModelConfig
from ..weights.checkpoint import open_checkpoint
from .export import attach_metadata, export_model
from .options import DEFAULT_CONTEXT_CAP, CompileOptions, resolve_activations
from .params import float_param_names, resolve_quantization, write_params
from .progress import NullProgress, Progress
from .target import resolve_target

log = logging.getLogger(__name__)

_GENERATION_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_new_tokens",
)


def compile_model(
    model: str,
    out: Path,
    options: CompileOptions = CompileOptions(),
    *,
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Compile `model` (a folder or cached hub id) into the artifact folder `out`."""
    progress = progress or NullProgress()
    out = Path(out)
    checkpoint = open_checkpoint(model)
    folder = checkpoint.folder
    hf_config = _read_json(folder / "config.json")
    cfg = registry.model_config(hf_config)
    wmap = registry.lookup(hf_config).weight_map(cfg)
    fingerprint = _fingerprint(checkpoint.fingerprint_files, options)
    if out.exists():
        if _up_to_date(out, fingerprint) and not force:
            log.info("%s is up to date", out)
            return out
        if not force:
            raise MlcrunError(f"{out} already exists; pass --force to overwrite it")
    context_window = _context_window(cfg, options)
    target = resolve_target(options.device)
    source = checkpoint.open_source()
    quantization = resolve_quantization(options.quantization, source)
    activations = resolve_activations(options.activations, target, quantization)
    progress.phase("Exporting model")
    mod, params = export_model(cfg, target, quantization, activations, options.kv_dtype)
    wmap.check(source, float_param_names(params))
    progress.done()

    def fill(tmp: Path) -> artifact.Artifact:
        files = write_params(tmp, source, wmap, params, quantization, progress, activations)
        return artifact.Artifact(
            model=cfg.to_dict(),
            quantization=quantization,
            device=options.device,
            target=str(target),
            library=f"{artifact.LIB_DIR}/{options.device}.so",
            context_window=context_window,
            prefill_chunk=min(options.prefill_chunk, context_window),
            max_batch=options.max_batch,
            page_size=options.page_size,
            param_files=tuple(f.name for f in files),
            params=tuple(artifact.TensorInfo(n, s, d) for n, s, d in params),
            params_sha256=artifact.hash_files(files),
            library_sha256="",  # known once the library is built (write_artifact)
            abi_version=abi.ABI_VERSION,
            mlcrun_version=__version__,
            source_fingerprint=fingerprint,
            tokenizer_files=_copy_tokenizer(folder, tmp),
            chat_template=read_chat_template(folder),
            generation=_generation_defaults(folder),
            activations=activations,
            kv_dtype=options.kv_dtype,
        )

    return write_artifact(out, mod, target, fill, progress)


def write_artifact(
    out: Path,
    mod: tvm.IRModule,
    target: tvm.target.Target,
    fill: Callable[[Path], artifact.Artifact],
    progress: Progress,
) -> Path:
    """Write an artifact folder atomically: `fill(tmp)` writes the params and tokenizer files
    into a temporary folder beside `out` and describes them; then the library is built and
    hashed, the config written, and the folder renamed to `out` (nothing is left on failure)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        art = fill(tmp)
        progress.phase(f"Compiling for {art.device} ({target.kind.name})")
        mod = attach_metadata(mod, art.library_metadata())
        _build_library(mod, target, tmp / art.library)
        art = replace(art, library_sha256=artifact.hash_file(tmp / art.library))
        progress.done()
        (tmp / artifact.CONFIG_FILE).write_text(art.to_json())
        _replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _build_library(mod: tvm.IRModule, target: tvm.target.Target, path: Path) -> None:
    from .pipeline import get_pipeline

    path.parent.mkdir(parents=True, exist_ok=True)
    with target:
        executable = tvm.compile(mod, target=target, relax_pipeline=get_pipeline(target))
    executable.export_library(str(path))


def _context_window(cfg: ModelConfig, options: CompileOptions) -> int:
    if options.context_window is None:
        return min(cfg.max_position_embeddings, DEFAULT_CONTEXT_CAP)
    if options.context_window > cfg.max_position_embeddings:
        raise MlcrunError(
            f"--context-window {options.context_window} exceeds the model's "
            f"max_position_embeddings ({cfg.max_position_embeddings})"
        )
    return options.context_window


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise MlcrunError(f"{path.parent}: missing config.json")
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise MlcrunError(f"{path}: not valid JSON ({err})") from None


def _fingerprint(files: tuple[Path, ...], options: CompileOptions) -> str:
    """Same inputs, same options, same compiler code -> same fingerprint (a no-op compile)."""
    digest = hashlib.sha256(f"{__version__}|{tvm.__version__}|{options}".encode())
    digest.update(str(resolve_target(options.device)).encode())
    package = Path(__file__).resolve().parents[1]
    for sub in ("compiler", "models", "weights", "quant"):
        for source in sorted((package / sub).rglob("*.py")):
            digest.update(source.read_bytes())
    for file in files:
        stat = file.stat()
        digest.update(f"{file.name}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def is_up_to_date(model: str, out: Path, options: CompileOptions) -> bool:
    """Would compiling `model` into `out` with `options` be a no-op?"""
    if not Path(out).exists():
        return False
    try:
        files = open_checkpoint(model).fingerprint_files
        return _up_to_date(Path(out), _fingerprint(files, options))
    except MlcrunError:
        return False


def _up_to_date(out: Path, fingerprint: str) -> bool:
    """Same fingerprint and an intact library: a library altered after compile would otherwise
    be kept by every later compile (and the $MLCRUN_HOME cache), and refused at every load."""
    try:
        art = artifact.read(out)
        if art.source_fingerprint != fingerprint:
            return False
        artifact.verify_library(out, art)
    except MlcrunError:
        return False
    return True


def _copy_tokenizer(folder: Path, tmp: Path) -> tuple[str, ...]:
    copied = []
    for name in artifact.TOKENIZER_FILES:
        if (folder / name).exists():
            shutil.copy2(folder / name, tmp / name)
            copied.append(name)
    return tuple(copied)


def _generation_defaults(folder: Path) -> dict:
    path = folder / "generation_config.json"
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {k: data[k] for k in _GENERATION_KEYS if k in data}


def _replace(tmp: Path, out: Path) -> None:
    """Swap the finished folder in; the old one (with --force) is removed only afterwards."""
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(out)
