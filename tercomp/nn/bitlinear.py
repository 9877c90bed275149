"""BitLinear (BitNet b1.58): ternary weights, optional int8 activation quantization.

Exact semantics (the NumPy references are tercomp.ops.ternary_pack):

- weights, per tensor (absmean): scale = max(mean(|W|), 1e-5),
  W_t = clip(rint(W / scale), -1, 1) in {-1, 0, +1} (rint rounds half to even);
- activations, per token (absmax over the last axis): s = 127 / max(max(|x|), 1e-5),
  x_q = clip(rint(x * s), -127, 127), integers in the closed range [-127, 127]
  (-128 is never produced, so the range is symmetric);
- y = (x_q @ W_t^T) * scale / s (+ bias). With act_quant=False (weights-only ternary)
  y = (x @ W_t^T) * scale, activations stay f32.

Training sees the quantized values in the forward pass and straight-through gradients
(identity through both quantizers). For inference the `ternary` pass freezes the
weights, packs W_t 4 per byte and emits add/sub kernels (`tc.compile(..., ternary=)`).
"""
from __future__ import annotations

import numpy as np

from ..errors import TercompError
from ..trace import api as _t
from ..trace.tracer import Tracer, apply, current_trace
from .layers import _uniform
from .module import Module


def _traced(v):
    tr = current_trace()
    if tr is None or isinstance(v, Tracer):
        return v
    return Tracer(tr.const(np.asarray(v), name="weight"), tr)


class BitLinear(Module):
    """Ternary linear layer; weight of shape (out_features, in_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 act_quant: bool = True, dtype="float32"):
        for v in (in_features, out_features):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise TercompError(f"BitLinear({in_features}, {out_features}): sizes must be "
                                   f"positive integers")
        bound = 1.0 / np.sqrt(in_features)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.act_quant = bool(act_quant)
        self.weight = _uniform((out_features, in_features), bound, dtype)
        self.bias = _uniform((out_features,), bound, dtype) if bias else None

    def forward(self, x):
        shape = tuple(getattr(x, "shape", np.shape(x)))
        if len(shape) < 1 or shape[-1] != self.in_features:
            raise TercompError(f"BitLinear({self.in_features}, {self.out_features}) got an input "
                               f"of shape {shape}; its last dim must be {self.in_features}")
        if self.act_quant:
            x = apply("act_quant", x)
        w = apply("ternarize", _traced(self.weight))
        y = _t.matmul(x, w, transpose_b=True)
        return y + self.bias if self.bias is not None else y
