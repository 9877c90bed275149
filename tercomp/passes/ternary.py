"""ternary: rewrite BitLinear-style matmuls into packed ternary kernels.

    matmul(x, ternarize(constant W), transpose_b=True)            (optionally x = act_quant(x'))
    matmul(x, reshape(ternarize(constant W)), transpose_b=True)   (W [N, *]: a BitConv's)
    matmul(x, ternary_weight(constant packed), transpose_b=True)
 -> reshape(ternary_matmul(reshape(x, [-1, K]), constant packed_i8), [..., N])

    matmul(act_quant(x), [reshape(]ternarize(W)[)], transpose_b=True)   (W computed: an input)
 -> reshape(ternary_matmul(reshape(x, [-1, K]), ternary_pack(T)) * max|T|, [..., N])
    (T the ternarize's result [N, K]; on a hand-scheduled CPU kernel only)

W [N, K] is ternarized (absmean, or the ternarize op's `scale`) and packed 2-bit planar
at compile time, so no f32 copy of the weights remains. A ternarized weight computed at
run time (a training step's or a gradient's: W an input, the forward's matmul kept for
the loss) is packed at run time, every call, by tern.ternary_pack, and its scale (max
|T|: every nonzero of T is +-scale, and an all-zero T makes y zero whatever the scale)
multiplies the kernel's output, where the table gives the matmul a hand-scheduled kernel
of the host (a row that needs its CPU feature: avx512-tall, amx, avx512, avx2); the
generic kernels would not beat IREE's f32 matmul, so the matmul stays as it is there.
Its gradient was built from the f32 matmul before this pass (autodiff runs first); the
kernel computes the same value from the int8 activations exactly (bench/RESULTS.md).
Otherwise a stored ternary weight
(`nn.BitLinear.from_ternary`, `ternary_weight`) is already packed and is used as it is,
except that a kernel that reads other 2-bit codes (the row's `codes`: the avx2 kernel's w + 1)
gets its constant re-coded, under the same name. `strategy` is "auto", a ternary_matmul
kernel of the kernel table (`tercomp.kernels.table`), or "off" (the pass does
nothing). `targets` are the compile's target names: "auto" is settled per target and per
shape by the table (`settle_ternary`, the choice the `kernels` pass makes; a
symbolic batch gets a kernel that dispatches on the batch size at run time), when the
op is created, because its weight constant's codes follow the kernel; ternary matmuls
already in the IR are settled by the kernels pass's own patterns. An explicit strategy
that does not compile for a target, or does not fit a layer's shape, is refused here, by
name (at the layer's line).
"""
from __future__ import annotations

import numpy as np

from ..errors import TercompError
from ..ir import Graph, TensorType
from ..kernels.ternary.avx512_tall import m_multiple
from ..kernels.ternary.strategies import check_strategy
from .kernels import recode, settle_patterns, settle_ternary, take_names
from .. import ternary_pack as tp
from ..ops.shape_util import same_dim
from .manager import register_pass
from .rewrite import dce, rewrite
from .simplify import const_value


def _dim(d):
    return int(d) if isinstance(d, (int, np.integer)) else str(d)


def _packed_weight(w):
    """(packed, N, K, scale) of a matmul's ternary rhs, or None. `packed` is the i8
    constant Value of a stored weight (`ternary_weight` of packed constant bytes), or the
    signed-code uint8 array of `ternarize` of an f32 constant, ternarized and packed here
    (absmean, or the op's fixed `scale`)."""
    if w is None:
        return None
    # a convolution's weight [N, C, *kernel], ternarized whole (one absmean scale), then
    # read as the [N, C * K] matrix of its im2col matmul (nn.BitConv2d)
    if w.opname == "reshape" and w.operands[0].producer is not None and \
            w.operands[0].producer.opname == "ternarize" and w.results[0].type.rank == 2 and \
            w.results[0].type.shape[0] == w.operands[0].type.shape[0]:
        w = w.operands[0].producer
        c = const_value(w.operands[0])
        if c is None or c.dtype != np.float32:
            return None
        return _ternarized(c.reshape(c.shape[0], -1), w.attrs.get("scale"))
    if w.opname == "ternary_weight" and const_value(w.operands[0]) is not None:
        n, k = w.results[0].type.shape
        return w.operands[0], n, k, float(w.attrs["scale"])
    if w.opname != "ternarize":
        return None
    c = const_value(w.operands[0])
    if c is None or c.ndim != 2 or c.dtype != np.float32:
        return None
    return _ternarized(c, w.attrs.get("scale"))


def _runtime_weight(w):
    """(T, N, K) for a matmul's rhs that is `ternarize` of a value computed at run time
    (absmean: no fixed scale), viewed [N, K] (T the [N, K] value itself: the ternarize's
    result, or a BitConv's reshape of it), or None."""
    if w is None:
        return None
    t = w
    if w.opname == "reshape" and w.operands[0].producer is not None and \
            w.operands[0].producer.opname == "ternarize" and w.results[0].type.rank == 2 and \
            w.results[0].type.shape[0] == w.operands[0].type.shape[0]:
        t = w.operands[0].producer
    if t.opname != "ternarize" or t.attrs.get("scale") is not None or \
            const_value(t.operands[0]) is not None or t.operands[0].dtype != "f32":
        return None
    ty = w.results[0].type
    if ty.rank != 2 or not ty.is_static:
        return None
    return w.results[0], int(ty.shape[0]), int(ty.shape[1])


def _ternarized(c, fixed):
    """(packed, N, K, scale) of the f32 matrix c [N, K], ternarized by absmean (or with
    the fixed scale)."""
    t, scale = tp.absmean_ternarize(c) if fixed is None else tp.ternarize_with_scale(c, fixed)
    n, k = c.shape
    return tp.pack_ternary(t), n, k, float(scale)


def _pattern(strategy, targets, recoded):
    def pat(b, op, xs):
        if not op.attrs.get("transpose_b"):
            return None
        x, wv = xs
        if x.dtype != "f32" or x.type.rank < 2 or wv.type.rank != 2 or \
                not same_dim(x.type.shape[-1], wv.type.shape[1]):
            return None
        found = _packed_weight(wv.producer)
        runtime = None if found is not None else _runtime_weight(wv.producer)
        if found is None and runtime is None:
            return None
        aq = False
        if x.producer is not None and x.producer.opname == "act_quant":
            x, aq = x.producer.operands[0], True
        if runtime is not None:
            return _runtime_matmul(b, op, x, aq, runtime, strategy, targets)
        packed, n, k, scale = found
        lead = list(x.type.shape[:-1])
        x2 = x if x.type.rank == 2 else b.reshape(x, shape=[-1, k])
        kb = packed.shape[1] if isinstance(packed, np.ndarray) else packed.type.shape[1]
        # "auto" is settled here, per shape, so the module only gets the flags it uses
        chosen = settle_ternary(strategy, [x2.type, TensorType((int(n), int(kb)), "i8")],
                                {"k": int(k), "n": int(n), "act_quant": aq}, targets, op.loc)
        packed, coded = recode(b, packed, chosen.codes if aq else "signed", recoded)
        y = b.ternary_matmul(x2, packed, k=int(k), n=int(n), scale=float(scale),
                             strategy=chosen.kernel, act_quant=aq, name=op.results[0].name,
                             **coded)
        if x.type.rank != 2:
            y = b.reshape(y, shape=[_dim(d) for d in lead] + [int(n)])
        return y
    return pat


#: The least work (M x N x K products, M's known factor where it is symbolic) of a matmul
#: on a computed ternarized weight that takes a kernel. Each kernel executable adds
#: ~0.5 s to the step's compile; a small matmul saves less than a millisecond a call
#: (bench/compile_time.py's 3-layer LM, M = 576, 256-512 wide: compile 9.06 -> 9.71 s,
#: the warm step within the noise); ResNet's 64-channel layer at batch 32 (32768 x 64 x
#: 576) lost 180 ms of f32 matmul a call (bench/RESULTS.md).
RUNTIME_MIN_WORK = 1 << 26


def runtime_kernel_pays(m, n: int, k: int) -> bool:
    """Is a matmul [M, K] x [K, N] on a computed ternarized weight large enough for a
    kernel (RUNTIME_MIN_WORK; `m` static or symbolic: its known factor)? Where it is not,
    nn.BitConv2d keeps its training forward in the columns form its backward shares."""
    return m_multiple(m) * n * k >= RUNTIME_MIN_WORK


def _runtime_matmul(b, op, x, aq, runtime, strategy, targets):
    """The matmul on a ternarized weight computed at run time (`runtime`: its [N, K]
    value T, N, K) on the kernel the table gives it, when that is a hand-scheduled CPU
    kernel: ternary_pack(T) in the kernel's codes, its output times max |T|; else None
    (the matmul is kept)."""
    t, n, k = runtime
    if not aq:
        return None
    lead = list(x.type.shape[:-1])
    x2 = x if x.type.rank == 2 else b.reshape(x, shape=[-1, k])
    if not runtime_kernel_pays(x2.type.shape[0], n, k):
        return None
    types = [x2.type, TensorType((n, tp.padded_k(k) // 4), "i8")]
    attrs = {"k": k, "n": n, "act_quant": True}
    try:
        chosen = settle_ternary(strategy, types, attrs, targets, op.loc)
    except TercompError:
        return None
    if not chosen.needs_feature:
        return None
    packed = b.ternary_pack(t, codes=chosen.codes)
    coded = {} if chosen.codes == "signed" else {"codes": chosen.codes}
    y = b.ternary_matmul(x2, packed, k=k, n=n, scale=1.0, strategy=chosen.kernel,
                         act_quant=True, **coded)
    y = b.mul(y, b.max(b.abs(t), axes=[0, 1]))
    if x.type.rank != 2:
        y = b.reshape(y, shape=[_dim(d) for d in lead] + [n])
    return y


@register_pass("ternary")
def ternary(graph: Graph, strategy: str = "auto", targets=("llvm-cpu",)) -> Graph:
    """Rewrite matmul(x, ternarize(const W), transpose_b=True) into tern.ternary_matmul
    with the kernel `strategy` (settled per shape for `targets` when "auto")."""
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if check_strategy(strategy, targets) == "off":
        return graph
    recoded = {}
    # the ternary matmuls already in the IR are settled by the kernels pass's rule
    settle = settle_patterns(targets, ("ternary_matmul", "matmul", "matmul_sum"), strategy, recoded)
    # a matmul that is no ternary one gets the table's kernel for its shape, if any
    patterns = {**settle, "matmul": [_pattern(strategy, targets, recoded), *settle.get("matmul", ())]}
    return take_names(dce(rewrite(graph, patterns)), recoded)
