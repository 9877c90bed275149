"""Qwen3 with BitNet's BitLinear projections (bitnet-embedding-0.6b: hidden 1024, 28
layers, 16 query / 8 K/V heads of head_dim 128, SiLU, vocabulary 151,936, tied).

As published by transformers (modeling_qwen3.py): a Llama layer whose query and key
heads each pass an RMSNorm over head_dim before RoPE (`self_attn.q_norm`/`k_norm`),
rotate-half RoPE with base rope_theta, attention scaled by head_dim**-0.5. BitNet's
checkpoints add an RMSNorm on each projection's input (`*_proj.norm.weight`). The
GGUF (bitnet.cpp's convert-bitnet-embedding-to-gguf.py) is llama.cpp's `qwen3`
architecture: NeoX RoPE on rows in Hugging Face's order, `attn_q_norm`/`attn_k_norm`,
`*_norm_in`, no `output.weight` (tied)."""
from ..config import ConfigError
from .base import Family
from . import backbone


def _hf_config(d: dict, source: str) -> dict:
    backbone.must_be_off(d, source, ("use_sliding_window",))
    lt = d.get("layer_types")
    if lt is not None and any(t != "full_attention" for t in lt):
        raise ConfigError(f"{source}: field 'layer_types' has sliding layers, which "
                          f"use_sliding_window false contradicts")
    return {**backbone.common(d), **backbone.rope(d, source)}


def _unwritable(cfg, fmt: str) -> str | None:
    if cfg.layer_types is not None and "sliding_attention" in cfg.layer_types:
        return "it has sliding-window layers"
    if cfg.query_pre_attn_scalar is not None:
        return "its attention scale is not head_dim**-0.5"
    return backbone.unwritable(cfg, "silu", qk_norm=True, post_norms=False,
                               scale_embeddings=False)


def _hf_config_out(cfg) -> dict:
    return {"use_sliding_window": False, "sliding_window": None,
            "layer_types": ["full_attention"] * cfg.num_hidden_layers}


def _gguf_config(field, arch: str) -> dict:
    backbone.gguf_causal(field, arch)
    return backbone.gguf_pooling(field, arch)


FAMILY = Family(name="qwen3", gguf_arch="qwen3", hf_architectures=("Qwen3ForCausalLM",
                "Qwen3Model"), hf_model_types=("qwen3",), sub_norms=False,
                gguf_rope_style="neox", options=(("qk_norm", True),), hf_config=_hf_config,
                gguf_config=_gguf_config, hf_needs_ternary_marker=True,
                unwritable=_unwritable, gguf_keys_out=backbone.gguf_keys_out,
                hf_config_out=_hf_config_out)
