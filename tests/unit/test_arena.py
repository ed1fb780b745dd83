"""ffi.arena: the params' memory, on transparent huge pages where the kernel offers them."""

from pathlib import Path

import numpy as np
import pytest

from mlcrun.runtime import ffi


def _mapping(pointer: int) -> dict[str, str]:
    """/proc/self/smaps' fields of the mapping that holds `pointer`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= pointer < end
        elif inside:
            fields[head.rstrip(":")] = rest.strip()
    return fields


def test_arena_is_zeroed_aligned_and_shared_by_its_tensors():
    host = ffi.arena(3 << 20)
    assert host.nbytes == 3 << 20 and not host.any()
    assert host.ctypes.data % ffi.HUGE_PAGE == 0
    tensor = ffi.from_host(host[64:80], (2, 2), "float32")
    assert tensor.data_ptr() == host.ctypes.data + 64  # no byte offset: kernels refuse one
    host[64:80] = np.arange(4, dtype=np.float32).view(np.uint8)
    np.testing.assert_array_equal(np.from_dlpack(tensor), [[0, 1], [2, 3]])
    del host  # the tensor keeps the memory alive
    np.testing.assert_array_equal(np.from_dlpack(tensor), [[0, 1], [2, 3]])
    assert ffi.arena(0).nbytes == 0


def test_arena_asks_for_huge_pages():
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        pytest.skip("no transparent huge pages in this kernel")
    mode = text.split("[", 1)[1].split("]", 1)[0]
    if mode not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {mode!r} here")
    if "THP_enabled:\t0" in Path("/proc/self/status").read_text():
        pytest.skip("transparent huge pages are disabled for this process (prctl)")
    host = ffi.arena(4 << 20)
    host[:] = 1
    fields = _mapping(host.ctypes.data)
    assert fields["THPeligible"] == "1", fields
    if mode == "madvise":  # asked for, not just allowed
        assert "hg" in fields["VmFlags"].split(), fields
