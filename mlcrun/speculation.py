"""What LLM needs for speculative decoding besides the engine: the draft model (checked against
the target), and the step costs that drive the adaptive draft length, measured once per model
and machine and cached in $MLCRUN_HOME/spec-costs."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path

from .engine.config import EngineConfig
from .engine.spec.adaptive import CostModel
from .errors import MlcrunError
from .paths import mlcrun_home
from .runtime import Model
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

COSTS_VERSION = 5  # 2: fastest of 5 calls (was the median of 3); 3: a second, deep point;
# 4: the draft model's step at the deep point too; 5: the deep point at 4 sequences, and
# rounds that alternate their order


def check_target(model: Model, config: EngineConfig) -> None:
    if model.config.local_window:
        raise MlcrunError(
            f"speculative_mode {config.speculative_mode!r}: models with sliding-window layers "
            "(Gemma 3) cannot verify token trees yet; use speculative_mode 'none'"
        )
    if model.config.sliding_window:
        raise MlcrunError(
            f"speculative_mode {config.speculative_mode!r}: sliding-window models (Mistral) "
            "cannot verify token trees (TVM 0.27's KV cache refuses tree forwards with a "
            "window); use speculative_mode 'none'"
        )


def load_draft(
    target: Model, tokenizer: Tokenizer | None, config: EngineConfig, num_threads: int | None
) -> Model | None:
    """The draft model of modes "draft" and "self", loaded and checked; None otherwise."""
    if config.speculative_mode == "draft":
        from .default_model import resolve_artifact  # an artifact as is; else compiled, cached

        folder = resolve_artifact(config.draft_model, device=target.artifact.device)
    elif config.speculative_mode == "self":
        from .compiler.draft import resolve_self_draft  # compiles on first use

        folder = resolve_self_draft(target.folder, config.draft_quantization)
    else:
        return None
    draft = Model(folder, num_threads=num_threads)
    if config.speculative_mode == "draft":
        _check_same_tokenizer(target, tokenizer, draft)
    if draft.config.sliding_window or draft.config.local_window:
        raise MlcrunError(f"draft model {folder}: sliding-window models cannot draft token trees")
    return draft


def _check_same_tokenizer(target: Model, tokenizer: Tokenizer | None, draft: Model) -> None:
    """A draft must speak the target's token ids: the same vocabulary and EOS ids (padded
    vocab_size may differ; that is only the size of the embedding table)."""
    name = draft.folder
    draft_tok = (
        Tokenizer.from_dir(draft.folder)
        if "tokenizer.json" in draft.artifact.tokenizer_files
        else None
    )
    if (tokenizer is None) != (draft_tok is None):
        raise MlcrunError(f"draft model {name}: one of the two models has no tokenizer to compare")
    if tokenizer is None or draft_tok is None:
        if target.vocab_size != draft.vocab_size:
            raise MlcrunError(f"draft model {name}: vocab_size differs from the target's")
        return
    ours, theirs = tokenizer.backend.get_vocab(), draft_tok.backend.get_vocab()
    if ours != theirs:
        differ = len(set(ours.items()) ^ set(theirs.items()))
        raise MlcrunError(
            f"draft model {name}: its tokenizer differs from the target's ({differ} vocabulary "
            "entries differ); a draft must share the target's tokenizer"
        )
    if set(tokenizer.eos_token_ids) != set(draft_tok.eos_token_ids):
        raise MlcrunError(
            f"draft model {name}: its EOS ids {sorted(draft_tok.eos_token_ids)} differ from the "
            f"target's {sorted(tokenizer.eos_token_ids)}"
        )


def cached_costs(
    target: Model, draft: Model | None, config: EngineConfig
) -> tuple[Path, CostModel | None]:
    """Where the measured step costs of this model (and draft) on this machine are cached, and
    their cached value (None when not measured yet)."""
    key = json.dumps(
        [
            COSTS_VERSION,
            target.artifact.params_sha256,
            target.artifact.library_sha256,
            draft.artifact.params_sha256 if draft is not None else None,
            platform.processor() or platform.machine(),
            _cpu_model(),
            os.cpu_count(),
            target.num_threads,
            config.max_num_sequence,
            config.draft_length_bound,
            config.spec_tree_width,
            config.prefill_chunk_size,
        ]
    )
    path = mlcrun_home() / "spec-costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    try:
        return path, CostModel.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return path, None


def save_costs(path: Path, costs: CostModel) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(costs.to_dict()))
        tmp.replace(path)
    except OSError as err:  # a cache: never fatal
        log.warning("could not cache the measured speculation costs in %s: %s", path, err)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""
