"""Loading the artifact's .so, its params, and the CPU thread pool."""

from __future__ import annotations

import json
import os
from pathlib import Path

import tvm
from safetensors import safe_open
from tvm import relax

from .. import abi, artifact
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
    a process decides. An explicit TVM_NUM_THREADS in the environment wins over the default."""
    n = num_threads or int(os.environ.get("TVM_NUM_THREADS", 0)) or len(os.sched_getaffinity(0))
    os.environ["TVM_NUM_THREADS"] = str(n)
    return n


def load_vm(folder: Path, art: artifact.Artifact, dev) -> relax.VirtualMachine:
    path = Path(folder) / art.library
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
    try:
        vm[name]
    except (AttributeError, KeyError, RuntimeError, tvm.error.TVMError):
        return False
    return True


def load_params(folder: Path, art: artifact.Artifact, dev) -> list[tvm.runtime.Tensor]:
    """Params in the order the library's functions take them."""
    tensors: dict[str, tvm.runtime.Tensor] = {}
    for name in art.param_files:
        with safe_open(str(Path(folder) / artifact.PARAMS_DIR / name), "numpy") as f:
            for key in f.keys():
                tensors[key] = tvm.runtime.tensor(f.get_tensor(key), dev)
    missing = [p.name for p in art.params if p.name not in tensors]
    if missing:
        raise MlcrunError(f"{folder}: param {missing[0]!r} is missing from the params files")
    for p in art.params:
        t = tensors[p.name]
        if tuple(t.shape) != tuple(p.shape) or str(t.dtype) != p.dtype:
            raise MlcrunError(f"{folder}: param {p.name!r} has the wrong shape or dtype")
    return [tensors[p.name] for p in art.params]
