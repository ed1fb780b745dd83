"""Compilation targets: the host CPU (features read from /proc/cpuinfo) and CUDA.

Why not `-mcpu=native` / LLVM's host feature detection: Intel CPUs since Sapphire Rapids
advertise AMX (amx_tile/amx_int8/amx_bf16), but Linux lets a process execute AMX instructions
only after it asks for the tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA)`); without
that request the first one raises SIGILL, and where a hypervisor does not pass the state
through, the request fails. So every SIMD feature is set explicitly from the kernel's flag
list, and AMX (amx-tile and amx-bf16, for the q0bf16 GEMM's tiles) only where this process was
granted the tile state and MLCRUN_AMX is not 0; the runtime asks for the same grant before it
loads a library built with AMX (cpu_features.check_host).
"""

from __future__ import annotations

import functools
import logging

import tvm
from tvm.target import Target

from .. import env
from ..cpu_features import AMX_FEATURES, X86_FEATURES, host_flags, request_amx

LOG = logging.getLogger(__name__)

# Each feature of X86_FEATURES is enabled iff its flag is present and disabled otherwise, so
# the CPU model name (kept for LLVM's instruction scheduling) cannot switch on a vector ISA the
# VM hides. Of the AMX features only AMX_FEATURES are ever enabled (see _amx_usable).
_AMX_ALL = ("amx-tile", "amx-int8", "amx-bf16", "amx-fp16", "amx-complex")


def _amx_usable(flags: set[str]) -> bool:
    """AMX bf16 tiles for the q0bf16 GEMM (schedules/bf16.py): the CPU has them, MLCRUN_AMX
    does not forbid them, and Linux grants this process the tile state (a library built with
    AMX needs that grant wherever it runs; the runtime asks for it before loading)."""
    want = set(AMX_FEATURES.values()) | {"avx512_bf16"}
    return want <= flags and env.amx_allowed() and request_amx()


def _mcpu(flags: set[str]) -> str:
    """LLVM's name for the host (for instruction scheduling) or a generic x86-64 level."""
    host = tvm.target.codegen.llvm_get_system_cpu()
    triple = tvm.target.codegen.llvm_get_system_triple()
    if host and host != "generic" and tvm.target.codegen.llvm_is_valid_cpu(host, triple):
        return host
    if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags:
        return "x86-64-v4"
    if {"avx2", "fma", "bmi2"} <= flags:
        return "x86-64-v3"
    return "x86-64-v2"


@functools.cache
def cpu_target() -> Target:
    """The llvm target for this machine with explicit SIMD features (AMX where granted)."""
    flags = host_flags()
    if not flags:  # not Linux/x86: trust LLVM's own detection
        LOG.warning("no /proc/cpuinfo flags; using Target.from_device(cpu)")
        return Target.from_device(tvm.cpu())
    mattr = [("+" if flag in flags else "-") + feat for feat, flag in X86_FEATURES.items()]
    amx = _amx_usable(flags)
    mattr += [("+" if amx and feat in AMX_FEATURES else "-") + feat for feat in _AMX_ALL]
    if "avx512f" in flags:
        # Our kernels are written for 512-bit vectors; some CPU models prefer 256-bit ones.
        mattr.append("-prefer-256-bit")
    target = Target(
        {
            "kind": "llvm",
            "mtriple": tvm.target.codegen.llvm_get_system_triple(),
            "mcpu": _mcpu(flags),
            "mattr": mattr,
        }
    )
    LOG.debug("cpu target: %s", target)
    return target


def cuda_target(arch: str = "sm_80") -> Target:
    """A CUDA target for `arch` (compiles here without a GPU; NVRTC JITs it when loaded)."""
    return Target({"kind": "cuda", "arch": arch, "host": {"kind": "llvm"}})


def _mattr(target: Target) -> set[str]:
    return {str(a) for a in (target.attrs.get("mattr") or ())}


def vector_bits(target: Target) -> int:
    """SIMD register width the CPU schedules tile for: 512 with AVX-512, 256 with AVX/AVX2,
    128 with neither. Read from the target's features: TVM 0.27's `llvm_get_vector_width`
    answers 512 for every x86 target, an AVX2-only one included (whose 16-lane float tiles
    then need twice the 16 ymm registers it has)."""
    mattr = _mattr(target)
    if "+avx512f" in mattr:
        return 512
    if "+avx2" in mattr or "+avx" in mattr:
        return 256
    if any(a.startswith(("+", "-")) for a in mattr):  # an x86 target without AVX
        return 128
    width = tvm.target.codegen.llvm_get_vector_width(target)  # not set from /proc/cpuinfo
    return width if width and width > 0 else 128


# How an llvm target multiplies int8 codes (compiler/schedules/int8.py), best first: 512-bit
# vpdpbusd (AVX512-VNNI), 256-bit vpdpbusd (AVX-VNNI, VEX), and without VNNI AVX2's
# vpmaddubsw + vpmaddwd pair (what llama.cpp uses there too).
INT8_DOTS = ("avx512vnni", "avxvnni", "avx2")


def int8_dot(target: Target) -> str:
    """The int8 dot product of INT8_DOTS the target has, or "" (none: not an x86 llvm
    target, or no AVX2)."""
    if target.kind.name != "llvm":
        return ""
    mattr = _mattr(target)
    return next((dot for dot in INT8_DOTS if f"+{dot}" in mattr), "")


def amx_bf16(target: Target) -> bool:
    """Whether the target multiplies bf16 in AMX tiles (tdpbf16ps) as well."""
    return target.kind.name == "llvm" and {"+amx-tile", "+amx-bf16"} <= _mattr(target)


def bf16_dot_bits(target: Target) -> int:
    """Width of the bf16 dot product (vdpbf16ps) the target can run: 512 with AVX512-BF16,
    0 without it (or not an x86 llvm target)."""
    if target.kind.name != "llvm":
        return 0
    mattr = _mattr(target)
    return 512 if {"+avx512bf16", "+avx512f"} <= mattr else 0


def resolve_target(device: str) -> Target:
    """Map a device name ("cpu", "llvm", "cuda", "cuda:sm_90") to a compilation target."""
    name, _, arch = device.partition(":")
    if name in ("cpu", "llvm"):
        return cpu_target()
    if name == "cuda":
        return cuda_target(arch or "sm_80")
    raise ValueError(f"device must be one of 'cpu', 'llvm', 'cuda[:sm_XX]'; got {device!r}")
