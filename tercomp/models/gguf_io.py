"""GGUF files of llama.cpp's `bitnet` and `llama` (1.58-bit) architectures: read into a
BitNetLM (models/families picks the options by `general.architecture`), and write
either back (`bitnet` for a model with sub-norms, `llama` without).

Reading and writing go through the `gguf` package (gguf-py, llama.cpp's own Python
library); this module maps its tensors onto the BitNetLM module tree:

    token_embd.weight            embed_tokens.weight      [vocab, hidden] (float)
    output_norm.weight           norm.weight
    blk.{i}.attn_norm            layers[i].input_layernorm
    blk.{i}.attn_q/k/v/output    layers[i].attn.q/k/v/o_proj     (ternary, + .scale)
    blk.{i}.attn_sub_norm        layers[i].attn.attn_sub_norm
    blk.{i}.ffn_norm             layers[i].post_attention_layernorm
    blk.{i}.ffn_gate/up/down     layers[i].mlp.gate/up/down_proj (ternary, + .scale)
    blk.{i}.ffn_sub_norm         layers[i].mlp.ffn_sub_norm
    output.weight                lm_head.weight (untied; `llama` models)
    rope_freqs.weight            config.rope_freq_factors (Llama 3's RoPE scaling)

A `llama` file has no sub-norms, stores q/k rows permuted for interleaved RoPE (so the
model reads them with rope_style "interleaved"), and may give `attention.key_length`
(head_dim). `rope.scaling.factor` divides every frequency (llama.cpp's linear scaling;
its converter writes 1.0 for BitNet). The FFN activation is `hidden_activation` when
the file gives it; no converter does, so without it the family decides (models/families:
BitNet b1.58 2B4T, relu2, is the `bitnet` file with Llama 3's BPE vocabulary).

A ternary tensor (TQ2_0 / TQ1_0) stores codes in {-1, 0, 1} and an f16 scale per block
of 256; llama.cpp multiplies the product by the optional f32 `*.scale` tensor.
bitnet.cpp's I2_S (type 36 of its llama.cpp fork, which gguf-py does not know) stores the
codes 2 bits each in blocks of 128 weights and one f32 scale for the whole tensor after
them (`ternary_pack.from_i2_s`; gguf_scan checks its size); its `bitnet-b1.58` /
`bitnet-25` architectures are the `bitnet` family (models/families/bitnet.py). The
weight is ``block_scale * T * scale``: tercomp needs one scale per tensor, so every block
holding a non-zero code must carry the same block scale (an error names the tensor
otherwise). Float (F32/F16/BF16) projections whose non-zero values share one magnitude
are stored ternary weights too; any other float projection becomes an ordinary
BitLinear (ternarized by absmean when compiled).
"""
from __future__ import annotations

import math
import mmap
import re

import numpy as np

from .. import nn
from .. import ternary_pack as tp
from ..errors import TercompError
from .bitnet import BitNetLM, rope_frequencies
from . import families
from .config import BitNetConfig, ConfigError
from .gguf_scan import EXTRA_TYPES, GGUFError, I2_S, scan
from ..runtime.files import atomic_target
from .tokenizer import gguf_vocab_from_tokenizer, tokenizer_from_gguf

try:
    import gguf
    from gguf import GGMLQuantizationType as QT
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
}
ACTS_IN = {"silu": "silu", "swish": "silu", "swiglu": "silu",
           "relu2": "relu2", "relu_sqr": "relu2", "squared_relu": "relu2"}
_TERNARY_TYPES = ("TQ2_0", "TQ1_0")
_FLOAT_TYPES = ("F32", "F16", "BF16")
#: what save_gguf writes the ternary projections as
TERNARY_TYPES_OUT = ("TQ2_0", "I2_S")
#: llama.h's LLAMA_FTYPE_MOSTLY_I2_S in bitnet.cpp's fork (the value its converter writes)
_FTYPE_I2_S = 40


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
        an error unless it is positive and at most tp.MAX_WEIGHT_SCALE (a product that
        overflows, underflows to 0, or would overflow the norms that follow)."""
        s = float(block) * float(extra)
        if not (math.isfinite(s) and s <= tp.MAX_WEIGHT_SCALE and np.float32(s) > 0):
            raise self.error(f"tensor {name + '.weight'!r}",
                             f"its {qname} scale {block:g} times its '.scale' {extra:g} is "
                             f"{s:g}, not a positive float32 number of at most "
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
                      f"activation {act!r} is not supported (silu or relu2)", ConfigError)
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
    """The per-block norms of `cfg`'s family: NORMS, less the sub-norms without them."""
    return {g: p for g, p in NORMS.items() if cfg.sub_norms or "sub_norm" not in g}


def _expected_shapes(cfg: BitNetConfig, rope_freqs: bool) -> dict:
    """GGUF tensor name -> NumPy shape of every tensor the model must have (`rope_freqs`:
    the file holds Llama 3's frequency factors as a tensor)."""
    h, v, ff, q, kv = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size, cfg.q_dim,
                       cfg.kv_dim)
    proj = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
            "ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff)}
    sizes = {"ffn_sub_norm": (ff,), "attn_sub_norm": (q,)}
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


def load_gguf(path) -> BitNetLM:
    """Read a `bitnet` or `llama` (1.58-bit) GGUF file into a BitNetLM (see the module
    docstring)."""
    if gguf is None:  # pragma: no cover
        raise TercompError("reading GGUF needs the 'gguf' package: pip install gguf")
    f = _File(path)
    cfg = _config(f)
    # the header must agree with the tensors before anything is allocated from its numbers
    blocks = {int(m.group(1)) for n in f.tensors if (m := re.match(r"blk\.(\d+)\.", n))}
    if len(blocks) != cfg.num_hidden_layers or blocks != set(range(len(blocks))):
        raise f.error(f"key '{cfg.family}.block_count'", f"{cfg.num_hidden_layers} blocks, but the "
                      f"file has tensors for {len(blocks)} (blk.{min(blocks, default=0)}.. "
                      f"blk.{max(blocks, default=0)})")
    shapes = _expected_shapes(cfg, "rope_freqs.weight" in f.tensors)
    for name, shape in shapes.items():
        f.tensor(name, shape)
    extra = sorted(n for n in f.tensors if n not in shapes and not (
        n.endswith(".scale") and n.split(".")[-2] in PROJECTIONS and n[:-6] + ".weight" in shapes))
    if extra:
        raise f.error(f"tensor {extra[0]!r}", f"not part of a {cfg.num_hidden_layers}-layer "
                      f"{cfg.family!r} model ({len(extra)} unexpected tensor(s))")
    lm = BitNetLM(cfg, init=False)
    lm.embed_tokens.weight = f.float_tensor("token_embd.weight", shapes["token_embd.weight"])
    lm.norm.weight = f.float_tensor("output_norm.weight", shapes["output_norm.weight"])
    if lm.lm_head is not None:
        lm.lm_head.weight = f.float_tensor("output.weight", shapes["output.weight"])
    for i, layer in enumerate(lm.layers):
        for g, path_ in _norms(cfg).items():
            name = f"blk.{i}.{g}.weight"
            _get(layer, path_).weight = f.float_tensor(name, shapes[name])
        for g, (block, proj) in PROJECTIONS.items():
            name = f"blk.{i}.{g}"
            setattr(getattr(layer, block), proj, f.projection(name, shapes[name + ".weight"]))
    lm.tokenizer, lm.gguf_vocab = tokenizer_from_gguf(f.reader, f.path)
    return lm


# ----------------------------------------------------------------------------- writing
def save_gguf(model: BitNetLM, path, ternary_type: str = "TQ2_0") -> None:
    """Write `model` as a GGUF file that llama.cpp loads and `models.load` reads back
    with the same logits.

    A model with sub-norms is written as llama.cpp's `bitnet` architecture: projections
    TQ2_0 with block scale 1.0 plus an f32 `*.scale` tensor holding the layer's scale,
    embedding and norms f32; llama.cpp's `bitnet` graph always uses the token embedding
    as output layer, so an untied one is refused. A llama-architecture 1.58-bit model
    (no sub-norms, silu) is written as llama.cpp's converter writes one: arch `llama`,
    TQ2_0 projections whose block scale is the layer's scale (rounded to f16, as the
    block stores it), q/k rows permuted for llama.cpp's interleaved RoPE, f16
    `token_embd` and `output.weight` (when untied), Llama 3's RoPE scaling as
    `rope_freqs.weight`. A projection whose input size is not a multiple of 256 (TQ2_0's
    block) is written as float ternary values instead.

    `ternary_type="I2_S"` writes a model with sub-norms as bitnet.cpp runs it: I2_S
    projections (the codes and the layer's scale as the tensor scale), arch
    `bitnet-b1.58` for relu2 (2B4T's graph) or `bitnet` for silu, f16 token embedding;
    every projection's input size must be a multiple of 128 (I2_S's block).

    The vocabulary is the loaded GGUF's, or the tokenizer's (BPE -> "gpt2", Unigram ->
    "llama"), or "no_vocab" (which llama.cpp refuses to load).

    >>> models.save_gguf(lm, "tiny.gguf"); lm2 = models.load("tiny.gguf")
    >>> models.save_gguf(lm, "tiny-i2s.gguf", ternary_type="I2_S")
    """
    if not isinstance(model, BitNetLM):
        raise TercompError(f"save_gguf expects a models.BitNetLM, got {type(model).__name__}")
    if ternary_type not in TERNARY_TYPES_OUT:
        raise TercompError(f"save_gguf: ternary_type={ternary_type!r}; it is one of "
                           f"{', '.join(TERNARY_TYPES_OUT)}")
    cfg = model.config
    family = _written_family(cfg)
    arch = _written_arch(cfg, family, ternary_type)
    _check_writable(model, cfg, family, arch, ternary_type)
    _check_vocab(getattr(model, "gguf_vocab", None) or {}, path)
    # written beside the target and moved over it whole: a failure leaves any existing
    # file as it was
    with atomic_target(path, "GGUF file", GGUFError) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        try:
            _write(w, model, cfg, arch, ternary_type)
        finally:
            w.close()


def _written_family(cfg):
    """The family whose llama.cpp architecture computes this model: `bitnet` with the
    sub-norms, `llama` without."""
    return families.by_gguf_arch("bitnet" if cfg.sub_norms else "llama")


def _written_arch(cfg, family, ternary_type) -> str:
    """The `general.architecture` written: the family's, or for I2_S bitnet.cpp's
    `bitnet-b1.58` when the model is relu2 (the graph that computes it)."""
    if ternary_type == "I2_S" and family.gguf_arch == "bitnet" and cfg.hidden_act == "relu2":
        return "bitnet-b1.58"
    return family.gguf_arch


def _check_writable(model, cfg, family, arch, ternary_type):
    """Refuse, before anything is written, a model the family's llama.cpp graph would
    compute differently."""
    if ternary_type == "I2_S":
        if family.gguf_arch != "bitnet":
            raise TercompError(f"save_gguf: I2_S files are bitnet.cpp's BitNet architectures; "
                               f"this {cfg.family!r} model (no sub-norms) is written as TQ2_0",
                               hint="save it with ternary_type='TQ2_0'")
        narrow = sorted({k for k in (cfg.hidden_size, cfg.q_dim, cfg.intermediate_size)
                         if k % tp.I2S_BLOCK})
        if narrow:
            raise TercompError(f"save_gguf: I2_S stores rows of whole {tp.I2S_BLOCK}-weight "
                               f"blocks; this model has projections with {narrow[0]} inputs",
                               hint="save it with ternary_type='TQ2_0'")
    untied_ok = arch == "bitnet-b1.58"      # its graph reads an optional output.weight
    arch = family.gguf_arch
    scaled = cfg.rope_scaling is not None or cfg.rope_freq_factors is not None
    if arch == "bitnet" and (cfg.q_dim != cfg.hidden_size or scaled):
        raise TercompError(f"save_gguf writes a model with sub-norms as llama.cpp's 'bitnet' "
                           f"architecture; this {cfg.family!r} model (head_dim {cfg.head_dim}, "
                           f"RoPE scaling {scaled}) is not one",
                           hint="keep the file it was loaded from")
    if arch == "bitnet" and not untied_ok and (model.lm_head is not None
                                               or not cfg.tie_word_embeddings):
        raise TercompError("save_gguf: the model has a separate output layer (lm_head); "
                           "llama.cpp's 'bitnet' graph always uses the token embedding as "
                           "output, so the file would compute different logits",
                           hint="tie the output layer (tie_word_embeddings=True)")
    if cfg.rope_style != family.gguf_rope_style and cfg.rope_style != "neox":
        raise TercompError(f"save_gguf: llama.cpp's {arch!r} graph uses "
                           f"{family.gguf_rope_style} RoPE; this model uses {cfg.rope_style} "
                           f"pairs")
    if arch == "llama" and cfg.hidden_act != "silu":
        raise TercompError(f"save_gguf: llama.cpp's 'llama' architecture computes silu; this "
                           f"model without sub-norms uses {cfg.hidden_act!r}")
    for i, layer in enumerate(model.layers):
        for g, (block, proj) in PROJECTIONS.items():
            if getattr(getattr(getattr(layer, block), proj), "bias", None) is not None:
                raise TercompError(f"save_gguf: layers.{i}.{block}.{proj} has a bias, which "
                                   f"the {arch!r} architecture does not have")


def _check_vocab(vocab: dict, path):
    """Every kept tokenizer key has the kind its writer method takes."""
    kinds = {"string": str, "uint32": (int, np.integer), "array": (list, tuple)}
    for key, (kind, value) in vocab.items():
        ok = isinstance(value, kinds.get(kind, ())) and not isinstance(value, bool)
        if kind == "uint32" and ok:
            ok = 0 <= int(value) < 2 ** 32
        if not ok:
            raise GGUFError(f"save_gguf {path}: key {key!r} should be a {kind}, got "
                            f"{type(value).__name__} {value!r:.60}")


def _permute_for_interleaved(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter order of q/k rows: within each head, the rotate-half pairs
    (i, i + d/2) become adjacent rows (2i, 2i + 1), so its interleaved RoPE rotates
    what Hugging Face's rotate_half does."""
    return rows.reshape(n_head, 2, rows.shape[0] // n_head // 2, *rows.shape[1:]) \
        .swapaxes(1, 2).reshape(rows.shape)


def _write(w, model, cfg, a, ternary_type):
    family = _written_family(cfg)
    w.add_name(f"tercomp BitNetLM ({cfg.family})")
    w.add_uint32(f"{a}.vocab_size", cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_rope_dimension_count(cfg.head_dim)
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_string(f"{a}.hidden_activation", cfg.hidden_act)
    i2_s = ternary_type == "I2_S"
    w.add_file_type(_FTYPE_I2_S if i2_s else int(gguf.LlamaFileType.MOSTLY_TQ2_0))
    _write_vocab(w, model, cfg)
    f32 = lambda x: np.ascontiguousarray(np.asarray(x, dtype=np.float32))  # noqa: E731
    # f32 in a bitnet-architecture file (bitnet.cpp's quantizer writes f16, it reads
    # either): the file's logits are the model's
    table = f32 if family.gguf_arch == "bitnet" else (lambda x: f32(x).astype(np.float16))
    w.add_tensor("token_embd.weight", table(model.embed_tokens.weight))
    w.add_tensor("output_norm.weight", f32(model.norm.weight))
    if model.lm_head is not None:
        w.add_tensor("output.weight", table(model.lm_head.weight))
    if a == "llama" and (cfg.rope_scaling is not None or cfg.rope_freq_factors is not None):
        base = float(cfg.rope_theta) ** (-np.arange(0, cfg.head_dim, 2, dtype=np.float64)
                                         / cfg.head_dim)
        w.add_tensor("rope_freqs.weight", f32(base / rope_frequencies(cfg)))
    # the stored q/k rows follow the file's RoPE pairs; a model that rotates halves
    # (loaded from Hugging Face) has them permuted as llama.cpp's converter does
    permute = {}
    if cfg.rope_style != family.gguf_rope_style:
        permute = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    for i, layer in enumerate(model.layers):
        for g, path_ in _norms(cfg).items():
            w.add_tensor(f"blk.{i}.{g}.weight", f32(_get(layer, path_).weight))
        for g, (block, proj) in PROJECTIONS.items():
            t, s = getattr(getattr(layer, block), proj).ternary()
            if g in permute:
                t = _permute_for_interleaved(t, permute[g])
            if i2_s:
                _write_i2_s(w, f"blk.{i}.{g}.weight", t, s)
            else:
                _write_projection(w, f"blk.{i}.{g}", t, float(s), family.gguf_scale)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()


def _write_vocab(w, model, cfg):
    vocab = getattr(model, "gguf_vocab", None)
    if not vocab and model.tokenizer is not None:
        vocab = gguf_vocab_from_tokenizer(model.tokenizer, cfg.vocab_size)
    template = getattr(model.tokenizer, "chat_template", None)
    if vocab and template is not None and "tokenizer.chat_template" not in vocab:
        vocab = {**vocab, "tokenizer.chat_template": ("string", template.source)}
    if vocab:
        for key, (kind, value) in vocab.items():
            getattr(w, f"add_{kind}")(key, value)
    else:
        w.add_tokenizer_model("no_vocab")


def _write_projection(w, name, t, s, where):
    """Ternary codes `t` times scale `s`: TQ2_0 with block scale 1 and a `.scale` tensor
    ("tensor"), or with the scale in every block ("block")."""
    vals = t.astype(np.float32) * np.float32(1.0 if where == "tensor" else s)
    if t.shape[1] % 256 == 0:
        w.add_tensor(name + ".weight", gguf.quants.quantize(vals, QT.TQ2_0), raw_dtype=QT.TQ2_0)
    else:       # not whole TQ2_0 blocks: float values (f16, as llama.cpp's converter falls back)
        w.add_tensor(name + ".weight", vals if where == "tensor" else vals.astype(np.float16))
    if where == "tensor":
        w.add_tensor(name + ".scale", np.array([s], dtype=np.float32))


def _write_i2_s(w, name, t, s):
    """Ternary codes `t` [N, K] and scale `s` as one I2_S tensor: the code bytes, then
    the float32 scale and 28 zero bytes (the fork's ggml_nbytes: n / 4 + 32)."""
    data = np.zeros(t.size // 4 + 32, np.uint8)
    data[:t.size // 4] = tp.to_i2_s(t)
    data[t.size // 4:t.size // 4 + 4] = np.array([s], "<f4").view(np.uint8)
    # as int8 bytes: gguf-py would look a uint8 array's type up in its own size table
    w.add_tensor(name, data.view(np.int8), raw_shape=t.shape, raw_dtype=I2_S)
