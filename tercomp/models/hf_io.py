"""Hugging Face checkpoint directories: `config.json` + `*.safetensors` (+ tokenizer.json).

The family (models/families) comes from `architectures` / `model_type`:
`BitNetForCausalLM`, or a `LlamaForCausalLM` whose `quantization_config` has
`quant_method: "bitnet"` (Falcon3-1.58bit, Llama3-8B-1.58). Tensor names are
transformers' (`model.embed_tokens`, `model.layers.{i}.self_attn.q_proj`,
`...attn_sub_norm` and `...mlp.ffn_sub_norm` for BitNet only, `model.norm`, `lm_head`).
A projection is one of:

- the BitNet b1.58 2B4T packed layout (transformers' `integrations/bitnet.py`):
  `weight` uint8 [ceil(out/4), in], 2-bit codes c in {0, 1, 2} meaning c - 1, row r of
  plane j (bits 2j..2j+1) being output row j * rows + r; `weight_scale` [1], the output
  being *divided* by it (so the layer's scale is 1 / weight_scale);
- a float `weight` with a `weight_scale` (transformers' offline AutoBitLinear: the output
  is multiplied by weight_scale) whose values are ternary;
- a plain float `weight`: an ordinary BitLinear, ternarized by absmean when compiled.

The `qwen3` / `gemma3` families (BitNet's embedding models) add BitLinear's input norm
of each projection (`*_proj.norm.weight`), q/k norms and Gemma's four layer norms
(weights w of a (1 + w) norm), and a sentence-transformers Pooling module
(modules.json, 1_Pooling/config.json) gives the pooling.

Files are read with `safetensors.deserialize` (no pickle; BF16 is widened here, since
NumPy has no bfloat16). `save_hf` writes the first form (packed codes + weight_scale,
float32 tables and norms), which both transformers and `load_hf` read.
"""
from __future__ import annotations

import glob
import json
import os
import re

import numpy as np
import safetensors
from safetensors.numpy import save as safetensors_save

from .. import nn
from .. import ternary_pack as tp
from . import families
from ..errors import ModelFileError, UnsupportedError
from ..runtime.files import check_regular, read_regular, write_atomic
from .bitnet import BitNetLM
from .config import BitNetConfig, ConfigError
from .tokenizer import tokenizer_from_hf

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "U8": np.uint8,
           "I8": np.int8, "I32": np.int32, "I64": np.int64}
_PROJ = {"self_attn": ("attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
         "mlp": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
_MAX_CONFIG_BYTES = 1 << 20


class CheckpointError(ModelFileError):
    """A Hugging Face checkpoint tercomp cannot read; names the tensor or field and file."""


#: the largest safetensors header read (the format's own limit, safetensors' MAX_HEADER_SIZE)
_MAX_HEADER = 100_000_000


def _check_header(path) -> None:
    """Read and check a shard's header before its data: an 8-byte little-endian length,
    that many bytes of a JSON object of {name: {dtype, shape, data_offsets}}, whose
    offsets cover the rest of the file exactly. A file that is not one is refused after
    reading at most _MAX_HEADER bytes, however large it is."""
    size = check_regular(path, "safetensors", CheckpointError)   # no FIFO, device, /dev/zero
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 2 <= n <= min(size - 8, _MAX_HEADER):
                raise CheckpointError(f"{path}: not a safetensors file (a header of {n} bytes "
                                      f"in a file of {size}; at most {_MAX_HEADER} are read)")
            header = json.loads(f.read(n).decode("utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: its safetensors header is not a JSON object "
                              f"({type(e).__name__})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: its safetensors header is not a JSON object")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offs = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise CheckpointError(f"{path}: tensor {name!r} has no valid data_offsets")
        end = max(end, offs[1])
    if end != size - 8 - n:
        raise CheckpointError(f"{path}: its header describes {end} bytes of tensor data, but "
                              f"{size - 8 - n} follow it (truncated, or not a safetensors file)")


def _read_tensors(path) -> dict:
    _check_header(path)
    data = read_regular(path, "safetensors", CheckpointError)   # no FIFO, device, /dev/zero
    try:
        items = safetensors.deserialize(data)
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
    out = {}
    for name, info in items:
        dt, shape, data = info["dtype"], tuple(info["shape"]), info["data"]
        if dt == "BF16":
            arr = (np.frombuffer(data, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif dt in _DTYPES:
            arr = np.frombuffer(data, _DTYPES[dt])
        else:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dt}, which tercomp does "
                                  f"not read")
        arr = arr.reshape(shape)
        if arr.dtype.kind == "f" and not np.isfinite(arr).all():
            raise CheckpointError(f"{path}: tensor {name!r} holds "
                                  f"{int(arr.size - np.isfinite(arr).sum())} NaN or infinite "
                                  f"value(s)")
        out[name] = (arr, path)
    return out


def unpack_hf_ternary(packed: np.ndarray, out_features: int, what: str = "the packed tensor") -> np.ndarray:
    """T int8 [out, in] from transformers' 2B4T packing (uint8 [ceil(out/4), in]); a
    CheckpointError naming `what` if a code is not one of -1, 0, +1."""
    codes = np.concatenate([(packed >> (2 * j)) & 3 for j in range(4)], axis=0)[:out_features]
    if (codes == 3).any():
        raise CheckpointError(f"{what} holds the invalid 2-bit code 3",
                              hint="the file is damaged, or not packed the way transformers packs BitNet")
    return codes.astype(np.int8) - 1


def _config(directory) -> tuple[BitNetConfig, bool]:
    """(the config, whether config.json has BitNet's quantization_config)."""
    path = os.path.join(directory, "config.json")
    if os.path.getsize(path) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {_MAX_CONFIG_BYTES} bytes; not a config")
    data = read_regular(path, "config", ConfigError)     # its own error, not "not JSON"
    try:
        d = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a config") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    family = families.by_hf_config(d)
    if family is None:
        known = ", ".join(a for f in families.FAMILIES for a in f.hf_architectures)
        raise ConfigError(f"{path}: architectures {d.get('architectures')!r} / model_type "
                          f"{d.get('model_type')!r} is not a ternary family tercomp reads",
                          hint=f"supported: {known}")
    q = d.get("quantization_config")
    if q is not None and (not isinstance(q, dict) or q.get("quant_method", "bitnet") != "bitnet"):
        raise ConfigError(f"{path}: field 'quantization_config' is {q!r:.200}; only BitNet's "
                          f"(quant_method 'bitnet') is supported")
    if family.hf_needs_bitnet_quant and q is None:
        raise ConfigError(f"{path}: a {d.get('architectures', [family.name])[0]} without "
                          f"quantization_config {{'quant_method': 'bitnet'}} is a float model, "
                          f"not a ternary one",
                          hint="tercomp loads 1.58-bit checkpoints (Falcon3-*-1.58bit, "
                               "Llama3-8B-1.58)")
    if family.hf_config is not None:        # the family's keys as BitNetConfig fields
        d = family.hf_config(d, path)
    d = {k: v for k, v in d.items() if k != "architectures"}
    d.update(sub_norms=family.sub_norms, family=family.name, **dict(family.options))
    d.setdefault("rope_style", "neox")       # HF's rotate_half
    pooling = _pooling(directory)
    if pooling is not None:
        d["pooling"] = pooling
    return BitNetConfig.from_dict(d, source=path), q is not None


#: sentence-transformers' Pooling modes -> BitNetConfig.pooling
_ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
               "pooling_mode_cls_token": "cls"}


def _pooling(directory):
    """The pooling of a sentence-transformers model directory (modules.json naming a
    Pooling module whose config.json sets one pooling_mode_*), or None without one."""
    modules = os.path.join(directory, "modules.json")
    if not os.path.isfile(modules):
        return None
    mods = _small_json(modules)
    pool = next((m for m in mods if isinstance(m, dict) and
                 str(m.get("type", "")).endswith("Pooling")), None) \
        if isinstance(mods, list) else None
    if pool is None:
        return None
    sub = str(pool.get("path", ""))
    path = os.path.join(directory, sub, "config.json")
    if os.path.isabs(sub) or ".." in sub.split("/") or not os.path.isfile(path):
        return None
    conf = _small_json(path)
    if not isinstance(conf, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    mode = conf.get("pooling_mode")          # newer sentence-transformers: one string
    if isinstance(mode, str):
        got = {"lasttoken": "last", "mean": "mean", "cls": "cls"}.get(mode)
        if got is None:
            raise ConfigError(f"{path}: pooling_mode {mode!r:.80} is not supported",
                              hint="tercomp pools by lasttoken, mean or cls")
        return got
    on = [k for k, v in conf.items() if k.startswith("pooling_mode_") and v is True]
    bad = [k for k in on if k not in _ST_POOLING]
    if bad or len(on) != 1:
        raise ConfigError(f"{path}: pooling {', '.join(on) or 'none'} is not supported",
                          hint="tercomp pools one way: pooling_mode_lasttoken, "
                               "pooling_mode_mean_tokens or pooling_mode_cls_token")
    return _ST_POOLING[on[0]]


def _small_json(path):
    """A sentence-transformers JSON file: a regular file (no FIFO or device) of at most
    _MAX_CONFIG_BYTES."""
    if os.path.getsize(path) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {_MAX_CONFIG_BYTES} bytes; not a config")
    data = read_regular(path, "config", ConfigError)     # its own error, not "not JSON"
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"{path}: not valid JSON ({type(e).__name__})") from None


class _Tensors:
    def __init__(self, tensors):
        self.t = tensors
        self.used = set()

    def get(self, name, shape=None, required=True):
        if name not in self.t:
            if required:
                raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
            return None
        arr, path = self.t[name]
        self.used.add(name)
        if shape is not None and arr.shape != tuple(shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {list(arr.shape)}, but "
                                  f"config.json implies {list(shape)}")
        return arr

    def float(self, name, shape, required=True, offset: float = 0.0):
        """The float tensor as float32 (plus `offset`, added in float64 and rounded once:
        a float64 norm that save_hf wrote as w - 1 comes back as w exactly)."""
        arr = self.get(name, shape, required)
        if arr is None:
            return None
        if arr.dtype.kind != "f":
            raise CheckpointError(f"{self.t[name][1]}: tensor {name!r} has dtype {arr.dtype}; "
                                  f"expected a float tensor")
        if offset:
            return np.ascontiguousarray(np.asarray(arr, np.float64) + offset, dtype=np.float32)
        return np.ascontiguousarray(arr, dtype=np.float32)

    def projection(self, prefix, out_f, in_f):
        w = self.get(prefix + ".weight")
        path = self.t[prefix + ".weight"][1]
        ws = self.get(prefix + ".weight_scale", required=False)
        if ws is not None:
            ws = np.asarray(ws, dtype=np.float64).reshape(-1)
            if ws.size != 1 or not (np.isfinite(ws[0]) and ws[0] > 0):
                raise CheckpointError(f"{path}: tensor {prefix + '.weight_scale'!r} must be one "
                                      f"positive number, got {ws.tolist()[:4]}")
        if w.dtype == np.uint8:
            if w.shape != (-(-out_f // 4), in_f):
                raise CheckpointError(f"{path}: packed tensor {prefix + '.weight'!r} has shape "
                                      f"{list(w.shape)}, but config.json implies "
                                      f"{[-(-out_f // 4), in_f]}")
            if ws is None:
                raise CheckpointError(f"{path}: packed tensor {prefix + '.weight'!r} has no "
                                      f"'{prefix}.weight_scale'")
            t = unpack_hf_ternary(w, out_f, f"{path}: tensor {prefix + '.weight'!r}")
            return nn.BitLinear.from_ternary(t, _layer_scale(path, prefix, 1.0 / ws[0]))
        w = self.float(prefix + ".weight", (out_f, in_f))
        if ws is not None:          # offline AutoBitLinear: y = (x @ W^T) * weight_scale
            mags = np.unique(np.abs(w[w != 0]))
            if mags.size > 1:
                raise CheckpointError(f"{path}: tensor {prefix + '.weight'!r} has a "
                                      f"weight_scale but its values are not ternary")
            mag = float(mags[0]) if mags.size else 1.0
            return nn.BitLinear.from_ternary(np.sign(w).astype(np.int8),
                                             _layer_scale(path, prefix, mag * ws[0]))
        layer = nn.BitLinear(in_f, out_f)
        layer.weight = w
        return layer


def _layer_scale(path, prefix, s) -> np.float32:
    """A stored layer's scale `s` as float32, or a CheckpointError naming the tensor when
    it is out of ternary_pack.weight_scale_in_range (as GGUF's loader)."""
    if not tp.weight_scale_in_range(s):
        raise CheckpointError(f"{path}: tensor {prefix + '.weight_scale'!r} gives the layer "
                              f"the scale {s:g}, not a float32 from {tp.MIN_WEIGHT_SCALE:.3g} "
                              f"to {tp.MAX_WEIGHT_SCALE:g} (the logits would be NaN or vanish)")
    return np.float32(s)


def _check_shapes(cfg, tensors):
    """config.json must agree with the tensors before anything is allocated from it."""
    layers = {int(m.group(1)) for n in tensors if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    if len(layers) != cfg.num_hidden_layers or layers != set(range(len(layers))):
        raise CheckpointError(f"config.json: field 'num_hidden_layers' is "
                              f"{cfg.num_hidden_layers}, but the checkpoint has tensors for "
                              f"{len(layers)} layers")
    h, v = cfg.hidden_size, cfg.vocab_size
    need = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for name, (out_f, in_f) in _projection_shapes(cfg).items():
        block = "self_attn" if name[0] in "qkvo" else "mlp"
        need[f"model.layers.0.{block}.{name}.weight"] = (out_f, in_f)
    for name, shape in need.items():
        if name not in tensors:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
        arr, path = tensors[name]
        packed = (-(-shape[0] // 4),) + shape[1:] if arr.dtype == np.uint8 else shape
        if arr.shape != packed:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {list(arr.shape)}, but "
                                  f"config.json implies {list(packed)}")


_LLAMA_LAYER_NORMS = (("input_layernorm", ("input_layernorm",)),
                      ("post_attention_layernorm", ("post_attention_layernorm",)))


def _proj_norms(cfg, tensors) -> bool:
    """Whether the checkpoint has BitLinear's per-projection input norms: on every
    projection of every layer, or on none (else a CheckpointError naming the file and
    the first tensor that breaks the rule)."""
    names = [f"model.layers.{i}.{hf_block}.{proj}.norm.weight"
             for i in range(cfg.num_hidden_layers)
             for hf_block, (_, projs) in _PROJ.items() for proj in projs]
    have = [n in tensors for n in names]
    if all(have) or not any(have):
        return all(have)
    missing = names[have.index(False)]
    present = tensors[names[have.index(True)]][1]
    raise CheckpointError(f"{present}: per-projection norm tensors on some projections only: "
                          f"{names[have.index(True)]!r} is there, {missing!r} is not",
                          hint="a BitLinear input norm belongs to every projection of every "
                               "layer, or to none")


def _projection_shapes(cfg) -> dict:
    """projection name -> (out_features, in_features)."""
    h, ff, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_dim, cfg.kv_dim
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (ff, h), "up_proj": (ff, h), "down_proj": (h, ff)}


def load_hf(directory) -> BitNetLM:
    """Read a Hugging Face BitNet directory into a BitNetLM (see the module docstring)."""
    cfg, quantized = _config(directory)
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files next to config.json")
    tensors = {}
    for f in files:
        for name, (arr, path) in _read_tensors(f).items():
            if name in tensors:
                raise CheckpointError(f"{path}: tensor {name!r} is defined again (first in "
                                      f"{tensors[name][1]})", hint="one shard per tensor")
            tensors[name] = (arr, path)
    family = families.by_name(cfg.family)
    if family.hf_config is not None and "model.embed_tokens.weight" not in tensors:
        # a base-model checkpoint (Qwen3Model, Gemma3TextModel: sentence-transformers'
        # embedding models) names its tensors without the "model." of *ForCausalLM
        tensors = {n if n == "lm_head.weight" else "model." + n: v for n, v in tensors.items()}
    ts = _Tensors(tensors)
    _check_shapes(cfg, tensors)
    cfg.proj_norms = _proj_norms(cfg, tensors)
    if family.hf_needs_ternary_marker and not (cfg.proj_norms or quantized):
        raise ConfigError(f"{os.path.join(directory, 'config.json')}: a {cfg.family} checkpoint "
                          f"with neither BitLinear input norms ('*_proj.norm.weight') nor "
                          f"quantization_config {{'quant_method': 'bitnet'}} is a float model, "
                          f"not a ternary one",
                          hint="tercomp loads BitNet checkpoints (bitnet-embedding-*)")
    c = cfg
    h, ff = c.hidden_size, c.intermediate_size
    lm = BitNetLM(cfg, init=False)
    lm.embed_tokens.weight = ts.float("model.embed_tokens.weight", (c.vocab_size, h))
    off = float(family.hf_norm_offset)
    lm.norm.weight = ts.float("model.norm.weight", (h,), offset=off)
    shapes = _projection_shapes(c)
    layer_norms = family.hf_layer_norms or _LLAMA_LAYER_NORMS
    for i, layer in enumerate(lm.layers):
        p = f"model.layers.{i}"
        for hf_name, path_ in layer_norms:
            owner = layer
            for a in path_[:-1]:
                owner = getattr(owner, a)
            getattr(owner, path_[-1]).weight = ts.float(f"{p}.{hf_name}.weight", (h,), offset=off)
        if c.qk_norm:
            for n in ("q_norm", "k_norm"):
                getattr(layer.attn, n).weight = ts.float(f"{p}.self_attn.{n}.weight",
                                                         (c.head_dim,), offset=off)
        if c.proj_norms:    # BitLinear's own RMSNorm: plain weights, never offset
            for hf_block, (block, projs) in _PROJ.items():
                for proj in projs:
                    getattr(getattr(layer, block), proj.replace("_proj", "_norm_in")).weight = \
                        ts.float(f"{p}.{hf_block}.{proj}.norm.weight", (shapes[proj][1],))
        if c.sub_norms:
            layer.attn.attn_sub_norm.weight = ts.float(f"{p}.self_attn.attn_sub_norm.weight",
                                                       (c.q_dim,))
            layer.mlp.ffn_sub_norm.weight = ts.float(f"{p}.mlp.ffn_sub_norm.weight", (ff,))
        for hf_block, (block, projs) in _PROJ.items():
            for proj in projs:
                setattr(getattr(layer, block), proj,
                        ts.projection(f"{p}.{hf_block}.{proj}", *shapes[proj]))
    if c.tie_word_embeddings:
        ts.get("lm_head.weight", required=False)    # a tied copy, if saved, is not used
    else:
        lm.lm_head.weight = ts.float("lm_head.weight", (c.vocab_size, h))
    extra = sorted(n for n in set(tensors) - ts.used if not n.endswith("rotary_emb.inv_freq"))
    if extra:
        raise CheckpointError(f"{tensors[extra[0]][1]}: tensor {extra[0]!r} is not part of a "
                              f"{c.num_hidden_layers}-layer {c.family} model "
                              f"({len(extra)} unexpected tensor(s))")
    lm.tokenizer = tokenizer_from_hf(directory)
    return lm


# ----------------------------------------------------------------------------- writing
_HF_QUANT = {"quant_method": "bitnet", "linear_class": "bitlinear",
             "quantization_mode": "offline"}


def pack_hf_ternary(t: np.ndarray) -> np.ndarray:
    """transformers' 2B4T packing of T int8 [out, in]: uint8 [ceil(out/4), in], output row
    j * rows + r in bits 2j..2j+1 of row r as the code T + 1 (`unpack_hf_ternary`'s
    inverse)."""
    out, rows = t.shape[0], -(-t.shape[0] // 4)
    codes = np.zeros((4 * rows, t.shape[1]), np.uint8)
    codes[:out] = (np.asarray(t) + 1).astype(np.uint8)
    packed = np.zeros((rows, t.shape[1]), np.uint8)
    for j in range(4):
        packed |= codes[j * rows:(j + 1) * rows] << np.uint8(2 * j)
    return packed


def _weight_scale(s: np.float32) -> np.ndarray:
    """The divisor transformers stores (`weight_scale` [1]: the output is divided by it)
    for the layer scale `s`: a float32 whose reciprocal load_hf turns back into `s`
    exactly, or, where no float32 does (the float32 reciprocals do not cover every
    float32), the float64 1 / s, which always does."""
    ws = np.float32(1.0 / np.float64(s))
    for cand in (ws, *(np.nextafter(ws, np.float32(d), dtype=np.float32)
                       for d in (np.inf, -np.inf))):
        if np.float32(1.0 / np.float64(cand)) == s:
            return np.array([cand], np.float32)
    return np.array([1.0 / np.float64(s)], np.float64)


def _hf_config(model: BitNetLM) -> dict:
    cfg = model.config
    family = families.by_name(cfg.family) or families.FAMILIES[0]
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "rope_theta", "hidden_act", "tie_word_embeddings", "max_position_embeddings")
    d = {"architectures": [family.hf_architectures[0]], "model_type": family.hf_model_types[0],
         **{k: getattr(cfg, k) for k in keep}}
    if family.hf_config_out is not None:
        d.update(family.hf_config_out(cfg))
    if cfg.rope_scaling is not None:
        d["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.rope_freq_factors is not None:       # a GGUF's rope_freqs: tercomp's own field
        d["rope_freq_factors"] = list(cfg.rope_freq_factors)
    d.update(attention_bias=False, mlp_bias=False, torch_dtype="float32",
             quantization_config=dict(_HF_QUANT))
    return d


def _hf_rows(t: np.ndarray, n_head: int) -> np.ndarray:
    """q/k rows stored for interleaved RoPE (pairs 2i, 2i+1) back in Hugging Face's
    rotate-half order (pairs i, i + d/2): the inverse of llama.cpp's converter
    permutation."""
    return t.reshape(n_head, t.shape[0] // n_head // 2, 2, *t.shape[1:]).swapaxes(1, 2) \
        .reshape(t.shape)


def save_hf(model: BitNetLM, directory) -> None:
    """Write `model` as a Hugging Face checkpoint directory that `models.load` reads
    back with the same logits: config.json (`BitNetForCausalLM`, or `LlamaForCausalLM`
    with BitNet's quantization_config for the llama family), model.safetensors with
    transformers' packed projections (uint8 codes, 4 rows a byte, and a `weight_scale`
    that divides the output: float32, or float64 where no float32 gives the scale back
    exactly) and float32 embedding, norms and lm_head,
    and the tokenizer (tokenizer.json, tokenizer_config.json with the chat template)
    when the model has one. A model whose q/k rows follow llama.cpp's interleaved RoPE
    (loaded from a `llama` GGUF) is written in Hugging Face's rotate-half order.

    A `qwen3` / `gemma3` model is written as `Qwen3ForCausalLM` / `Gemma3ForCausalLM`
    (the family's config keys: layer types, window, `query_pre_attn_scalar`, ...) with
    the same packed projections, each projection's input norm as
    `*_proj.norm.weight`, the q/k norms, Gemma's norms as the w of its (1 + w) (float32,
    or float64 where float32 would not give 1 + w back exactly), and, when the model
    has a pooling, sentence-transformers' modules.json and 1_Pooling/config.json.

    >>> models.save_hf(lm, "out_dir"); lm2 = models.load("out_dir")
    """
    if not isinstance(model, BitNetLM):
        raise ConfigError(f"save_hf expects a models.BitNetLM, got {type(model).__name__}")
    cfg = model.config
    family = families.by_name(cfg.family)
    backbone = family is not None and family.unwritable is not None
    if backbone:
        why = family.unwritable(cfg, "hf")
        if why is not None:
            raise UnsupportedError(f"save_hf: transformers' {family.hf_architectures[0]} would "
                                   f"compute another network than this model: {why}",
                                   hint="keep the checkpoint it was loaded from")
    elif cfg.family in ("qwen3", "gemma3") or cfg.proj_norms or cfg.qk_norm or cfg.post_norms:
        raise UnsupportedError(f"save_hf: this {cfg.family!r} model has norms (per-projection, "
                               f"q/k or Gemma's) that its family's checkpoints do not",
                               hint="keep the checkpoint it was loaded from")
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    f32 = lambda x: np.ascontiguousarray(np.asarray(x, dtype=np.float32))  # noqa: E731
    off = family.hf_norm_offset if backbone else 0.0
    norm = (lambda x: _offset_norm(x, off)) if off else f32     # noqa: E731
    st = {"model.embed_tokens.weight": f32(model.embed_tokens.weight),
          "model.norm.weight": norm(model.norm.weight)}
    if model.lm_head is not None:
        st["lm_head.weight"] = f32(model.lm_head.weight)
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    layer_norms = (family.hf_layer_norms if backbone else ()) or _LLAMA_LAYER_NORMS
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}"
        for hf_name, path_ in layer_norms:
            owner = layer
            for a in path_:
                owner = getattr(owner, a)
            st[f"{p}.{hf_name}.weight"] = norm(owner.weight)
        if cfg.qk_norm:
            for n in ("q_norm", "k_norm"):
                st[f"{p}.self_attn.{n}.weight"] = norm(getattr(layer.attn, n).weight)
        if cfg.proj_norms:      # BitLinear's own RMSNorm: plain weights
            for hf_block, (block, projs) in _PROJ.items():
                for proj in projs:
                    st[f"{p}.{hf_block}.{proj}.norm.weight"] = f32(getattr(
                        getattr(layer, block), proj.replace("_proj", "_norm_in")).weight)
        if cfg.sub_norms:
            st[f"{p}.self_attn.attn_sub_norm.weight"] = f32(layer.attn.attn_sub_norm.weight)
            st[f"{p}.mlp.ffn_sub_norm.weight"] = f32(layer.mlp.ffn_sub_norm.weight)
        for hf_block, (block, projs) in _PROJ.items():
            for proj in projs:
                lin = getattr(getattr(layer, block), proj)
                if getattr(lin, "bias", None) is not None:
                    raise UnsupportedError(f"save_hf: layers.{i}.{block}.{proj} has a bias, which "
                                           f"a {cfg.family} checkpoint does not have")
                t, s = lin.ternary()
                if cfg.rope_style == "interleaved" and proj in heads:
                    t = _hf_rows(t, heads[proj])
                st[f"{p}.{hf_block}.{proj}.weight"] = pack_hf_ternary(t)
                st[f"{p}.{hf_block}.{proj}.weight_scale"] = _weight_scale(s)
    write_atomic(os.path.join(directory, "model.safetensors"),
                 safetensors_save(st, metadata={"format": "pt"}), "safetensors", CheckpointError)
    write_atomic(os.path.join(directory, "config.json"),
                 json.dumps(_hf_config(model), indent=2).encode(), "config", CheckpointError)
    if cfg.pooling is not None:
        _save_pooling(cfg, directory)
    _save_tokenizer(model.tokenizer, directory)


def _offset_norm(w, off: float) -> np.ndarray:
    """The checkpoint's w of a norm that multiplies by (off + w), from the stored off + w:
    float32 where load_hf's float32(w + off) gives the stored weight back exactly, else
    float64 (w - off is exact there)."""
    stored = np.asarray(w, np.float32)
    w64 = stored.astype(np.float64) - off
    w32 = w64.astype(np.float32)
    if np.array_equal((w32.astype(np.float64) + off).astype(np.float32), stored):
        return np.ascontiguousarray(w32)
    return np.ascontiguousarray(w64)


def _save_pooling(cfg, directory):
    """sentence-transformers' modules.json and 1_Pooling/config.json for cfg.pooling
    (what _pooling reads)."""
    mode = {v: k for k, v in _ST_POOLING.items()}[cfg.pooling]
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    write_atomic(os.path.join(directory, "modules.json"), json.dumps(modules, indent=2).encode(),
                 "modules", CheckpointError)
    os.makedirs(os.path.join(directory, "1_Pooling"), exist_ok=True)
    conf = {"word_embedding_dimension": cfg.hidden_size,
            **{k: k == mode for k in ("pooling_mode_cls_token", "pooling_mode_mean_tokens",
                                      "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                                      "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")}}
    write_atomic(os.path.join(directory, "1_Pooling", "config.json"),
                 json.dumps(conf, indent=2).encode(), "pooling config", CheckpointError)


def _save_tokenizer(tok, directory):
    if tok is None:
        return
    write_atomic(os.path.join(directory, "tokenizer.json"), tok.to_str().encode(),
                 "tokenizer", CheckpointError)
    template = getattr(tok, "chat_template", None)
    if template is not None:
        conf = {"chat_template": template.source, "bos_token": template.bos_token,
                "eos_token": template.eos_token}
        write_atomic(os.path.join(directory, "tokenizer_config.json"),
                     json.dumps(conf, indent=2).encode(), "tokenizer config", CheckpointError)
