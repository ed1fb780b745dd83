"""Loading the artifact's .so, its params, and the CPU thread pool."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np
import tvm
from tvm import relax

from .. import abi, artifact, env
from ..errors import MlcrunError


def device_for(art: artifact.Artifact) -> tvm.runtime.Device:
    if art.device == "cuda":
        dev = tvm.cuda(0)
        if not dev.exist:
            raise MlcrunError("this artifact was compiled for cuda, but no CUDA GPU is available")
        return dev
    return tvm.cpu(0)


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


def load_vm(folder: Path, art: artifact.Artifact, dev) -> relax.VirtualMachine:
    # Loading a .so runs its code: only the bytes that were compiled get that far.
    path = artifact.verify_library(folder, art)
    try:
        lib = tvm.runtime.load_module(str(path))
    except Exception as err:  # TVM raises its own error types for a bad .so
        raise MlcrunError(f"{path}: cannot load the compiled library ({err})") from None
    vm = relax.VirtualMachine(lib, dev)
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


def _has(vm: relax.VirtualMachine, name: str) -> bool:
    # apache-tvm 0.27 raises AttributeError for a missing function; it has no
    # tvm.error.TVMError, which, named here, made the miss itself an AttributeError.
    try:
        vm[name]
    except (AttributeError, KeyError, RuntimeError):
        return False
    return True


def load_params(
    folder: Path, art: artifact.Artifact, dev, verify: bool = True
) -> list[tvm.runtime.Tensor]:
    """Params in the order the library's functions take them.

    Each file is read once, front to back: on the CPU straight into the TVM tensors' memory
    (no mapping, no intermediate copy, so peak memory is the params themselves), and hashed on
    the way when `verify` (params altered after compile are refused)."""
    specs = {p.name: p for p in art.params}
    tensors: dict[str, tvm.runtime.Tensor] = {}
    digest = hashlib.sha256()
    for name in art.param_files:
        path = Path(folder) / artifact.PARAMS_DIR / name
        if not path.exists():
            raise MlcrunError(f"{folder}: params file {name} is missing")
        digest.update(name.encode())
        with path.open("rb") as f:
            tensors.update(_read_shard(f, path, specs, dev, digest if verify else None))
    if verify and digest.hexdigest() != art.params_sha256:
        raise MlcrunError(
            f"{folder}: params were modified after compile (hash mismatch); recompile the model"
        )
    missing = [p.name for p in art.params if p.name not in tensors]
    if missing:
        raise MlcrunError(f"{folder}: param {missing[0]!r} is missing from the params files")
    return [tensors[p.name] for p in art.params]


def _read_shard(f, path: Path, specs: dict, dev, digest) -> dict[str, tvm.runtime.Tensor]:
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
    out = {}
    pos = 0
    for key, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = info["data_offsets"]
        spec = specs.get(key)
        if spec is None or tuple(info["shape"]) != tuple(spec.shape) or begin < pos:
            raise MlcrunError(f"{path}: param {key!r} does not match the artifact's config")
        if begin > pos:
            read(begin - pos)  # padding between tensors (hashed like the rest of the file)
        tensor = tvm.runtime.empty(tuple(spec.shape), spec.dtype, tvm.cpu())
        view = np.from_dlpack(tensor).reshape(-1).view(np.uint8)
        if view.nbytes != end - begin:
            raise MlcrunError(f"{path}: param {key!r} has the wrong size")
        if f.readinto(view) != view.nbytes:
            raise MlcrunError(f"{path}: truncated params file")
        if digest is not None:
            digest.update(view)
        out[key] = tensor if dev == tvm.cpu(0) else tensor.copyto(dev)
        pos = end
    if digest is not None:
        while chunk := f.read(1 << 20):  # trailing bytes, if any, are part of the hash too
            digest.update(chunk)
    return out
