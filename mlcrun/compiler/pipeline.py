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
* On CPU, `trim_vm_bookkeeping` at the end: the relax VM interprets one instruction per
  register release, view and shape, and a small model's step is short enough for those to
  show (3,229 builtin calls per decode step of the default model before, about 500 after).
* On CPU, float32 SiLU legalizes to `x / (1 + fast_exp(-x))` (a vectorizable polynomial
  exp, accurate to a few ulp) instead of a libm `expf` call per element.
* PrimFuncs already in the exported module (the paged KV cache's kernels, some of which lack
  the scheduled attribute) are marked scheduled and never touched on CPU.
"""

from __future__ import annotations

import tvm
from tvm import relax, te, tirx, topi
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


_DEFAULT_SILU = tvm.ir.Op.get("relax.nn.silu").get_attr("FLegalize")


def _fast_silu(bb: relax.BlockBuilder, call: relax.Call) -> relax.Expr:
    """SiLU as `x / (1 + fast_exp(-x))` for float32 on CPU: TVM's default lowers `sigmoid`
    to a libm `expf` call per element, which LLVM cannot vectorize; `topi.fast_exp` is a
    polynomial that it can (a 4-token MLP step spends 5x less in SiLU). Other dtypes keep
    the default legalization."""
    x = call.args[0]
    if str(getattr(x.ty, "dtype", "")) != "float32":
        return _DEFAULT_SILU(bb, call)

    def silu(t: te.Tensor) -> te.Tensor:
        e = topi.fast_exp(topi.negative(t))
        return te.compute(t.shape, lambda *i: t(*i) / (tirx.const(1.0, "float32") + e(*i)))

    return bb.call_te(silu, x, primfunc_name_hint="silu")


def _legalize_and_fuse(target: Target) -> list[tvm.transform.Pass]:
    custom = {"relax.nn.silu": _fast_silu} if target.kind.name == "llvm" else None
    return [
        relax.transform.LegalizeOps(custom),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ]


def _dataflow_lower_and_finalize(target: Target, trim_vm: bool) -> list[tvm.transform.Pass]:
    passes = [
        relax.transform.RewriteDataflowReshape(),
        relax.transform.ToNonDataflow(),
        relax.transform.RemovePurityChecking(),
        relax.transform.CallTIRRewrite(),
        relax.transform.StaticPlanBlockMemory(),
    ]
    if target.kind.name == "cuda":
        passes.append(relax.transform.RewriteCUDAGraph())  # no-op unless enabled by config
    finish = [trim_vm_bookkeeping] if trim_vm and target.kind.name == "llvm" else []
    return passes + [
        relax.transform.LowerAllocTensor(),
        relax.transform.KillAfterLastUse(),
        relax.transform.LowerRuntimeBuiltin(),
        relax.transform.ComputePrimValue(),
        relax.transform.VMShapeLower(),
        relax.transform.AttachGlobalSymbol(),
        *finish,
    ]


_KILL = tvm.ir.Op.get("relax.vm.kill_object")
_ALLOC_TENSOR = tvm.ir.Op.get("relax.vm.alloc_tensor")


def _is_call(value, op=None, packed: str | None = None) -> bool:
    if not isinstance(value, relax.Call):
        return False
    if op is not None:
        return value.op.same_as(op)
    return isinstance(value.op, relax.ExternFunc) and value.op.global_symbol == packed


@relax.expr_functor.mutator
class _Rename(relax.PyExprMutator):
    def __init__(self, names: dict):
        super().__init__()
        self.names = names

    def visit_var_(self, op):
        return self.names.get(op, op)


def _arg_key(arg):
    """Vars by identity, constants (ints, dtypes, strings) by their text."""
    return arg if isinstance(arg, relax.Var) else str(arg)


def _view_key(value):
    """A hashable key for a `make_shape`, `alloc_tensor` or `reshape` call (None for other
    values). A reshape is a view too: the same tensor and the same shape object give the same
    view, and the input of a layer's reshape is the view every layer shares."""
    if _is_call(value, packed="vm.builtin.make_shape"):
        kind = "shape"
    elif _is_call(value, op=_ALLOC_TENSOR):
        kind = "tensor"
    elif _is_call(value, packed="vm.builtin.reshape"):
        kind = "reshape"
    else:
        return None
    return (kind, *(_arg_key(a) for a in value.args))


def _reused_views(bindings: list) -> list:
    """Bindings with repeated views dropped: a `make_shape` equal to an earlier one since the
    shape heap was last written, and an `alloc_tensor` of the same storage, offset, shape and
    dtype as an earlier one (the same memory: one view serves every layer); later uses are
    renamed to the first."""
    names: dict = {}
    rename = _Rename(names)
    seen: dict = {}  # view key -> the var of its first binding
    heaps: set = set()  # the shape heap(s): what make_shape reads
    out = []
    for binding in bindings:
        value = rename.visit_expr(binding.value) if names else binding.value
        key = _view_key(value)
        if key is not None:
            if key in seen:
                names[binding.var] = seen[key]
                continue
            seen[key] = binding.var
        elif _is_call(value, packed="vm.builtin.alloc_shape_heap"):
            heaps.add(binding.var)
        elif isinstance(value, relax.Call) and any(a in heaps for a in value.args):
            # match_shape and shape functions write the heap: forget the shapes read from it.
            seen = {k: v for k, v in seen.items() if k[0] != "shape"}
        out.append(relax.VarBinding(binding.var, value) if value is not binding.value else binding)
    return out


def _trimmed(func: relax.Function) -> relax.Function:
    """`func` without `kill_object` calls, unread tuples and repeated views (see
    trim_vm_bookkeeping). Functions with nested control flow are left alone."""
    bindings = [b for block in func.body.blocks for b in block.bindings]
    if any(isinstance(b.value, (relax.If, relax.SeqExpr, relax.Function)) for b in bindings):
        return func
    bindings = _reused_views([b for b in bindings if not _is_call(b.value, op=_KILL)])
    used = set(relax.analysis.free_vars(func.body.body))
    kept = []
    for binding in reversed(bindings):
        if isinstance(binding.value, relax.Tuple) and binding.var not in used:
            continue
        kept.append(binding)
        used.update(relax.analysis.free_vars(binding.value))
    body = relax.SeqExpr([relax.BindingBlock(list(reversed(kept)))], func.body.body)
    return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)


@tvm.transform.module_pass(opt_level=0, name="mlcrun.TrimVMBookkeeping")
def trim_vm_bookkeeping(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
    """Fewer VM instructions per step, same kernels, same memory.

    After TVM's lowering a decode step of the default model (30 layers) made 3,229 builtin
    calls into the VM, each a few tenths of a microsecond: ~1,160 `kill_object` (release a
    register after its last use), ~740 `make_shape` and ~600 `alloc_tensor` (a view of a
    planned storage for every intermediate of every layer), ~120 tuples nobody reads. This
    pass leaves about 500:
    * no kills: the views' storages are planned and allocated once per call and stay alive
      through their views anyway, and the weights belong to the params tuple; every register
      is released when the function returns (peak RSS of a 512-token prefill unchanged);
    * one view per (storage, offset, shape, dtype) and one shape per (heap, slots) since the
      shape heap was last written: layer 7's view of the norm output's storage is layer 0's;
      likewise one reshape per (tensor, shape): the attention's q/k/v and output reshapes,
      4 per layer (120 calls of the default model's step), are made once;
    * tuples that are never read (CallTIRRewrite's leftovers) dropped."""
    mod = mod.clone()  # never edit the caller's module in place
    for gvar, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[gvar] = _trimmed(func)
    return mod


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
    return [*front, relax.transform.FuseTransposeMatmul(), *_legalize_and_fuse(target), schedules]


def get_pipeline(target: Target, trim_vm: bool = True) -> tvm.transform.Pass:
    """The relax pipeline for an llvm (CPU) or cuda target. `trim_vm=False` keeps the VM code
    as TVM lowers it (for comparison; trim_vm_bookkeeping runs on CPU only, where it is
    tested)."""
    kind = target.kind.name
    if kind not in ("llvm", "cuda"):
        raise ValueError(f"unsupported target kind {kind!r}: expected 'llvm' or 'cuda'")

    @tvm.transform.module_pass(opt_level=0, name="mlcrun.Pipeline")
    def _pipeline(mod: tvm.IRModule, _ctx: tvm.transform.PassContext) -> tvm.IRModule:
        passes = scheduled_tir_passes(target) + _dataflow_lower_and_finalize(target, trim_vm)
        with target:
            return tvm.transform.Sequential(passes)(mod)

    return _pipeline
