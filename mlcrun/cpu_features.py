"""The x86 SIMD features our CPU kernels may use, and which of them this machine has.

Shared by the compiler (compiler/target.py sets each feature on or off from the host's flags)
and the runtime (an artifact compiled with a feature this CPU lacks is refused with a message
instead of dying on an illegal instruction at its first matmul). No TVM import.
"""

from __future__ import annotations

import ctypes
import functools
import json
from pathlib import Path

from . import env
from .errors import MlcrunError

# LLVM feature name -> /proc/cpuinfo flag for the SIMD sets our kernels can use.
X86_FEATURES = {
    "sse4.2": "sse4_2",
    "avx": "avx",
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "bmi2": "bmi2",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512cd": "avx512cd",
    "avx512dq": "avx512dq",
    "avx512vl": "avx512vl",
    "avx512vnni": "avx512_vnni",
    "avx512bf16": "avx512_bf16",
    "avx512fp16": "avx512_fp16",
    "avx512vbmi": "avx512vbmi",
    "avxvnni": "avx_vnni",
}

# AMX, used only where the OS grants the tile state (request_amx): LLVM feature -> flag.
AMX_FEATURES = {"amx-tile": "amx_tile", "amx-bf16": "amx_bf16"}

CPUINFO = Path("/proc/cpuinfo")

_SYS_ARCH_PRCTL = 158  # x86-64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def host_flags(cpuinfo: Path | None = None) -> set[str]:
    """The CPU's flags from /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        text = (cpuinfo or CPUINFO).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def required_flags(target: str) -> set[str]:
    """The /proc/cpuinfo flags of the features an llvm target string switches on."""
    try:
        mattr = json.loads(target).get("mattr", [])
    except (ValueError, AttributeError):
        return set()
    known = X86_FEATURES | AMX_FEATURES
    return {known[f[1:]] for f in mattr if f.startswith("+") and f[1:] in known}


def uses_amx(target: str) -> bool:
    """Whether an llvm target string switches AMX on (its library then has AMX kernels)."""
    return AMX_FEATURES["amx-tile"] in required_flags(target)


@functools.cache
def request_amx() -> bool:
    """Ask Linux for the AMX tile state for this process (arch_prctl ARCH_REQ_XCOMP_PERM,
    XTILEDATA): without it the first AMX instruction raises SIGILL. Granted once for every
    thread of the process; False where the kernel or the hypervisor refuses (or not x86-64
    Linux). Needs the amx_tile flag first: the request alone does not say the CPU has it."""
    if "amx_tile" not in host_flags():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


def check_host(target: str, where: str, cpuinfo: Path | None = None) -> None:
    """Refuse a CPU library whose target needs a feature this CPU lacks."""
    flags = host_flags(cpuinfo)
    missing = sorted(required_flags(target) - flags) if flags else []
    if missing:
        raise MlcrunError(
            f"{where}: compiled for a CPU with {', '.join(missing)}, which this CPU lacks; "
            "compile the model again on this machine"
        )
    if uses_amx(target) and not request_amx():
        raise MlcrunError(
            f"{where}: compiled with AMX kernels, but this process was refused the AMX tile "
            f"state (arch_prctl); compile the model again with {env.MLCRUN_AMX}=0"
        )


CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_SIZE_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3}


def l2_cache_bytes(caches: Path | None = None) -> int | None:
    """Size of one core's level-2 cache from sysfs (e.g. "2048K"), None where it is unknown.
    The GEMM sizes the weight rows it keeps hot for a stream of activation rows by it."""
    for index in sorted((caches or CPU_CACHES).glob("index*")):
        try:
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        if level != "2" or kind not in ("Unified", "Data"):
            continue
        unit = _SIZE_UNITS.get(size[-1:].upper())
        digits = size[:-1] if unit else size
        if digits.isdigit() and int(digits) > 0:
            return int(digits) * (unit or 1)
    return None
