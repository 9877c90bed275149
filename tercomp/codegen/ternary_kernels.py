"""MLIR emitters for `y[M, N] = scale * x[M, K] @ T[N, K]^T` with T ternary and packed
2-bit planar (`tercomp/ops/ternary_pack.py`), built with IREE's MLIR Python builders.

Four strategies, the formulations measured in `shared/kernels/` (README there) and
bench/ternary_kernels.py:

``"addsub"``  (ref_d) int8 activations (per-row absmax, held in i16 lanes) and a fused
              masked add/sub over the 2-bit constant: no multiplies, no widened
              weights. K/4 is split into (KO, KI) with KI a *parallel* accumulator
              dimension of i16 partial sums (exact while KO * 4 * 127 < 32767), then a
              small generic reduces KI into i32. The fastest decode (M = 1) kernel. Without activation
              quantization it emits the "f32" kernel.
``"int8"``    (ref_c) the packed constant is unpacked to i8 {-1, 0, 1} by its own
              generic, which IREE hoists to module load (the .vmfb stays 2-bit, RAM
              holds 1 B/weight), then an i8 x i8 -> i32 `linalg.matmul` that data tiling
              lowers to IREE's VNNI ukernel. Best from M = 2 up. Without activation
              quantization it unpacks to f32 (4 B/weight resident) for an f32 matmul.
``"vnni"``    int8 activations times the u8 codes c = w + 1 in {0, 1, 2} recoded from the
              2-bit constant (still 2-bit in memory), accumulated in i32 with `vpdpbusd`
              (AVX-512 VNNI), minus the row sum of x. The fastest decode kernel measured
              (1x4096x4096: 0.14-0.17 ms median vs addsub 0.22-0.27 in the same runs).
              Without activation quantization it emits the "f32" kernel.
``"f32"``     (ref_b) exact f32 masked add/sub on the f32 x, or on the integer-valued
              quantized x when ``act_quant`` (then the result equals the int kernels
              up to the final rounding, since the integer sums are exact in f32).

Every kernel computes `ternary_matmul_reference` (up to float rounding):

>>> import numpy as np
>>> import iree.runtime
>>> from iree.compiler.dialects import func
>>> from tercomp.codegen.iree_session import HOST_CPU_FLAGS, build_and_compile
>>> from tercomp.ops.ternary_pack import absmean_ternarize, pack_ternary
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

from typing import Callable, Sequence

import numpy as np
from iree.compiler import ir
from iree.compiler.dialects import arith, linalg, math, tensor

from ..errors import TercompError
from ..ops.ternary_pack import k_split

STRATEGIES = ("addsub", "int8", "f32", "vnni")

_DATA_TILING = ("--iree-opt-data-tiling=true", "--iree-llvmcpu-enable-ukernels=all")
# Hoist the weight unpack (a constant expression that grows 4x or 16x) to module load:
# the size threshold lets the hoisting happen at all; const-eval=false keeps the
# compiler from evaluating it, so the .vmfb stores the 2-bit constant.
_HOIST_TO_LOAD = ("--iree-opt-const-expr-max-size-increase-threshold=4294967296",
                  "--iree-opt-const-eval=false")
_FLAGS = {
    "addsub": (),
    "f32": (),
    "int8": _DATA_TILING + _HOIST_TO_LOAD,
    "vnni": (),
}

_ACT_EPS = 1e-5
_PAR = "#linalg.iterator_type<parallel>"
_RED = "#linalg.iterator_type<reduction>"


def strategy_flags(strategy: str) -> list[str]:
    """The IREE flags a strategy needs on top of `HOST_CPU_FLAGS`.

    >>> strategy_flags("addsub")
    []
    >>> strategy_flags("int8")[:2]
    ['--iree-opt-data-tiling=true', '--iree-llvmcpu-enable-ukernels=all']
    """
    _check_strategy(strategy, allow_auto=False)
    return list(_FLAGS[strategy])


def choose_strategy(m: int | None, k: int, n: int) -> str:
    """The fastest strategy for an [m, k] x [k, n] ternary matmul on llvm-cpu.

    Measured with bench/ternary_kernels.py (median / min ms, interleaved runs on a shared
    2-core machine): at 1x4096x4096 vnni 0.15-0.17 / 0.09-0.13, addsub 0.25-0.35 /
    0.20-0.21, int8 0.38-0.46 / 0.33; at 2x4096x4096 vnni 0.33 / 0.19, int8 0.50 / 0.36;
    at 8x4096x4096 vnni and int8 tie (0.88 vs 0.80 median); prefill 128x2048x2048 int8
    2.1 vs vnni 4.6. A dynamic M (None) serves batches, so it gets "int8".

    >>> choose_strategy(1, 4096, 4096), choose_strategy(8, 4096, 4096), choose_strategy(None, 64, 64)
    ('vnni', 'int8', 'int8')
    """
    return "vnni" if m in (1, 2) else "int8"


def emit_ternary_matmul(x: ir.Value, packed: np.ndarray | ir.Value, k: int, n: int,
                        scale: float, *, strategy: str, act_quant: bool) -> ir.Value:
    """Emit `y = scale * x @ T^T` at the current insertion point; returns y.

    `x` is a `tensor<M x K x f32>` value (M static or dynamic), `packed` the uint8
    [N, KB] output of `pack_ternary` (KB * 4 >= K; columns past K are zero-padded in
    the kernel too), embedded as a constant, or a `tensor<N x KB x i8>` value holding
    the same bytes at run time; `scale` the absmean scale. With `act_quant`, x is quantized per
    row to int8 first (`act_quant` in ternary_pack). `strategy` is one of
    "addsub", "int8", "f32", "vnni" or "auto" (`choose_strategy(M or None, K, N)`); compile
    with `strategy_flags` of the strategy used. Returns a `tensor<M x N x f32>` value.
    """
    _check_strategy(strategy, allow_auto=True)
    packed = _check_packed(packed, k, n)
    x_type = ir.RankedTensorType(x.type)
    if (x_type.rank != 2 or x_type.is_dynamic_dim(1) or x_type.get_dim_size(1) != k
            or not isinstance(x_type.element_type, ir.F32Type)):
        raise TercompError(f"ternary matmul expects x of type tensor<?x{k}xf32> (M static "
                           f"or dynamic), got {x_type}")
    m = None if x_type.is_dynamic_dim(0) else x_type.get_dim_size(0)
    if strategy == "auto":
        strategy = choose_strategy(m, k, n)
    kern = _Kernel(x, m, k, n, packed, float(scale))
    if strategy == "int8":
        return kern.int8_matmul(act_quant)
    if strategy == "vnni" and act_quant:
        return kern.vnni()
    if strategy == "addsub" and act_quant:
        return kern.addsub(integer=True, act_quant=True)
    return kern.addsub(integer=False, act_quant=act_quant)


# ---------------------------------------------------------------------- validation
def _check_strategy(strategy, allow_auto: bool):
    ok = STRATEGIES + (("auto",) if allow_auto else ())
    if strategy not in ok:
        raise TercompError(f"unknown ternary matmul strategy {strategy!r}; expected one of "
                           f"{', '.join(map(repr, ok))}",
                           hint=None if allow_auto else
                           "resolve 'auto' with choose_strategy(m, k, n) first")


def _check_packed(packed, k: int, n: int) -> np.ndarray | ir.Value:
    if isinstance(packed, ir.Value):
        t = packed.type
        if (not isinstance(t, ir.RankedTensorType) or t.rank != 2 or not t.has_static_shape
                or t.element_type != ir.IntegerType.get_signless(8)
                or t.get_dim_size(0) != n or not 0 < k <= 4 * t.get_dim_size(1)):
            raise TercompError(f"packed ternary weights must be a tensor<{n}xKBxi8> value "
                               f"with 4 * KB >= {k}, got {t}")
        return packed
    packed = np.asarray(packed)
    if packed.dtype == np.int8:
        packed = packed.view(np.uint8)
    if packed.ndim != 2 or packed.dtype != np.uint8:
        raise TercompError(f"packed ternary weights must be a uint8 [N, KB] array, got "
                           f"{packed.dtype} of shape {packed.shape}")
    if packed.shape[0] != n or not 0 < k <= 4 * packed.shape[1]:
        raise TercompError(f"packed ternary weights of shape {packed.shape} do not hold a "
                           f"[{n}, {k}] matrix (need [N, KB] with 4 * KB >= K)")
    if ((packed & (packed >> 1)) & 0x55).any():
        raise TercompError("packed ternary weights hold invalid 2-bit codes 0b11",
                           hint="pack the weights with tercomp.ops.ternary_pack.pack_ternary")
    return np.ascontiguousarray(packed)


# ------------------------------------------------------------------- IR helpers
def _amap(ndim: int, results: Sequence[int]) -> ir.AffineMap:
    """affine_map<(d0..d{ndim-1}) -> (d{results[0]}, ...)>"""
    return ir.AffineMap.get(ndim, 0, [ir.AffineDimExpr.get(d) for d in results])


def _generic(result_type: ir.Type, ins: Sequence[ir.Value], out: ir.Value,
             maps: Sequence[ir.AffineMap], iters: Sequence[str],
             body: Callable[..., ir.Value]) -> ir.Value:
    """One-result linalg.generic whose body is `body(*scalar_args) -> yielded value`."""
    op = linalg.GenericOp([result_type], list(ins), [out],
                          ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps]),
                          ir.ArrayAttr.get([ir.Attribute.parse(it) for it in iters]))
    elem_types = [ir.RankedTensorType(v.type).element_type for v in (*ins, out)]
    block = op.regions[0].blocks.append(*elem_types)
    with ir.InsertionPoint(block):
        linalg.YieldOp([body(*block.arguments)])
    return op.results[0]


def _const(value, type_: ir.Type) -> ir.Value:
    return arith.constant(type_, value)


class _Kernel:
    """Shared state of one emitted kernel: x, its (possibly dynamic) M, the weights."""

    def __init__(self, x: ir.Value, m: int | None, k: int, n: int,
                 packed: np.ndarray | ir.Value, scale: float):
        self.x, self.m, self.k, self.n, self.scale = x, m, k, n, scale
        self.packed = packed
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
        self.m_values = [tensor.dim(x, _const(0, self.index))] if m is None else []

    # -- shapes with the leading M dimension
    def ttype(self, shape_after_m: Sequence[int], elem: ir.Type) -> ir.RankedTensorType:
        return ir.RankedTensorType.get([self.m_static, *shape_after_m], elem)

    def empty(self, shape_after_m: Sequence[int], elem: ir.Type) -> ir.Value:
        m = self.m_values[0] if self.m_values else self.m
        return tensor.empty([m, *shape_after_m], elem)

    def zeros(self, shape_after_m: Sequence[int], elem: ir.Type) -> ir.Value:
        zero = _const(0.0 if elem == self.f32 else 0, elem)
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

    # -- activations
    def row_absmax(self) -> ir.Value:
        """max |x[m, :]| as tensor<M x f32>."""
        return _generic(self.ttype([], self.f32), [self.x], self.zeros([], self.f32),
                        [_amap(2, [0, 1]), _amap(2, [0])], [_PAR, _RED],
                        lambda v, acc: arith.maximumf(acc, math.absf(v)))

    def quantize(self, amax: ir.Value, elem: ir.Type) -> ir.Value:
        """clip(rint(x * (127 / max(amax, eps))), -127, 127) as an integer type (i8, i16)
        or integer-valued f32, in the order `ternary_pack.act_quant` uses (so the
        rounding agrees exactly)."""
        f32 = self.f32

        def body(v, am, _out):
            amc = arith.maximumf(am, _const(_ACT_EPS, f32))
            s = arith.divf(_const(127.0, f32), amc)
            r = math.roundeven(arith.mulf(v, s))
            r = arith.minimumf(arith.maximumf(r, _const(-127.0, f32)), _const(127.0, f32))
            return r if elem == f32 else arith.fptosi(elem, r)

        return _generic(self.ttype([self.k], elem), [self.x, amax],
                        self.empty([self.k], elem),
                        [_amap(2, [0, 1]), _amap(2, [0]), _amap(2, [0, 1])], [_PAR, _PAR],
                        body)

    def pad_k(self, v: ir.Value) -> ir.Value:
        """Zero-pad [M, K] to [M, KP] (the pack's zero-code columns meet zeros of x)."""
        if self.kp == self.k:
            return v
        elem = ir.RankedTensorType(v.type).element_type
        op = tensor.PadOp(self.ttype([self.kp], elem), v, [], [], [0, 0], [0, self.kp - self.k])
        block = op.regions[0].blocks.append(self.index, self.index)
        with ir.InsertionPoint(block):
            tensor.YieldOp(_const(0.0 if elem == self.f32 else 0, elem))
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
        masks = [(_const(1 << (2 * j), i8), _const(_to_i8(2 << (2 * j)), i8)) for j in range(4)]
        z8, zero = _const(0, i8), _const(0 if integer else 0.0, elem)
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

        xmap, wmap, pmap = _amap(4, [0, 2, 3]), _amap(4, [1, 2, 3]), _amap(4, [0, 1, 3])
        part = _generic(self.ttype([self.n, ki], part_t), [*xs, w],
                        self.zeros([self.n, ki], part_t),
                        [xmap, xmap, xmap, xmap, wmap, pmap], [_PAR, _PAR, _RED, _PAR], body)

        def reduce_ki(v, acc):
            return arith.addi(acc, arith.extsi(sum_t, v)) if integer else arith.addf(acc, v)

        total = _generic(self.ttype([self.n], sum_t), [part], self.zeros([self.n], sum_t),
                         [_amap(3, [0, 1, 2]), _amap(3, [0, 1])], [_PAR, _PAR, _RED],
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
                            indexing_maps=[_amap(3, [0, 2]), _amap(3, [1, 2]),
                                           _amap(3, [0, 1])])
        return self.dequant(acc, amax)

    def unpack(self, elem: ir.Type) -> ir.Value:
        """tensor<N x KP x elem> with values {-1, 0, 1}: code c of plane j at
        (p >> 2j) & 3, value (c & 1) - (c >> 1)."""
        i8 = self.i8
        one, three = _const(1, i8), _const(3, i8)

        def body(p, _out):
            j = arith.index_cast(i8, linalg.IndexOp(1).result)
            c = arith.andi(arith.shrui(p, arith.shli(j, one)), three)
            v = arith.subi(arith.andi(c, one), arith.shrui(c, one))
            return v if elem == i8 else arith.sitofp(elem, v)

        n, kb = self.n, self.kb
        wu = _generic(ir.RankedTensorType.get([n, 4, kb], elem), [self.weights()],
                      tensor.empty([n, 4, kb], elem),
                      [_amap(3, [0, 2]), _amap(3, [0, 1, 2])], [_PAR, _PAR, _PAR], body)
        return tensor.collapse_shape(ir.RankedTensorType.get([n, self.kp], elem), wu,
                                     [[0], [1, 2]])

    def vnni(self) -> ir.Value:
        """u8 codes c = w + 1 in {0, 1, 2} times the i8 quantized x, accumulated in i32,
        minus the row sum of x: sum_k c_k x_k - sum_k x_k = sum_k w_k x_k.

        One reduction generic over (M, N, plane j, KB): the body extracts plane j's code
        from the recoded byte and multiply-adds `extui(c) * extsi(x)` into a scalar i32
        accumulator. A `compilation_info` fixes the tiling to 2 rows of N x 512 bytes of
        KB per vector step, so each step is `vector.reduce.add(mul(zext <512 x i8>, sext
        <512 x i8>))` inside one basic block, which LLVM's X86 ISel lowers to `vpdpbusd`
        (8 per step, one horizontal add). IREE's default tiling (8 rows x 64 bytes) also
        gets `vpdpbusd` but pays a horizontal add per 64 bytes and is slower than
        "addsub"; a loop-carried vector accumulator (the (KO, KI) split) gets only
        `vpmaddwd`/`vpdpwssd` from this LLVM.
        """
        i8, i32, kb = self.i8, self.i32, self.kb
        amax = self.row_absmax()
        xq = self.pad_k(self.quantize(amax, i8))
        # x [M, KP] as [M, 4, KB]: plane j is the contiguous K slice j*KB .. (j+1)*KB.
        xe = tensor.expand_shape(self.ttype([4, kb], i8), xq, [[0], [1, 2]],
                                 self.m_values, [self.m_static, 4, kb])
        w = self.codes()
        red = _vnni_k_tile(kb)
        if self.m == 1:
            # No unit M dimension: IREE would fold it away and drop the compilation_info.
            xe = tensor.collapse_shape(ir.RankedTensorType.get([4, kb], i8), xe, [[0, 1], [2]])
            maps = [_amap(3, [1, 2]), _amap(3, [0, 2]), _amap(3, [0])]
            iters, jdim = [_PAR, _RED, _RED], 1
            part_t = ir.RankedTensorType.get([self.n], i32)
            init = linalg.fill(_const(0, i32), outs=[tensor.empty([self.n], i32)])
            tiles = ([32, 0, 0], [2, 0, 0], [0, 1, red])
        else:
            maps = [_amap(4, [0, 2, 3]), _amap(4, [1, 3]), _amap(4, [0, 1])]
            iters, jdim = [_PAR, _PAR, _RED, _RED], 2
            part_t = self.ttype([self.n], i32)
            init = self.zeros([self.n], i32)
            tiles = ([1, 32, 0, 0], [1, 2, 0, 0], [0, 0, 1, red])
        three, two = _const(3, i8), _const(2, i8)

        def body(a, p, acc):
            j = arith.index_cast(i8, linalg.IndexOp(jdim).result)
            c = arith.andi(arith.shrui(p, arith.muli(j, two)), three)
            return arith.addi(acc, arith.muli(arith.extui(i32, c), arith.extsi(i32, a)))

        part = _generic(part_t, [xe, w], init, maps, iters, body)
        dist, par, redt = (", ".join(map(str, t)) for t in tiles)
        part.owner.attributes["compilation_info"] = ir.Attribute.parse(
            "#iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
            f"distribution = [{dist}], vector_common_parallel = [{par}], "
            f"vector_reduction = [{redt}]>, translation_info = "
            "#iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>")
        if self.m == 1:
            part = tensor.expand_shape(self.ttype([self.n], i32), part, [[0, 1]], [], [1, self.n])
        rowsum = _generic(self.ttype([], i32), [xq], self.zeros([], i32),
                          [_amap(2, [0, 1]), _amap(2, [0])], [_PAR, _RED],
                          lambda v, acc: arith.addi(acc, arith.extsi(i32, v)))
        total = _generic(self.ttype([self.n], i32), [part, rowsum], self.empty([self.n], i32),
                         [_amap(2, [0, 1]), _amap(2, [0]), _amap(2, [0, 1])], [_PAR, _PAR],
                         lambda v, rs, _o: arith.subi(v, rs))
        return self.dequant(total, amax)

    def codes(self) -> ir.Value:
        """The weights with every 2-bit field recoded to c = w + 1 (0b00 -> 1,
        0b01 -> 2, 0b10 -> 0): lo' = ~(lo | hi), hi' = lo."""
        if not isinstance(self.packed, ir.Value):
            p = self.packed
            lo, hi = p & 0x55, (p >> 1) & 0x55
            c = ((~(lo | hi)) & 0x55) | (lo << 1)
            data = c.astype(np.uint8).view(np.int8)
            t = ir.RankedTensorType.get(list(data.shape), self.i8)
            return arith.constant(t, ir.DenseElementsAttr.get(data, type=self.i8))
        i8 = self.i8
        m55, one, ff = _const(0x55, i8), _const(1, i8), _const(-1, i8)

        def body(p, _o):
            lo = arith.andi(p, m55)
            hi = arith.andi(arith.shrui(p, one), m55)
            return arith.ori(arith.andi(arith.xori(arith.ori(lo, hi), ff), m55),
                             arith.shli(lo, one))

        t = ir.RankedTensorType.get([self.n, self.kb], i8)
        return _generic(t, [self.packed], tensor.empty([self.n, self.kb], i8),
                        [_amap(2, [0, 1])] * 2, [_PAR, _PAR], body)

    def dequant(self, acc: ir.Value, amax: ir.Value | None) -> ir.Value:
        """y = acc * scale (f32) or, after activation quantization, acc * scale / s with
        1/s = max(amax, eps) / 127."""
        f32 = self.f32
        is_int = isinstance(ir.RankedTensorType(acc.type).element_type, ir.IntegerType)

        def to_f32(a):
            return arith.sitofp(f32, a) if is_int else a

        out_t, out = self.ttype([self.n], f32), self.empty([self.n], f32)
        if amax is None:
            return _generic(out_t, [acc], out, [_amap(2, [0, 1])] * 2, [_PAR, _PAR],
                            lambda a, _o: arith.mulf(to_f32(a), _const(self.scale, f32)))

        wscale = float(np.float32(self.scale / 127.0))

        def body(a, am, _o):
            inv_s = arith.mulf(arith.maximumf(am, _const(_ACT_EPS, f32)), _const(wscale, f32))
            return arith.mulf(to_f32(a), inv_s)

        return _generic(out_t, [acc, amax], out,
                        [_amap(2, [0, 1]), _amap(2, [0]), _amap(2, [0, 1])], [_PAR, _PAR], body)


def _vnni_k_tile(kb: int) -> int:
    """The KB tile of one "vnni" vector step: 512 bytes (8 x 64-byte `vpdpbusd`), or the
    largest power-of-two divisor of KB below that, or KB itself when no such divisor
    is a multiple of 64 (small or odd widths; the step is then a plain vector loop)."""
    t = 512
    while t >= 64:
        if kb % t == 0:
            return t
        t //= 2
    return kb if kb <= 512 else 64


def _to_i8(v: int) -> int:
    """An unsigned byte mask as the signed i8 literal MLIR expects (0x80 -> -128)."""
    return v - 256 if v >= 128 else v
