"""Ternary weights: absmean quantization, 2-bit planar packing, and the NumPy semantics
of the ternary matmul kernels (`tercomp/kernels/ternary/builder.py`). A leaf module
(NumPy only): the ops (tern.ternary_matmul lowers through codegen) and the codegen
kernels (which need its constants) both import it, so it sits in neither package.

Packing layout (planar, as measured in `shared/kernels/README.md`)
-------------------------------------------------------------------
A ternary matrix ``T[N, K]`` (values in {-1, 0, +1}) is zero-padded along K to ``KP``
columns and stored as ``packed[N, KB]`` (uint8), ``KB = KP // 4``. Byte ``kb`` of row
``n`` holds four 2-bit codes, one per *plane* ``j = 0..3``::

    bits 2j..2j+1 of packed[n, kb]  =  code(T[n, j*KB + kb])
    code:  0b00 -> 0,   0b01 -> +1,   0b10 -> -1,   0b11 -> invalid

so plane ``j`` covers the contiguous slice ``x[:, j*KB:(j+1)*KB]`` of the activations and
every bit test in a kernel uses a constant mask (the interleaved layout, where a byte
holds four neighbouring k, was 8x slower).

These are the "signed" codes, the format of every packed weight tercomp stores and
reads. A kernel that multiplies the codes as unsigned bytes (the avx2 kernel's
``vpmaddubsw``) wants the "offset" codes ``w + 1`` (0b00 -> -1, 0b01 -> 0, 0b10 -> +1, as
llama.cpp's TQ2_0 stores them) and gets a constant re-coded at compile time
(`to_offset_codes`), which saves it the per-byte remap at run time.

Padding rule (`padded_k`)
-------------------------
The kernels split ``KB = KO * KI`` with ``KI`` a parallel (vectorized) dimension and
``KO`` the reduction carried in i16 partial sums, which is exact while
``KO * 4 * 127 < 32767``, i.e. ``KO <= 64``. ``KP`` is therefore:

* ``K <= 256``: ``KP = 4 * KI`` with ``KI`` the next power of two >= ceil(K / 4)
  (``KO = 1``); e.g. K=3 -> 4, K=100 -> 128.
* ``K > 256``: ``KI = 64 * 2**p`` with the smallest ``p`` that makes
  ``KO = ceil(K / (4 * KI)) <= 64``, and ``KP = 4 * KI * KO``; e.g. K=4096 -> 4096
  (KI=64, KO=16), K=784 -> 1024, K=20000 -> 20480 (KI=128, KO=40).

`k_split(KB)` recovers ``(KO, KI)`` from the packed width alone (it also accepts widths
this module did not produce, as long as they are >= ceil(K / 4)).

>>> import numpy as np
>>> t = np.array([[1, 0, -1, 1, -1]], dtype=np.int8)
>>> p = pack_ternary(t)
>>> p.shape, padded_k(5)
((1, 2), 8)
>>> unpack_ternary(p, 5).tolist()
[[1, 0, -1, 1, -1]]
"""
from __future__ import annotations

import numpy as np

from .errors import ConfigError, InputError

#: Largest KO for which the i16 partial sums of the int8 add/sub kernel cannot overflow.
KO_MAX = 64
#: Preferred KI (lanes of the ki-parallel accumulator) for large K.
KI_BASE = 64

#: BitNet b1.58's constants, one definition for the NumPy reference, the tern decompositions
#: (ops/ternary.py) and the compiled kernels (kernels/ternary/builder.py):
#: activations are quantized to [-ACT_MAX, ACT_MAX] with s = ACT_MAX / max(amax, ACT_EPS),
#: and the absmean weight scale is at least SCALE_EPS.
ACT_MAX = 127
ACT_EPS = 1e-5
SCALE_EPS = 1e-5
#: the largest weight scale a stored ternary layer may have: float16's largest number, the
#: range of TQ2_0's own block scale. A scale this size times a few thousand inputs already
#: nears float32's range in the RMS norm that follows (its squares overflow past ~1.8e19),
#: so a larger one (a corrupt file) would give NaN logits, not a model
MAX_WEIGHT_SCALE = 65504.0
#: the smallest: float32's smallest normal number (a smaller one has lost its precision,
#: or is 0, and the layer's output vanishes)
MIN_WEIGHT_SCALE = float(np.finfo(np.float32).tiny)


def weight_scale_in_range(s) -> bool:
    """Whether `s` (a Python or NumPy number) may be a stored ternary layer's scale: a
    float32 from MIN_WEIGHT_SCALE to MAX_WEIGHT_SCALE (what the loaders accept)."""
    s = float(s)
    return MIN_WEIGHT_SCALE <= s <= MAX_WEIGHT_SCALE and np.float32(s) >= MIN_WEIGHT_SCALE

_CODE_POS = 0b01
_CODE_NEG = 0b10
_CODE_BAD = 0b11
#: The 2-bit code formats (module docstring): "signed" (0, +1, -1 -> 0b00, 0b01, 0b10)
#: and "offset" (w + 1).
CODES = ("signed", "offset")


def _recode_table(mapping) -> np.ndarray:
    """The byte table that applies `mapping` (2-bit code -> 2-bit code) to all 4 fields."""
    b = np.arange(256, dtype=np.uint8)
    out = np.zeros(256, np.uint8)
    for j in range(4):
        out |= mapping[(b >> (2 * j)) & 3] << (2 * j)
    return out


# signed -> offset: 0 -> 0b01, +1 -> 0b10, -1 -> 0b00 (0b11 stays invalid); and back
_TO_OFFSET = _recode_table(np.array([1, 2, 0, 3], np.uint8))
_FROM_OFFSET = _recode_table(np.array([2, 0, 1, 3], np.uint8))


# --------------------------------------------------------------------------- layout
def padded_k(k: int) -> int:
    """KP, the padded reduction length of a packed ternary matrix with K columns.

    >>> padded_k(4096), padded_k(784), padded_k(3)
    (4096, 1024, 4)
    """
    k = _check_k(k)
    if k <= 4 * KI_BASE:
        ki = 1 << max(0, (-(-k // 4) - 1).bit_length())
        return 4 * ki
    ki = KI_BASE
    while -(-k // (4 * ki)) > KO_MAX:
        ki *= 2
    return 4 * ki * -(-k // (4 * ki))


def k_split(kb: int) -> tuple[int, int]:
    """(KO, KI) with KO * KI == KB, KO <= 64 (i16-safe), KI as close to 64 as KB allows.

    >>> k_split(1024), k_split(16), k_split(5120)
    ((16, 64), (1, 16), (40, 128))
    """
    kb = int(kb)
    if kb < 1:
        raise InputError(f"packed width KB must be >= 1, got {kb}")
    if kb <= KI_BASE:
        return 1, kb
    ki = KI_BASE
    while ki <= kb:
        if kb % ki == 0 and kb // ki <= KO_MAX:
            return kb // ki, ki
        ki *= 2
    # A width this module did not produce: the smallest divisor >= 64 with KO <= 64
    # (KI = KB, KO = 1 always qualifies).
    for ki in range(KI_BASE, kb + 1):
        if kb % ki == 0 and kb // ki <= KO_MAX:
            return kb // ki, ki
    raise AssertionError("unreachable")  # pragma: no cover


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or int(k) < 1:
        raise ConfigError(f"K must be a positive integer, got {k!r}")
    return int(k)


# ---------------------------------------------------------------------- quantizers
def absmean_ternarize(w: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """Quantize a float weight matrix W[N, K] to ternary (BitNet b1.58 absmean).

    ``scale = max(mean(|W|), 1e-5)`` (float32; the guard makes an all-zero W give T = 0)
    and ``T = clip(rint(W / scale), -1, 1)`` as int8, with round-half-to-even. Then
    ``W ~= scale * T``.

    >>> t, s = absmean_ternarize(np.array([[0.5, -2.0], [0.0, 1.5]]))  # 0.5 rounds to 0
    >>> t.tolist(), float(s)
    ([[0, -1], [0, 1]], 1.0)
    """
    w = np.asarray(w)
    if w.ndim != 2:
        raise InputError(f"absmean_ternarize expects a 2-D weight matrix [N, K], "
                         f"got shape {w.shape}")
    if not np.issubdtype(w.dtype, np.floating):
        raise InputError(f"absmean_ternarize expects float weights, got dtype {w.dtype}")
    if w.size == 0:
        raise InputError(f"absmean_ternarize got an empty matrix of shape {w.shape}")
    if not np.all(np.isfinite(w)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(w))[0])
        raise InputError(f"absmean_ternarize got a non-finite weight {w[bad]} at {bad}")
    w64 = w.astype(np.float64)
    scale = np.float32(max(np.mean(np.abs(w64)), SCALE_EPS))
    t = np.clip(np.rint(w64 / np.float64(scale)), -1, 1).astype(np.int8)
    return t, scale


def ternarize_with_scale(w: np.ndarray, scale) -> tuple[np.ndarray, np.float32]:
    """Quantize W[N, K] to ternary with a *given* scale: ``T = clip(rint(W / scale), -1, 1)``.

    This is how a stored ternary weight keeps its own scale (`nn.BitLinear.from_ternary`,
    weights loaded from GGUF): for ``W = scale * T`` it returns T exactly, where absmean
    would give ``scale * density`` instead of ``scale``.

    >>> t, s = ternarize_with_scale(np.float32(0.5) * np.array([[1, 0, -1]], np.float32), 0.5)
    >>> t.tolist(), float(s)
    ([[1, 0, -1]], 0.5)
    """
    w = np.asarray(w)
    if w.ndim != 2 or not np.issubdtype(w.dtype, np.floating) or w.size == 0:
        raise InputError(f"ternarize_with_scale expects a non-empty 2-D float matrix, got "
                         f"shape {w.shape} dtype {w.dtype}")
    s = np.float32(scale)
    if not (np.isfinite(s) and s > 0):
        raise InputError(f"a ternary weight scale must be finite and positive, got {scale!r}")
    t = np.clip(np.rint(w.astype(np.float64) / np.float64(s)), -1, 1).astype(np.int8)
    return t, s


def absmean_latent(t: np.ndarray, scale) -> np.ndarray:
    """Float weights W [N, K] that `absmean_ternarize` maps back to exactly (t, scale):
    the latent of a trainable layer over stored ternary weights.

    ``scale * t`` would not do: its absmean is ``scale * density`` (the share of non-zero
    codes), so re-quantizing it changes the scale. Here every non-zero code becomes
    ``±v`` with ``v ~= scale / density`` (>= scale, so it rounds to ±1 whatever the
    density) and every zero code stays 0; the first non-zero one is moved by a few ulps
    so that the float64 absmean rounds to `scale` itself (one magnitude alone cannot
    always hit a float32 scale exactly). An all-zero `t` gives zeros.

    >>> t = np.array([[1, 0, -1, 0]], np.int8)
    >>> w = absmean_latent(t, 0.25)
    >>> w.tolist(), absmean_ternarize(w)[0].tolist(), float(absmean_ternarize(w)[1])
    ([[0.5, 0.0, -0.5, 0.0]], [[1, 0, -1, 0]], 0.25)
    """
    t = np.asarray(t)
    s = np.float32(scale)
    if t.ndim != 2 or t.size == 0 or not np.isin(t, (-1, 0, 1)).all():
        raise InputError(f"absmean_latent expects a non-empty ternary matrix [N, K], got "
                         f"shape {t.shape}")
    if not (np.isfinite(s) and s >= SCALE_EPS):
        raise InputError(f"absmean_latent: the scale must be finite and at least "
                         f"{SCALE_EPS}, got {scale!r}")
    nnz = int(np.count_nonzero(t))
    w = t.astype(np.float32)
    if nnz == 0:
        return w
    v = np.float32(np.float64(s) * t.size / nnz)
    # the float64 sum of float32 magnitudes this close together is exact, so np.mean
    # rounds once: (rest + first) / size
    rest = np.float64(v) * (nnz - 1)
    first = np.float32(np.float64(s) * t.size - rest)
    best = first
    for step in range(16):          # the neighbours, nearest first
        cands = [_nudge(first, step), _nudge(first, -step)]
        hit = [c for c in cands if np.float32((rest + np.float64(c)) / t.size) == s]
        if hit:
            best = hit[0]
            break
    w *= v
    i = np.flatnonzero(t)[0]
    w.flat[i] = np.sign(w.flat[i]) * best
    return w


def _nudge(v: np.float32, steps: int) -> np.float32:
    """`v` moved `steps` float32 ulps (negative: down)."""
    for _ in range(abs(steps)):
        v = np.nextafter(v, np.float32(np.inf if steps > 0 else -np.inf), dtype=np.float32)
    return np.float32(v)


def act_quant(x: np.ndarray, eps: float = ACT_EPS) -> tuple[np.ndarray, np.ndarray]:
    """Per-row absmax int8 quantization of activations (BitNet b1.58).

    Over the last axis: ``s = 127 / max(max|x_row|, eps)`` (shape ``[..., 1]``) and
    ``xq = clip(rint(x * s), -127, 127)``. ``xq`` keeps x's float dtype and holds
    integers in the closed range [-127, 127] (-128 never occurs); ``x ~= xq / s``.
    Everything is computed in x's dtype, in the order above, which is exactly what
    the compiled kernels do in f32 (so their rounding matches bit for bit).

    >>> xq, s = act_quant(np.array([[1.0, -0.5, 0.25]], dtype=np.float32))
    >>> xq.tolist(), s.tolist()
    ([[127.0, -64.0, 32.0]], [[127.0]])
    """
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise InputError(f"act_quant expects float activations, got dtype {x.dtype}")
    if x.ndim < 1 or x.shape[-1] == 0:
        raise InputError(f"act_quant expects a non-empty last axis, got shape {x.shape}")
    dt = x.dtype.type
    amax = np.max(np.abs(x), axis=-1, keepdims=True)
    s = dt(ACT_MAX) / np.maximum(amax, dt(eps))
    xq = np.clip(np.rint(x * s), dt(-ACT_MAX), dt(ACT_MAX))
    return xq, s


_act_quant = act_quant  # ternary_matmul_reference's `act_quant` flag shadows the name


# ------------------------------------------------------------------------- packing
def pack_ternary(t: np.ndarray) -> np.ndarray:
    """Pack a ternary matrix T[N, K] (integer dtype, values in {-1, 0, 1}) into the
    planar 2-bit layout: returns uint8 ``[N, padded_k(K) // 4]`` (see module docstring).

    >>> pack_ternary(np.array([[1, -1, 0, 1]], dtype=np.int8)).tolist()
    [[73]]
    """
    t = np.asarray(t)
    if t.ndim != 2:
        raise InputError(f"pack_ternary expects a 2-D matrix [N, K], got shape {t.shape}")
    if not (np.issubdtype(t.dtype, np.integer) and t.dtype != np.bool_):
        raise InputError(f"pack_ternary expects an integer ternary matrix, got dtype "
                         f"{t.dtype}", hint="quantize float weights with absmean_ternarize")
    n, k = t.shape
    if n == 0 or k == 0:
        raise InputError(f"pack_ternary got an empty matrix of shape {t.shape}")
    t8 = t
    if t.dtype != np.int8:               # out-of-range values stay out of range
        t8 = (np.minimum(t, 2) if t.dtype.kind == "u" else np.clip(t, -2, 2)).astype(np.int8)
    b = t8.view(np.uint8)
    bad = (b + np.uint8(1)) > 2          # -1, 0, 1 -> 0, 1, 2 as bytes; anything else is bad
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise InputError(f"pack_ternary: {int(bad.sum())} value(s) are not in {{-1, 0, 1}}, "
                         f"e.g. {t[idx]} at index {idx}",
                         hint="quantize with absmean_ternarize first")
    kp = padded_k(k)
    kb = kp // 4
    codes = b & np.uint8(3)              # 0, 1, 0b11 for 0, 1, -1
    codes ^= codes >> 1                  # 0b11 -> 0b10 (_CODE_NEG)
    if kp != k:
        codes = np.concatenate([codes, np.zeros((n, kp - k), np.uint8)], axis=1)
    planes = codes.reshape(n, 4, kb)
    out = planes[:, 3] << 6
    out |= planes[:, 2] << 4
    out |= planes[:, 1] << 2
    out |= planes[:, 0]
    return out


def unpack_ternary(packed: np.ndarray, k: int) -> np.ndarray:
    """Inverse of `pack_ternary`: the int8 matrix T[N, K] from packed uint8 [N, KB].

    Any width ``KB >= ceil(K / 4)`` is accepted; the codes of the padding columns
    (k >= K) must be 0, and no code may be 0b11.
    """
    packed = _check_packed(packed)
    k = _check_k(k)
    n, kb = packed.shape
    if 4 * kb < k:
        raise InputError(f"packed ternary matrix has {kb} bytes per row, which hold at "
                         f"most {4 * kb} columns, but K = {k} was asked for")
    codes = np.stack([(packed >> (2 * j)) & 3 for j in range(4)], axis=1).reshape(n, 4 * kb)
    invalid = codes == _CODE_BAD
    if invalid.any():
        r, c = (int(i) for i in np.argwhere(invalid)[0])
        raise InputError(f"packed ternary matrix holds {int(invalid.sum())} invalid 2-bit "
                         f"code(s) 0b11, e.g. row {r} byte {c % kb} plane {c // kb}",
                         hint="the data is not a pack_ternary output (corrupt or "
                              "another layout)")
    if (codes[:, k:] != 0).any():
        r, c = (int(i) for i in np.argwhere(codes[:, k:] != 0)[0])
        raise InputError(f"packed ternary matrix has a non-zero code in padding column "
                         f"{k + c} of row {r} (K = {k}); wrong K or a corrupt pack")
    t = (codes[:, :k] & 1).astype(np.int8) - (codes[:, :k] >> 1).astype(np.int8)
    return t


def to_offset_codes(packed: np.ndarray) -> np.ndarray:
    """The "offset" codes (w + 1) of a signed-code packed matrix, same shape and layout.

    >>> to_offset_codes(pack_ternary(np.array([[1, -1, 0, 1]], dtype=np.int8))).tolist()
    [[146]]
    """
    p = _check_packed(packed)
    if p.flags.c_contiguous and p.size % 8 == 0:     # 8 bytes at a time (of the whole
        w = p.reshape(-1).view(np.uint64)             # matrix: rows of 7 bytes too)
        lo, hi = w & _W55, (w >> np.uint64(1)) & _W55
        # signed 0b00 -> 0b01, 0b01 -> 0b10, 0b10 -> 0b00, 0b11 stays
        out = (~(lo | hi) & _W55) | (lo << np.uint64(1)) | (lo & hi)
        return out.view(np.uint8).reshape(p.shape)
    return _TO_OFFSET[p]


def from_offset_codes(packed: np.ndarray) -> np.ndarray:
    """Inverse of `to_offset_codes`: the signed codes of an offset-code packed matrix."""
    return _FROM_OFFSET[_check_packed(packed)]


_W55 = np.uint64(0x5555555555555555)   # bit 0 of every 2-bit field of a 64-bit word
_W03 = np.uint64(0x0303030303030303)   # the low field of every byte


def from_tq2_0(qs: np.ndarray, n: int, k: int) -> np.ndarray | None:
    """The signed-code planar matrix [N, K // 4] of llama.cpp's TQ2_0 codes, without
    going through int8 values; None if a code is 3 (invalid).

    `qs`: uint8 [N * K / 256, 64], each block's 64 code bytes (the f16 scale left out),
    ``K % 256 == 0`` and ``padded_k(K) == K``. In TQ2_0, value ``128*h + 32*l + m`` of a
    block is the offset code ``(qs[32*h + m] >> 2*l) & 3`` (w + 1): a 32-byte group
    holds 32 columns in each of its four fields, so the re-layout moves whole 32-byte
    groups of one field, which the bit operations below do 8 bytes at a time.

    >>> t = np.array([[1, -1, 0, 1] * 64], dtype=np.int8)
    >>> qs = np.zeros((1, 64), np.uint8)
    >>> for i in range(256): qs[0, 32 * (i // 128) + i % 32] |= (t[0, i] + 1) << 2 * (i % 128 // 32)
    >>> bool((from_tq2_0(qs, 1, 256) == pack_ternary(t)).all())
    True
    """
    if k % 256 or padded_k(k) != k:
        raise InputError(f"from_tq2_0: K = {k} is not a multiple of 256 without padding")
    return _from_offset_groups(qs, n, k)


def _from_offset_groups(qs: np.ndarray, n: int, k: int) -> np.ndarray | None:
    """`from_tq2_0` for any K that is a multiple of 128 and needs no padding: `qs` holds,
    for each group of 128 columns, 32 bytes whose field l (bits 2l..2l+1) of byte m is
    the offset code of column 32*l + m of the group (a strided view of the file's blocks
    is fine: each block of rows is copied once).

    In blocks of about 1 MiB of rows, so that the chain of bit operations stays in the
    core's cache: 1.7x faster than whole-matrix passes on a 4096 x 1536 matrix (a model's
    load re-lays ~200 MB of codes this way, on the path of every cached compile_lm). Two
    threads over the blocks measured slower (NumPy's small calls contend for the GIL)."""
    groups = np.asarray(qs, dtype=np.uint8).reshape(n, k // 128, 32)
    out = np.empty((n, k // 4), np.uint8)
    words = out.view(np.uint64)
    rows = max(1, (1 << 20) // k)
    for r0 in range(0, n, rows):
        w = np.ascontiguousarray(groups[r0:r0 + rows]).view(np.uint64)
        if _offset_groups_to_planes(w, words[r0:r0 + rows]):
            return None
    return out


def _offset_groups_to_planes(w: np.ndarray, out: np.ndarray) -> bool:
    """Rows `w` (uint64 [r, K / 128, 4]: each group's 32 code bytes) into `out` (uint64
    [r, K / 32], the planar signed codes); True if a code is 3 (invalid)."""
    lo, hi = w & _W55, (w >> np.uint64(1)) & _W55
    if (lo & hi).any():
        return True
    # offset code 0 (-1) -> signed 0b10, 1 (0) -> 0b00, 2 (+1) -> 0b01
    signed = hi | ((~(lo | hi) & _W55) << np.uint64(1))
    r, g, _ = w.shape
    codes = np.empty((r, g, 4, 4), np.uint64)
    for j in range(4):
        np.bitwise_and(signed >> np.uint64(2 * j), _W03, out=codes[:, :, j, :])
    codes = codes.reshape(r, 4, 4 * g)                  # columns in order, by plane
    np.left_shift(codes[:, 3], np.uint64(6), out=out)
    out |= codes[:, 2] << np.uint64(4)
    out |= codes[:, 1] << np.uint64(2)
    out |= codes[:, 0]
    return False


_W0F = np.uint64(0x0F0F0F0F0F0F0F0F)   # the low nibble of every byte
_W33 = np.uint64(0x3333333333333333)   # the low field of every nibble


def _reverse_fields(codes: np.ndarray) -> np.ndarray:
    """The bytes of `codes` (uint8, a multiple of 8 of them) with their four 2-bit fields
    in reverse order, 8 bytes at a time: swap the nibbles, then the fields in each."""
    w = np.ascontiguousarray(codes, dtype=np.uint8).view(np.uint64)
    w = ((w & _W0F) << np.uint64(4)) | ((w >> np.uint64(4)) & _W0F)
    w = ((w & _W33) << np.uint64(2)) | ((w >> np.uint64(2)) & _W33)
    return w.view(np.uint8)


#: weights in one block of bitnet.cpp's I2_S (x86 layout)
I2S_BLOCK = 128


def from_i2_s(codes: np.ndarray, n: int, k: int) -> np.ndarray | None:
    """The signed-code planar matrix [N, K // 4] of bitnet.cpp's I2_S codes (x86 layout,
    the packed bytes only: the tensor scale that follows them is the caller's), without
    going through int8 values; None if a code is 3 (invalid).

    I2_S cuts the row-major weights into blocks of 128 and stores each in 32 bytes:
    weight ``j`` of a block is in byte ``j % 32`` at bits ``6 - 2 * (j // 32)``, as the
    code ``w + 1`` (0, 1, 2 = -1, 0, +1). That is TQ2_0's grouping with the four fields
    of each byte in reverse order: reversing them gives TQ2_0's bytes.
    ``K % 128 == 0`` and ``padded_k(K) == K``.

    >>> t = np.array([[1, -1, 0, 1] * 32], dtype=np.int8)
    >>> bool((from_i2_s(to_i2_s(t), 1, 128) == pack_ternary(t)).all())
    True
    """
    if k % I2S_BLOCK or padded_k(k) != k:
        raise InputError(f"from_i2_s: K = {k} is not a multiple of {I2S_BLOCK} without "
                         f"padding")
    return _from_offset_groups(_reverse_fields(codes), n, k)


def to_i2_s(t: np.ndarray) -> np.ndarray:
    """The I2_S code bytes (uint8, ``N * K / 4``) of a ternary matrix T[N, K] with
    ``N * K % 128 == 0`` (`from_i2_s` describes the layout); the tensor scale is not
    included."""
    t = np.asarray(t)
    if t.ndim != 2 or t.size % I2S_BLOCK or not np.isin(t, (-1, 0, 1)).all():
        raise InputError(f"to_i2_s expects a ternary matrix of whole {I2S_BLOCK}-weight "
                         f"blocks, got shape {t.shape}")
    c = (t.astype(np.int8) + np.int8(1)).view(np.uint8).reshape(-1, 4, 32)
    out = c[:, 0] << 6
    out |= c[:, 1] << 4
    out |= c[:, 2] << 2
    out |= c[:, 3]
    return out.reshape(-1)


def _check_packed(packed) -> np.ndarray:
    packed = np.asarray(packed)
    if packed.ndim != 2:
        raise InputError(f"a packed ternary matrix is 2-D [N, KB], got shape {packed.shape}")
    if packed.dtype == np.int8:  # same bytes, as an MLIR i8 constant reads them
        packed = packed.view(np.uint8)
    if packed.dtype != np.uint8:
        raise InputError(f"a packed ternary matrix has dtype uint8, got {packed.dtype}")
    if packed.shape[0] == 0 or packed.shape[1] == 0:
        raise InputError(f"packed ternary matrix is empty (shape {packed.shape})")
    return packed


# ---------------------------------------------------------------------- reference
def ternary_matmul_reference(x: np.ndarray, packed: np.ndarray, k: int, scale: float,
                             act_quant: bool, codes: str = "signed") -> np.ndarray:
    """The exact NumPy semantics of the compiled ternary matmul kernels.

    ``T = unpack_ternary(packed, k)`` (of `from_offset_codes(packed)` for "offset"
    `codes`); for x[..., K]:

    * ``act_quant=True``:  ``xq, s = act_quant(x)``; ``y = (xq @ T.T) * scale / s``
    * ``act_quant=False``: ``y = (x @ T.T) * scale``

    computed in float64 and cast to x's dtype. The int8 kernels match this up to the
    rounding of the final f32 scaling; the f32 kernel up to f32 summation order.

    >>> t = np.array([[1, -1, 0]], dtype=np.int8)
    >>> ternary_matmul_reference(np.array([[2.0, 1.0, 5.0]]), pack_ternary(t), 3, 0.5, False)
    array([[0.5]])
    """
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):
        raise InputError(f"ternary matmul expects float activations, got {x.dtype}")
    if x.ndim < 1 or x.shape[-1] != k:
        raise InputError(f"ternary matmul expects activations [..., {k}], got {x.shape}")
    if codes not in CODES:
        raise ConfigError(f"unknown ternary code format {codes!r}; expected one of {CODES}")
    if codes == "offset":
        packed = from_offset_codes(packed)
    t = unpack_ternary(packed, k).astype(np.float64)
    if act_quant:
        xq, s = _act_quant(x)
        y = (xq.astype(np.float64) @ t.T) * float(scale) / s.astype(np.float64)
    else:
        y = (x.astype(np.float64) @ t.T) * float(scale)
    return y.astype(x.dtype)
