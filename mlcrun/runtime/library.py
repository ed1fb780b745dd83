"""Loading the artifact's .so, its params, and the CPU thread pool."""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
from pathlib import Path

import numpy as np

from .. import abi, artifact, cpu_features, env
from ..errors import MlcrunError
from . import ffi


def device_for(art: artifact.Artifact) -> ffi.Device:
    if art.device == "cuda":
        dev = ffi.cuda_device()
        if dev is None:
            raise MlcrunError("this artifact was compiled for cuda, but no CUDA GPU is available")
        return dev
    cpu_features.check_host(art.target, "this artifact")
    return ffi.cpu()


def set_num_threads(num_threads: int | None) -> int:
    """Size TVM's CPU worker pool, which otherwise defaults to 1 thread on some machines.

    In apache-tvm 0.27 only TVM_NUM_THREADS works (runtime.config_threadpool is a no-op), and
    it is read when the pool starts, at the first parallel kernel: the first Model loaded in
    a process decides. An explicit TVM_NUM_THREADS in the environment wins over the default
    (it is checked even when `num_threads` overrides it, so a malformed value never passes)."""
    from_env = env.tvm_num_threads()
    n = num_threads or from_env or len(os.sched_getaffinity(0))
    os.environ[env.TVM_NUM_THREADS] = str(n)
    return n


def load_vm(folder: Path, art: artifact.Artifact, dev) -> ffi.VirtualMachine:
    # Loading a .so runs its code: only the bytes that were compiled get that far.
    path = artifact.verify_library(folder, art)
    try:
        lib = ffi.load_module(path.resolve())
    except Exception as err:  # TVM raises its own error types for a bad .so
        raise MlcrunError(f"{path}: cannot load the compiled library ({err})") from None
    vm = ffi.VirtualMachine(lib, dev)
    for name in abi.MODEL_FUNCTIONS:
        if not _has(vm, name):
            raise MlcrunError(f"{path}: library lacks function {name!r}; recompile the model")
    embedded = json.loads(str(vm[abi.METADATA]()))
    expected = json.loads(json.dumps(art.library_metadata(), sort_keys=True))
    if embedded != expected:
        diff = sorted(k for k in expected if embedded.get(k) != expected[k])
        raise MlcrunError(
            f"{folder}: the library does not match {artifact.CONFIG_FILE} "
            f"(differs in: {', '.join(diff) or 'keys'}); recompile the model"
        )
    return vm


def _has(vm, name: str) -> bool:
    # apache-tvm 0.27 raises AttributeError for a missing function; it has no
    # tvm.error.TVMError, which, named here, made the miss itself an AttributeError.
    try:
        vm[name]
    except (AttributeError, KeyError, RuntimeError):
        return False
    return True


def load_params(folder: Path, art: artifact.Artifact, dev, verify: bool = True) -> list[ffi.Tensor]:
    """Params in the order the library's functions take them.

    Each file is read once, front to back: on the CPU straight into the TVM tensors' memory,
    one arena of huge pages per file (`ffi.arena`; no file mapping, no intermediate copy, so
    peak memory is the params themselves), and hashed on
    the way when `verify` (params altered after compile are refused), on a second thread, so
    that hashing overlaps reading."""
    specs = {p.name: p for p in art.params}
    tensors: dict[str, ffi.Tensor] = {}
    digest = _Hasher() if verify else None
    try:
        for name in art.param_files:
            path = Path(folder) / artifact.PARAMS_DIR / name
            if not path.exists():
                raise MlcrunError(f"{folder}: params file {name} is missing")
            if digest is not None:
                digest.update(name.encode())
            with path.open("rb") as f:
                tensors.update(_read_shard(f, path, specs, dev, digest))
    finally:
        hexdigest = digest.close() if digest is not None else None
    if verify and hexdigest != art.params_sha256:
        raise MlcrunError(
            f"{folder}: params were modified after compile (hash mismatch); recompile the model"
        )
    missing = [p.name for p in art.params if p.name not in tensors]
    if missing:
        raise MlcrunError(f"{folder}: param {missing[0]!r} is missing from the params files")
    return [tensors[p.name] for p in art.params]


class _Hasher:
    """sha256 fed in order by one worker thread (hashlib releases the GIL on large buffers,
    as file reads do). The buffers handed to update() must not change until close()."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mlcrun-params-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            self._digest.update(data)

    def update(self, data) -> None:
        self._queue.put(data)

    def close(self) -> str:
        """Wait for what was queued; the hex digest of it."""
        self._queue.put(None)
        self._thread.join()
        return self._digest.hexdigest()


def _read_shard(f, path: Path, specs: dict, dev, digest) -> dict[str, ffi.Tensor]:
    def read(n: int) -> bytes:
        data = f.read(n)
        if len(data) != n:
            raise MlcrunError(f"{path}: truncated params file")
        if digest is not None:
            digest.update(data)
        return data

    head = read(8)
    try:
        header = json.loads(read(struct.unpack("<Q", head)[0]))
    except (ValueError, MemoryError, OverflowError):
        raise MlcrunError(f"{path}: corrupt params file header") from None
    header.pop("__metadata__", None)
    layout = []  # (name, spec, file offsets, offset in the arena)
    pos = size = 0
    for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        spec = specs.get(key)
        if spec is None or tuple(info["shape"]) != tuple(spec.shape) or begin < pos:
            raise MlcrunError(f"{path}: param {key!r} does not match the artifact's config")
        if ffi.nbytes(spec.shape, spec.dtype) != end - begin:
            raise MlcrunError(f"{path}: param {key!r} has the wrong size")
        at = -(-size // ffi.ALIGNMENT) * ffi.ALIGNMENT
        layout.append((key, spec, begin, end, at))
        pos, size = end, at + end - begin
    # On the CPU the params live in one arena per file (huge pages; see ffi.arena), read
    # straight into it; for another device each is read into host memory of its own, copied
    # over, and freed.
    host = ffi.arena(size) if ffi.is_cpu(dev) else None
    out = {}
    pos = 0
    for key, spec, begin, end, at in layout:
        if begin > pos:
            read(begin - pos)  # padding between tensors (hashed like the rest of the file)
        if host is not None:
            view = host[at : at + end - begin]
            tensor = ffi.from_host(view, spec.shape, spec.dtype)
        else:
            tensor = ffi.empty(spec.shape, spec.dtype)
            view = ffi.as_numpy(tensor).reshape(-1).view(np.uint8)
        if f.readinto(view) != view.nbytes:
            raise MlcrunError(f"{path}: truncated params file")
        if digest is not None:
            digest.update(view)
        out[key] = tensor if host is not None else ffi.copy_to(tensor, dev)
        pos = end
    if digest is not None:
        while chunk := f.read(1 << 20):  # trailing bytes, if any, are part of the hash too
            digest.update(chunk)
    return out
