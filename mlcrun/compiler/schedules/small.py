"""Small kernels run on the calling thread: a parallel loop whose whole work is a few thousand
elements becomes serial, below a runtime guard where its extent is symbolic.

A parallel loop is a thread-pool launch: the calling thread wakes the workers, runs its share
and waits for theirs. That fork and join costs about 2 us on a 2-core Xeon even with the
workers spinning (a parallel loop of one iteration: 2.1 us a call, the same loop serial
0.2 us), more than the whole work of a decode step's norms, SiLU * up, embedding row and
RoPE (one row of a few hundred to a few thousand elements). A decode step of SmolLM2 made
about 120 such launches.

`serial_when_small` estimates the elements a parallel loop touches (the product of its static
loop extents, summed over sequential parts; a loop of symbolic extent inside counts as large)
and, when they stay under MIN_PARALLEL_ELEMENTS,
* with a static extent: makes the loop serial;
* with a symbolic one (rows = tokens in the step): keeps the parallel loop for
  `extent >= ceil(MIN_PARALLEL_ELEMENTS / per-iteration elements)` and runs a serial copy of
  it below that (a loop whose body allocates a buffer keeps its launch: TVM's ConvertSSA,
  which gives the copy fresh loop and block variables, does not renew block buffers).
Applied to the row reductions, injective and fallback kernels (schedules/cpu.py); the matmul,
attention and RoPE kernels decide their own threading. SmolLM2 Q4_1, 2 threads, Intel Xeon:
a decode step's norms, SiLU * up and embedding row took 0.08 ms less, about 2% of the step.
"""

from __future__ import annotations

import tvm
from tvm import s_tir, tirx

# Elements under which a parallel loop runs serially: at a few elements per nanosecond
# (vectorized, from cache), about 2-4 us of work, the cost of the launch it saves.
MIN_PARALLEL_ELEMENTS = 16384
_LARGE = 1 << 40


def elements(stmt: tirx.Stmt) -> int:
    """The elements `stmt` touches, estimated: loop extents multiplied, sequential parts
    added; a symbolic extent or a while loop counts as large."""
    if isinstance(stmt, tirx.For):
        if not isinstance(stmt.extent, tirx.IntImm):
            return _LARGE
        return min(_LARGE, int(stmt.extent.value) * elements(stmt.body))
    if isinstance(stmt, tirx.SeqStmt):
        return min(_LARGE, sum(elements(s) for s in stmt.seq))
    if isinstance(stmt, s_tir.SBlockRealize):
        return elements(stmt.block)
    if isinstance(stmt, s_tir.SBlock):
        return elements(stmt.body) + (elements(stmt.init) if stmt.init is not None else 0)
    if isinstance(stmt, tirx.IfThenElse):
        other = elements(stmt.else_case) if stmt.else_case is not None else 0
        return max(elements(stmt.then_case), other)
    if isinstance(stmt, (tirx.LetStmt, tirx.AttrStmt)):
        return elements(stmt.body)
    if isinstance(stmt, tirx.While):
        return _LARGE
    return 1


def _loop(loop: tirx.For, kind: tirx.ForKind, body: tirx.Stmt) -> tirx.For:
    """`loop` with another kind and body."""
    return tirx.For(
        loop.loop_var, loop.min, loop.extent, kind, body, loop.thread_binding, loop.annotations
    )


def _serial(loop: tirx.For) -> tirx.For:
    return _loop(loop, tirx.ForKind.SERIAL, loop.body)


def _allocates(stmt: tirx.Stmt) -> bool:
    """Whether a block inside `stmt` allocates a buffer (ConvertSSA would not renew it in a
    copy of `stmt`, and TVM refuses a buffer defined twice)."""
    if isinstance(stmt, s_tir.SBlockRealize):
        return _allocates(stmt.block)
    if isinstance(stmt, s_tir.SBlock):
        return bool(stmt.alloc_buffers) or _allocates(stmt.body)
    if isinstance(stmt, tirx.SeqStmt):
        return any(_allocates(s) for s in stmt.seq)
    if isinstance(stmt, tirx.IfThenElse):
        return _allocates(stmt.then_case) or (
            stmt.else_case is not None and _allocates(stmt.else_case)
        )
    if isinstance(stmt, (tirx.For, tirx.LetStmt, tirx.AttrStmt, tirx.While)):
        return _allocates(stmt.body)
    return False


def _guard(loop: tirx.For) -> tirx.Stmt:
    """The parallel `loop`, serial where it is small (see the module docstring)."""
    per_iteration = max(1, elements(loop.body))
    if per_iteration >= MIN_PARALLEL_ELEMENTS:
        return loop
    if isinstance(loop.extent, tirx.IntImm):
        small = int(loop.extent.value) * per_iteration < MIN_PARALLEL_ELEMENTS
        return _serial(loop) if small else loop
    if _allocates(loop.body):  # no copy possible: keep the launch
        return loop
    rows = -(-MIN_PARALLEL_ELEMENTS // per_iteration)
    return tirx.IfThenElse(loop.extent >= rows, loop, _serial(loop))


def _rewrite(stmt: tirx.Stmt) -> tirx.Stmt:
    """`stmt` with each outermost parallel loop guarded (blocks and serial loops above it
    rebuilt, everything else kept as it is)."""
    if isinstance(stmt, tirx.For):
        if stmt.kind == tirx.ForKind.PARALLEL:
            return _guard(stmt)
        body = _rewrite(stmt.body)
        return stmt if body.same_as(stmt.body) else _loop(stmt, stmt.kind, body)
    if isinstance(stmt, tirx.SeqStmt):
        parts = [_rewrite(s) for s in stmt.seq]
        if all(p.same_as(s) for p, s in zip(parts, stmt.seq, strict=True)):
            return stmt
        return tirx.SeqStmt(parts)
    if isinstance(stmt, s_tir.SBlockRealize):
        block = stmt.block
        body = _rewrite(block.body)
        if body.same_as(block.body):
            return stmt
        new = s_tir.SBlock(
            block.iter_vars,
            block.reads,
            block.writes,
            block.name_hint,
            body,
            block.init,
            block.alloc_buffers,
            block.match_buffers,
            block.annotations,
        )
        return s_tir.SBlockRealize(stmt.iter_values, stmt.predicate, new)
    return stmt


def serial_when_small(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """`func` with its small parallel loops serial (see the module docstring)."""
    body = _rewrite(func.body)
    if body.same_as(func.body):
        return func
    # The serial copy redefines the parallel loop's variables and blocks: give them fresh ones.
    mod = tvm.IRModule({"main": func.with_body(body)})
    return s_tir.transform.ConvertSSA()(mod)["main"]
