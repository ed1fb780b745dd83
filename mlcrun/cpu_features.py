"""The x86 SIMD features our CPU kernels may use, and which of them this machine has.

Shared by the compiler (compiler/target.py sets each feature on or off from the host's flags)
and the runtime (an artifact compiled with a feature this CPU lacks is refused with a message
instead of dying on an illegal instruction at its first matmul). No TVM import.
"""

from __future__ import annotations

import json
from pathlib import Path

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

CPUINFO = Path("/proc/cpuinfo")


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
    return {X86_FEATURES[f[1:]] for f in mattr if f.startswith("+") and f[1:] in X86_FEATURES}


def check_host(target: str, where: str, cpuinfo: Path | None = None) -> None:
    """Refuse a CPU library whose target needs a feature this CPU lacks."""
    flags = host_flags(cpuinfo)
    missing = sorted(required_flags(target) - flags) if flags else []
    if missing:
        raise MlcrunError(
            f"{where}: compiled for a CPU with {', '.join(missing)}, which this CPU lacks; "
            "compile the model again on this machine"
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
