"""What the Qwen3 and Gemma3 families share: their config.json keys and GGUF keys as
BitNetConfig fields (families/qwen3.py, families/gemma3.py hold the differences).

BitNet's embedding models (bitnet-embedding-0.6b: Qwen3; -270m: Gemma3) are
Hugging Face `qwen3` / `gemma3_text` checkpoints whose projections are BitLinear
layers: a float weight ternarized by absmean, int8 per-token activations, and an
RMSNorm of its own on the input (`*_proj.norm.weight`). bitnet.cpp's
utils/convert-bitnet-embedding-to-gguf.py writes them as arch `qwen3` / `gemma3` with
`attention.key_length`/`value_length` (head_dim), `pooling_type` (from the
sentence-transformers files), the input norms as `blk.{i}.*_norm_in.weight`, F16
tables and norms, and I2_S (or F16) projections.
"""
from __future__ import annotations

from ..config import ConfigError

#: gguf-py's PoolingType values -> BitNetConfig.pooling (0 NONE: no pooling given)
GGUF_POOLING = {0: None, 1: "mean", 2: "cls", 3: "last"}

#: config.json keys of these families that describe training or the file, not the model
HF_IGNORED = ("max_window_layers", "cache_implementation", "final_logit_softcapping",
              "attn_logit_softcapping", "use_bidirectional_attention", "use_sliding_window",
              "sliding_window_pattern", "_sliding_window_pattern", "rope_parameters",
              "hidden_activation", "layer_types", "sliding_window", "rope_local_base_freq",
              "query_pre_attn_scalar", "rope_scaling", "rope_theta")


def must_be_off(d: dict, source: str, keys: tuple) -> None:
    """A ConfigError for each key whose value would change the network in a way the
    decoder does not compute (logit soft-capping, bidirectional attention)."""
    for k in keys:
        if d.get(k) not in (None, False):
            raise ConfigError(f"{source}: field {k!r} is {d[k]!r}; tercomp's decoder does not "
                              f"compute it", hint="only null / false is supported")


def rope(d: dict, source: str) -> dict:
    """rope_theta / rope_scaling / rope_local_base_freq, from transformers' flat keys or
    from its `rope_parameters` (one dict, or one per layer type)."""
    out = {k: d[k] for k in ("rope_theta", "rope_scaling", "rope_local_base_freq") if k in d}
    rp = d.get("rope_parameters")
    if rp is None:
        return out
    if not isinstance(rp, dict):
        raise ConfigError(f"{source}: field 'rope_parameters' must be an object")
    per_type = {k: v for k, v in rp.items() if k in ("full_attention", "sliding_attention")}
    full, local = (per_type.get("full_attention", {}), per_type.get("sliding_attention")) \
        if per_type else (rp, None)
    for part in (full, local):
        if part is not None and part.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: rope_parameters of type {part.get('rope_type')!r} "
                              f"are not supported (default only)")
    if "rope_theta" in full:
        out["rope_theta"] = full["rope_theta"]
    if local is not None and "rope_theta" in local:
        out["rope_local_base_freq"] = local["rope_theta"]
    return out


def common(d: dict) -> dict:
    """The config.json keys every family spells as BitNetConfig does."""
    return {k: v for k, v in d.items() if k not in HF_IGNORED}


def gguf_pooling(field, arch: str) -> dict:
    """{"pooling": ...} from `{arch}.pooling_type` (absent: nothing)."""
    v = field(f"{arch}.pooling_type", None, kind=int)
    if v is None:
        return {}
    if v not in GGUF_POOLING:
        raise ConfigError(f"key '{arch}.pooling_type': pooling type {v} is not supported "
                          f"(1 mean, 2 cls, 3 last)")
    return {"pooling": GGUF_POOLING[v]}


def unwritable(cfg, act: str, **options) -> str | None:
    """Why a Qwen3 / Gemma3 file could not hold this config (its graph fixes the
    activation `act`, the decoder `options`, unscaled RoPE on rotate-half pairs), or None."""
    fixed = {"hidden_act": act, "sub_norms": False, "rope_style": "neox",
             "rope_scaling": None, "rope_freq_factors": None, **options}
    for k, want in fixed.items():
        if getattr(cfg, k) != want:
            return f"{k} is {getattr(cfg, k)!r}, where the {cfg.family} graph has {want!r}"
    return None


def gguf_keys_out(cfg, arch: str) -> list:
    """The keys bitnet.cpp's embedding converter writes for both families: head_dim as
    key/value length, the pooling type."""
    keys = [("add_uint32", f"{arch}.attention.key_length", cfg.head_dim),
            ("add_uint32", f"{arch}.attention.value_length", cfg.head_dim)]
    if cfg.pooling is not None:
        code = {v: k for k, v in GGUF_POOLING.items()}[cfg.pooling]
        keys.append(("add_uint32", f"{arch}.pooling_type", code))
    return keys


def gguf_causal(field, arch: str) -> None:
    if field(f"{arch}.attention.causal", True) is False:
        raise ConfigError(f"key '{arch}.attention.causal': bidirectional attention is not "
                          f"supported (tercomp's decoder is causal)")
