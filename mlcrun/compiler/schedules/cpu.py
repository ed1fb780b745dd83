"""CPU schedule rules, applied to every PrimFunc that is not already scheduled.

Rules are tried in order; the first that applies wins:

0. `int8.schedule` / `bf16.schedule`: the int8- and bf16-activation ops of quant/modules.py
   (recognised by their block annotations), hand-written int8 (VNNI, AVX2) / vdpbf16ps kernels.
1. `matmul.schedule`: NT matmul + epilogue (every Linear); GEMV/GEMM variants, see matmul.py.
2. `norm.schedule`: RMSNorm (relax's legalized `nn.rms_norm`), a two-pass vector kernel.
   Other row reductions (softmax, ...): the wheel's `s_tir.dlight.cpu.Reduction` (parallel
   over rows, vectorized elementwise parts) -- these are a tiny share of the time.
3. Injective functions (SiLU*mul, residual add, embedding take, casts, logits slice):
   everything inlined into one loop nest, parallel over the outer loops, vectorized inside.
4. Fallback: parallelize the outermost data-parallel loop of each block, so nothing stays a
   single-threaded scalar loop nest where a parallel loop is legal.

A rule that raises is logged and skipped: a slower kernel is better than a failed compile.
"""

from __future__ import annotations

import logging

import tvm
from tvm import s_tir, tirx
from tvm.relax.analysis import has_reshape_pattern
from tvm.s_tir.dlight.cpu import Reduction
from tvm.target import Target

from ...cpu_features import l2_cache_bytes
from ..target import amx_bf16, bf16_dot_bits, int8_dot, vector_bits
from . import bf16, int8, matmul, norm
from .small import serial_when_small

LOG = logging.getLogger(__name__)

SCHEDULED_ATTR = "tirx.is_scheduled"


def _root(sch: s_tir.Schedule) -> s_tir.schedule.SBlockRV:
    return sch.get_sblock(sch.mod["main"].body.block.name_hint)


def _is_spatial(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV) -> bool:
    return all(iv.iter_type == tirx.IterVar.DataPar for iv in sch.get(block).iter_vars)


def _static(extent: tirx.PrimExpr) -> int | None:
    return int(extent.value) if isinstance(extent, tirx.IntImm) else None


def _vectorize_and_parallelize(
    sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, lanes: int
) -> None:
    """Split a vector off the innermost static loop, fuse the rest and run it in parallel."""
    loops = sch.get_loops(block)
    if not loops:
        return
    inner = _static(sch.get(loops[-1]).extent)
    vec = None
    if inner is not None and inner > 1:
        width = next((w for w in (lanes, lanes // 2, lanes // 4, 2) if w > 1 and inner % w == 0), 1)
        if width > 1:
            outer, vec = sch.split(loops[-1], [None, width])
            loops = [*loops[:-1], outer]
    # The pool splits a parallel loop statically into one range per thread, so a single
    # fused loop over everything but the vector is the whole story.
    outer = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    sch.parallel(outer)
    if vec is not None:
        sch.vectorize(vec)


def schedule_injective(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """Functions made only of spatial blocks: inline into one nest, parallel + vectorize."""
    sch = s_tir.Schedule(func)
    blocks = sch.get_child_blocks(_root(sch))
    if not blocks or not all(_is_spatial(sch, b) for b in blocks):
        return None
    for block in blocks[:-1]:  # producers into the output block where possible
        try:
            sch.compute_inline(block)
        except Exception:  # noqa: BLE001 - multi-consumer or non-inlinable: keep the block
            pass
    for block in sch.get_child_blocks(_root(sch)):
        _vectorize_and_parallelize(sch, block, lanes)
    return sch.mod["main"]


def schedule_reduction(func: tirx.PrimFunc, target: Target) -> tirx.PrimFunc | None:
    """Row-wise reductions (norms, softmax): one row per parallel task."""
    sch = Reduction().apply(func, target, False)
    return None if sch is None else sch.mod["main"]


def schedule_fallback(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """Parallelize the outermost loop of each block when that is legal."""
    sch = s_tir.Schedule(func)
    changed = False
    for block in sch.get_child_blocks(_root(sch)):
        loops = sch.get_loops(block)
        if not loops:
            continue
        try:
            sch.parallel(loops[0])
            changed = True
        except Exception:  # noqa: BLE001 - reduction or shared loop: leave it serial
            continue
    return sch.mod["main"] if changed else None


def gemm_tuning(target: Target) -> matmul.GemmTuning:
    """The GEMM's cache blocking for the CPU being compiled for: a CPU target is always this
    machine's (compiler/target.py), so its L2 comes from sysfs."""
    return matmul.GemmTuning.for_cpu(l2_cache_bytes(), str(target.attrs.get("mcpu", "")))


def _small(func: tirx.PrimFunc | None) -> tirx.PrimFunc | None:
    """A norm, elementwise or fallback kernel runs serially where its work is a few thousand
    elements (small.py: a thread-pool launch costs more). A reshape is left as it is: the
    relax pipeline turns a kernel it recognises as a reshape into a view (no copy at all),
    and a guarded copy no longer looks like one."""
    if func is None or has_reshape_pattern(func):
        return func
    return serial_when_small(func)


def schedule_func(func: tirx.PrimFunc, target: Target) -> tirx.PrimFunc | None:
    """Schedule one PrimFunc for `target` (an llvm target), or None if no rule applies."""
    bits = vector_bits(target)
    tuning = gemm_tuning(target)
    rules = [
        ("int8", lambda f: int8.schedule(f, int8_dot(target))),  # int8 activations
        ("bf16", lambda f: bf16.schedule(f, bf16_dot_bits(target), amx_bf16(target))),
        ("matmul", lambda f: matmul.schedule(f, bits, tuning)),
        ("norm", norm.schedule),
        ("reduction", lambda f: _small(schedule_reduction(f, target))),
        ("injective", lambda f: _small(schedule_injective(f, max(bits // 32, 1)))),
        ("fallback", lambda f: _small(schedule_fallback(f))),
    ]
    for name, rule in rules:
        try:
            result = rule(func)
        except Exception as err:  # noqa: BLE001 - see module docstring
            LOG.warning("CPU rule %s failed (%s); trying the next one", name, err)
            continue
        if result is not None:
            return result.with_attr(SCHEDULED_ATTR, True)
    return None


def is_scheduled(func: tirx.PrimFunc) -> bool:
    return bool(func.attrs is not None and func.attrs.get(SCHEDULED_ATTR, False))


@tvm.transform.module_pass(opt_level=0, name="mlcrun.ApplyCPUSchedules")
class ApplyCPUSchedules:  # pylint: disable=too-few-public-methods
    """Schedule every PrimFunc of the module that does not carry the scheduled attribute."""

    def __init__(self, target: Target) -> None:
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        mod = mod.clone()  # never edit the caller's module in place
        for gvar, func in list(mod.functions_items()):
            if not isinstance(func, tirx.PrimFunc) or is_scheduled(func):
                continue
            new_func = schedule_func(func, self.target)
            if new_func is not None:
                mod[gvar] = new_func
            else:
                LOG.debug("no CPU schedule for %s", gvar.name_hint)
        return mod
