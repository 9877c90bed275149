"""BitConv1d / BitConv2d: ternary convolutions, BitLinear's quantization on im2col rows.

The layer is written as a matmul over image patches (tern.im2col): the patches of x
[N, C, *S] become rows [N * P, C * K] (P output positions, K kernel positions, in the order of
the weight's [C // groups, *kernel] dims), and

    y = act_quant(rows) @ ternarize(W)^T      with W [out, in // groups, *kernel]

reshaped back to [N, out, *P]. So the numerics are BitLinear's exactly (absmean ternary
weights with one scale per layer, int8 absmax activations per patch row, straight-
through gradients; tercomp/nn/bitlinear.py), and the `ternary` pass packs the weights 2
bits each and hands the matmul to the kernel table's ternary GEMM kernels (avx512 /
avx2 / blocked / addsub, by target and shape) as it does a BitLinear's: the patch
matmul is a BitLinear's matmul. With groups > 1 the rows are split per group and the
matmul is batched over groups; the ternary pass leaves that (a rank-3 weight) to the
generic lowering of its fake-quantized form.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import ternary_pack as tp
from ..autodiff import custom_vjp, vjp
from ..errors import TraceError, ConfigError
from ..ops.conv import _out_size
from ..passes.ternary import runtime_kernel_pays
from ..ops.shape_util import SLICE_END
from ..tracing import api as _t
from ..tracing.conv_api import PADDING_HINT, resolve_padding
from ..tracing.tracer import Tracer, apply
from .bitlinear import _traced
from .conv import _check_channels, _check_rank, _shape, _tuple
from .layers import _uniform
from .module import Module


def patches(x, kernel, stride, pads, dilation):
    """im2col: x [N, C, *S] -> (rows [N * P, C * K], P) with the rows' columns in the
    order (c, *k), the zero padding `pads` ((lo, hi) per spatial dim) applied first: one
    tern.im2col (tercomp/ops/im2col.py) and a reshape."""
    nd = len(kernel)
    cols = apply("im2col", x, kernel=list(kernel), stride=list(stride),
                 padding=[list(p) for p in pads], dilation=list(dilation))
    shape = _shape(cols)                                                 # [N, *P, C, *K]
    return _t.reshape(cols, (-1, int(np.prod(shape[1 + nd:])))), list(shape[1:1 + nd])


def _pooled_absmax(kernel, pads, dilation) -> bool:
    """Can each patch's absmax be a max_pool of the channels' absmax (_absmax_scale)? Not
    with dilation, nor where the padding covers more than half the kernel (windows the
    pool does not take)."""
    return all(d == 1 for d in dilation) and all(max(lo, hi) <= k // 2 for (lo, hi), k in zip(pads, kernel))


def _absmax_scale(x, kernel, stride, pads):
    """act_quant's scale 127 / max(absmax, eps) of every patch, [N, 1, *P]: the max over
    channels of |x|, then over each window (a max_pool: exact, max is associative)."""
    amax = _t.max(_t.abs(x), axis=1, keepdims=True)                             # [N, 1, *S]
    amax = _t.max_pool(amax, list(kernel), stride=list(stride), padding=[list(q) for q in pads])
    return _t.divide(np.float32(tp.ACT_MAX), _t.maximum(amax, np.float32(tp.ACT_EPS)))


def _sliced_quantized_columns(x, kernel, stride, pads, dilation, out):
    """The act_quant-ed patches of x as [N, C, *K, *P], built one kernel offset at a
    time: the offset's window of the padded input (a strided slice, [N, C, *P]) quantized
    by each patch's scale, the K planes stacked. The numbers and the straight-through
    gradient of tern.act_quant over the tern.im2col columns (ternary_pack.act_quant's
    formula, in its order; q + (cols - cols) with q and the second cols out of the
    gradient), but every dispatch reads and writes along P with identity maps, so IREE
    vectorizes it: the im2col generic's window map (p * s + k * d) is not a projected
    permutation, and IREE 3.13 compiled the quantize fused with it to scalar code (176
    ms a call for the 64-channel 32x32 layer at batch 32, bench/RESULTS.md). The
    gradient is the col2im's: a sum of unslices of the planes."""
    xp = _t.pad(x, [[0, 0], [0, 0]] + [list(q) for q in pads]) if any(lo or hi for lo, hi in pads) else x
    s = _absmax_scale(x, kernel, stride, pads)                                  # [N, 1, *P]
    top = np.float32(tp.ACT_MAX)
    planes = []
    for kk in np.ndindex(*kernel):
        starts = [k * d for k, d in zip(kk, dilation)]
        win = apply("slice", xp, starts=[0, 0] + starts,
                    stops=[SLICE_END, SLICE_END] + [st + (int(o) - 1) * sd + 1
                                                    for st, o, sd in zip(starts, out, stride)],
                    steps=[1, 1] + list(stride))                                # [N, C, *P]
        q = _t.divide(_t.minimum(_t.maximum(_t.round(_t.multiply(win, s)), -top), top), s)
        planes.append(_t.stop_gradient(q) + (win - _t.stop_gradient(win)))
    return _t.stack(planes, axis=2) if len(planes) > 1 else _t.expand_dims(planes[0], 2)


def _is_input(w) -> bool:
    """Is the weight traced from an input of the function (a gradient's; a training
    step's, where it is a slice of the one packed parameter vector: training/packing.py),
    not a constant that the ternary pass packs?"""
    return isinstance(w, Tracer) and (w.value.producer is None or w.value.producer.opname != "constant")


def _columns(x, t, kernel, stride, pads, dilation, out, act_quant=True):
    """The convolution of x [N, C, *S] by the ternarized weight t [O, C, *kernel] with
    the patches as columns [N, C * K, P] (P the output positions, innermost: read and
    written along the input's rows) and y = W @ columns, batched over the images,
    already [N, O, *P]. Every matmul of it and of its VJP is then IREE's fast
    orientation (A [M, K] @ B [K, N], no transposed operand or output map): the input's
    cotangent W^T @ g comes out as [N, C, *K, *P], the col2im's own layout, and the
    weight's, g @ columns^T, sums a batched matmul (ops/linalg.py). As rows [N * P, C *
    K] IREE fused the transposes into the f32 matmuls and the quantize wrote 3-wide rows
    (bench/RESULTS.md). The quantized columns are built one kernel offset at a time
    (_sliced_quantized_columns) where a max_pool gives the patches' absmax; else from
    tern.im2col and the rows' act_quant. The forward and backward of a layer whose
    matmul is too small for a kernel fed at run time (passes/ternary.py:
    runtime_kernel_pays) or without act_quant; the backward of the others (_kernel_conv)."""
    nd, o = len(kernel), int(t.shape[0])
    p, k = int(np.prod(out)), int(np.prod(t.shape[1:]))
    if act_quant and _pooled_absmax(kernel, pads, dilation):
        cols = _sliced_quantized_columns(x, kernel, stride, pads, dilation, out)
        cols = _t.reshape(cols, (-1, k, p))                                     # [N, C * K, P]
    else:
        cols = apply("im2col", x, kernel=list(kernel), stride=list(stride),
                     padding=[list(q) for q in pads], dilation=list(dilation))  # [N, *P, C, *K]
        cols = _t.transpose(cols, [0] + list(range(nd + 1, 2 * nd + 2)) + list(range(1, nd + 1)))
        cols = _t.reshape(cols, (-1, k, p))                                     # [N, C * K, P]
        if act_quant:             # dilation, or padding over half the kernel: the rows' act_quant
            cols = _t.transpose(apply("act_quant", _t.transpose(cols, [0, 2, 1])), [0, 2, 1])
    y = _t.matmul(_t.reshape(t, (o, k)), cols)                                  # [N, out, P]
    return _t.reshape(y, (-1, o) + tuple(out))


def _rows(x, t, kernel, stride, pads, dilation):
    """The same convolution as patch rows: act_quant(im2col rows [N * P, C * K]) @ T^T,
    [N, O, *P]: the form the `ternary` pass hands to a ternary kernel (with the weights
    packed at run time when they are computed) and the inference forward's."""
    nd, o = len(kernel), int(t.shape[0])
    rows, out = patches(x, kernel, stride, pads, dilation)
    rows = apply("act_quant", rows)
    y = _t.matmul(rows, _t.reshape(t, (o, int(rows.shape[-1]))), transpose_b=True)  # [N * P, O]
    y = _t.reshape(y, (x.shape[0],) + tuple(out) + (o,))
    return _t.transpose(y, [0, nd + 1] + list(range(1, nd + 1)))


@functools.lru_cache(maxsize=None)
def _kernel_conv(kernel, stride, pads, dilation, out):
    """conv(x, w) of a layer whose weights are computed (a training step's, a gradient's),
    as a custom_vjp: the value from the patch rows (_rows: on the host's ternary kernel,
    the weights ternarized and packed every call: the `ternary` pass), the gradients
    those of the columns form (_columns: IREE's fast matmul orientations for W^T g and g
    columns^T). The rows' f32 matmul is IREE's fast orientation forward too where no
    kernel takes it (bench/RESULTS.md: 27-29 against 49-51 ms for the 64-channel layer at
    batch 32); its VJP is not (3-10x slower), which this keeps out of the step. One
    rule per layer geometry."""
    pads = [list(q) for q in pads]

    def conv(x, w):
        return _rows(x, apply("ternarize", w), kernel, stride, pads, dilation)

    def fwd(x, w):
        return conv(x, w), (x, w)

    def bwd(res, g):
        x, w = res
        _, pullback = vjp(lambda x, w: _columns(x, apply("ternarize", w), kernel, stride, pads,
                                                dilation, out), x, w)
        return pullback(g)

    conv.__name__ = "bitconv"
    return custom_vjp(conv).defvjp(fwd, bwd)


class _BitConvNd(Module):
    nd = 0

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=False, act_quant=True, dtype="float32"):
        name = type(self).__name__
        _check_channels(name, in_channels, out_channels, groups)
        self.kernel_size = tuple(int(k) for k in _tuple(kernel_size, self.nd, "kernel_size", name))
        self.stride = tuple(int(s) for s in _tuple(stride, self.nd, "stride", name))
        self.dilation = tuple(int(d) for d in _tuple(dilation, self.nd, "dilation", name))
        for what, v in (("kernel_size", self.kernel_size), ("stride", self.stride),
                        ("dilation", self.dilation)):
            if min(v) < 1:
                raise ConfigError(f"{name}: {what} must be positive, got {v}")
        if isinstance(padding, str) and padding not in ("same", "valid"):
            raise ConfigError(f"{name}: padding must be \"same\" or \"valid\" when it is a "
                              f"string, got {padding!r}", hint=PADDING_HINT)
        self.padding = padding
        self.in_channels, self.out_channels, self.groups = int(in_channels), int(out_channels), int(groups)
        self.act_quant = bool(act_quant)
        bound = 1.0 / np.sqrt(in_channels // groups * int(np.prod(self.kernel_size)))
        self.weight = _uniform((out_channels, in_channels // groups) + self.kernel_size, bound, dtype)
        self.bias = _uniform((out_channels,), bound, dtype) if bias else None

    def ternary(self) -> tuple[np.ndarray, np.float32]:
        """(T int8 [out, in // groups, *kernel], scale float32): the weights as the compiled
        model uses them (absmean of the current float weights)."""
        w = np.asarray(self.weight)
        t, s = tp.absmean_ternarize(w.reshape(w.shape[0], -1))
        return t.reshape(w.shape), s

    def forward(self, x):
        name = type(self).__name__
        shape = _check_rank(name, x, (self.nd + 2,), f"[N, C, {'L' if self.nd == 1 else 'H, W'}]")
        if shape[1] != self.in_channels:
            raise TraceError(f"{name}({self.in_channels}, {self.out_channels}) got an input of "
                             f"shape {list(shape)}; its dim 1 must be {self.in_channels}")
        pads = resolve_padding(self.padding, self.nd, name,
                               same=(self.kernel_size, shape[2:], self.stride, self.dilation))
        for i, (d, k, dl, (lo, hi)) in enumerate(zip(shape[2:], self.kernel_size, self.dilation, pads)):
            if isinstance(d, (int, np.integer)) and dl * (k - 1) + 1 > d + lo + hi:
                raise TraceError(f"{name}: the kernel spans {dl * (k - 1) + 1} on spatial dim {i}, "
                                 f"more than the padded input ({d} + {lo + hi} padding)")
        if self.groups == 1 and _is_input(self.weight) and self.in_channels > 1:
            # weights traced as inputs (a gradient, a training step: no constant to pack).
            # One input channel stays on the rows: IREE 3.13 fails to compile the columns'
            # quantize there ("write affecting operations on global resources are
            # restricted to workgroup distributed contexts")
            out = _out_size(tuple(shape[2:]), self.kernel_size, self.stride, self.dilation, pads, name)
            k = self.in_channels * int(np.prod(self.kernel_size))
            if self.act_quant and runtime_kernel_pays(shape[0] * int(np.prod(out)), self.out_channels, k):
                # large enough for the host's kernel (the ternary pass): the value from the
                # patch rows, the gradients from the columns
                y = _kernel_conv(self.kernel_size, self.stride, tuple(map(tuple, pads)),
                                 self.dilation, tuple(out))(x, _traced(self.weight))
            else:       # the columns form, whose quantized columns the backward shares
                y = _columns(x, apply("ternarize", _traced(self.weight)), self.kernel_size,
                             self.stride, pads, self.dilation, out, act_quant=self.act_quant)
            if self.bias is not None:
                y = y + _t.reshape(self.bias, (self.out_channels,) + (1,) * self.nd)
            return y
        # the 4-D (5-D) weight is ternarized, then viewed as [out, K]: the ternary pass
        # packs it through that reshape
        t = apply("ternarize", _traced(self.weight))
        rows, out = patches(x, self.kernel_size, self.stride, pads, self.dilation)
        g, o, k = self.groups, self.out_channels, int(rows.shape[-1]) // self.groups
        if g == 1:
            if self.act_quant:
                rows = apply("act_quant", rows)
            y = _t.matmul(rows, _t.reshape(t, (o, k)), transpose_b=True)           # [N * P, out]
        else:
            rows = _t.transpose(_t.reshape(rows, (-1, g, k)), (1, 0, 2))           # [G, N * P, K]
            if self.act_quant:
                rows = apply("act_quant", rows)
            y = _t.matmul(rows, _t.reshape(t, (g, o // g, k)), transpose_b=True)    # [G, N * P, O/G]
            y = _t.reshape(_t.transpose(y, (1, 0, 2)), (-1, o))
        y = _t.reshape(y, (shape[0],) + tuple(out) + (o,))
        y = _t.transpose(y, [0, self.nd + 1] + list(range(1, self.nd + 1)))
        if self.bias is not None:
            y = y + _t.reshape(self.bias, (o,) + (1,) * self.nd)
        return y


class BitConv1d(_BitConvNd):
    """Ternary 1-D convolution over x [N, C, L] (BitNet b1.58 quantization; see the
    module docstring). The latent float weights are `.weight` [out, in // groups, k].

    >>> conv = nn.BitConv1d(8, 16, 3, padding=1)
    >>> conv(np.ones((2, 8, 20), np.float32)).shape
    (2, 16, 20)
    """
    nd = 1


class BitConv2d(_BitConvNd):
    """Ternary 2-D convolution over x [N, C, H, W]; `.weight` [out, in // groups, kh, kw]
    (PyTorch's layout). `tc.compile(model, x)` packs the weights 2 bits each and runs the
    patch matmul on the kernel table's ternary GEMM kernels."""
    nd = 2
