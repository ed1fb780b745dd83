"""The part of TVM that running a compiled library needs, and no more.

`import tvm` loads the whole compiler: libtvm_compiler.so (LLVM included) and the Python
packages of relax, tirx, s_tir, ... (about 1.2 s and 150 MB of resident memory). Running an
artifact needs only `tvm_ffi` (objects, functions, tensors, modules) and libtvm_runtime.so
(the relax VM, the paged KV cache, the thread pool), loaded here exactly as `tvm.base` loads it
(RTLD_GLOBAL, from the tvm package's lib folder), so that a later `import tvm` in the same
process (to compile) finds the same library and everything keeps working.

Objects come back as tvm_ffi's own classes (`tvm_ffi.Tensor`, `tvm_ffi.Module`), or as tvm's
subclasses of them once `tvm` is imported: the helpers below use only what both have. Tensors
on the CPU are shared with numpy through DLPack, without copies.

Like mlcrun/_tvm.py, this keeps `tvm_ffi` from importing torch (for DLPack interop mlcrun never
uses); a CUDA device needs tvm's backend loading, so `device("cuda")` imports all of tvm.
"""

from __future__ import annotations

import contextlib
import importlib.util
import mmap
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np


@contextlib.contextmanager
def without_torch() -> Iterator[None]:
    """`import torch` fails inside (unless torch is already imported); torch stays importable
    afterwards."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if blocked and sys.modules.get("torch", False) is None:
            del sys.modules["torch"]


with without_torch():
    import tvm_ffi


def _load_runtime_library() -> None:
    """libtvm_runtime.so, as tvm.base loads it (a no-op when tvm is imported already)."""
    if "tvm.base" in sys.modules:
        return
    from tvm_ffi.libinfo import load_lib_ctypes

    spec = importlib.util.find_spec("tvm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("apache-tvm is not installed")
    paths = [Path(p) / "lib" for p in spec.submodule_search_locations]
    if os.environ.get("TVM_LIBRARY_PATH"):  # as tvm.libinfo.package_lib_paths
        paths.insert(0, Path(os.environ["TVM_LIBRARY_PATH"]))
    load_lib_ctypes("tvm", "tvm_runtime", "RTLD_GLOBAL", extra_lib_paths=paths)


_load_runtime_library()

Tensor = tvm_ffi.Tensor
Shape = tvm_ffi.Shape
Device = tvm_ffi.Device
Function = tvm_ffi.Function

_CPU = tvm_ffi.device("cpu", 0)
_functions: dict[str, Function] = {}


def global_func(name: str) -> Function:
    """A global function of the runtime (looked up once)."""
    func = _functions.get(name)
    if func is None:
        func = _functions[name] = tvm_ffi.get_global_func(name)
    return func


def cpu() -> Device:
    return _CPU


def cuda_device() -> Device | None:
    """The first CUDA GPU, or None when there is none. Loads all of tvm (its CUDA backend)."""
    with without_torch():
        import tvm

    dev = tvm.cuda(0)
    return dev if dev.exist else None


def is_cpu(dev: Device) -> bool:
    return dev.dlpack_device_type() == _CPU.dlpack_device_type()


def empty(shape: Sequence[int], dtype: str, dev: Device = _CPU) -> Tensor:
    return global_func("runtime.TVMTensorAllocWithScope")(
        Shape(tuple(int(d) for d in shape)), tvm_ffi.dtype(dtype), dev, None
    )


ALIGNMENT = 64  # bytes: what TVM's allocator gives, and what compiled kernels assume of a param
HUGE_PAGE = 2 << 20  # x86-64's transparent huge page


def arena(nbytes: int) -> np.ndarray:
    """`nbytes` of fresh, zeroed CPU memory as a uint8 array, to hold tensors (`from_host`).

    The memory is a private anonymous mapping marked for transparent huge pages (madvise,
    where the OS has it) before anything is written, and it starts on a huge-page boundary
    (the mapping is one huge page longer; the part before the boundary is never touched, so
    it takes no memory). Weights then sit on 2 MB pages rather than 4 KB ones, and a decode
    step that streams them walks 512x fewer page-table entries: SmolLM2 F32 decode at batch 1
    (2 threads, a Xeon with THP in its usual `madvise` mode) +8-10%. malloc, which TVM's own
    allocations use, gets 4 KB pages in that mode."""
    if hasattr(mmap, "MAP_ANONYMOUS"):  # private: a shared mapping is shmem, without THP
        flags = {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS}
    else:
        flags = {}
    memory = mmap.mmap(-1, nbytes + HUGE_PAGE, **flags)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # THP off, or not in this kernel: 4 KB pages
            memory.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(memory, np.uint8)
    skip = -whole.ctypes.data % HUGE_PAGE
    return whole[skip : skip + nbytes]


def from_host(memory: np.ndarray, shape: Sequence[int], dtype: str) -> Tensor:
    """A CPU tensor over `memory` (contiguous uint8, ALIGNMENT-aligned, the tensor's exact
    size), sharing it: the data pointer is the memory's own (compiled functions refuse a
    tensor with a byte offset), and the tensor keeps the memory alive."""
    return view(tvm_ffi.from_dlpack(memory, require_alignment=ALIGNMENT), shape, dtype)


def nbytes(shape: Sequence[int], dtype: str) -> int:
    d = tvm_ffi.dtype(dtype)
    return (int(np.prod(shape, dtype=np.int64)) * d.bits * d.lanes + 7) // 8


def as_numpy(tensor: Tensor) -> np.ndarray:
    """A CPU tensor's memory as a writable numpy array (no copy); other devices: a copy."""
    if is_cpu(tensor.device):
        return np.from_dlpack(tensor)
    host = empty(tensor.shape, str(tensor.dtype))
    global_func("runtime.TVMTensorCopyFromTo")(tensor, host)
    return np.from_dlpack(host)


def from_numpy(array: np.ndarray, dev: Device = _CPU) -> Tensor:
    """A new tensor on `dev` holding a copy of `array`."""
    array = np.ascontiguousarray(array)
    host = empty(array.shape, str(array.dtype))
    np.from_dlpack(host)[...] = array
    return host if is_cpu(dev) else copy_to(host, dev)


def copy_to(tensor: Tensor, dev: Device) -> Tensor:
    out = empty(tensor.shape, str(tensor.dtype), dev)
    global_func("runtime.TVMTensorCopyFromTo")(tensor, out)
    return out


_shapes: dict[tuple[int, ...], Shape] = {}


def array(items: Sequence) -> tvm_ffi.Array:
    """An FFI array of `items` (e.g. tensors), to pass to many calls without converting the
    Python list each time."""
    return tvm_ffi.Array(list(items))


def shape(values: Sequence[int]) -> Shape:
    """An ffi Shape of `values` (immutable, so made once: building one costs microseconds,
    and a decode step passes the same few every time)."""
    key = tuple(values)
    out = _shapes.get(key)
    if out is None:
        if len(_shapes) >= 1024:
            _shapes.clear()
        out = _shapes[key] = Shape(key)
    return out


def view(tensor: Tensor, shape_: Sequence[int], dtype: str | None = None) -> Tensor:
    """The same memory under another shape (and dtype; the same number of bytes)."""
    dt = tensor.dtype if dtype is None else tvm_ffi.dtype(dtype)
    return global_func("runtime.TVMTensorCreateView")(tensor, shape(shape_), dt, 0)


def load_module(path: str | Path):
    return tvm_ffi.load_module(str(path))


class VirtualMachine:
    """The relax VM over a loaded library (what tvm.relax.VirtualMachine does, pooled
    allocator, without importing relax)."""

    POOLED_ALLOCATOR = 2

    def __init__(self, lib, dev: Device) -> None:
        self.module = lib["vm_load_executable"]()
        args = [dev.dlpack_device_type(), dev.index, self.POOLED_ALLOCATOR]
        if not is_cpu(dev):  # the VM also needs the host
            args += [_CPU.dlpack_device_type(), 0, self.POOLED_ALLOCATOR]
        self.module["vm_initialization"](*args)

    def __getitem__(self, name: str) -> Function:
        return self.module[name]

    def set_instrument(self, instrument) -> None:
        """See tvm.runtime.vm.VirtualMachine.set_instrument (None: stop)."""
        self.module["set_instrument"](instrument)
