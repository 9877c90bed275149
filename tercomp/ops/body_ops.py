"""Ops with a body region: scan (a loop over a leading axis) and checkpoint (a call whose
intermediates are recomputed for the backward instead of saved).

A body is a Graph kept in the op's `body` attribute. It is isolated from above: every
value it reads is one of its inputs, fed by an operand of the op.

    %c, %ys = "tern.scan"(%init, %xs, %w) ({
      ^bb0(%carry: tensor<4xf32>, %x: tensor<4xf32>, %w_1: tensor<4x4xf32>):
        ...
        "tern.yield"(%new_carry, %y) : (tensor<4xf32>, tensor<4xf32>) -> ()
      }) {length = "T", n_carry = 1 : i64, n_xs = 1 : i64, reverse = false} : ...

scan's operands are `n_carry` initial carries, `n_xs` sequences (scanned along axis 0)
and the body's captured values; its body maps (carries, one slice of each sequence,
captured values) to (new carries, per-step outputs); its results are the final carries
and the per-step outputs stacked along a new leading axis of size `length` (an int or a
symbolic dim). With `reverse` the steps run from the last index to the first, and the
outputs stay at the index of their step (jax.lax.scan semantics). It lowers to one
`scf.for` over tensors. Their VJPs are installed by tercomp.autodiff.body_vjps.
"""
from __future__ import annotations

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith, flow, scf, tensor, util

from ..errors import TercompError, TraceError
from ..ir import Graph, TensorType, as_dim, is_static, numpy_dtype
from ..codegen.builders import index_const, tensor_type
from .interpret import interpret
from .registry import OpDef, REQUIRED, register
from .shape_util import concrete_dim, fmt_shape, same_dim


def _fmt(t: TensorType) -> str:
    return f"{fmt_shape(t.shape)}{t.dtype}"


def _same(a: TensorType, b: TensorType) -> bool:
    return a.dtype == b.dtype and len(a.shape) == len(b.shape) and all(
        same_dim(x, y) for x, y in zip(a.shape, b.shape))


def _body(a) -> Graph:
    body = a.get("body")
    if not isinstance(body, Graph):
        raise TraceError("the op's body must be a region (a Graph)")
    return body


# -- scan ----------------------------------------------------------------------------------
def _counts(types, a):
    nc, nx = a.get("n_carry"), a.get("n_xs")
    for k, v in (("n_carry", nc), ("n_xs", nx)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TraceError(f"scan: {k} must be a non-negative int, got {v!r}")
    if nc + nx > len(types):
        raise TraceError(f"scan: n_carry + n_xs = {nc + nx} but there are {len(types)} operands")
    return nc, nx


def scan_length(a):
    """The `length` attribute as a dim (int or sympy expression)."""
    n = a.get("length")
    if isinstance(n, bool) or not isinstance(n, (int, str)):
        raise TraceError(f"scan: length must be an int or a dim name, got {n!r}")
    try:
        d = as_dim(n)
    except (ValueError, TercompError) as e:
        raise TraceError(f"scan: bad length {n!r}: {e}") from None
    if is_static(d) and d < 0:
        raise TraceError(f"scan: length {d} is negative")
    return d


def _scan_region_args(types, a):
    nc, nx = _counts(types, a)
    length = scan_length(a)
    ins = list(types[:nc])
    for k, t in enumerate(types[nc:nc + nx]):
        if t.rank == 0 or not same_dim(t.shape[0], length):
            raise TraceError(f"scan: sequence {k} has shape {_fmt(t)}, but its leading dim must be "
                             f"the scan length {length}")
        ins.append(t.with_shape(t.shape[1:]))
    return [("body", ins + list(types[nc + nx:]))]


def _scan_infer(types, a):
    body = _body(a)
    nc, nx = _counts(types, a)
    (_, ins), = _scan_region_args(types, a)
    if len(ins) != len(body.inputs):
        raise TraceError(f"scan: the body takes {len(body.inputs)} inputs, the op gives it {len(ins)}")
    for k, (t, v) in enumerate(zip(ins, body.inputs)):
        if not _same(t, v.type):
            raise TraceError(f"scan: body input {k} (%{v.name}) is {_fmt(v.type)}, the op gives {_fmt(t)}")
    if len(body.outputs) < nc:
        raise TraceError(f"scan: the body returns {len(body.outputs)} values, fewer than its {nc} carries")
    for k, (t, v) in enumerate(zip(types[:nc], body.outputs)):
        if not _same(t, v.type):
            raise TraceError(f"scan: the body turns carry {k} from {_fmt(t)} into {_fmt(v.type)}; "
                             "a carry must keep its shape and dtype")
    length = scan_length(a)
    return list(types[:nc]) + [TensorType((length,) + tuple(v.shape), v.dtype) for v in body.outputs[nc:]]


def _scan_reference(xs, a):
    body = _body(a)
    nc, nx = a["n_carry"], a["n_xs"]
    carry, seqs, consts = list(xs[:nc]), xs[nc:nc + nx], list(xs[nc + nx:])
    n = concrete_dim(scan_length(a))
    if n is None:
        if not seqs:
            raise TraceError(f"scan: the length {a['length']} is not bound; give a sequence or a "
                             "static length")
        n = seqs[0].shape[0]
    steps = range(n - 1, -1, -1) if a.get("reverse") else range(n)
    ys = [None] * n
    for t in steps:
        outs = interpret(body, *carry, *[s[t] for s in seqs], *consts)
        carry, ys[t] = outs[:nc], outs[nc:]
    n_y = len(body.outputs) - nc
    if n == 0:
        stacked = [np.zeros((0,) + tuple(concrete_dim(d) or 0 for d in v.shape), numpy_dtype(v.dtype))
                   for v in body.outputs[nc:]]
    else:
        stacked = [np.stack([ys[t][k] for t in range(n)]) for k in range(n_y)]
    return [np.asarray(c) for c in carry] + stacked


def _step_index(ctx, i, n, reverse):
    if not reverse:
        return i
    last = arith.SubIOp(n, index_const(1)).result
    return arith.SubIOp(last, i).result


def _slice_args(ctx, t: TensorType, at):
    """Offsets/sizes/strides of row `at` (an index value) of a tensor of type t."""
    dyn = ir.ShapedType.get_dynamic_size()
    dyn_off = ir.ShapedType.get_dynamic_stride_or_offset()
    rest = list(t.shape[1:])
    sizes = [ctx.dim(d) for d in rest if not is_static(d)]
    return ([at], sizes, [], [dyn_off] + [0] * len(rest),
            [1] + [d if is_static(d) else dyn for d in rest], [1] * t.rank)


def _cast(v, t: TensorType):
    want = tensor_type(t)
    return v if v.type == want else tensor.CastOp(want, v).result


def _fence(ctx, v, t: TensorType):
    """`v` behind an optimization barrier, its dynamic dims re-tied. IREE 3.13 miscompiles
    a loop with dynamic-shaped carries when the producers of its operands are fused into
    the loop's dispatches (a wrong final carry, tests/test_scan.py); the barrier keeps
    them out. The barrier hides the dims, so flow.tensor.tie_shape gives them back
    (without it: "tensor.dim op unexpected during shape cleanup", IREE issue 19474).
    Only dynamic-shaped operands are fenced: fencing static ones made IREE emit a
    copy_buffer that fails at run time ("indirect buffer reference slot 0 is out range")."""
    (b,) = util.OptimizationBarrierOp([v.type], [v]).results
    dims = ctx.dyn_sizes(t)
    return flow.TensorTieShapeOp(b, dims).result if dims else b


# Stacked outputs are loop-carried and updated with insert_slice; IREE copies a
# loop-carried tensor every iteration (~T rows per step, quadratic in T). Long scans
# therefore run as chunks of CHUNK steps: the inner loop carries a CHUNK-row buffer,
# the outer loop inserts each filled chunk into the stacked result, so a step copies
# about CHUNK + T / CHUNK rows.
CHUNK = 32


def _step(ctx, op, xs, carries, t):
    """Lower the body for step index `t` (an index value), yielding it to the lowering
    driver: returns (its context, new carries, per-step ys)."""
    body = _body(op.attrs)
    nc, nx = op.attrs["n_carry"], op.attrs["n_xs"]
    sub = ctx.child()
    for v, c in zip(body.inputs[:nc], carries):
        sub.values[v] = c
    for v, s, st in zip(body.inputs[nc:nc + nx], xs[nc:nc + nx], op.operands[nc:nc + nx]):
        sub.values[v] = tensor.ExtractSliceOp(tensor_type(v.type), s, *_slice_args(sub, st.type, t)).result
    for v, c in zip(body.inputs[nc + nx:], xs[nc + nx:]):
        sub.values[v] = c
    yield sub, body.ops             # the lowering driver lowers the body here
    new = [_cast(sub.values[v], r.type) for v, r in zip(body.outputs[:nc], op.results[:nc])]
    return sub, new, [_cast(sub.values[v], v.type) for v in body.outputs[nc:]]


def _scan_lower(ctx, op, xs):
    xs = [_fence(ctx, v, o.type) if not o.type.is_static else v for v, o in zip(xs, op.operands)]
    length = scan_length(op.attrs)
    if is_static(length) and length <= CHUNK:
        return (yield from _flat_loop(ctx, op, xs, ctx.dim(length)))
    return (yield from _chunked_loop(ctx, op, xs, ctx.dim(length)))


def _flat_loop(ctx, op, xs, n):
    nc = op.attrs["n_carry"]
    stacked_types = [r.type for r in op.results[nc:]]
    loop = scf.ForOp(index_const(0), n, index_const(1), list(xs[:nc]) + [ctx.empty(t) for t in stacked_types])
    with ir.InsertionPoint(loop.body):
        t = _step_index(ctx, loop.induction_variable, n, op.attrs.get("reverse", False))
        carried = list(loop.inner_iter_args)
        sub, new, ys = yield from _step(ctx, op, xs, carried[:nc], t)
        for y, acc, st in zip(ys, carried[nc:], stacked_types):
            new.append(tensor.InsertSliceOp(y, acc, *_slice_args(sub, st, t)).result)
        scf.YieldOp(new)
    return list(loop.results)


def _rows_args(ctx, t: TensorType, offset, rows):
    """Offsets/sizes/strides of `rows` (an index value) rows of t from row `offset`."""
    dyn = ir.ShapedType.get_dynamic_size()
    dyn_off = ir.ShapedType.get_dynamic_stride_or_offset()
    rest = list(t.shape[1:])
    return ([offset], [rows] + [ctx.dim(d) for d in rest if not is_static(d)], [],
            [dyn_off] + [0] * len(rest), [dyn] + [d if is_static(d) else dyn for d in rest], [1] * t.rank)


def _tie(ctx, values, types):
    """Re-state the dynamic dims of loop-carried tensors: IREE 3.13 cannot resolve a
    tensor.dim of the iter_args or results of a loop nested in a loop (issue 19474)."""
    out = []
    for v, t in zip(values, types):
        dims = ctx.dyn_sizes(t)
        out.append(flow.TensorTieShapeOp(v, dims).result if dims else v)
    return out


def _chunked_loop(ctx, op, xs, n):
    nc = op.attrs["n_carry"]
    reverse = op.attrs.get("reverse", False)
    stacked_types = [r.type for r in op.results[nc:]]
    chunk_types = [t.with_shape((CHUNK,) + tuple(t.shape[1:])) for t in stacked_types]
    k = index_const(CHUNK)
    n_chunks = arith.CeilDivUIOp(n, k).result
    outer = scf.ForOp(index_const(0), n_chunks, index_const(1),
                      list(xs[:nc]) + [ctx.empty(t) for t in stacked_types])
    with ir.InsertionPoint(outer.body):
        octx = ctx.child()
        k0 = arith.MulIOp(outer.induction_variable, k).result
        valid = arith.MinUIOp(k, arith.SubIOp(n, k0).result).result
        carry_types = [r.type for r in op.results[:nc]]
        carried = _tie(octx, list(outer.inner_iter_args), carry_types + stacked_types)
        inner = scf.ForOp(index_const(0), valid, index_const(1),
                          carried[:nc] + [octx.empty(t) for t in chunk_types])
        with ir.InsertionPoint(inner.body):
            j = inner.induction_variable
            t = _step_index(octx, arith.AddIOp(k0, j).result, n, reverse)
            row = arith.SubIOp(arith.SubIOp(valid, index_const(1)).result, j).result if reverse else j
            inner_args = _tie(octx, list(inner.inner_iter_args), carry_types + chunk_types)
            chunks = inner_args[nc:]
            sub, new, ys = yield from _step(octx, op, xs, inner_args[:nc], t)
            for y, buf, ct in zip(ys, chunks, chunk_types):
                new.append(tensor.InsertSliceOp(y, buf, *_slice_args(sub, ct, row)).result)
            scf.YieldOp(new)
        done = _tie(octx, list(inner.results), carry_types + chunk_types)
        # the chunk's rows land at k0 (reverse: the rows n - k0 - valid .. n - k0 - 1)
        at = arith.SubIOp(arith.SubIOp(n, k0).result, valid).result if reverse else k0
        new = done[:nc]
        for buf, acc, st, ct in zip(done[nc:], carried[nc:], stacked_types, chunk_types):
            rows = tensor.ExtractSliceOp(tensor_type(st.with_shape(("rows",) + tuple(st.shape[1:]))), buf,
                                         *_rows_args(octx, ct, index_const(0), valid)).result
            new.append(tensor.InsertSliceOp(rows, acc, *_rows_args(octx, st, at, valid)).result)
        scf.YieldOp(new)
    return _tie(ctx, list(outer.results), carry_types + stacked_types)


register(OpDef(
    "scan", "control", _scan_infer, _scan_reference, num_operands=None, num_results=None,
    attrs={"body": REQUIRED, "n_carry": REQUIRED, "n_xs": REQUIRED, "length": REQUIRED,
           "reverse": False},
    lower=_scan_lower, region_args=_scan_region_args,
    doc="a loop over the leading axis of its sequences with loop-carried values "
        "(jax.lax.scan); results: final carries, then per-step outputs stacked"))


# -- checkpoint ----------------------------------------------------------------------------
def _checkpoint_region_args(types, a):
    return [("body", list(types))]


def _checkpoint_infer(types, a):
    body = _body(a)
    if len(types) != len(body.inputs):
        raise TraceError(f"checkpoint: the body takes {len(body.inputs)} inputs, got {len(types)}")
    for k, (t, v) in enumerate(zip(types, body.inputs)):
        if not _same(t, v.type):
            raise TraceError(f"checkpoint: body input {k} (%{v.name}) is {_fmt(v.type)}, the op gives {_fmt(t)}")
    return [v.type for v in body.outputs]


def _checkpoint_lower(ctx, op, xs):
    body = _body(op.attrs)
    sub = ctx.child()
    for v, x in zip(body.inputs, xs):
        sub.values[v] = x
    yield sub, body.ops             # the lowering driver lowers the body here
    return [_cast(sub.values[v], r.type) for v, r in zip(body.outputs, op.results)]


register(OpDef(
    "checkpoint", "control", _checkpoint_infer,
    lambda xs, a: interpret(_body(a), *xs), num_operands=None, num_results=None,
    attrs={"body": REQUIRED}, lower=_checkpoint_lower, region_args=_checkpoint_region_args,
    doc="calls its body; the backward recomputes the body's intermediates instead of "
        "saving them (jax.checkpoint)"))
