"""Lower a tern Graph to an MLIR module (linalg on tensors, tensor, arith, math, util).

An op whose kernel attribute names a row of the kernel table (kernels/table.py, set by
the `kernels` and `ternary` passes, which alone choose) is emitted by that row's `emit`;
any other op by its registry entry: `lower` emits MLIR directly; a composite's
`decompose` is expanded into other tern ops first, which are then lowered. Symbolic
dims become dynamic dims whose sizes are read with `tensor.dim` from the function
argument that introduced each symbol. After lowering, a legality check makes sure no
op outside the dialects IREE accepts is left (an unknown op reaching IREE in-process
can crash the interpreter). With a `ParamTable` (codegen.params), constants whose
value is a `Parameter` become `util.global`s of `#flow.parameter.named` values.

The lowering reports, with the module, the IREE flags its kernels need on top of the
target's (the flags of the table's rows it emitted): the drivers (tc.compile,
tc.compile_lm) pass them on to IREE.

    >>> lowered = to_mlir(graph, ctx, targets=["llvm-cpu"])
    >>> lowered.module, lowered.flags            # e.g. ['--iree-opt-data-tiling=true', ...]
"""
from __future__ import annotations

import inspect
from typing import NamedTuple

from iree.compiler import ir
from iree.compiler.dialects import func

from ..errors import CompileError, TercompError
from ..ir import Graph, Op
from ..ir.graph import regions
from ..ops import GraphBuilder, get
from ..codegen.builders import LowerCtx, tensor_type
from ..codegen.targets import WITH_16BIT_STORAGE
from ..kernels import table as kernel_table

LEGAL_DIALECTS = ("builtin", "func", "arith", "math", "linalg", "tensor", "scf", "flow", "util", "hal",
                  "iree_linalg_ext")
#: Hand-written executables (codegen/executables.py): IREE compiles their bodies as they
#: are, so the check does not look inside.
OPAQUE_OPS = ("stream.executable",)


class Lowered(NamedTuple):
    """A lowered MLIR module and what IREE needs to compile it as lowered."""
    module: ir.Module
    flags: list          # IREE flags the module's kernels need on top of the target's
    kernels: list        # the ternary strategies its ops emitted, sorted


def _location(op: Op) -> ir.Location:
    return ir.Location.file(op.loc.file, max(op.loc.line, 0), max(op.loc.col, 0))


def lower_op(ctx: LowerCtx, op: Op):
    opdef = get(op.opname)
    row = kernel_table.row_of(op.opname, op.attrs)
    with _location(op):
        results = None
        if row is not None:
            ctx.kernels.add(row)         # the module needs its IREE flags
            results = row.emit(ctx, op, [ctx.values[v] for v in op.operands])
        elif opdef.lower is not None:
            results = _run(opdef.lower(ctx, op, [ctx.values[v] for v in op.operands]))
        if results is None and opdef.decompose is not None:
            results = _lower_decomposition(ctx, op, opdef)
        if results is None:
            raise CompileError(f"tern.{op.opname} has no lowering to MLIR", loc=op.loc,
                               hint="run the pass that rewrites it first (e.g. the ternary "
                                    "pass), or that settles its kernel (the kernels pass)")
    for r, m in zip(op.results, results):
        ctx.values[r] = m


def _run(results):
    """The results of an op's lowering. The lowering of an op with a body (tern.scan,
    tern.checkpoint) is a generator: it builds the region, yields (child context, the
    body's ops) for this driver to lower at the insertion point it set, and goes on with
    the body's values; its return value is the op's results. An error in the body ends
    it through its own `with` blocks (insertion points, locations) before it propagates."""
    if not inspect.isgenerator(results):
        return results
    gen = results
    try:
        request = next(gen)
        while True:
            sub, ops = request
            try:
                for op in ops:
                    lower_op(sub, op)
            except BaseException as e:
                request = gen.throw(e)
            else:
                request = gen.send(None)
    except StopIteration as done:
        return done.value


def _lower_decomposition(ctx: LowerCtx, op: Op, opdef) -> list:
    scratch = Graph(name="decomposition")
    b = GraphBuilder(scratch, op.loc)
    outs = opdef.decompose(b, list(op.operands), op.attrs)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    for sub in scratch.ops:
        lower_op(ctx, sub)
    return [ctx.values[v] for v in outs]


#: The argument `transients=True` appends to a function: the caller's storage for every
#: buffer IREE allocates and frees within one call (IREE's `iree.abi.transients`).
TRANSIENTS_ARG = "!hal.buffer_view"


def lower_graph(graph: Graph, module: ir.Module, params=None, targets=("llvm-cpu",),
                transients: bool = False) -> set:
    """Append `func.func @<graph.name>` to `module` (inside an active context); returns
    the kernel table's rows its ops were emitted with (see `lowered`). `params`: the ParamTable
    that parameter constants are declared in; `targets`: the target names the module
    is compiled for (LowerCtx.targets).

    With `transients`, the function takes one more argument, last, after the graph's
    inputs: a `!hal.buffer_view {iree.abi.transients}` into which IREE places every
    buffer that lives only within a call, instead of taking them from the device's queue
    pool each call (on local-task that pool's slabs are calloc'ed and unmapped again
    every call: a training step page-faulted ~700 MB a call, bench/RESULTS.md). IREE
    records the bytes it needs in the function's reflection
    (`iree.abi.transients.size.constant` for static shapes, else a size query function
    of the same arguments); CompiledModule allocates them and passes them to every call."""
    arg_types = [tensor_type(v.type) for v in graph.inputs]
    res_types = [tensor_type(v.type) for v in graph.outputs]
    with ir.InsertionPoint(module.body), ir.Location.unknown():
        extra = [ir.Type.parse(TRANSIENTS_ARG)] if transients else []
        fop = func.FuncOp(graph.name, (arg_types + extra, res_types))
        if transients:
            plain = ir.DictAttr.get({})
            fop.arg_attrs = ir.ArrayAttr.get(
                [plain] * len(arg_types) + [ir.DictAttr.get({"iree.abi.transients": ir.UnitAttr.get()})])
        entry = fop.add_entry_block()
    sources = {}
    for v, a in zip(graph.inputs, entry.arguments):
        for axis, d in enumerate(v.type.shape):
            if not isinstance(d, int) and d.is_Symbol and d not in sources:
                sources[d] = (a, axis)
    ctx = LowerCtx(sources, params=params, targets=targets)
    if params is not None:
        params.anchor = fop          # globals go before the function that first reads them
    for v, a in zip(graph.inputs, entry.arguments):
        ctx.values[v] = a
    with ir.InsertionPoint(entry), ir.Location.unknown():
        for op in graph.ops:
            try:
                lower_op(ctx, op)
            except CompileError as e:
                if e.loc is None and op.loc is not None:   # name the user's line
                    raise CompileError(e.message, loc=op.loc, hint=e.hint) from None
                raise
            except TercompError:
                raise
            except Exception as e:
                raise CompileError(f"lowering tern.{op.opname} to MLIR failed: {e}", loc=op.loc) from None
        func.ReturnOp([ctx.values[v] for v in graph.outputs])
    return ctx.kernels


def lowered(module: ir.Module, kernels: set, targets=("llvm-cpu",)) -> Lowered:
    """`module` with the IREE flags of the kernel table's rows (`kernels`) it was emitted
    with, each checked to compile for `targets` (a CPU-only kernel for a GPU fails here,
    by name, instead of inside IREE's GPU pipeline), and its ternary strategies."""
    return Lowered(module, kernel_table.flags(kernels, targets),
                   sorted(r.kernel for r in kernels if r.op == "ternary_matmul"))


def check_legal(module: ir.Module) -> None:
    """Fail loudly if an op of a dialect IREE does not take is left in the module."""
    bad = []

    def visit(op):
        name = op.name if hasattr(op, "name") else op.operation.name
        if name in OPAQUE_OPS:
            return ir.WalkResult.SKIP
        if name.split(".")[0] not in LEGAL_DIALECTS:
            bad.append(name)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    if bad:
        raise CompileError(f"ops IREE cannot take are left after lowering: {sorted(set(bad))}",
                           hint="a lowering is missing for these ops")
    if not module.operation.verify():
        raise CompileError("the lowered MLIR module does not verify")


def check_storage(graphs, targets) -> None:
    """A CompileError at the user's line for the first f16/bf16 value of `graphs` when
    one of `targets` (codegen.targets.Target) cannot store 16-bit floats (the default
    Vulkan target): IREE would compile it into wrong numbers (targets.NO_16BIT_STORAGE)."""
    narrow = [t for t in targets if not t.stores_16bit]
    if not narrow:
        return
    if isinstance(graphs, Graph):
        graphs = [graphs]

    def first_narrow(g: Graph):
        for v in g.inputs:
            if v.dtype in ("f16", "bf16"):
                return v, None
        for op in g.ops:
            for r in op.results:
                if r.dtype in ("f16", "bf16"):
                    return r, op.loc
            for body in regions(op):
                found = first_narrow(body)
                if found:
                    return found[0], found[1] or op.loc
        return None
    for g in graphs:
        found = first_narrow(g)
        if found:
            v, loc = found
            t = narrow[0]
            raise CompileError(
                f"%{v.name} is {v.dtype}, but the {t.name} target {t.arch!r} has no 16-bit "
                f"storage: IREE 3.13 would read and write it as 32-bit floats (wrong numbers)",
                loc=loc, hint=f"cast it to float32 (x.astype('float32')), or compile for a "
                              f"{t.name}_target with 16-bit storage: "
                              f"{', '.join(map(repr, WITH_16BIT_STORAGE))}, ...")


def to_mlir(graphs, ctx: ir.Context, params=None, targets=("llvm-cpu",),
            transients: bool = False) -> Lowered:
    """Lower one or more graphs into one MLIR module in `ctx`, compiled for `targets`.
    Constants swapped for `Parameter`s (codegen.params.parameterized) are declared in
    `params`; `transients`: each function takes the caller's transient storage
    (lower_graph)."""
    if isinstance(graphs, Graph):
        graphs = [graphs]
    kernels = set()
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        for g in graphs:
            kernels |= lower_graph(g, module, params, targets, transients)
        check_legal(module)
    return lowered(module, kernels, targets)
