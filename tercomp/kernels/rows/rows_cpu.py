"""Row-wise kernels of a language model's step on a CPU, as hand-written dispatches
(vector code compiled by IREE like `kernels.ternary.avx2`): `rms_norm` over the rows of
x [R, N], `rope` (the "neox" or "interleaved" rotation) over the rows of x [T, H, D], and
`kv_write`, the batched generator's KV rows written into their slots in place.

Why by hand: with a dynamic row count R, IREE 3.13 tiles the rows by 8 and masks the
tile, and on this Zen 3 machine the masked loads and stores (`vmaskmovps`) of the 7
empty rows of a decode step's one-row tile made one RMSNorm of 1536 floats cost ~0.24 ms
(a static R = 1 compiles to ~0.006 ms): the 97 norms of the 700M shape were ~6 ms of a
~30 ms decode step. Here each workgroup takes ROWS rows, one row at a time, 8 lanes
at a time, with no masking: N (and D/2) must be multiples of 8.

ROWS = 4: a batched decode step's 8 rows are two workgroups, one a thread. At 8 rows a
workgroup they were one, and the other thread waited: at the 700M shape's batched step
of 8 sequences the 97 norms, 48 ropes and 96 quantizes took 2.0 ms, and with the
quantize dispatch split too (ternary.avx2_quant.QUANT_ROWS, ternary.amx.SMALL_ROWS)
the step was 0.65 ms faster (median of 12 paired rounds, bench/RESULTS.md 2026-11-28),
bit for bit the same.
"""
from __future__ import annotations

import sympy
from iree.compiler import ir
from iree.compiler.dialects import arith, tensor

from ...codegen.builders import tensor_type
from ...codegen.executables import dispatch, dispatch_in_place, ensure_executable
from ...ir import TensorType, is_static
from ..template import render

ROWS = 4


def norm_fits(n: int) -> bool:
    return n % 8 == 0


def rope_fits(d: int) -> bool:
    return d % 16 == 0


def rms_norm_text(name: str, n: int) -> str:
    """(x [R, N] f32, w [N] f32, eps: f32, R: index) -> x / sqrt(mean(x^2) + eps) * w,
    computed as x * rsqrt(...) * w like the op's decomposition (templates/rms_norm.mlir)."""
    return render("rms_norm", name=name, n=n, rows=ROWS)


def rope_text(name: str, heads: int, d: int, interleaved: bool = False) -> str:
    """(x [T, H, D] f32, cos [T, D/2], sin [T, D/2], T: index) -> x rotated in the pairs
    (i, i + D/2), or (2i, 2i + 1) where `interleaved`: (x1 c - x2 s, x2 c + x1 s)
    (templates/rope.mlir)."""
    return render("rope", name=name, heads=heads, d=d, rows=ROWS, interleaved=interleaved)


#: The kv_write kernel's vector: 64 bytes (one cache line) a load and a store.
KV_VECTOR_BYTES = 64
_KV_BYTES = {"f16": 2, "f32": 4}


def kv_write_fits(cache: TensorType) -> bool:
    """Whether kv_write takes a static cache [N, S, KV, D] of f16 or f32 whose rows (KV x D
    elements) are whole 64-byte vectors."""
    return (cache.rank == 4 and all(is_static(d) for d in cache.shape)
            and cache.dtype in _KV_BYTES
            and int(cache.shape[2]) * int(cache.shape[3]) * _KV_BYTES[cache.dtype]
            % KV_VECTOR_BYTES == 0)


def kv_write_text(name: str, n: int, s: int, w: int, el: str) -> str:
    """(cache [N, S, W] el, rows [T, W] el, slots, positions: i32 [T], T: index) -> the
    cache with row t at (slots[t], positions[t]), in place (templates/kv_write.mlir)."""
    return render("kv_write", name=name, n=n, s=s, w=w, el=el,
                  lanes=KV_VECTOR_BYTES // _KV_BYTES[el])


def emit_kv_write(ctx, op, xs) -> list:
    """The kernel table's kv_scatter "cpu" row: the rows [T, KV, D] written into the cache
    [N, S, KV, D] by one workgroup a row, in place (a dispatch whose result is the cache
    operand). IREE's scatter of the same rows ran element by element: 15 us a layer's K
    or V at 8 rows (the 700M shape's batched step), 4.3 us here; 0.14 -> 0.03 ms a step of
    one row (bench/RESULTS.md 2026-11-28)."""
    cache, rows, slots, positions = xs
    ct = op.operands[0].type
    n, s, kv, d = (int(x) for x in ct.shape)
    w = kv * d
    el = ir.RankedTensorType(cache.type).element_type
    name = f"tern_kv_write_{n}x{s}x{w}_{ct.dtype}"
    ensure_executable(name, lambda: kv_write_text(name, n, s, w, ct.dtype))
    rt = op.operands[1].type
    t = ctx.dim(rt.shape[0])
    dyn = not is_static(rt.shape[0])
    flat_rows = tensor.CollapseShapeOp(
        ir.RankedTensorType.get([ir.ShapedType.get_dynamic_size() if dyn else int(rt.shape[0]), w],
                                el), rows, [[0], [1, 2]]).result
    flat_cache = tensor.CollapseShapeOp(ir.RankedTensorType.get([n, s, w], el), cache,
                                        [[0], [1], [2, 3]]).result
    dims = [t] if dyn else []
    idx = [t] if ir.RankedTensorType(slots.type).is_dynamic_dim(0) else []
    out = dispatch_in_place(name, name, [t], [flat_cache, flat_rows, slots, positions, t],
                            dims + idx + idx)
    return [tensor.ExpandShapeOp(cache.type, out, [[0], [1], [2, 3]], [], [n, s, kv, d]).result]


def _dims(rows: ir.Value, *xs: ir.Value) -> list:
    """The dynamic dims of tensors xs, whose only dynamic dim can be dim 0 (`rows`)."""
    return [rows for x in xs if ir.RankedTensorType(x.type).is_dynamic_dim(0)]


def rms_norm(x: ir.Value, w: ir.Value, eps: float, rows: ir.Value) -> ir.Value:
    """x tensor<R x N x f32> normalized row by row and scaled by w tensor<N x f32>."""
    n = ir.RankedTensorType(x.type).get_dim_size(1)
    name = f"tern_rms_norm_{n}"
    ensure_executable(name, lambda: rms_norm_text(name, n))
    eps_v = arith.constant(ir.F32Type.get(), float(eps))
    return dispatch(name, name, [rows], [x, w, eps_v, rows], _dims(rows, x), x.type,
                    _dims(rows, x))


def rope(x: ir.Value, cos: ir.Value, sin: ir.Value, rows: ir.Value,
         style: str = "neox") -> ir.Value:
    """x tensor<T x H x D x f32> rotated by cos, sin tensor<T x D/2 x f32> (`style` "neox"
    or "interleaved")."""
    t = ir.RankedTensorType(x.type)
    heads, d = t.get_dim_size(1), t.get_dim_size(2)
    interleaved = style == "interleaved"
    name = f"tern_rope_{'i_' if interleaved else ''}{heads}x{d}"
    ensure_executable(name, lambda: rope_text(name, heads, d, interleaved))
    return dispatch(name, name, [rows], [x, cos, sin, rows], _dims(rows, x, cos, sin), x.type,
                    _dims(rows, x))


def _expanded(ctx, y: ir.Value, x_t: TensorType, groups) -> ir.Value:
    """y, the rows of x collapsed by `groups`, expanded back to x's type."""
    dyn = ir.ShapedType.get_dynamic_size()
    return tensor.ExpandShapeOp(tensor_type(x_t), y, groups, ctx.dyn_sizes(x_t),
                                [d if is_static(d) else dyn for d in x_t.shape]).result


def emit_rms_norm(ctx, op, xs) -> list:
    """The kernel table's rms_norm "cpu" row: x [..., N] f32 (N % 8 == 0), its leading dims
    taken as rows."""
    x_t = op.operands[0].type
    r = x_t.rank
    rows = sympy.Mul(*x_t.shape[:-1])
    if r == 2:
        return [rms_norm(xs[0], xs[1], op.attrs["eps"], ctx.dim(rows))]
    groups = [list(range(r - 1)), [r - 1]]
    flat = TensorType((rows, x_t.shape[-1]), "f32")
    x = tensor.CollapseShapeOp(tensor_type(flat), xs[0], groups).result
    return [_expanded(ctx, rms_norm(x, xs[1], op.attrs["eps"], ctx.dim(rows)), x_t, groups)]


def emit_rope(ctx, op, xs) -> list:
    """The kernel table's rope "cpu" row: "neox" or "interleaved" pairs on f32 x [T, H, D]
    or [1, T, H, D] (one sequence), D % 16 == 0."""
    x_t = op.operands[0].type
    style = op.attrs["style"]
    lead = list(x_t.shape[:-3])
    if not lead:
        return [rope(xs[0], xs[1], xs[2], ctx.dim(x_t.shape[0]), style)]
    groups = [list(range(len(lead) + 1)), [len(lead) + 1], [len(lead) + 2]]
    rows = TensorType(x_t.shape[-3:], x_t.dtype)
    x = tensor.CollapseShapeOp(tensor_type(rows), xs[0], groups).result
    return [_expanded(ctx, rope(x, xs[1], xs[2], ctx.dim(x_t.shape[-3]), style), x_t, groups)]
