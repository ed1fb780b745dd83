"""The relax compilation pipeline: `tvm.compile(mod, target, relax_pipeline=get_pipeline(target))`.

Differences from TVM's default llvm pipeline, and why:

* `FuseTransposeMatmul` before legalization: with packed params every nn.Linear is
  `matmul(x, permute_dims(w))`; legalized naively that materializes every weight transpose
  on every call. Fused, it becomes one NT matmul reading W in place.
* float16 matmuls accumulate in float32 (then cast back): x86 has no fp16 arithmetic, and
  long fp16 sums lose precision.
* Our CPU schedules (schedules/cpu.py) after FuseTIR; the default llvm pipeline schedules
  nothing (~1 token/s for a 135M model). For cuda the wheel's s_tir.dlight GPU rules, as in
  tvm/relax/backend/cuda/pipeline.py.
* PrimFuncs already in the exported module (the paged KV cache's kernels, some of which lack
  the scheduled attribute) are marked scheduled and never touched on CPU.
"""

from __future__ import annotations

import tvm
from tvm import relax, tirx
from tvm.relax.dpl import is_op, rewrite_call, wildcard
from tvm.target import Target

from ..quant.modules import SCHEDULABLE_ATTR
from .schedules.cpu import SCHEDULED_ATTR, ApplyCPUSchedules, is_scheduled


@tvm.transform.module_pass(opt_level=0, name="mlcrun.AccumulateF16MatmulInF32")
def accumulate_f16_matmul_in_f32(
    mod: tvm.IRModule, _ctx: tvm.transform.PassContext
) -> tvm.IRModule:
    """Rewrite `matmul(a16, b16)` into `astype(matmul(a16, b16, out_dtype=f32), f16)`."""
    pattern = is_op("relax.matmul")(wildcard(), wildcard())

    def rewriter(expr: relax.Expr, matches: dict) -> relax.Expr:
        call = matches[pattern]
        a, b = call.args
        dtypes = {str(getattr(x.ty, "dtype", "")) for x in (a, b, call)}
        if dtypes != {"float16"}:
            return expr
        return relax.op.astype(relax.op.matmul(a, b, out_dtype="float32"), "float16")

    mod = mod.clone()  # never edit the caller's module in place
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gvar] = rewrite_call(pattern, rewriter, func)
    return mod


def _legalize_and_fuse() -> list[tvm.transform.Pass]:
    return [
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]


def _dataflow_lower_and_finalize(target: Target) -> list[tvm.transform.Pass]:
    passes = [
        relax.transform.RewriteDataflowReshape(),
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),
        relax.transform.StaticPlanBlockMemory(),
    ]
    if target.kind.name == "cuda":
        passes.append(relax.transform.RewriteCUDAGraph())  # no-op unless enabled by config
    return passes + [
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        relax.transform.AttachGlobalSymbol(),
    ]


def _gpu_schedules() -> tvm.transform.Pass:
    from tvm.s_tir import dlight as dl  # noqa: PLC0415 - GPU only

    return dl.ApplyDefaultSchedule(
        dl.gpu.Matmul(),
        dl.gpu.GEMV(),
        dl.gpu.Reduction(),
        dl.gpu.GeneralReduction(),
        dl.gpu.Fallback(),
    )


@tvm.transform.module_pass(opt_level=0, name="mlcrun.KeepExportedKernels")
def keep_exported_kernels(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Mark every PrimFunc already in the module (the paged KV cache's attention, copy and
    RoPE kernels, some without the attribute) as scheduled, so no CPU rule touches them --
    except the quantized layers' TE kernels, which carry SCHEDULABLE_ATTR."""
    mod = mod.clone()  # never edit the caller's module in place
    for gvar, func in list(mod.functions_items()):
        if not isinstance(func, tirx.PrimFunc) or is_scheduled(func):
            continue
        if not (func.attrs is not None and func.attrs.get(SCHEDULABLE_ATTR, False)):
            mod[gvar] = func.with_attr(SCHEDULED_ATTR, True)
    return mod


def scheduled_tir_passes(target: Target) -> list[tvm.transform.Pass]:
    """Passes from the exported module up to scheduled TIR, without lowering (the first
    part of `get_pipeline`; handy to inspect the kernels)."""
    front = [relax.backend.DispatchSampling(), relax.backend.DispatchSortScan()]
    if target.kind.name == "llvm":
        front += [keep_exported_kernels, accumulate_f16_matmul_in_f32]
        schedules = ApplyCPUSchedules(target)
    else:
        schedules = _gpu_schedules()  # every unscheduled GPU kernel needs thread bindings
    return [*front, relax.transform.FuseTransposeMatmul(), *_legalize_and_fuse(), schedules]


def get_pipeline(target: Target) -> tvm.transform.Pass:
    """The relax pipeline for an llvm (CPU) or cuda target."""
    kind = target.kind.name
    if kind not in ("llvm", "cuda"):
        raise ValueError(f"unsupported target kind {kind!r}: expected 'llvm' or 'cuda'")

    @tvm.transform.module_pass(opt_level=0, name="mlcrun.Pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        passes = scheduled_tir_passes(target) + _dataflow_lower_and_finalize(target)
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
