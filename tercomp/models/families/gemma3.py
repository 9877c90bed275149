"""Gemma3 (text) with BitNet's BitLinear projections (bitnet-embedding-270m: hidden
640, 18 layers, 4 query / 1 K/V heads of head_dim 256, GELU, vocabulary 262,144, tied).

As published by transformers (modeling_gemma3.py, Gemma3TextConfig): the token
embedding times sqrt(hidden_size); per layer input_layernorm, attention (q/k RMSNorms
over head_dim before RoPE, scores times query_pre_attn_scalar**-0.5, sliding-window
layers per `layer_types` with RoPE base rope_local_base_freq, the others rope_theta),
post_attention_layernorm on the attention output, the residual add,
pre_feedforward_layernorm, the gated MLP with gelu_pytorch_tanh,
post_feedforward_layernorm, the residual add; the final norm. Every Gemma RMSNorm
multiplies by (1 + w): the Hugging Face loader stores 1 + w (llama.cpp's files hold
1 + w already; BitNet's converter adds it to all but the `*_norm_in` BitLinear norms,
which are ordinary RMSNorms). Layer types, when not listed, repeat
`sliding_window_pattern` (default 6: five sliding layers, then a full one).

As GGUF (bitnet.cpp's converter): llama.cpp's `gemma3` architecture, whose graph scales
the embedding by sqrt(hidden), uses GELU, NeoX RoPE, 1/sqrt(head_dim) attention unless
`attention.scale` says otherwise, sliding layers every 6 (or as
`attention.sliding_window_pattern` says: a period, or a boolean per layer) with RoPE
base 10000; the
window is `attention.sliding_window` (bitnet.cpp's converter writes none: without it
every layer attends to all positions)."""
from ..config import ConfigError
from .base import Family
from . import backbone

_GGUF_SWA_PATTERN = 6           # llama.cpp's gemma3: hparams.set_swa_pattern(6)
_GGUF_SWA_ROPE_BASE = 10000.0   # llama.cpp's gemma3: rope_freq_base_train_swa


def _pattern_types(n: int, pattern: int) -> list:
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]


def _hf_config(d: dict, source: str) -> dict:
    backbone.must_be_off(d, source, ("final_logit_softcapping", "attn_logit_softcapping",
                                     "use_bidirectional_attention"))
    out = {**backbone.common(d), **backbone.rope(d, source)}
    out["hidden_act"] = d.get("hidden_activation", d.get("hidden_act", "gelu_pytorch_tanh"))
    out.setdefault("rope_theta", 1_000_000.0)           # Gemma3TextConfig's defaults
    out.setdefault("rope_local_base_freq", 10_000.0)
    out["query_pre_attn_scalar"] = d.get("query_pre_attn_scalar", 256)
    window = d.get("sliding_window", 4096)                 # Gemma3TextConfig's default
    lt = d.get("layer_types")
    if lt is None and window is not None:
        pattern = d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6))
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ConfigError(f"{source}: field 'sliding_window_pattern' must be a positive "
                              f"integer, got {pattern!r}")
        lt = _pattern_types(d.get("num_hidden_layers", 0), pattern)
    if lt is not None:
        out["layer_types"] = lt
        if window is not None:
            out["sliding_window"] = window
    return out


def _gguf_config(field, arch: str) -> dict:
    backbone.gguf_causal(field, arch)
    out = backbone.gguf_pooling(field, arch)
    scale = field(f"{arch}.attention.scale", None, kind=float)
    if scale is not None:
        if not 0 < scale < float("inf"):
            raise ConfigError(f"key '{arch}.attention.scale': {scale} is not a positive number")
        out["query_pre_attn_scalar"] = float(scale) ** -2
    window = field(f"{arch}.attention.sliding_window", None, kind=int)
    n = field(f"{arch}.block_count", 0, kind=int)
    out["rope_local_base_freq"] = _GGUF_SWA_ROPE_BASE
    pattern = field(f"{arch}.attention.sliding_window_pattern", _GGUF_SWA_PATTERN)
    if isinstance(pattern, (list, tuple)):      # llama.cpp's per-layer form: true = sliding
        if len(pattern) != n or any(not isinstance(p, (bool, int)) for p in pattern):
            raise ConfigError(f"key '{arch}.attention.sliding_window_pattern': expected "
                              f"{n} booleans, got {pattern!r:.80}")
        out["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
        raise ConfigError(f"key '{arch}.attention.sliding_window_pattern': expected a positive "
                          f"integer or one boolean per layer, got {pattern!r:.80}")
    else:
        out["layer_types"] = _pattern_types(n, pattern)
    if window:
        out["sliding_window"] = window
    else:       # no window: the pattern only chooses each layer's RoPE base
        out["sliding_window"] = field(f"{arch}.context_length", 2048, kind=int)
    return out


def _unwritable(cfg, fmt: str) -> str | None:
    sliding = cfg.layer_types is not None and "sliding_attention" in cfg.layer_types
    if fmt == "gguf" and sliding and cfg.rope_local_base_freq != _GGUF_SWA_ROPE_BASE:
        return (f"its sliding layers' RoPE base is {cfg.rope_local_base_freq}, where "
                f"llama.cpp's gemma3 graph has {_GGUF_SWA_ROPE_BASE}")
    return backbone.unwritable(cfg, "gelu_pytorch_tanh", qk_norm=True, post_norms=True,
                               scale_embeddings=True)


def _gguf_keys_out(cfg, arch: str) -> list:
    """The converter's keys, and those that say what this model's graph is where
    llama.cpp's defaults would say otherwise: the attention scale, the window and each
    layer's type (true = sliding; all false without sliding layers)."""
    types = cfg.layer_types or ("full_attention",) * cfg.num_hidden_layers
    keys = backbone.gguf_keys_out(cfg, arch) + [
        ("add_float32", f"{arch}.attention.scale", cfg.attention_scale),
        ("add_array", f"{arch}.attention.sliding_window_pattern",
         [t == "sliding_attention" for t in types])]
    if cfg.sliding_window is not None and "sliding_attention" in types:
        keys.append(("add_uint32", f"{arch}.attention.sliding_window", cfg.sliding_window))
    return keys


def _hf_config_out(cfg) -> dict:
    """Gemma3TextConfig's keys (hidden_activation, the window, every layer's type)."""
    types = cfg.layer_types or ("full_attention",) * cfg.num_hidden_layers
    return {"hidden_activation": cfg.hidden_act, "layer_types": list(types),
            "sliding_window": cfg.sliding_window if "sliding_attention" in types else None,
            "query_pre_attn_scalar": cfg.query_pre_attn_scalar or cfg.head_dim,
            "rope_local_base_freq": cfg.rope_local_base_freq or cfg.rope_theta,
            "final_logit_softcapping": None, "attn_logit_softcapping": None}


FAMILY = Family(name="gemma3", gguf_arch="gemma3",
                hf_architectures=("Gemma3ForCausalLM", "Gemma3TextModel"),
                hf_model_types=("gemma3_text",), sub_norms=False, gguf_rope_style="neox",
                options=(("qk_norm", True), ("post_norms", True), ("scale_embeddings", True)),
                hf_config=_hf_config, gguf_config=_gguf_config, hf_norm_offset=1.0,
                gguf_default_act="gelu_pytorch_tanh", hf_needs_ternary_marker=True,
                unwritable=_unwritable, gguf_keys_out=_gguf_keys_out,
                hf_config_out=_hf_config_out,
                hf_layer_norms=(("input_layernorm", ("input_layernorm",)),
                                ("pre_feedforward_layernorm", ("post_attention_layernorm",)),
                                ("post_attention_layernorm", ("attn_post_norm",)),
                                ("post_feedforward_layernorm", ("ffn_post_norm",))))
