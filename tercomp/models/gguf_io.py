"""GGUF files of llama.cpp's `bitnet` and `llama` (1.58-bit) architectures, and
bitnet.cpp's: read into a BitNetLM (models/families picks the options by
`general.architecture`); gguf_write.py writes them back with the same tables.

Reading and writing go through the `gguf` package (gguf-py, llama.cpp's own Python
library); this module maps its tensors onto the BitNetLM module tree:

    token_embd.weight            embed_tokens.weight      [vocab, hidden] (float; an F16
                                 table stays f16: embed_tokens is an nn.StoredEmbedding)
    output_norm.weight           norm.weight
    blk.{i}.attn_norm            layers[i].input_layernorm
    blk.{i}.attn_q/k/v/output    layers[i].attn.q/k/v/o_proj     (ternary, + .scale)
    blk.{i}.attn_sub_norm        layers[i].attn.attn_sub_norm
    blk.{i}.ffn_norm             layers[i].post_attention_layernorm
    blk.{i}.ffn_gate/up/down     layers[i].mlp.gate/up/down_proj (ternary, + .scale)
    blk.{i}.ffn_sub_norm         layers[i].mlp.ffn_sub_norm
    output.weight                lm_head.weight (untied; `llama` models; F16: nn.StoredLinear)
    rope_freqs.weight            config.rope_freq_factors (Llama 3's RoPE scaling)

A `llama` file has no sub-norms, stores q/k rows permuted for interleaved RoPE (so the
model reads them with rope_style "interleaved"), and may give `attention.key_length`
(head_dim). `rope.scaling.factor` divides every frequency (llama.cpp's linear scaling;
its converter writes 1.0 for BitNet). The FFN activation is `hidden_activation` when
the file gives it; no converter does, so without it the family decides (models/families:
BitNet b1.58 2B4T, relu2, is the `bitnet` file with Llama 3's BPE vocabulary).

A ternary tensor (TQ2_0 / TQ1_0) stores codes in {-1, 0, 1} and an f16 scale per block
of 256; llama.cpp multiplies the product by the optional f32 `*.scale` tensor. The
weight is ``block_scale * T * scale``: tercomp needs one scale per tensor, so every block
holding a non-zero code must carry the same block scale (an error names the tensor
otherwise). Float (F32/F16/BF16) projections whose non-zero values share one magnitude
are stored ternary weights too; any other float projection becomes an ordinary
BitLinear (ternarized by absmean when compiled). A layer's scale must be a positive
float32 of at most ternary_pack.MAX_WEIGHT_SCALE.

bitnet.cpp's I2_S (type 36 of its llama.cpp fork, which gguf-py does not know) stores the
codes 2 bits each in blocks of 128 weights and one f32 scale for the whole tensor after
them (`ternary_pack.from_i2_s`; gguf_scan checks its size); its `bitnet-b1.58` /
`bitnet-25` architectures are the `bitnet` family (models/families/bitnet.py).

I2_S's byte layout depends on the machine that quantized it, and the file does not say
which (src/ggml-bitnet-mad.cpp `quantize_i2_s`): until November 2025 every build, and
since then x86 builds with ACT_PARALLEL (include/gemm-config.h defines it), write the
128-weight blocks read here, as does utils/convert-hf-to-gguf-bitnet.py on any machine;
since November 2025 ARM builds write blocks of 64 weights in 16 bytes (weight j in byte
j % 16 at bits 6 - 2 * (j // 16)), and x86 builds without ACT_PARALLEL four rows a byte
(row 4g + r at bits 6 - 2r). Neither can be told from the header or the bytes; a row
that is not whole 128-weight blocks is refused naming the ARM layout.
"""
from __future__ import annotations

import math
import mmap
import re

import struct

import numpy as np

from .. import nn
from .. import ternary_pack as tp
from ..errors import MissingDependency
from .bitnet import BitNetLM
from . import families
from .config import BitNetConfig, ConfigError
from .gguf_scan import EXTRA_TYPES, GGUFError, scan
from .tokenizer import tokenizer_from_gguf

try:
    import gguf
except ImportError:  # pragma: no cover - gguf is a dependency
    gguf = None

PROJECTIONS = {  # gguf tensor -> (block, BitLinear) in a DecoderLayer
    "attn_q": ("attn", "q_proj"), "attn_k": ("attn", "k_proj"), "attn_v": ("attn", "v_proj"),
    "attn_output": ("attn", "o_proj"), "ffn_gate": ("mlp", "gate_proj"),
    "ffn_up": ("mlp", "up_proj"), "ffn_down": ("mlp", "down_proj"),
}
NORMS = {  # gguf tensor -> module path in a DecoderLayer
    "attn_norm": ("input_layernorm",), "attn_sub_norm": ("attn", "attn_sub_norm"),
    "ffn_norm": ("post_attention_layernorm",), "ffn_sub_norm": ("mlp", "ffn_sub_norm"),
    # qwen3 / gemma3 (families/backbone.py): each with the BitNetConfig option it needs
    "attn_q_norm": ("attn", "q_norm"), "attn_k_norm": ("attn", "k_norm"),
    "post_attention_norm": ("attn_post_norm",), "post_ffw_norm": ("ffn_post_norm",),
    **{g + "_norm_in": (block, proj.replace("_proj", "_norm_in"))
       for g, (block, proj) in PROJECTIONS.items()},
}
NORM_OPTIONS = {"attn_sub_norm": "sub_norms", "ffn_sub_norm": "sub_norms",
                "attn_q_norm": "qk_norm", "attn_k_norm": "qk_norm",
                "post_attention_norm": "post_norms", "post_ffw_norm": "post_norms",
                **{g + "_norm_in": "proj_norms" for g in PROJECTIONS}}
ACTS_IN = {"silu": "silu", "swish": "silu", "swiglu": "silu",
           "relu2": "relu2", "relu_sqr": "relu2", "squared_relu": "relu2",
           "gelu": "gelu_pytorch_tanh", "gelu_pytorch_tanh": "gelu_pytorch_tanh"}
_TERNARY_TYPES = ("TQ2_0", "TQ1_0")
_FLOAT_TYPES = ("F32", "F16", "BF16")


def _get(obj, path):
    for p in path:
        obj = getattr(obj, p)
    return obj


# ----------------------------------------------------------------------------- reading
class _ExtraType:
    """Stands in for the GGMLQuantizationType member gguf-py lacks (I2_S)."""

    def __init__(self, value):
        self.value, self.name = value, EXTRA_TYPES[value][0]


class _GGUFReader(gguf.GGUFReader if gguf is not None else object):
    """gguf-py's reader, which raises on a tensor type outside its enum: the tensors of
    the types in gguf_scan.EXTRA_TYPES (whose sizes scan() has checked) are built here,
    the rest by gguf-py."""

    def _get(self, offset, dtype, count=1, override_order=None):
        # gguf-py's own, on a plain ndarray view of its np.memmap: slicing a memmap runs
        # Python-level hooks per slice, which made a 32k-token vocabulary's fields cost
        # ~2 s of a 700M model's 3 s load (now ~0.2 s)
        raw = self.__dict__.get("_raw")
        if raw is None:
            raw = self._raw = self.data.view(np.ndarray)
        dtype = np.dtype(dtype)
        count = int(count)
        arr = raw[offset:offset + dtype.itemsize * count].view(dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None
                                               else override_order))

    def _get_field_parts(self, orig_offs, raw_type):
        # An array (a vocabulary, its scores, BPE merges) walked here, one view per element
        # and no per-element recursion, as gguf-py's contents() reads it: ~0.05 s for a
        # 32k-token vocabulary instead of ~1.5 s (scan() has bounded every length)
        if raw_type != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        head = self._get(orig_offs, np.uint8, 12)
        itype, alen = head[:4].view(np.uint32), head[4:12].view(np.uint64)
        etype, n = gguf.GGUFValueType(int(itype[0])), int(alen[0])
        parts, buf, offs = [itype, alen], self._raw, orig_offs + 12
        if etype == gguf.GGUFValueType.STRING:
            for _ in range(n):
                (size,) = struct.unpack_from("<Q", buf, offs)
                parts.append(buf[offs + 8:offs + 8 + size])
                offs += 8 + size
        elif etype in self.gguf_scalar_to_np:
            values = self._get(offs, self.gguf_scalar_to_np[etype], n)
            parts.extend(values[i:i + 1] for i in range(n))
            offs += values.nbytes
        else:                       # an array of arrays: gguf-py's own walk
            return super()._get_field_parts(orig_offs, raw_type)
        return offs - orig_offs, parts, list(range(2, len(parts))), \
            [gguf.GGUFValueType.ARRAY, etype]

    def _build_tensors(self, start_offs, fields):
        extra = [f for f in fields if int(f.parts[4][0]) in EXTRA_TYPES]
        super()._build_tensors(start_offs, [f for f in fields
                                            if int(f.parts[4][0]) not in EXTRA_TYPES])
        for f in extra:
            _, name, _, dims, raw_type, offset = f.parts
            ttype = _ExtraType(int(raw_type[0]))
            n = int(np.prod(dims.astype(np.uint64)))
            nbytes = EXTRA_TYPES[ttype.value][2](n)
            start = int(start_offs + offset[0])
            self.tensors.append(gguf.ReaderTensor(
                name=str(bytes(name), encoding="utf-8"), tensor_type=ttype, shape=dims,
                n_elements=n, n_bytes=nbytes, data_offset=start,
                data=self._get(start, np.uint8, nbytes), field=f))


class _File:
    """A GGUFReader with errors that name the file and the key or tensor."""

    def __init__(self, path):
        self.path = str(path)
        scan(self.path)         # bounded: gguf-py's reader believes the file's counts
        try:
            self.reader = _GGUFReader(self.path)
        except Exception as e:  # gguf raises ValueError/KeyError/IndexError/OSError alike
            raise GGUFError(f"{self.path}: not a readable GGUF file ({type(e).__name__}: {e})",
                            hint="the file may be truncated or not GGUF at all") from None
        self.tensors = {t.name: t for t in self.reader.tensors}

    def release(self, t) -> None:
        """Drop tensor `t`'s pages from this process's map of the file once its values
        are converted (the page cache keeps them): the load's resident memory is the
        model's own arrays, not those plus the whole file."""
        m = getattr(self.reader.data, "_mmap", None)
        if m is None or not hasattr(m, "madvise"):
            return
        lo = -(-int(t.data_offset) // mmap.PAGESIZE) * mmap.PAGESIZE
        hi = (int(t.data_offset) + int(t.n_bytes)) // mmap.PAGESIZE * mmap.PAGESIZE
        if hi > lo:
            m.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def error(self, what, msg, cls=GGUFError):
        return cls(f"{self.path}: {what}: {msg}")

    def field(self, key, default=None, required=False, kind=None):
        f = self.reader.fields.get(key)
        if f is None:
            if required:
                raise self.error(f"key {key!r}", "missing")
            return default
        try:
            v = f.contents()
        except Exception as e:
            raise self.error(f"key {key!r}", f"unreadable ({e})") from None
        if kind is int and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
            raise self.error(f"key {key!r}", f"expected an integer, got {v!r}")
        if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float, np.number))):
            raise self.error(f"key {key!r}", f"expected a number, got {v!r}")
        if kind is str and not isinstance(v, str):
            raise self.error(f"key {key!r}", f"expected a string, got {v!r}")
        return kind(v) if kind is not None else v

    def tensor(self, name, shape):
        """(type name, data) of tensor `name`, checked against the numpy `shape`."""
        t = self.tensors.get(name)
        if t is None:
            raise self.error(f"tensor {name!r}", "missing")
        got = tuple(int(d) for d in reversed(list(t.shape)))  # GGUF lists ne[0] (columns) first
        if got != tuple(shape):
            raise self.error(f"tensor {name!r}", f"shape {list(got)} contradicts the header, "
                                                 f"which implies {list(shape)}")
        return t.tensor_type.name, t

    def float_tensor(self, name, shape):
        qname, t = self.tensor(name, shape)
        if qname not in _FLOAT_TYPES:
            raise self.error(f"tensor {name!r}", f"type {qname} is not supported here "
                                                 f"(expected one of {', '.join(_FLOAT_TYPES)})")
        arr = self._finite(name, self._dequantize(name, t).reshape(shape))
        if np.may_share_memory(arr, self.reader.data):
            arr = arr.copy()    # a view would keep the file's map (and its pages) alive
        self.release(t)
        return arr

    def table(self, name, shape):
        """Tensor `name` as it is stored where that is f16 (an nn.StoredTable of a copy of
        the file's bytes: a token embedding or output table read, never widened, by the
        stored layers that keep it), else float32 (float_tensor)."""
        qname, t = self.tensor(name, shape)
        if qname != "F16":
            return self.float_tensor(name, shape)
        src = np.asarray(t.data).view(np.float16).reshape(shape)
        arr = np.empty(shape, np.float16)
        for lo in range(0, shape[0], 4096):   # the finiteness check a slice at a time
            arr[lo:lo + 4096] = src[lo:lo + 4096]
            if not np.isfinite(arr[lo:lo + 4096]).all():
                self._finite(name, src)          # counts them over the file's and raises
        self.release(t)
        return nn.StoredTable(arr)

    def _finite(self, name, arr):
        if not np.isfinite(arr).all():
            bad = int(np.size(arr) - np.isfinite(arr).sum())
            raise self.error(f"tensor {name!r}", f"holds {bad} NaN or infinite value(s)")
        return arr

    def _dequantize(self, name, t):
        try:
            return np.asarray(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type),
                              dtype=np.float32)
        except Exception as e:
            raise self.error(f"tensor {name!r}", f"cannot decode its {t.tensor_type.name} "
                                                 f"data ({e})") from None

    def scale_tensor(self, name) -> float:
        t = self.tensors.get(name)
        if t is None:
            return 1.0
        if t.tensor_type.name not in _FLOAT_TYPES or int(t.n_elements) != 1:
            raise self.error(f"tensor {name!r}", f"a scale must be one F32/F16/BF16 number, got "
                                                 f"{t.tensor_type.name} of {int(t.n_elements)} "
                                                 f"elements")
        s = float(self._dequantize(name, t).reshape(-1)[0])
        if not (np.isfinite(s) and s > 0):
            raise self.error(f"tensor {name!r}", f"scale {s} is not finite and positive")
        return s

    def projection(self, name, shape):
        """A BitLinear from tensor `name` (+ `.scale`): stored ternary when it is one."""
        qname, t = self.tensor(name + ".weight", shape)
        extra = self.scale_tensor(name + ".scale")
        if qname in _TERNARY_TYPES or qname == "I2_S":
            read = self._i2_s if qname == "I2_S" else self._ternary_blocks
            data, block = read(name + ".weight", t, shape)
            self.release(t)
            scale = self._weight_scale(name, qname, block, extra)
            if data.dtype == np.uint8:      # already in tercomp's packed layout
                return nn.StoredBitLinear.from_packed(data, shape[1], scale)
            return nn.BitLinear.from_ternary(data, scale)
        if qname not in _FLOAT_TYPES:
            raise self.error(f"tensor {name + '.weight'!r}",
                             f"quantization type {qname} is not supported (tercomp reads "
                             f"{', '.join(_TERNARY_TYPES + _FLOAT_TYPES)})")
        w = self._finite(name + ".weight", self._dequantize(name + ".weight", t).reshape(shape))
        mags = np.unique(np.abs(w[w != 0]))
        if mags.size == 1:          # already ternary times one magnitude
            return nn.BitLinear.from_ternary(np.sign(w).astype(np.int8),
                                             np.float32(float(mags[0]) * extra))
        layer = nn.BitLinear(shape[1], shape[0])
        layer.weight = (w * np.float32(extra)).astype(np.float32)
        return layer

    def _weight_scale(self, name, qname, block, extra) -> np.float32:
        """The layer's scale, the stored scale times the `.scale` tensor's, as float32:
        an error unless tp.weight_scale_in_range (a product that overflows, underflows,
        or would overflow the norms that follow)."""
        s = float(block) * float(extra)
        if not tp.weight_scale_in_range(s):
            raise self.error(f"tensor {name + '.weight'!r}",
                             f"its {qname} scale {block:g} times its '.scale' {extra:g} is "
                             f"{s:g}, not a float32 from {tp.MIN_WEIGHT_SCALE:.3g} to "
                             f"{tp.MAX_WEIGHT_SCALE:g} (the logits would be NaN or vanish)")
        return np.float32(s)

    def _i2_s(self, name, t, shape):
        """(data, tensor scale) of an I2_S tensor: data is the packed uint8 matrix
        (K needs no padding) or the int8 values T."""
        n, k = shape
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        codes = raw[:n * k // 4]
        scale = float(raw[n * k // 4:n * k // 4 + 4].view("<f4")[0])
        if scale == 0 and (codes == 0x55).all():     # bitnet.cpp's all-zero tensor
            scale = 1.0
        if not (math.isfinite(scale) and scale > 0):
            raise self.error(f"tensor {name!r}", f"its I2_S tensor scale (the float32 after "
                                                 f"its {n * k // 4} code bytes) is {scale}, not "
                                                 f"a finite positive number")
        if k % tp.I2S_BLOCK:
            raise self.error(f"tensor {name!r}", f"rows of {k} weights are not whole I2_S "
                                                 f"blocks of {tp.I2S_BLOCK}")
        if tp.padded_k(k) == k:
            packed = tp.from_i2_s(codes, n, k)
            if packed is None:
                raise self.error(f"tensor {name!r}", "holds the invalid I2_S code 3")
            return packed, scale
        j = np.arange(tp.I2S_BLOCK)
        vals = (codes.reshape(-1, 32)[:, j % 32] >> (6 - 2 * (j // 32)).astype(np.uint8)) & 3
        if (vals == 3).any():
            raise self.error(f"tensor {name!r}", "holds the invalid I2_S code 3")
        return (vals.view(np.int8) - np.int8(1)).reshape(shape), scale

    def _ternary_blocks(self, name, t, shape):
        """(data, block scale) of a TQ2_0 / TQ1_0 tensor: data is the packed uint8 matrix
        (TQ2_0 whose K needs no padding) or the int8 values T."""
        raw = np.asarray(t.data).view(np.uint8)
        block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type][1]
        if raw.size % block_bytes:
            raise self.error(f"tensor {name!r}", "its data is not a whole number of blocks")
        blocks = raw.reshape(-1, block_bytes)
        d = blocks[:, -2:].copy().view(np.float16).astype(np.float64).reshape(-1)  # f16 d is last
        n, k = shape
        if t.tensor_type == gguf.GGMLQuantizationType.TQ2_0 and tp.padded_k(k) == k:
            # straight into tercomp's packed layout, 8 bytes at a time, no int8 values
            qs = blocks[:, :64]
            if (d == 0).any():              # a zero scale zeroes its block: code 1 (w + 1)
                qs = qs.copy()
                qs[d == 0] = 0x55           # four codes 1 a byte
            packed = tp.from_tq2_0(qs, n, k)
            if packed is None:
                raise self.error(f"tensor {name!r}", "holds the invalid TQ2_0 code 3")
            if d.size and (d == d[0]).all():    # one scale for all blocks (as converters write):
                used = packed.view(np.uint64).any() if packed.size % 8 == 0 else packed.any()
                return packed, self._one_scale(name, t, d[:1], np.array([used]))  # no block mask
            return packed, self._one_scale(name, t, d, (qs != 0x55).any(axis=1))
        if t.tensor_type == gguf.GGMLQuantizationType.TQ2_0:
            tern = _tq2_values(blocks)
            if tern is None:
                raise self.error(f"tensor {name!r}", "holds the invalid TQ2_0 code 3")
            tern[d == 0] = 0
        else:
            vals = self._dequantize(name, t).astype(np.float64).reshape(-1, 256)
            with np.errstate(divide="ignore", invalid="ignore"):
                tern = np.where(d[:, None] != 0, vals / d[:, None], 0.0)
            if not np.all(np.isin(tern, (-1.0, 0.0, 1.0))):
                raise self.error(f"tensor {name!r}", "decodes to values that are not ternary")
        block = self._one_scale(name, t, d, np.any(tern != 0, axis=1))
        return tern.reshape(shape).astype(np.int8, copy=False), block

    def _one_scale(self, name, t, d, nonzero) -> float:
        """The one block scale of the blocks holding a non-zero weight (1.0 if none)."""
        used = np.unique(d[nonzero])
        if used.size > 1:
            raise self.error(f"tensor {name!r}",
                             f"its {t.tensor_type.name} blocks carry {used.size} different "
                             f"scales ({used.min():g} .. {used.max():g}); tercomp needs one "
                             f"scale per tensor (write block scale 1 and a '.scale' tensor)")
        if used.size and not (np.isfinite(used[0]) and used[0] > 0):
            raise self.error(f"tensor {name!r}", f"block scale {used[0]} is not finite and "
                                                 f"positive")
        return float(used[0]) if used.size else 1.0


def _tq2_values(blocks: np.ndarray) -> np.ndarray | None:
    """The ternary values (int8 [blocks, 256]) of TQ2_0 blocks (66 bytes: 64 bytes of
    2-bit codes, then the f16 scale), decoded with bit operations instead of through
    floats; None if a code is 3. In a block, value 128*h + 32*l + m is code
    (qs[32*h + m] >> 2*l) & 3, minus 1 (ggml's dequantize_row_tq2_0)."""
    qs = blocks[:, :64].reshape(-1, 2, 1, 32)
    codes = (qs >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & np.uint8(3)
    if (codes == 3).any():
        return None
    return codes.reshape(-1, 256).view(np.int8) - np.int8(1)


def _f32(v: float) -> float:
    """GGUF stores these as f32: read back the shortest decimal (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(v)))


def _config(f: _File) -> BitNetConfig:
    arch = f.field("general.architecture", required=True, kind=str)
    family = families.by_gguf_arch(arch)
    if family is None:
        known = ", ".join(repr(fam.gguf_arch) for fam in families.FAMILIES)
        aliases = ", ".join(repr(a) for fam in families.FAMILIES
                            for a in dict(fam.gguf_arch_aliases))
        raise f.error("key 'general.architecture'",
                      f"architecture {arch!r}; tercomp reads {known} (and bitnet.cpp's "
                      f"{aliases})", GGUFError)
    a = arch
    emb = f.tensors.get("token_embd.weight")
    if emb is None:
        raise f.error("tensor 'token_embd.weight'", "missing")
    if len(emb.shape) != 2:
        raise f.error("tensor 'token_embd.weight'", f"{len(emb.shape)} dims; an embedding "
                                                    f"is [vocab, hidden]")
    act = f.field(f"{a}.hidden_activation", None, kind=str)
    if act is None:         # no converter writes it: the family knows its files apart
        act = family.gguf_activation(f.field("tokenizer.ggml.pre", None, kind=str), arch)
    if act not in ACTS_IN:
        raise f.error(f"key '{a}.hidden_activation'",
                      f"activation {act!r} is not supported (silu, relu2 or gelu)", ConfigError)
    heads = f.field(f"{a}.attention.head_count", required=True, kind=int)
    hidden = f.field(f"{a}.embedding_length", required=True, kind=int)
    d = {
        "vocab_size": f.field(f"{a}.vocab_size", int(emb.shape[1]), kind=int),
        "hidden_size": hidden,
        "intermediate_size": f.field(f"{a}.feed_forward_length", required=True, kind=int),
        "num_hidden_layers": f.field(f"{a}.block_count", required=True, kind=int),
        "num_attention_heads": heads,
        "num_key_value_heads": f.field(f"{a}.attention.head_count_kv", heads, kind=int),
        "rms_norm_eps": _f32(f.field(f"{a}.attention.layer_norm_rms_epsilon", required=True,
                                     kind=float)),
        "rope_theta": _f32(f.field(f"{a}.rope.freq_base", 10000.0, kind=float)),
        "max_position_embeddings": f.field(f"{a}.context_length", 2048, kind=int),
        "hidden_act": ACTS_IN[act], "tie_word_embeddings": "output.weight" not in f.tensors,
        "rope_style": family.gguf_rope_style, "sub_norms": family.sub_norms,
        "family": family.name, "head_dim": f.field(f"{a}.attention.key_length", None, kind=int),
    }
    freqs = f.tensors.get("rope_freqs.weight")
    if freqs is not None:
        if freqs.tensor_type.name not in _FLOAT_TYPES or int(freqs.n_elements) > 4096:
            raise f.error("tensor 'rope_freqs.weight'", "must be at most 4096 F32/F16/BF16 "
                                                        "numbers")
        d["rope_freq_factors"] = f._dequantize("rope_freqs.weight", freqs).reshape(-1).tolist()
    linear = _linear_rope_factor(f, a)
    if linear != 1.0:       # positions divided by the factor: every frequency is
        head_dim = d["head_dim"] or (hidden // heads if heads > 0 else 0)
        d["rope_freq_factors"] = [x * linear for x in
                                  d.get("rope_freq_factors") or [1.0] * (head_dim // 2)]
    d.update(dict(family.options))
    if family.gguf_config is not None:      # the family's own keys (families/qwen3.py, ...)
        try:
            d.update(family.gguf_config(f.field, a))
        except ConfigError as e:
            raise ConfigError(f"{f.path}: {e.message}", hint=e.hint) from None
    cfg = BitNetConfig.from_dict(d, source=f.path)
    rot = f.field(f"{a}.rope.dimension_count", None, kind=int)
    if rot is not None and rot != cfg.head_dim:
        raise f.error(f"key '{a}.rope.dimension_count'", f"{rot} != head dim "
                      f"{cfg.head_dim}: partial rotary embeddings are not supported")
    return cfg


def _linear_rope_factor(f: _File, a: str) -> float:
    """`{a}.rope.scaling.factor` (llama.cpp divides every position by it, whatever the
    scaling type; llama.cpp's converter writes "linear" with factor 1.0 for BitNet). The
    types that change more than that (yarn, longrope) are refused."""
    kind = f.field(f"{a}.rope.scaling.type", "none", kind=str)
    if kind not in ("none", "linear"):
        raise f.error(f"key '{a}.rope.scaling.type'", f"RoPE scaling {kind!r} is not "
                      f"supported (none, linear, or Llama 3's rope_freqs)", ConfigError)
    factor = f.field(f"{a}.rope.scaling.factor", 0.0, kind=float)
    if not np.isfinite(factor) or factor < 0:
        raise f.error(f"key '{a}.rope.scaling.factor'", f"{factor} is not a finite, "
                      f"non-negative number", ConfigError)
    return 1.0 if factor == 0 else _f32(factor)     # 0: llama.cpp's "not given"


def _norms(cfg: BitNetConfig) -> dict:
    """The per-block norms of `cfg`: NORMS, less those of options it does not have."""
    return {g: p for g, p in NORMS.items()
            if g not in NORM_OPTIONS or getattr(cfg, NORM_OPTIONS[g])}


def _expected_shapes(cfg: BitNetConfig, rope_freqs: bool) -> dict:
    """GGUF tensor name -> NumPy shape of every tensor the model must have (`rope_freqs`:
    the file holds Llama 3's frequency factors as a tensor)."""
    h, v, ff, q, kv = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.q_dim,
                       cfg.kv_dim)
    proj = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
            "ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff)}
    sizes = {"ffn_sub_norm": (ff,), "attn_sub_norm": (q,), "attn_output_norm_in": (q,),
             "ffn_down_norm_in": (ff,), "attn_q_norm": (cfg.head_dim,),
             "attn_k_norm": (cfg.head_dim,)}
    out = {"token_embd.weight": (v, h), "output_norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = (v, h)
    if rope_freqs:
        out["rope_freqs.weight"] = (cfg.head_dim // 2,)
    for i in range(cfg.num_hidden_layers):
        for g in _norms(cfg):
            out[f"blk.{i}.{g}.weight"] = sizes.get(g, (h,))
        for g, shape in proj.items():
            out[f"blk.{i}.{g}.weight"] = shape
    return out


def _proj_norms(f: _File, cfg: BitNetConfig) -> bool:
    """Whether the file has BitLinear's per-projection input norms (`blk.{i}.*_norm_in`,
    bitnet.cpp's embedding converter): on every projection of every block, or on none
    (else a GGUFError naming the file and the tensors that break the rule)."""
    names = [f"blk.{i}.{g}_norm_in.weight" for i in range(cfg.num_hidden_layers)
             for g in PROJECTIONS]
    have = [n in f.tensors for n in names]
    if all(have) or not any(have):
        return all(have)
    raise f.error(f"tensor {names[have.index(False)]!r}",
                  f"missing, while {names[have.index(True)]!r} is there: per-projection norm "
                  f"tensors on some projections only",
                  GGUFError)


def load_gguf(path) -> BitNetLM:
    """Read a `bitnet` or `llama` (1.58-bit) GGUF file into a BitNetLM (see the module
    docstring)."""
    if gguf is None:  # pragma: no cover
        raise MissingDependency("reading GGUF needs the 'gguf' package: pip install gguf")
    f = _File(path)
    cfg = _config(f)
    # the header must agree with the tensors before anything is allocated from its numbers
    blocks = {int(m.group(1)) for n in f.tensors if (m := re.match(r"blk\.(\d+)\.", n))}
    if len(blocks) != cfg.num_hidden_layers or blocks != set(range(len(blocks))):
        raise f.error(f"key '{cfg.family}.block_count'", f"{cfg.num_hidden_layers} blocks, but the "
                      f"file has tensors for {len(blocks)} (blk.{min(blocks, default=0)}.. "
                      f"blk.{max(blocks, default=0)})")
    cfg.proj_norms = _proj_norms(f, cfg)
    shapes = _expected_shapes(cfg, "rope_freqs.weight" in f.tensors)
    for name, shape in shapes.items():
        f.tensor(name, shape)
    extra = sorted(n for n in f.tensors if n not in shapes and not (
        n.endswith(".scale") and n.split(".")[-2] in PROJECTIONS and n[:-6] + ".weight" in shapes))
    if extra:
        raise f.error(f"tensor {extra[0]!r}", f"not part of a {cfg.num_hidden_layers}-layer "
                      f"{cfg.family!r} model ({len(extra)} unexpected tensor(s))")
    lm = BitNetLM(cfg, init=False)
    # f16 tables stay f16 (nn.StoredEmbedding / StoredLinear over the file's bytes)
    emb = f.table("token_embd.weight", shapes["token_embd.weight"])
    if isinstance(emb, nn.StoredTable):
        lm.embed_tokens = nn.StoredEmbedding(emb)
    else:
        lm.embed_tokens.weight = emb
    lm.norm.weight = f.float_tensor("output_norm.weight", shapes["output_norm.weight"])
    if lm.lm_head is not None:
        head = f.table("output.weight", shapes["output.weight"])
        if isinstance(head, nn.StoredTable):
            lm.lm_head = nn.StoredLinear(head)
        else:
            lm.lm_head.weight = head
    for i, layer in enumerate(lm.layers):
        for g, path_ in _norms(cfg).items():
            name = f"blk.{i}.{g}.weight"
            _get(layer, path_).weight = f.float_tensor(name, shapes[name])
        for g, (block, proj) in PROJECTIONS.items():
            name = f"blk.{i}.{g}"
            setattr(getattr(layer, block), proj, f.projection(name, shapes[name + ".weight"]))
    lm.tokenizer, lm.gguf_vocab = tokenizer_from_gguf(f.reader, f.path)
    return lm
