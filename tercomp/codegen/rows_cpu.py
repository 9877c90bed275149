"""Row-wise kernels of a language model's step on a CPU, as hand-written dispatches
(vector code compiled by IREE like `ternary_avx2`): `rms_norm` over the rows of
x [R, N], and `rope` (the "neox" rotation) over the rows of x [T, H, D].

Why by hand: with a dynamic row count R, IREE 3.13 tiles the rows by 8 and masks the
tile, and on this Zen 3 machine the masked loads and stores (`vmaskmovps`) of the 7
empty rows of a decode step's one-row tile made one RMSNorm of 1536 floats cost ~0.24 ms
(a static R = 1 compiles to ~0.006 ms): the 97 norms of the 700M shape were ~6 ms of a
~30 ms decode step. Here each workgroup takes ROWS rows, one row at a time, 8 lanes
at a time, with no masking: N (and D/2) must be multiples of 8.
"""
from __future__ import annotations

from iree.compiler import ir
from iree.compiler.dialects import arith

from .executables import dispatch, ensure_executable
from .executables import executable_text as wrap_executable

ROWS = 8
V8 = "vector<8xf32>"


def norm_fits(n: int) -> bool:
    return n % 8 == 0


def rope_fits(d: int) -> bool:
    return d % 16 == 0


def _rows_prologue() -> str:
    return f"""      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c8 = arith.constant 8 : index
      %crows = arith.constant {ROWS} : index
      %wg = stream.dispatch.workgroup.id[0] : index
      %r0 = arith.muli %wg, %crows : index
      %r1u = arith.addi %r0, %crows : index
      %r1 = arith.minui %r1u, %m : index"""


def rms_norm_text(name: str, n: int) -> str:
    """(x [R, N] f32, w [N] f32, eps: f32, R: index) -> x / sqrt(mean(x^2) + eps) * w,
    computed as x * rsqrt(...) * w like the op's decomposition."""
    xt = f"memref<?x{n}xf32>"
    body = f"""{_rows_prologue()}
      %cn = arith.constant {n} : index
      %nf = arith.constant {float(n)!r} : f32
      %z8 = arith.constant dense<0.0> : {V8}
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> {xt}{{%m}}
      %w = stream.binding.subspan %bw[%c0] : !stream.binding -> memref<{n}xf32>
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {xt}{{%m}}
      scf.for %r = %r0 to %r1 step %c1 {{
        %acc = scf.for %c = %c0 to %cn step %c8 iter_args(%a = %z8) -> ({V8}) {{
          %xv = vector.load %x[%r, %c] : {xt}, {V8}
          %a2 = vector.fma %xv, %xv, %a : {V8}
          scf.yield %a2 : {V8}
        }}
        %ss = vector.reduction <add>, %acc fastmath<reassoc> : {V8} into f32
        %ms = arith.divf %ss, %nf : f32
        %me = arith.addf %ms, %eps : f32
        %inv = math.rsqrt %me : f32
        %invv = vector.broadcast %inv : f32 to {V8}
        scf.for %c = %c0 to %cn step %c8 {{
          %xv = vector.load %x[%r, %c] : {xt}, {V8}
          %wv = vector.load %w[%c] : memref<{n}xf32>, {V8}
          %y = arith.mulf %xv, %invv : {V8}
          %yw = arith.mulf %y, %wv : {V8}
          vector.store %yw, %o[%r, %c] : {xt}, {V8}
        }}
      }}"""
    return wrap_executable(name, None, "%bx: !stream.binding, %bw: !stream.binding, "
                           "%bo: !stream.binding, %eps: f32, %m: index", body, per_group=ROWS)


def rope_text(name: str, heads: int, d: int) -> str:
    """(x [T, H, D] f32, cos [T, D/2], sin [T, D/2], T: index) -> x rotated in the pairs
    (i, i + D/2): (x1 c - x2 s, x2 c + x1 s)."""
    half = d // 2
    xt, tt = f"memref<?x{heads}x{d}xf32>", f"memref<?x{half}xf32>"
    body = f"""{_rows_prologue()}
      %ch = arith.constant {heads} : index
      %chalf = arith.constant {half} : index
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> {xt}{{%m}}
      %cs = stream.binding.subspan %bc[%c0] : !stream.binding -> {tt}{{%m}}
      %sn = stream.binding.subspan %bs[%c0] : !stream.binding -> {tt}{{%m}}
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {xt}{{%m}}
      scf.for %t = %r0 to %r1 step %c1 {{
        scf.for %i = %c0 to %chalf step %c8 {{
          %c = vector.load %cs[%t, %i] : {tt}, {V8}
          %s = vector.load %sn[%t, %i] : {tt}, {V8}
          %j = arith.addi %i, %chalf : index
          scf.for %h = %c0 to %ch step %c1 {{
            %x1 = vector.load %x[%t, %h, %i] : {xt}, {V8}
            %x2 = vector.load %x[%t, %h, %j] : {xt}, {V8}
            %x1c = arith.mulf %x1, %c : {V8}
            %x2s = arith.mulf %x2, %s : {V8}
            %y1 = arith.subf %x1c, %x2s : {V8}
            %x2c = arith.mulf %x2, %c : {V8}
            %x1s = arith.mulf %x1, %s : {V8}
            %y2 = arith.addf %x2c, %x1s : {V8}
            vector.store %y1, %o[%t, %h, %i] : {xt}, {V8}
            vector.store %y2, %o[%t, %h, %j] : {xt}, {V8}
          }}
        }}
      }}"""
    return wrap_executable(name, None, "%bx: !stream.binding, %bc: !stream.binding, "
                           "%bs: !stream.binding, %bo: !stream.binding, %m: index", body,
                           per_group=ROWS)


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


def rope(x: ir.Value, cos: ir.Value, sin: ir.Value, rows: ir.Value) -> ir.Value:
    """x tensor<T x H x D x f32> rotated by cos, sin tensor<T x D/2 x f32> ("neox")."""
    t = ir.RankedTensorType(x.type)
    heads, d = t.get_dim_size(1), t.get_dim_size(2)
    name = f"tern_rope_{heads}x{d}"
    ensure_executable(name, lambda: rope_text(name, heads, d))
    return dispatch(name, name, [rows], [x, cos, sin, rows], _dims(rows, x, cos, sin), x.type,
                    _dims(rows, x))
