"""MLIR emitters for `y[M, N] = scale * x[M, K] @ T[N, K]^T` with T ternary and packed
2-bit planar (`tercomp/ternary_pack.py`), built with IREE's MLIR Python builders:
the state one kernel shares (`TernaryBuilder`: x, its static or dynamic M, the weights, the
activation quantizer and the final scaling) and the portable kernels, the formulations
measured in `shared/kernels/` (README there). The CPU "vnni" family is in
`vnni`; which kernel a module gets is the kernel table (kernels/table.py).

``addsub``  (ref_d) int8 activations (per-row absmax, held in i16 lanes) and a fused
            masked add/sub over the 2-bit constant: no multiplies, no widened weights.
            K/4 is split into (KO, KI) with KI a *parallel* accumulator dimension of i16
            partial sums (exact while KO * 4 * 127 < 32767), then a small generic
            reduces KI into i32. Compiles for every target.
``int8``    (ref_c) the packed constant is unpacked to i8 {-1, 0, 1} by its own generic,
            which IREE hoists to module load (the .vmfb stays 2-bit, RAM holds an
            unpacked copy, 1 B/weight), then an i8 x i8 -> i32 `linalg.matmul` that data
            tiling lowers to IREE's VNNI ukernel. Without activation quantization it
            unpacks to f32 (4 B/weight resident) for an f32 matmul.
``f32``     (ref_b) exact f32 masked add/sub on the f32 x, or on the integer-valued
            quantized x when ``act_quant`` (then the result equals the int kernels up to
            the final rounding, since the integer sums are exact in f32).

Every kernel computes `ternary_matmul_reference` (up to float rounding):

>>> import numpy as np
>>> import iree.runtime
>>> from iree.compiler.dialects import func
>>> from tercomp.codegen.iree_session import HOST_CPU_FLAGS, build_and_compile
>>> from tercomp.kernels.ternary.strategies import emit_ternary_matmul, strategy_flags
>>> from tercomp.ternary_pack import absmean_ternarize, pack_ternary
>>> t, scale = absmean_ternarize(np.random.default_rng(0).standard_normal((6, 10)))
>>> packed = pack_ternary(t)
>>> def build():
...     x_type = ir.RankedTensorType.get([ir.ShapedType.get_dynamic_size(), 10], ir.F32Type.get())
...     @func.FuncOp.from_py_func(x_type)
...     def main(x):
...         return emit_ternary_matmul(x, packed, 10, 6, scale, strategy="int8", act_quant=True)
>>> _, vmfb = build_and_compile(build, [*HOST_CPU_FLAGS, *strategy_flags("int8")])
>>> mod = iree.runtime.load_vm_flatbuffer(vmfb, driver="local-task")
>>> mod.main(np.ones((3, 10), np.float32)).to_host().shape
(3, 6)
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith, linalg, math, tensor, util

from ...errors import TraceError, InputError
from ...ternary_pack import ACT_EPS, ACT_MAX, k_split
from ...codegen.builders import PARALLEL, REDUCTION, affine_map, const, generic


# ---------------------------------------------------------------------- validation
def check_packed(packed, k: int, n: int) -> np.ndarray | ir.Value:
    if isinstance(packed, ir.Value):
        t = packed.type
        if (not isinstance(t, ir.RankedTensorType) or t.rank != 2 or not t.has_static_shape
                or t.element_type != ir.IntegerType.get_signless(8)
                or t.get_dim_size(0) != n or not 0 < k <= 4 * t.get_dim_size(1)):
            raise TraceError(f"packed ternary weights must be a tensor<{n}xKBxi8> value "
                             f"with 4 * KB >= {k}, got {t}")
        return packed
    packed = np.asarray(packed)
    if packed.dtype == np.int8:
        packed = packed.view(np.uint8)
    if packed.ndim != 2 or packed.dtype != np.uint8:
        raise InputError(f"packed ternary weights must be a uint8 [N, KB] array, got "
                         f"{packed.dtype} of shape {packed.shape}")
    if packed.shape[0] != n or not 0 < k <= 4 * packed.shape[1]:
        raise InputError(f"packed ternary weights of shape {packed.shape} do not hold a "
                         f"[{n}, {k}] matrix (need [N, KB] with 4 * KB >= K)")
    if ((packed & (packed >> 1)) & 0x55).any():
        raise InputError("packed ternary weights hold invalid 2-bit codes 0b11",
                         hint="pack the weights with tercomp.ternary_pack.pack_ternary")
    return np.ascontiguousarray(packed)


def unpack_codes(w: ir.Value, n: int, kb: int, elem: ir.Type) -> ir.Value:
    """The ternary values of packed weights `w` (tensor<n x KB x i8>, planar 2-bit codes)
    as tensor<n x 4*KB x elem>: code c of plane j at (p >> 2j) & 3, value (c & 1) - (c >> 1)."""
    i8 = ir.IntegerType.get_signless(8)
    one, three = const(1, i8), const(3, i8)

    def body(p, _out):
        j = arith.index_cast(i8, linalg.IndexOp(1).result)
        c = arith.andi(arith.shrui(p, arith.shli(j, one)), three)
        v = arith.subi(arith.andi(c, one), arith.shrui(c, one))
        return v if elem == i8 else arith.sitofp(elem, v)

    wu = generic(ir.RankedTensorType.get([n, 4, kb], elem), [w], tensor.empty([n, 4, kb], elem),
                  [affine_map(3, [0, 2]), affine_map(3, [0, 1, 2])], [PARALLEL, PARALLEL, PARALLEL], body)
    return tensor.collapse_shape(ir.RankedTensorType.get([n, 4 * kb], elem), wu, [[0], [1, 2]])


class TernaryBuilder:
    """What every ternary matmul kernel is emitted from: x (`tensor<M x K x f32>`, M
    static or None when dynamic), the packed weights (a uint8 [N, KB] array or an i8
    value, in `codes`), K, N and the scale, with the pieces kernels share: `weights()` /
    `pin_weights()`, the activation quantizer (`row_absmax`, `quantize`, `pad_k`,
    `planes`), `unpack` and `dequant`, and the portable kernels `addsub` and
    `int8_matmul`. A new kernel is a function `(TernaryBuilder, act_quant) -> y`
    (kernels/ternary/emitters.py) registered as a ternary_matmul row of
    tercomp/kernels/table.py, with where it fits; the row's emit (and
    `emit_ternary_matmul`) builds one and calls it, at the current insertion point.
    """

    def __init__(self, x: ir.Value, m: int | None, k: int, n: int,
                 packed: np.ndarray | ir.Value, scale: float, codes: str = "signed"):
        self.x, self.m, self.k, self.n, self.scale = x, m, k, n, scale
        self.packed, self.codes = packed, codes
        self.kb = (ir.RankedTensorType(packed.type).get_dim_size(1)
                   if isinstance(packed, ir.Value) else packed.shape[1])
        self.kp = 4 * self.kb
        self.f32 = ir.F32Type.get()
        self.i8 = ir.IntegerType.get_signless(8)
        self.i16 = ir.IntegerType.get_signless(16)
        self.i32 = ir.IntegerType.get_signless(32)
        self.index = ir.IndexType.get()
        dyn = ir.ShapedType.get_dynamic_size()
        self.m_static = dyn if m is None else m
        # The dynamic sizes that tensor ops need when M is dynamic: [tensor.dim(x, 0)].
        self.m_values = [tensor.dim(x, const(0, self.index))] if m is None else []

    # -- shapes with the leading M dimension
    def ttype(self, shape_after_m: Sequence[int], elem: ir.Type) -> ir.RankedTensorType:
        return ir.RankedTensorType.get([self.m_static, *shape_after_m], elem)

    def empty(self, shape_after_m: Sequence[int], elem: ir.Type) -> ir.Value:
        m = self.m_values[0] if self.m_values else self.m
        return tensor.empty([m, *shape_after_m], elem)

    def zeros(self, shape_after_m: Sequence[int], elem: ir.Type) -> ir.Value:
        zero = const(0.0 if elem == self.f32 else 0, elem)
        return linalg.fill(zero, outs=[self.empty(shape_after_m, elem)])

    # -- weights
    def weights(self) -> ir.Value:
        """The packed planar weights as tensor<N x KB x i8>: the runtime value, or a
        constant built from the bytes (never decimal text)."""
        if isinstance(self.packed, ir.Value):
            return self.packed
        data = self.packed.view(np.int8)
        t = ir.RankedTensorType.get(list(data.shape), self.i8)
        return arith.constant(t, ir.DenseElementsAttr.get(data, type=self.i8))

    def pin_weights(self) -> ir.Value:
        """Make the weights an opaque value (`util.optimization_barrier`) for every later
        use: IREE then folds no reshape of the constant into a reshaped copy and sees no
        unpack of it as a constant expression to evaluate or hoist into an unpacked copy.
        Kernels that read the weights several ways call it, so one 2-bit copy remains."""
        w = self.weights()
        owner = w.owner      # an op, or a block for a function argument
        if getattr(owner, "name", None) != "util.optimization_barrier":
            self.packed = w = util.optimization_barrier([w.type], [w])
        return w

    # -- activations
    def row_absmax(self) -> ir.Value:
        """max |x[m, :]| as tensor<M x f32>."""
        return generic(self.ttype([], self.f32), [self.x], self.zeros([], self.f32),
                        [affine_map(2, [0, 1]), affine_map(2, [0])], [PARALLEL, REDUCTION],
                        lambda v, acc: arith.maximumf(acc, math.absf(v)))

    def quantize(self, amax: ir.Value, elem: ir.Type) -> ir.Value:
        """clip(rint(x * (127 / max(amax, eps))), -127, 127) as an integer type (i8, i16)
        or integer-valued f32, in the order `ternary_pack.act_quant` uses (so the
        rounding agrees exactly)."""
        f32 = self.f32

        def body(v, am, _out):
            amc = arith.maximumf(am, const(ACT_EPS, f32))
            s = arith.divf(const(float(ACT_MAX), f32), amc)
            r = math.roundeven(arith.mulf(v, s))
            r = arith.minimumf(arith.maximumf(r, const(-float(ACT_MAX), f32)),
                               const(float(ACT_MAX), f32))
            return r if elem == f32 else arith.fptosi(elem, r)

        return generic(self.ttype([self.k], elem), [self.x, amax],
                        self.empty([self.k], elem),
                        [affine_map(2, [0, 1]), affine_map(2, [0]), affine_map(2, [0, 1])], [PARALLEL, PARALLEL],
                        body)

    def pad_k(self, v: ir.Value) -> ir.Value:
        """Zero-pad [M, K] to [M, KP] (the pack's zero-code columns meet zeros of x)."""
        if self.kp == self.k:
            return v
        elem = ir.RankedTensorType(v.type).element_type
        op = tensor.PadOp(self.ttype([self.kp], elem), v, [], [], [0, 0], [0, self.kp - self.k])
        block = op.regions[0].blocks.append(self.index, self.index)
        with ir.InsertionPoint(block):
            tensor.YieldOp(const(0.0 if elem == self.f32 else 0, elem))
        return op.result

    def planes(self, v: ir.Value, ko: int, ki: int) -> list[ir.Value]:
        """Padded x [M, KP] viewed as [M, 4, KO, KI] and cut into the 4 planes [M, KO, KI]."""
        elem = ir.RankedTensorType(v.type).element_type
        xe = tensor.expand_shape(self.ttype([4, ko, ki], elem), v, [[0], [1, 2, 3]],
                                 self.m_values, [self.m_static, 4, ko, ki])
        return [tensor.extract_slice(self.ttype([ko, ki], elem), xe, [], self.m_values, [],
                                     [0, j, 0, 0], [self.m_static, 1, ko, ki], [1, 1, 1, 1])
                for j in range(4)]

    # -- strategies
    def addsub(self, *, integer: bool, act_quant: bool) -> ir.Value:
        """Masked add/sub over the planar constant with a (KO, KI) split of K/4, into i16
        partial sums (`integer`, ref_d) or exact f32 ones (ref_b)."""
        f32, i8 = self.f32, self.i8
        amax = self.row_absmax() if act_quant else None
        if integer:
            # The quantized x is stored as i16 (values in [-127, 127]): the selects then
            # work on i16 lanes and no sign extension is left in the inner loop, 8-15%
            # faster than selecting on i8 and widening each plane (bench/).
            elem = part_t = self.i16
            xv = self.quantize(amax, elem)
            ko, ki = k_split(self.kb)
            sum_t = self.i32
        else:
            elem = part_t = sum_t = f32
            xv = self.quantize(amax, f32) if act_quant else self.x
            # f32 has no overflow bound: one 512-bit vector of KI = 16 lanes as in ref_b.
            ko, ki = (self.kb // 16, 16) if self.kb % 16 == 0 else k_split(self.kb)
        xs = self.planes(self.pad_k(xv), ko, ki)
        w = tensor.expand_shape(ir.RankedTensorType.get([self.n, ko, ki], i8), self.weights(),
                                [[0], [1, 2]], [], [self.n, ko, ki])
        masks = [(const(1 << (2 * j), i8), const(_to_i8(2 << (2 * j)), i8)) for j in range(4)]
        z8, zero = const(0, i8), const(0 if integer else 0.0, elem)
        add = arith.addi if integer else arith.addf

        def body(a0, a1, a2, a3, p, acc):
            terms = []
            for a, (pos, neg) in zip((a0, a1, a2, a3), masks):
                is_pos = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(p, pos), z8)
                is_neg = arith.cmpi(arith.CmpIPredicate.ne, arith.andi(p, neg), z8)
                minus = arith.subi(zero, a) if integer else arith.negf(a)
                terms.append(arith.select(is_pos, a, arith.select(is_neg, minus, zero)))
            # Sum the planes first and touch the accumulator with one add, the form
            # the vectorizer recognizes as a reduction (pitfall 2: 9.5 ms -> 0.6 ms).
            return add(acc, add(add(terms[0], terms[1]), add(terms[2], terms[3])))

        xmap, wmap, pmap = affine_map(4, [0, 2, 3]), affine_map(4, [1, 2, 3]), affine_map(4, [0, 1, 3])
        part = generic(self.ttype([self.n, ki], part_t), [*xs, w],
                        self.zeros([self.n, ki], part_t),
                        [xmap, xmap, xmap, xmap, wmap, pmap], [PARALLEL, PARALLEL, REDUCTION, PARALLEL], body)

        def reduce_ki(v, acc):
            return arith.addi(acc, arith.extsi(sum_t, v)) if integer else arith.addf(acc, v)

        total = generic(self.ttype([self.n], sum_t), [part], self.zeros([self.n], sum_t),
                         [affine_map(3, [0, 1, 2]), affine_map(3, [0, 1])], [PARALLEL, PARALLEL, REDUCTION],
                         reduce_ki)
        return self.dequant(total, amax)

    def int8_matmul(self, act_quant: bool) -> ir.Value:
        """Unpack to {-1, 0, 1} (hoisted by the strategy's flags), then linalg.matmul."""
        if act_quant:
            amax = self.row_absmax()
            xv, elem, acc_t = self.pad_k(self.quantize(amax, self.i8)), self.i8, self.i32
        else:
            amax, xv, elem, acc_t = None, self.pad_k(self.x), self.f32, self.f32
        wt = self.unpack(elem)
        acc = linalg.matmul(xv, wt, outs=[self.zeros([self.n], acc_t)],
                            indexing_maps=[affine_map(3, [0, 2]), affine_map(3, [1, 2]),
                                           affine_map(3, [0, 1])])
        return self.dequant(acc, amax)

    def unpack(self, elem: ir.Type, w: ir.Value | None = None, n: int | None = None) -> ir.Value:
        """tensor<N x KP x elem> with values {-1, 0, 1} (see `unpack_codes`): of the
        whole weights, or of `w`, a tensor<n x KB x i8> slice of them."""
        return unpack_codes(w or self.weights(), n or self.n, self.kb, elem)

    def scale_value(self, value: float) -> ir.Value:
        """`value` as a tensor<f32> operand behind `util.optimization_barrier`: IREE then
        passes it to the dispatch instead of inlining it, so the kernels of every layer
        of one shape are one executable (compiled once) whatever their scales."""
        t = ir.RankedTensorType.get([], self.f32)
        c = arith.constant(t, ir.DenseElementsAttr.get_splat(t, ir.FloatAttr.get(self.f32, value)))
        return util.optimization_barrier([t], [c])

    def dequant(self, acc: ir.Value, amax: ir.Value | None) -> ir.Value:
        """y = acc * scale (f32) or, after activation quantization, acc * scale / s with
        1/s = max(amax, eps) / 127."""
        f32 = self.f32
        is_int = isinstance(ir.RankedTensorType(acc.type).element_type, ir.IntegerType)

        def to_f32(a):
            return arith.sitofp(f32, a) if is_int else a

        out_t, out = self.ttype([self.n], f32), self.empty([self.n], f32)
        scalar = affine_map(2, [])
        if amax is None:
            return generic(out_t, [acc, self.scale_value(self.scale)], out,
                            [affine_map(2, [0, 1]), scalar, affine_map(2, [0, 1])], [PARALLEL, PARALLEL],
                            lambda a, sc, _o: arith.mulf(to_f32(a), sc))

        def body(a, am, sc, _o):
            inv_s = arith.mulf(arith.maximumf(am, const(ACT_EPS, f32)), sc)
            return arith.mulf(to_f32(a), inv_s)

        wscale = float(np.float32(self.scale / ACT_MAX))
        return generic(out_t, [acc, amax, self.scale_value(wscale)], out,
                        [affine_map(2, [0, 1]), affine_map(2, [0]), scalar, affine_map(2, [0, 1])],
                        [PARALLEL, PARALLEL], body)


def _to_i8(v: int) -> int:
    """An unsigned byte mask as the signed i8 literal MLIR expects (0x80 -> -128)."""
    return v - 256 if v >= 128 else v
