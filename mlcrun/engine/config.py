"""EngineConfig: how many sequences run together and how much memory the KV cache may use."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..abi import MAX_TREE_NODES
from ..errors import MlcrunError

# The self-draft's preset (mode "self"): 4-bit layers, an 8-bit embedding and lm_head (a 4-bit
# table costs SmolLM2 a tenth of its top-1 agreement with the target; compiler/draft.py).
DEFAULT_DRAFT_QUANTIZATION = "q4f16_1+q8f16"

PRESETS = ("local", "interactive", "server")
SPECULATIVE_MODES = ("none", "ngram", "draft", "self")


@dataclass(frozen=True)
class EngineConfig:
    """`None` fields are filled from the model (see `resolve`)."""

    max_num_sequence: int | None = None
    max_total_sequence_length: int | None = None  # KV capacity in tokens, all sequences together
    prefill_chunk_size: int | None = None
    kv_cache_page_size: int | None = None
    prefix_cache: bool = True
    prefix_cache_max_retained: int = 32  # finished sequences kept in the KV cache for reuse
    kv_memory: float | None = None  # bytes (> 1) or a fraction of RAM (<= 1)
    mode: str = "local"
    # Speculative decoding: "ngram" (prompt lookup), "draft" (a smaller model, `draft_model`),
    # "self" (a low-bit copy of the model's own weights, `draft_quantization`).
    speculative_mode: str = "none"
    spec_draft_length: int = 0  # K drafted tokens per step; 0 = adaptive (up to the max below)
    spec_max_draft_length: int = 8  # the adaptive K's upper bound
    spec_tree_width: int = 1  # W > 1: the top-W alternatives at the first drafted position
    ngram_max: int = 4  # prompt lookup matches the last N..1 tokens
    draft_model: str | None = None  # an artifact, HF folder or GGUF (mode "draft")
    draft_quantization: str = DEFAULT_DRAFT_QUANTIZATION

    def __post_init__(self) -> None:
        if self.mode not in PRESETS:
            raise MlcrunError(f"mode must be one of {', '.join(PRESETS)}, got {self.mode!r}")
        for name in (
            "max_num_sequence",
            "max_total_sequence_length",
            "prefill_chunk_size",
            "kv_cache_page_size",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise MlcrunError(f"{name} must be a positive integer, got {value!r}")
        if self.prefix_cache_max_retained < 0:
            raise MlcrunError("prefix_cache_max_retained must be >= 0")
        if self.kv_memory is not None and self.kv_memory <= 0:
            raise MlcrunError(f"kv_memory must be positive, got {self.kv_memory!r}")
        self._check_speculation()

    def _check_speculation(self) -> None:
        if self.speculative_mode not in SPECULATIVE_MODES:
            raise MlcrunError(
                f"speculative_mode must be one of {', '.join(SPECULATIVE_MODES)}, "
                f"got {self.speculative_mode!r}"
            )
        for name, lo in (
            ("spec_draft_length", 0),
            ("spec_max_draft_length", 1),
            ("spec_tree_width", 1),
            ("ngram_max", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise MlcrunError(f"{name} must be an integer >= {lo}, got {value!r}")
        nodes = 1 + self.draft_length_bound + self.spec_tree_width - 1
        if self.speculating and nodes > MAX_TREE_NODES:
            raise MlcrunError(
                f"spec_draft_length/spec_tree_width: a tree of {nodes} nodes is over the "
                f"{MAX_TREE_NODES} the KV cache verifies per sequence"
            )
        if self.speculative_mode == "draft" and not self.draft_model:
            raise MlcrunError("speculative_mode 'draft' needs a draft_model")
        if self.draft_model and self.speculative_mode != "draft":
            raise MlcrunError("draft_model is only used with speculative_mode 'draft'")

    @property
    def speculating(self) -> bool:
        return self.speculative_mode != "none"

    @property
    def draft_length_bound(self) -> int:
        """The most tokens a request drafts in one step."""
        return self.spec_draft_length or self.spec_max_draft_length

    def resolve(
        self,
        *,
        context_window: int,
        max_batch: int,
        prefill_chunk: int,
        page_size: int,
        kv_bytes_per_token: int,
        chunk_limit: int | None = None,
    ) -> EngineConfig:
        """Concrete values for a model: every field set, the KV capacity from the budget.
        `chunk_limit`: the most tokens of one sequence the model takes in one forward (Gemma 3's
        sliding layers: `abi.local_chunk`), which caps the prefill chunk before it is checked."""
        page_size = self.kv_cache_page_size or page_size
        default_seqs = {"interactive": 1, "local": min(4, max_batch), "server": max_batch}
        seqs = self.max_num_sequence or default_seqs[self.mode]
        if self.max_total_sequence_length is not None:
            capacity = self.max_total_sequence_length
        elif self.kv_memory is not None:
            budget = self.kv_memory * _ram_bytes() if self.kv_memory <= 1 else self.kv_memory
            capacity = int(budget // kv_bytes_per_token)
        elif self.mode == "server":
            capacity = int(0.25 * _ram_bytes() // kv_bytes_per_token)
            capacity = min(capacity, seqs * context_window)
        else:
            capacity = seqs * context_window
        capacity = capacity // page_size * page_size
        chunk = self.prefill_chunk_size or prefill_chunk
        if chunk_limit is not None:
            chunk = min(chunk, chunk_limit)
        if seqs > chunk:  # the KV cache's workspaces hold one chunk of tokens per forward
            raise MlcrunError(
                f"max_num_sequence {seqs} (serve --max-num-seqs, bench -c) is over the prefill "
                f"chunk of {chunk} tokens (compile --prefill-chunk): a decode step of every "
                "running sequence is one forward, which holds at most a chunk"
            )
        if capacity < page_size:
            raise MlcrunError(
                f"the KV budget holds {capacity} tokens, less than one page of {page_size}"
            )
        return replace(
            self,
            max_num_sequence=seqs,
            max_total_sequence_length=capacity,
            prefill_chunk_size=chunk,
            kv_cache_page_size=page_size,
        )


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
