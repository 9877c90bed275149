"""Writing a BitNetLM as GGUF (`save_gguf`): llama.cpp's `bitnet` architecture for a
model with sub-norms, `llama` without, as TQ2_0; or bitnet.cpp's I2_S; the `qwen3` and
`gemma3` families (BitNet's embedding models) as bitnet.cpp's embedding converter
writes them. The tensor names are gguf_io.py's tables (PROJECTIONS, NORMS), read and
written alike; a family's own keys come from its module (models/families).
"""
from __future__ import annotations

import numpy as np

from .. import ternary_pack as tp
from ..errors import ConfigError, UnsupportedError
from ..runtime.files import atomic_target
from . import families
from .bitnet import BitNetLM, rope_frequencies
from .gguf_io import PROJECTIONS, _get, _norms
from .gguf_scan import GGUFError, I2_S
from .tokenizer import gguf_vocab_from_tokenizer

try:
    import gguf
    from gguf import GGMLQuantizationType as QT
except ImportError:  # pragma: no cover - gguf is a dependency
    gguf = None

#: what save_gguf writes the ternary projections as
TERNARY_TYPES_OUT = ("TQ2_0", "I2_S")
#: llama.h's LLAMA_FTYPE_MOSTLY_I2_S in bitnet.cpp's fork (the value its converter writes)
_FTYPE_I2_S = 40


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

    A `qwen3` / `gemma3` model (BitNet's embedding backbones) is written as bitnet.cpp's
    utils/convert-bitnet-embedding-to-gguf.py writes it: arch `qwen3` / `gemma3`,
    `attention.key_length` / `value_length`, `pooling_type`, the per-projection norms as
    `blk.{i}.*_norm_in`, q/k norms, Gemma's norms (stored as 1 + w), tables and norms
    F16 where F16 holds them exactly (else F32), projections I2_S or TQ2_0 with a
    `.scale`; for Gemma3 also the keys that pin its graph (`attention.scale`,
    `attention.sliding_window`, the per-layer `sliding_window_pattern`).

    The vocabulary is the loaded GGUF's, or the tokenizer's (BPE -> "gpt2", Unigram ->
    "llama"), or "no_vocab" (which llama.cpp refuses to load).

    >>> models.save_gguf(lm, "tiny.gguf"); lm2 = models.load("tiny.gguf")
    >>> models.save_gguf(lm, "tiny-i2s.gguf", ternary_type="I2_S")
    """
    if not isinstance(model, BitNetLM):
        raise ConfigError(f"save_gguf expects a models.BitNetLM, got {type(model).__name__}")
    if ternary_type not in TERNARY_TYPES_OUT:
        raise ConfigError(f"save_gguf: ternary_type={ternary_type!r}; it is one of "
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
    """The family whose llama.cpp architecture computes this model: its own for a family
    with its own keys (qwen3, gemma3), else `bitnet` with the sub-norms, `llama` without."""
    own = families.by_name(cfg.family)
    if own is not None and own.gguf_keys_out is not None:
        return own
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
    if family.unwritable is not None:
        _check_backbone(model, cfg, family, ternary_type)
        return
    if cfg.family in ("qwen3", "gemma3") or cfg.proj_norms or cfg.qk_norm or cfg.post_norms:
        raise UnsupportedError(f"save_gguf writes llama.cpp's 'bitnet' and 'llama' architectures; "
                               f"this {cfg.family!r} model (q/k norms, per-projection norms or "
                               f"Gemma's norms) is neither", hint="keep the file it was loaded from")
    if ternary_type == "I2_S":
        if family.gguf_arch != "bitnet":
            raise UnsupportedError(f"save_gguf: I2_S files are bitnet.cpp's BitNet architectures; "
                                   f"this {cfg.family!r} model (no sub-norms) is written as TQ2_0",
                                   hint="save it with ternary_type='TQ2_0'")
        narrow = sorted({k for k in (cfg.hidden_size, cfg.q_dim, cfg.intermediate_size)
                         if k % tp.I2S_BLOCK})
        if narrow:
            raise UnsupportedError(f"save_gguf: I2_S stores rows of whole {tp.I2S_BLOCK}-weight "
                                   f"blocks; this model has projections with {narrow[0]} inputs",
                                   hint="save it with ternary_type='TQ2_0'")
    untied_ok = arch == "bitnet-b1.58"      # its graph reads an optional output.weight
    arch = family.gguf_arch
    scaled = cfg.rope_scaling is not None or cfg.rope_freq_factors is not None
    if arch == "bitnet" and (cfg.q_dim != cfg.hidden_size or scaled):
        raise UnsupportedError(f"save_gguf writes a model with sub-norms as llama.cpp's 'bitnet' "
                               f"architecture; this {cfg.family!r} model (head_dim {cfg.head_dim}, "
                               f"RoPE scaling {scaled}) is not one",
                               hint="keep the file it was loaded from")
    if arch == "bitnet" and not untied_ok and (model.lm_head is not None
                                               or not cfg.tie_word_embeddings):
        raise UnsupportedError("save_gguf: the model has a separate output layer (lm_head); "
                               "llama.cpp's 'bitnet' graph always uses the token embedding as "
                               "output, so the file would compute different logits",
                               hint="tie the output layer (tie_word_embeddings=True)")
    if cfg.rope_style != family.gguf_rope_style and cfg.rope_style != "neox":
        raise UnsupportedError(f"save_gguf: llama.cpp's {arch!r} graph uses "
                               f"{family.gguf_rope_style} RoPE; this model uses {cfg.rope_style} "
                               f"pairs")
    if arch == "llama" and cfg.hidden_act != "silu":
        raise UnsupportedError(f"save_gguf: llama.cpp's 'llama' architecture computes silu; this "
                               f"model without sub-norms uses {cfg.hidden_act!r}")
    _check_no_bias(model, arch)


def _check_backbone(model, cfg, family, ternary_type):
    why = family.unwritable(cfg, "gguf")
    if why is not None:
        raise UnsupportedError(f"save_gguf: llama.cpp's {family.gguf_arch!r} graph would compute "
                               f"another network than this model: {why}",
                               hint="keep the file it was loaded from")
    if ternary_type == "I2_S":
        narrow = sorted({k for k in (cfg.hidden_size, cfg.q_dim, cfg.intermediate_size)
                         if k % tp.I2S_BLOCK})
        if narrow:
            raise UnsupportedError(f"save_gguf: I2_S stores rows of whole {tp.I2S_BLOCK}-weight "
                                   f"blocks; this model has projections with {narrow[0]} inputs",
                                   hint="save it with ternary_type='TQ2_0'")
    _check_no_bias(model, family.gguf_arch)


def _check_no_bias(model, arch):
    for i, layer in enumerate(model.layers):
        for g, (block, proj) in PROJECTIONS.items():
            if getattr(getattr(getattr(layer, block), proj), "bias", None) is not None:
                raise UnsupportedError(f"save_gguf: layers.{i}.{block}.{proj} has a bias, which "
                                       f"the {arch!r} architecture does not have")


def _f16_if_exact(x) -> np.ndarray:
    """x as F16 where that holds every value (the converter's F16 tables and norms),
    else F32 (the model's logits are kept either way); compared in bounded chunks."""
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    flat = x.reshape(-1)
    step = 1 << 20
    if all(np.array_equal(flat[i:i + step].astype(np.float16).astype(np.float32),
                          flat[i:i + step]) for i in range(0, flat.size, step)):
        return x.astype(np.float16)
    return x


def _check_vocab(vocab: dict, path):
    """Every kept tokenizer key has the kind its writer method takes."""
    kinds = {"string": str, "uint32": (int, np.integer), "array": (list, tuple), "bool": bool}
    for key, (kind, value) in vocab.items():
        ok = isinstance(value, kinds.get(kind, ())) and (kind == "bool") == isinstance(value, bool)
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
    if family.gguf_keys_out is not None:
        for method, key, value in family.gguf_keys_out(cfg, a):
            getattr(w, method)(key, value)
    elif cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
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
    norm = f32
    if family.gguf_keys_out is not None:
        table = norm = _f16_if_exact
    w.add_tensor("token_embd.weight", table(model.embed_tokens.weight))
    w.add_tensor("output_norm.weight", norm(model.norm.weight))
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
            w.add_tensor(f"blk.{i}.{g}.weight", norm(_get(layer, path_).weight))
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
