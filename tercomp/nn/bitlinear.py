"""BitLinear (BitNet b1.58): ternary weights, optional int8 activation quantization.

Exact semantics (the NumPy references are tercomp.ternary_pack):

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

`BitLinear.from_ternary(T, scale)` builds a layer from *stored* ternary weights (a loaded
checkpoint): it keeps the 2-bit codes and the scale (no f32 copy) and is frozen;
`layer.trainable()` turns it into an ordinary BitLinear whose float latent weights
quantize back to exactly those codes and that scale (`ternary_pack.absmean_latent`).
"""
from __future__ import annotations

import numpy as np

from ..errors import TraceError, ConfigError, InputError
from .. import ternary_pack as tp
from ..tracing import api as _t
from ..tracing.tracer import Tracer, apply, current_trace
from .layers import _uniform
from .module import Module


def _traced(v, name: str = "weight"):
    tr = current_trace()
    if tr is None or isinstance(v, Tracer):
        return v
    return Tracer(tr.const(np.asarray(v), name=name), tr)


class BitLinear(Module):
    """Ternary linear layer; weight of shape (out_features, in_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 act_quant: bool = True, dtype="float32"):
        for v in (in_features, out_features):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ConfigError(f"BitLinear({in_features}, {out_features}): sizes must be "
                                  f"positive integers")
        bound = 1.0 / np.sqrt(in_features)
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.act_quant = bool(act_quant)
        self.weight = _uniform((out_features, in_features), bound, dtype)
        self.bias = _uniform((out_features,), bound, dtype) if bias else None

    def forward(self, x):
        shape = tuple(getattr(x, "shape", np.shape(x)))
        if len(shape) < 1 or shape[-1] != self.in_features:
            raise TraceError(f"BitLinear({self.in_features}, {self.out_features}) got an input "
                             f"of shape {shape}; its last dim must be {self.in_features}")
        if self.act_quant:
            x = apply("act_quant", x)
        y = _t.matmul(x, self._ternary_weight(), transpose_b=True)
        return y + self.bias if self.bias is not None else y

    def _ternary_weight(self):
        """The ternary weights [out, in] as the traced matmul reads them."""
        return apply("ternarize", _traced(self.weight))

    def ternary(self) -> tuple[np.ndarray, np.float32]:
        """(T int8 [out, in], scale float32): the weights as the compiled model uses them
        (absmean of the current float weights)."""
        return tp.absmean_ternarize(np.asarray(self.weight))

    @classmethod
    def from_ternary(cls, t, scale, bias=None, act_quant: bool = True) -> "BitLinear":
        """A BitLinear with stored ternary weights: ``W = scale * T``, T [out, in] integers
        in {-1, 0, +1}, scale > 0 kept as given (not re-estimated by absmean, which would
        give scale * density).

        The layer holds T packed 2 bits per weight plus the float32 scale (1/16 of a
        float32 copy); `layer.weight` materializes ``scale * T`` on each access and
        `layer.ternary()` gives (T, scale) back exactly. It is **frozen**: the weights are
        not a parameter (only a bias is), so `tc.grad` and `tc.compile_train_step` leave
        them alone; to fine-tune, `layer.trainable()` gives the float-latent layer. The `ternary` pass packs them with their own scale, losslessly.

        >>> layer = nn.BitLinear.from_ternary(np.array([[1, 0, -1]]), 0.25)
        >>> layer.ternary()[0].tolist(), float(layer.ternary()[1])
        ([[1, 0, -1]], 0.25)
        """
        return StoredBitLinear(t, scale, bias=bias, act_quant=act_quant)


class StoredBitLinear(BitLinear):
    """A frozen BitLinear over stored ternary weights; see `BitLinear.from_ternary`."""

    def __init__(self, t, scale, bias=None, act_quant: bool = True):
        t = np.asarray(t)
        if t.ndim != 2 or t.size == 0:
            raise InputError(f"BitLinear.from_ternary expects a 2-D matrix [out, in], got "
                             f"shape {t.shape}")
        s = np.float32(scale)
        if np.ndim(scale) != 0 or not (np.isfinite(s) and s > 0):
            raise InputError(f"BitLinear.from_ternary: the scale must be one finite positive "
                             f"number, got {scale!r}")
        self.out_features, self.in_features = (int(d) for d in t.shape)
        self.act_quant = bool(act_quant)
        self._packed = tp.pack_ternary(t)        # checks the values are in {-1, 0, 1}
        self._set_scale_bias(s, bias)

    @classmethod
    def zeros(cls, in_features: int, out_features: int) -> "StoredBitLinear":
        """An all-zero layer (scale 1) for loaders that fill in every weight: its packed
        bytes are zeros, allocated lazily by the OS, so a model's skeleton costs nothing
        before its weights are read."""
        packed = np.zeros((int(out_features), tp.padded_k(int(in_features)) // 4), np.uint8)
        return cls.from_packed(packed, in_features, 1.0)

    @classmethod
    def from_packed(cls, packed, in_features: int, scale, act_quant: bool = True
                    ) -> "StoredBitLinear":
        """The layer over an already packed matrix (`ternary_pack.pack_ternary`'s layout,
        [out, padded_k(in) // 4] signed codes) that a loader converted from its file's own
        layout; the caller vouches for the codes (`ternary_pack.from_tq2_0` checks them)."""
        packed = np.asarray(packed)
        k = int(in_features)
        if packed.dtype != np.uint8 or packed.ndim != 2 or packed.shape[1] != tp.padded_k(k) // 4:
            raise InputError(f"StoredBitLinear.from_packed: packed {packed.dtype} "
                             f"{packed.shape} is not [out, {tp.padded_k(k) // 4}] uint8 for "
                             f"{k} input features")
        with np.errstate(over="ignore"):        # an overflow is the inf refused below
            s = np.float32(scale)
        if np.ndim(scale) != 0 or not (np.isfinite(s) and s > 0):
            raise InputError(f"StoredBitLinear.from_packed: the scale must be one finite "
                             f"positive float32 number, got {scale!r}")
        layer = cls.__new__(cls)
        layer.out_features, layer.in_features = int(packed.shape[0]), k
        layer.act_quant = bool(act_quant)
        layer._packed = packed
        layer._set_scale_bias(s, None)
        return layer

    def _set_scale_bias(self, s, bias):
        self._scale = s
        if bias is not None:
            bias = np.asarray(bias, dtype=np.float32)
            if bias.shape != (self.out_features,):
                raise InputError(f"BitLinear.from_ternary: bias of shape {bias.shape}, "
                                 f"expected ({self.out_features},)")
        self.bias = bias

    def trainable(self) -> BitLinear:
        """An ordinary (trainable) BitLinear computing what this layer computes: its float
        latent weight W is chosen so that absmean quantization gives back exactly T and
        the stored scale (``scale * T`` would re-quantize to ``scale * density``), and
        training moves W through the straight-through estimators.

        >>> layer = nn.BitLinear.from_ternary(np.array([[1, 0, -1, 0]]), 0.25).trainable()
        >>> layer.ternary()[0].tolist(), float(layer.ternary()[1])
        ([[1, 0, -1, 0]], 0.25)
        """
        t, s = self.ternary()
        layer = BitLinear.__new__(BitLinear)
        layer.in_features, layer.out_features = self.in_features, self.out_features
        layer.act_quant = self.act_quant
        layer.weight = tp.absmean_latent(t, s)
        layer.bias = None if self.bias is None else np.array(self.bias, np.float32)
        return layer

    @property
    def weight(self) -> np.ndarray:
        """``scale * T`` as float32 (materialized on each access)."""
        t, s = self.ternary()
        return t.astype(np.float32) * s

    def ternary(self) -> tuple[np.ndarray, np.float32]:
        return tp.unpack_ternary(self._packed, self.in_features), self._scale

    def _ternary_weight(self):
        # the packed bytes themselves enter the IR (no f32 copy): the ternary pass hands
        # them to the kernel as they are, and without it ternary_weight unpacks them
        return apply("ternary_weight", _traced(self._packed.view(np.int8), "packed"),
                     k=self.in_features, scale=float(self._scale))
