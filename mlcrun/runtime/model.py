"""`Model`: the Python counterpart of MLC-LLM's serve/model.h over a compiled artifact.

Embeddings in, logits out, over a paged KV cache that holds every sequence's history.
Sequences are identified by integer ids chosen by the caller (the engine).

Sliding-window models (Mistral): TVM's cache keeps the last `window - 1` keys of a sequence and
every new token also sees itself, which equals Hugging Face's window of `window` keys. Inside a
multi-token chunk, the ragged attention is not windowed, so once a sequence reaches the window
`batch_prefill` feeds the rest of its tokens one at a time (exact, slower on long prompts).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .. import abi, artifact
from ..abi import local_chunk
from ..errors import MlcrunError
from . import ffi
from .library import device_for, load_params, load_vm, set_num_threads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    """The few facts of the model's config that running it needs (from the artifact)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    local_window: int | None = None  # Gemma 3's sliding layers (a window per layer kind)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelShape:
        try:
            return cls(
                vocab_size=int(data["vocab_size"]),
                hidden_size=int(data["hidden_size"]),
                num_hidden_layers=int(data["num_hidden_layers"]),
                num_key_value_heads=int(data["num_key_value_heads"]),
                head_dim=int(data["head_dim"]),
                sliding_window=data.get("sliding_window"),
                eos_token_ids=tuple(int(t) for t in data.get("eos_token_ids", ())),
                local_window=data.get("local_window"),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise MlcrunError(
                f"mlcrun-config.json: the model entry is incomplete ({err})"
            ) from None


class Model:
    def __init__(self, folder: str | Path, *, num_threads: int | None = None, verify: bool = True):
        self.folder = Path(folder)
        self.artifact = artifact.read(self.folder)
        if self.artifact.abi_version != abi.ABI_VERSION:
            raise MlcrunError(
                f"{folder}: library ABI {self.artifact.abi_version} != {abi.ABI_VERSION}; "
                "recompile the model"
            )
        self.config = ModelShape.from_dict(self.artifact.model)
        self.device = device_for(self.artifact)
        self.num_threads = set_num_threads(num_threads) if self.artifact.device == "cpu" else 0
        self._vm = load_vm(self.folder, self.artifact, self.device)
        # One FFI array, converted once: a Python list of the params is converted on every
        # call (SmolLM2's 423 tensors: 13 us a call instead of 4, twice per step).
        self._params = ffi.array(
            load_params(self.folder, self.artifact, self.device, verify=verify)
        )
        self._f = {name: self._vm[name] for name in abi.MODEL_FUNCTIONS}
        self._kv = None
        self._kv_settings: dict[str, int] = {}
        self._trees: dict[int, list[int]] = {}  # parent pointers of the last verified trees
        # The sequences in the cache (lengths are TVM's own): asking TVM about a sequence it
        # lacks raises, and the first C++ exception of a process costs ~0.3 s (symbolizing
        # its backtrace), which an existence check before every add would pay.
        self._seq_ids: set[int] = set()
        # Token ids are staged in one host buffer reused by every token_embed (CPU only).
        self._ids_host = ffi.is_cpu(self.device)
        self._ids_base: ffi.Tensor | None = None
        self._ids: np.ndarray = np.empty(0, np.int32)  # its numpy view
        self._ids_views: dict[int, tuple[ffi.Tensor, np.ndarray]] = {}

    # ---------------------------------------------------------------- info
    @property
    def metadata(self) -> dict[str, Any]:
        a = self.artifact
        return {
            "model": a.model,
            "quantization": a.quantization,
            "device": a.device,
            "context_window": a.context_window,
            "prefill_chunk": a.prefill_chunk,
            "max_batch": a.max_batch,
            "page_size": a.page_size,
            "activations": a.activations,
            "kv_dtype": a.kv_dtype,
            "sliding_window": self.config.sliding_window,
            "num_threads": self.num_threads,
            "kv_cache": dict(self._kv_settings),  # as last created (empty before)
        }

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def kv_bytes_per_token(self) -> int:
        c = self.config
        itemsize = 2 if self.artifact.kv_dtype == "float16" else 4  # compile --kv-dtype
        return c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * itemsize

    # ---------------------------------------------------------------- kv cache
    def create_kv_cache(
        self,
        page_size: int | None = None,
        max_num_sequence: int | None = None,
        max_total_sequence_length: int | None = None,
        prefill_chunk_size: int | None = None,
    ) -> None:
        a = self.artifact
        s = dict(
            page_size=page_size or a.page_size,
            max_num_sequence=max_num_sequence or a.max_batch,
            max_total_sequence_length=max_total_sequence_length or a.context_window,
            prefill_chunk_size=prefill_chunk_size or a.prefill_chunk,
        )
        self._kv = self._f[abi.CREATE_KV_CACHE](
            ffi.Shape([s["max_num_sequence"]]),
            ffi.Shape([s["max_total_sequence_length"]]),
            ffi.Shape([s["prefill_chunk_size"]]),
            ffi.Shape([s["page_size"]]),
            ffi.Shape([1 if self.config.sliding_window else 0]),
        )
        self._kv_settings = s
        self._trees = {}
        self._seq_ids.clear()

    @property
    def kv(self):
        if self._kv is None:
            self.create_kv_cache()
        return self._kv

    def add_new_sequence(self, seq_id: int) -> None:
        if self._exists(seq_id):
            raise MlcrunError(f"sequence {seq_id} already exists in the KV cache")
        _call(abi.KV_ADD_SEQUENCE, self.kv, seq_id)
        self._seq_ids.add(seq_id)
        if self.config.sliding_window:
            self.enable_sliding_window_for_seq(seq_id)

    def fork_sequence(self, parent_seq_id: int, child_seq_id: int, fork_pos: int = -1) -> None:
        self._check(parent_seq_id)
        if self._exists(child_seq_id):
            raise MlcrunError(f"sequence {child_seq_id} already exists in the KV cache")
        _call(abi.KV_FORK_SEQUENCE, self.kv, parent_seq_id, child_seq_id, fork_pos)
        self._seq_ids.add(child_seq_id)

    def remove_sequence(self, seq_id: int) -> None:
        self._check(seq_id)
        _call(abi.KV_REMOVE_SEQUENCE, self.kv, seq_id)
        self._seq_ids.discard(seq_id)

    def popn(self, seq_id: int, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.sequence_length(seq_id):
            raise MlcrunError(f"cannot pop {num_tokens} tokens from sequence {seq_id}")
        if num_tokens:
            _call(abi.KV_POPN, self.kv, seq_id, num_tokens)

    def commit_accepted_token_tree_nodes(
        self, seq_ids: Sequence[int], accepted_leaf_indices: Sequence[int]
    ) -> None:
        """Keep the path root -> accepted leaf of each sequence's last verified tree. Must name
        the same sequences, in the same order, as the last batch_verify."""
        if list(self._trees) != list(seq_ids):
            raise MlcrunError("commit must name the sequences of the last batch_verify, in order")
        leaves = [int(leaf) for leaf in accepted_leaf_indices]
        for seq_id, leaf in zip(seq_ids, leaves, strict=True):
            if not 0 <= leaf < len(self._trees[seq_id]):
                raise MlcrunError(f"accepted leaf {leaf} is not a node of sequence {seq_id}'s tree")
        trees, self._trees = self._trees, {}
        order = self._tree_commit_order(list(trees.values()))  # as batch_verify ran them
        _call(
            abi.KV_COMMIT_TREE,
            self.kv,
            ffi.Shape([int(seq_ids[i]) for i in order]),
            ffi.Shape([leaves[i] for i in order]),
        )

    @staticmethod
    def _tree_commit_order(trees: Sequence[Sequence[int]]) -> list[int]:
        """TVM-0.27-TREE-COMMIT: the order (indices into `trees`, the parent pointers of each
        sequence's tree in the caller's order) in which batch_verify hands the sequences to the
        KV cache, and commit names them: the caller's order, except that when the last tree is
        a chain and another one is not, the last non-chain tree moves to the end.

        Root cause, apache-tvm 0.27 `PagedAttentionKVCacheObj::CommitAcceptedTokenTreeNodes`
        (src/runtime/vm/paged_kv_cache.cc): its loop over the sequences does
        `is_chain = it->second.is_chain;`, overwriting instead of AND-ing, and only
        `if (!is_chain)` builds the copy lists and runs CompactKVCopy. So the LAST sequence's
        tree decides for all: when it is a chain (every parent is the previous node), no
        sequence's accepted nodes are moved, and a path that is not a prefix of its tree keeps
        the K/V of the wrong nodes (PopN then keeps the first `depth + 1` slots). When the last
        tree is not a chain, the copy lists are right for every sequence (a chain's path needs
        no copy) and the copy kernel (`compact_kv_copy_cpu`) is correct. The commit cannot be
        reordered or split instead: it reads the verify's per-batch-index state
        (append_position_map, cur_seq_ids_, cur_append_lengths_, and cur_batch_size_ as the
        copy kernel's batch size), so it must name the verify's sequences in the verify's
        order. Hence the order is chosen at verify time; it costs a row permutation of the
        embeddings and logits, and only in batches that need it.
        tests/compiled/test_kv.py::test_upstream_multi_sequence_commit_bug fails once upstream
        is fixed; then this method (and its use in batch_verify) can go."""
        chain = [all(p == i - 1 for i, p in enumerate(parents)) for parents in trees]
        order = list(range(len(trees)))
        if chain and chain[-1] and not all(chain):
            order.append(order.pop(max(i for i, c in enumerate(chain) if not c)))
        return order

    def enable_sliding_window_for_seq(self, seq_id: int) -> None:
        """No-op for models without a sliding window."""
        if self.config.sliding_window:
            _call(abi.KV_ENABLE_SLIDING_WINDOW, self.kv, seq_id, self.config.sliding_window - 1, 0)

    def get_num_available_pages(self) -> int:
        return int(_call(abi.KV_AVAILABLE_PAGES, self.kv))

    def get_current_total_sequence_length(self) -> int:
        return int(_call(abi.KV_TOTAL_LENGTH, self.kv))

    def sequence_length(self, seq_id: int) -> int:
        """Tokens of `seq_id` in the cache (TVM's own count: the runtime keeps no mirror)."""
        if seq_id not in self._seq_ids:
            raise MlcrunError(f"sequence {seq_id} is not in the KV cache")
        try:
            return int(_call(abi.KV_SEQUENCE_LENGTH, self.kv, seq_id))
        except RuntimeError:  # tvm.error.InternalError, or tvm_ffi's RuntimeError without tvm
            raise MlcrunError(f"sequence {seq_id} is not in the KV cache") from None

    def reset(self) -> None:
        """Drop every sequence (the cache's memory stays allocated)."""
        if self._kv is not None:
            _call(abi.KV_CLEAR, self._kv)
        self._trees = {}
        self._seq_ids.clear()

    # ---------------------------------------------------------------- compute
    def token_embed(self, token_ids: Sequence[int]) -> ffi.Tensor:
        """[n] token ids -> [n, hidden] embeddings (a device tensor)."""
        if self._ids_host:
            ids, staged = self._staged_ids(len(token_ids))
            try:
                staged[...] = token_ids
            except (TypeError, ValueError, OverflowError):
                staged = None
        else:
            ids = staged = None
        if staged is None:  # not a flat sequence of ints: the check below names the problem
            staged = np.asarray(token_ids, dtype=np.int32)
        if staged.ndim != 1 or not self._ids_in_vocab(token_ids, staged):
            raise MlcrunError(f"token ids must be in [0, {self.vocab_size})")
        if ids is None:
            ids = ffi.from_numpy(staged, self.device)
        return self._f[abi.EMBED](ids, self._params)

    def _staged_ids(self, n: int) -> tuple[ffi.Tensor, np.ndarray]:
        """A [n] int32 tensor over the reused host buffer, and its numpy view."""
        views = self._ids_views.get(n)
        if views is None:
            if n > self._ids.size:
                self._ids_base = ffi.empty([max(n, 2 * self._ids.size, 64)], "int32")
                self._ids = ffi.as_numpy(self._ids_base)
                self._ids_views.clear()
            views = (ffi.view(self._ids_base, [n]), self._ids[:n])
            if n <= 64:  # decode batches and small chunks: the views are kept
                self._ids_views[n] = views
        return views

    def _ids_in_vocab(self, token_ids, staged: np.ndarray) -> bool:
        if not staged.size:
            return True
        if isinstance(token_ids, list) and len(token_ids) <= 64:  # cheaper than numpy
            lo, hi = min(token_ids), max(token_ids)
        else:
            lo, hi = staged.min(), staged.max()
        return 0 <= lo and hi < self.vocab_size

    def batch_prefill(
        self, embeddings: ffi.Tensor, seq_ids: Sequence[int], lengths: Sequence[int]
    ) -> np.ndarray:
        """Append ragged chunks (concatenated in `embeddings` [sum(lengths), hidden]) to their
        sequences; returns the logits after each sequence's last token [len(seq_ids), vocab]."""
        self._check_batch(seq_ids, lengths, embeddings)
        window = self.config.sliding_window
        if window and any(self.sequence_length(s) + n > window for s, n in zip(seq_ids, lengths)):
            return self._prefill_in_steps(
                embeddings, seq_ids, lengths, lambda s: max(window - self.sequence_length(s), 1)
            )
        chunk = local_chunk(self.config.local_window)
        if chunk and max(lengths) > chunk:
            return self._prefill_in_steps(embeddings, seq_ids, lengths, lambda s: chunk)
        return self._prefill(embeddings, seq_ids, lengths)

    def _prefill(self, embeddings, seq_ids, lengths) -> np.ndarray:
        hidden = self.config.hidden_size
        positions = np.cumsum(lengths, dtype=np.int32) - 1
        x = ffi.view(embeddings, (1, int(sum(lengths)), hidden))
        out = self._forward(
            abi.BATCH_PREFILL, [x, ffi.from_numpy(positions, self.device)], seq_ids, lengths
        )
        return ffi.as_numpy(out[0])[0]

    def _prefill_in_steps(self, embeddings, seq_ids, lengths, room) -> np.ndarray:
        """Chunks of at most `room(seq_id)` tokens per sequence and call (Mistral's window:
        whole chunks until a sequence reaches it, then one token per step)."""
        emb = ffi.as_numpy(embeddings)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        logits = np.zeros((len(seq_ids), self.vocab_size), np.float32)
        todo = {i: (int(starts[i]), int(starts[i + 1])) for i in range(len(seq_ids))}
        while todo:
            batch, rows = [], []
            for i, (begin, end) in todo.items():
                take = min(end - begin, room(seq_ids[i]))
                batch.append((i, take))
                rows.append(emb[begin : begin + take])
            out = self._prefill(
                ffi.from_numpy(np.concatenate(rows), self.device),
                [seq_ids[i] for i, _ in batch],
                [n for _, n in batch],
            )
            for row, (i, take) in enumerate(batch):
                begin, end = todo[i]
                if begin + take == end:
                    logits[i] = out[row]
                    del todo[i]
                else:
                    todo[i] = (begin + take, end)
        return logits

    def batch_decode(self, embeddings: ffi.Tensor, seq_ids: Sequence[int]) -> np.ndarray:
        """One new token per sequence ([len(seq_ids), hidden]) -> logits [len(seq_ids), vocab]."""
        lengths = [1] * len(seq_ids)
        self._check_batch(seq_ids, lengths, embeddings)
        x = ffi.view(embeddings, (len(seq_ids), 1, self.config.hidden_size))
        out = self._forward(abi.BATCH_DECODE, [x], seq_ids, lengths)
        return ffi.as_numpy(out[0])[:, 0]

    def set_vm_instrument(self, instrument) -> None:
        """Call `instrument(func, name, before, ret, *args)` around every VM call (None: stop);
        see tvm.runtime.vm.VirtualMachine.set_instrument. For profiling (bench/profile.py)."""
        self._vm.set_instrument(instrument)

    def batch_verify(
        self,
        embeddings: ffi.Tensor,
        seq_ids: Sequence[int],
        lengths: Sequence[int],
        token_tree_parent_ptr: Sequence[int],
    ) -> np.ndarray:
        """Score a token tree per sequence in one pass. `token_tree_parent_ptr` holds, for every
        node, its parent's index within its own sequence's tree (-1 for a root). Returns logits
        for every node [sum(lengths), vocab]. Call commit_accepted_token_tree_nodes afterwards."""
        if self.config.local_window:
            raise MlcrunError(
                "token trees over sliding-window layers (Gemma 3) are not supported: TVM 0.27's "
                "cache does not window a tree's attention"
            )
        if max(lengths, default=0) > abi.MAX_TREE_NODES:
            raise MlcrunError(
                f"a token tree of {max(lengths)} nodes: the KV cache verifies at most "
                f"{abi.MAX_TREE_NODES} per sequence"
            )
        self._check_batch(seq_ids, lengths, embeddings)
        parents = list(token_tree_parent_ptr)
        if len(parents) != sum(lengths):
            raise MlcrunError("token_tree_parent_ptr must have one entry per tree node")
        starts = np.cumsum([0, *lengths])
        trees = [parents[starts[i] : starts[i + 1]] for i in range(len(seq_ids))]
        order = self._tree_commit_order(trees)  # TVM-0.27-TREE-COMMIT: the cache's order
        rows = None
        if order != sorted(order):
            rows = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in order])
            embeddings = ffi.from_numpy(ffi.as_numpy(embeddings)[rows], self.device)
            parents = [parents[r] for r in rows]
        x = ffi.view(embeddings, (1, int(sum(lengths)), self.config.hidden_size))
        seq_order, length_order = [seq_ids[i] for i in order], [lengths[i] for i in order]
        out = self._forward(abi.BATCH_VERIFY, [x], seq_order, length_order, parents)
        self._trees = dict(zip(seq_ids, trees, strict=True))  # parent pointers, for commit
        logits = ffi.as_numpy(out[0])[0]
        if rows is not None:
            logits[rows] = logits.copy()  # back to the caller's order
        return logits

    # ---------------------------------------------------------------- helpers
    def _forward(self, name: str, inputs: list, seq_ids, lengths, parents=None):
        """Run one exported forward between the cache's begin_forward and end_forward (the
        latter also when the forward fails, so that the cache takes the next one)."""
        if self._trees:
            raise MlcrunError("commit the last batch_verify before the next forward")
        shape = [ffi.shape(seq_ids), ffi.shape(lengths)]
        if parents is not None:
            shape.append(ffi.Shape(parents))
        _call(abi.KV_BEGIN_FORWARD, self.kv, *shape)
        try:
            out = self._f[name](*inputs, self.kv, self._params)
        except BaseException:
            with contextlib.suppress(Exception):
                _call(abi.KV_END_FORWARD, self.kv)
            raise
        _call(abi.KV_END_FORWARD, self.kv)
        return out

    def _exists(self, seq_id: int) -> bool:
        return seq_id in self._seq_ids

    def _check(self, seq_id: int) -> None:
        self.sequence_length(seq_id)  # raises naming the sequence when it is not there

    def _check_batch(self, seq_ids, lengths, embeddings) -> None:
        if len(seq_ids) != len(lengths) or len(set(seq_ids)) != len(seq_ids):
            raise MlcrunError("seq_ids must be distinct and match lengths")
        if int(embeddings.shape[0]) != sum(lengths):
            raise MlcrunError(f"{embeddings.shape[0]} embeddings for {sum(lengths)} tokens")
        limit = self.artifact.context_window
        for seq_id, n in zip(seq_ids, lengths):
            length = self.sequence_length(seq_id)
            if length + n > limit:
                raise MlcrunError(
                    f"sequence {seq_id} would reach {length + n} tokens, "
                    f"over the context window of {limit}"
                )
        chunk = self._kv_settings.get("prefill_chunk_size")  # the cache exists by now
        if chunk and sum(lengths) > chunk:  # the cache's workspaces hold one chunk
            raise MlcrunError(
                f"{sum(lengths)} tokens in one forward, over the KV cache's prefill chunk of "
                f"{chunk}: feed them in chunks"
            )


def _call(name: str, *args):
    return ffi.global_func(name)(*args)
