"""Self-drafting: a low-bit copy of a compiled model's own weights, for speculative decoding.

A self-draft is an ordinary artifact folder (loaded with `runtime.Model(folder)` like any
other) built from a target artifact, not from a checkpoint: the same model config, context
window, prefill chunk, max batch, page size, device/target and tokenizer files, and the
target's params dequantized to float32 (q8/q4/f16 params through the numpy reference) and
put through the draft preset's weight transform, keyed by the same param names as a compile.
From a q0f32 target the draft's params are bit for bit those of compiling the checkpoint with
the draft preset directly. The draft records the target's `params_sha256` (`draft_of`), so a
draft whose target changed is detected and rebuilt.

Where drafts live:

* `TARGET/draft-<q>/`, written by `mlcrun compile --draft-quantization q` after the model;
* `$MLCRUN_HOME/drafts/<target params_sha256[:16]>-<q>-<device>-<key>/`, built on first use by
  `resolve_self_draft` when the target has no matching draft of its own (`key` hashes the
  target's compile settings: the same params compiled for another context window share a hash).

A draft only pays when it reads markedly less weight memory per token than the target, so a
target whose linear layers are not at least `MIN_BITS_RATIO` times as wide (bits per weight)
as the draft's is refused: a q4 self-draft (the default, `DEFAULT_DRAFT_QUANTIZATION`, keeps the
embedding table and lm_head in q8f16) helps q0f32, q0f16, q0bf16, q8f32 and q8f16 targets, not
q4 ones (the default model is q4f16_1+q8f16).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import tvm
from safetensors import safe_open

from .. import __version__, abi, artifact
from ..engine.config import DEFAULT_DRAFT_QUANTIZATION
from ..errors import MlcrunError
from ..models.config import ModelConfig
from ..paths import drafts_dir
from ..quant import PRESETS, QuantPreset, get_preset, numpy_ref
from ..quant.transform import dequantize_params, float_param_name, preset_for
from ..weights.mapping import ParamRule, WeightMap
from .build import _fingerprint, write_artifact
from .export import export_model
from .options import CompileOptions, resolve_activations
from .params import float_param_names, write_params
from .progress import NullProgress, Progress

log = logging.getLogger(__name__)

# DEFAULT_DRAFT_QUANTIZATION (defined with the engine's config, which must not import this
# module): 4-bit linear layers, the embedding table and lm_head in 8 bits. A 4-bit table alone
# costs acceptance. SmolLM2-135M compiled q0f32 from its GGUF (whose Q4_1 layers a q4 draft holds
# exactly): top-1 agreement with the target on its own greedy text 1.000 with q4f16_1+q8f32,
# 0.883 with q4f16_1 (logits cosine 1.0000 / 0.9913), for 98 MB of draft params instead of 84
# (the table is a fifth of that model; less of larger ones). q4f16_1+q8f16 holds the same
# table values (its Q8_0 blocks, exactly) in 96 MB: the params of the GGUF's own `-q auto`.
# Tiny random llamas: 0.63 / 0.57 (init 0.1), 0.79 / 0.70 (init 0.02).

# The target's linear layers must take at least this many times the draft's bits per weight.
MIN_BITS_RATIO = 1.5


def draft_dirname(quantization: str) -> str:
    """The sub-folder of a target that `mlcrun compile --draft-quantization` writes."""
    return f"draft-{quantization}"


def draft_preset(quantization: str) -> QuantPreset:
    """The preset a draft is stored in (a preset or a mixed A+B; not `auto`)."""
    try:
        preset = get_preset(quantization)
    except MlcrunError:
        raise MlcrunError(
            f"--draft-quantization {quantization!r} is not available; choose from: "
            f"{', '.join(PRESETS)} (or A+B: layers in A, embedding/lm_head in B)"
        ) from None
    if not helped_targets(preset):
        raise MlcrunError(
            f"--draft-quantization {quantization!r} is no narrower than any model; "
            f"use a low-bit preset such as {DEFAULT_DRAFT_QUANTIZATION}"
        )
    return preset


def helped_targets(preset: QuantPreset) -> list[str]:
    """The presets whose models a draft in `preset` can speed up."""
    return [
        name
        for name, p in PRESETS.items()
        if p.bits_per_weight >= MIN_BITS_RATIO * preset.bits_per_weight
    ]


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def check_helps(target_quantization: str, quantization: str) -> None:
    """Refuse (one line) a draft preset that is not markedly narrower than the target's linear
    layers, naming the targets it would help; also refuses an unknown draft preset."""
    preset = draft_preset(quantization)
    target = get_preset(target_quantization)  # linear layers: the A of a mixed A+B
    bits, draft_bits = target.bits_per_weight, preset.bits_per_weight
    if bits >= MIN_BITS_RATIO * draft_bits:
        return
    how = (
        "already as narrow as"
        if bits <= draft_bits
        else f"less than {MIN_BITS_RATIO:g}x as wide as"
    )
    raise MlcrunError(
        f"self-drafting cannot speed up a {target_quantization} model: its linear layers "
        f"({bits:.2f} bits/weight) are {how} a {quantization} draft's ({draft_bits:.2f}); "
        f"a {quantization} self-draft helps {_and(helped_targets(preset))} targets"
    )


class ArtifactTensors:
    """A TensorSource over an artifact's params by their float names (`X.weight` for
    `X.q_weight`/`X.q_scale`/`X.q_min`), each dequantized to float32 when read."""

    def __init__(self, folder: Path, art: artifact.Artifact) -> None:
        self.folder = Path(folder)
        self._preset, self._activations = get_preset(art.quantization), art.activations
        self._info = {p.name: p for p in art.params}
        self._file: dict[str, Path] = {}
        for name in art.param_files:
            path = self.folder / artifact.PARAMS_DIR / name
            with safe_open(str(path), framework="np") as f:
                self._file.update(dict.fromkeys(f.keys(), path))
        self._parts: dict[str, list[str]] = {}
        for p in art.params:
            self._parts.setdefault(float_param_name(p.name), []).append(p.name)

    def names(self) -> list[str]:
        return list(self._parts)

    def __contains__(self, name: str) -> bool:
        return name in self._parts

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._info:  # stored as a float
            return tuple(self._info[name].shape)
        prefix = name[: -len("weight")]
        codes = self._info[prefix + "q_weight"]
        n, k = codes.shape
        if codes.dtype == "uint32":  # q4: K / 8 words of 8 codes
            k *= numpy_ref.NIBBLES_PER_WORD
        return (n, k)

    def dtype(self, name: str) -> str:
        return "F32"

    def _read(self, name: str) -> np.ndarray:
        if name not in self._file:
            raise MlcrunError(f"{self.folder}: param {name!r} is missing from the params files")
        with safe_open(str(self._file[name]), framework="np") as f:
            return f.get_tensor(name)

    def get(self, name: str) -> np.ndarray:
        if name in self._info:
            return np.ascontiguousarray(self._read(name), dtype=np.float32)
        prefix = name[: -len("weight")]
        suffixes = ("q_weight", "q_scale", "q_min")
        params = {prefix + s: self._read(prefix + s) for s in suffixes if prefix + s in self._info}
        return dequantize_params(preset_for(self._preset, name), params, self._activations)


class _DraftProgress:
    """Labels the phases of a draft build as such."""

    def __init__(self, progress: Progress, quantization: str) -> None:
        self._progress, self._label = progress, f"Draft {quantization}: "

    def phase(self, name: str, total: int | None = None) -> None:
        self._progress.phase(f"{self._label}{name[:1].lower()}{name[1:]}", total=total)

    def advance(self, steps: int = 1) -> None:
        self._progress.advance(steps)

    def done(self) -> None:
        self._progress.done()


def _options(art: artifact.Artifact, quantization: str) -> CompileOptions:
    return CompileOptions(
        quantization=quantization,
        device=art.device,
        context_window=art.context_window,
        prefill_chunk=art.prefill_chunk,
        max_batch=art.max_batch,
        page_size=art.page_size,
        activations="auto",  # the draft's own preset decides (build_draft)
        kv_dtype=art.kv_dtype,
    )


def draft_fingerprint(target: Path, art: artifact.Artifact, quantization: str) -> str:
    """Same target params and settings, same preset, same compiler code -> same draft."""
    digest = hashlib.sha256(_fingerprint((), _options(art, quantization)).encode())
    facts = [art.params_sha256, art.target, art.model, art.chat_template, art.generation]
    digest.update(json.dumps(facts, sort_keys=True).encode())
    for name in art.tokenizer_files:
        try:
            digest.update(f"{name}|{artifact.hash_file(Path(target) / name)}".encode())
        except OSError as err:
            raise MlcrunError(f"{target}: cannot read {name} ({err.strerror})") from None
    return digest.hexdigest()


def is_draft_of(
    folder: Path, art: artifact.Artifact, quantization: str, fingerprint: str | None = None
) -> bool:
    """Is `folder` an intact `quantization` draft of the target `art` (made from its params;
    with `fingerprint`, also by this compiler from the target's current settings)?"""
    try:
        draft = artifact.read(folder)
        if draft.draft_of != art.params_sha256 or draft.quantization != quantization:
            return False
        if fingerprint is not None and draft.source_fingerprint != fingerprint:
            return False
        artifact.verify_library(folder, draft)
    except MlcrunError:
        return False
    return True


def build_draft(
    target: Path,
    quantization: str,
    out: Path,
    *,
    progress: Progress | None = None,
    force: bool = False,
) -> Path:
    """Write the `quantization` self-draft of the artifact `target` into `out`, atomically
    (a temporary folder beside `out`, renamed at the end). An up-to-date `out` is kept; a
    different existing one needs `force`."""
    target, out = Path(target), Path(out)
    progress = _DraftProgress(progress or NullProgress(), quantization)
    art = artifact.read(target)
    check_helps(art.quantization, quantization)
    fingerprint = draft_fingerprint(target, art, quantization)
    if out.exists():
        if not force and is_draft_of(out, art, quantization, fingerprint):
            log.info("%s is up to date", out)
            return out
        if not force:
            raise MlcrunError(f"{out} already exists; pass --force to overwrite it")
    artifact.verify_params(target, art)  # the draft records this hash: it must be these params
    tvm_target = tvm.target.Target(art.target)
    progress.phase("Exporting model")
    cfg = ModelConfig.from_dict(art.model)
    # The draft's q4/q8 layers run on int8 activations where the CPU has them, whatever the
    # target's (a q0f32 target has none): a draft is for speed, and the target checks it.
    activations = resolve_activations("auto", tvm_target, quantization)
    mod, params = export_model(cfg, tvm_target, quantization, activations, art.kv_dtype)
    source = ArtifactTensors(target, art)
    wmap = WeightMap(tuple(ParamRule(n, (n,), (source.shape(n),)) for n in source.names()))
    wmap.check(source, float_param_names(params))
    progress.done()

    def fill(tmp: Path) -> artifact.Artifact:
        files = write_params(tmp, source, wmap, params, quantization, progress, activations)
        for name in art.tokenizer_files:
            shutil.copy2(target / name, tmp / name)
        return replace(
            art,
            quantization=quantization,
            library=f"{artifact.LIB_DIR}/{art.device}.so",
            param_files=tuple(f.name for f in files),
            params=tuple(artifact.TensorInfo(n, s, d) for n, s, d in params),
            params_sha256=artifact.hash_files(files),
            library_sha256="",  # known once the library is built (write_artifact)
            abi_version=abi.ABI_VERSION,
            mlcrun_version=__version__,
            source_fingerprint=fingerprint,
            draft_of=art.params_sha256,
            format_version=artifact.FORMAT_VERSION,
            activations=activations,
        )

    return write_artifact(out, mod, tvm_target, fill, progress)


def draft_cache_path(art: artifact.Artifact, quantization: str) -> Path:
    """Where `resolve_self_draft` builds a target's draft in `$MLCRUN_HOME`."""
    settings = [art.target, art.context_window, art.prefill_chunk, art.max_batch, art.page_size]
    key = hashlib.sha256(json.dumps(settings).encode()).hexdigest()[:8]
    return drafts_dir() / f"{art.params_sha256[:16]}-{quantization}-{art.device}-{key}"


def resolve_self_draft(
    target: Path,
    quantization: str = DEFAULT_DRAFT_QUANTIZATION,
    progress: Progress | None = None,
) -> Path:
    """The `quantization` self-draft of the artifact `target`: its own `draft-<q>/` when that
    was made from its current params, else the `$MLCRUN_HOME/drafts` one, built on first use
    (and rebuilt when the compiler or the target's settings changed)."""
    target = Path(target)
    art = artifact.read(target)
    check_helps(art.quantization, quantization)
    own = target / draft_dirname(quantization)
    if is_draft_of(own, art, quantization):
        return own
    cached = draft_cache_path(art, quantization)
    if is_draft_of(cached, art, quantization, draft_fingerprint(target, art, quantization)):
        return cached
    return build_draft(target, quantization, cached, progress=progress, force=True)


def compile_draft(
    out: Path, quantization: str, *, progress: Progress | None = None, force: bool = False
) -> Path:
    """`mlcrun compile --draft-quantization`: write the artifact `out`'s `draft-<q>/`, unless
    an up-to-date one is there already (and not `force`); a stale one is replaced."""
    path = Path(out) / draft_dirname(quantization)
    if not force and draft_is_up_to_date(out, quantization):
        return path
    return build_draft(out, quantization, path, progress=progress, force=True)


def draft_is_up_to_date(out: Path, quantization: str) -> bool:
    """Would `compile_draft(out, quantization)` be a no-op?"""
    out = Path(out)
    try:
        art = artifact.read(out)
        fingerprint = draft_fingerprint(out, art, quantization)
    except MlcrunError:
        return False
    return is_draft_of(out / draft_dirname(quantization), art, quantization, fingerprint)
