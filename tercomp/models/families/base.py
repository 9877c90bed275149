"""`Family`: what distinguishes one family of ternary decoders from another."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Family:
    """One LM family: how its files name it and which decoder options it takes.

    `sub_norms`: BitNet's extra RMSNorms before o_proj and down_proj (`attn_sub_norm`,
    `ffn_sub_norm`). `gguf_rope_style`: the RoPE pairs on the q/k rows as the GGUF stores
    them (llama.cpp's converter permutes a `llama` model's q/k rows so that its
    interleaved RoPE equals Hugging Face's rotate-half; `bitnet` keeps HF's order).
    `hf_needs_bitnet_quant`: the architecture is also a float model's (Llama), so only a
    checkpoint whose `quantization_config.quant_method` is "bitnet" is this family.

    `gguf_scale`: where a GGUF of the family keeps a projection's weight scale: "tensor"
    (an f32 `*.scale` beside TQ2_0 blocks of scale 1, which llama.cpp's `bitnet` graph
    multiplies in) or "block" (the TQ2_0 block scale itself: llama.cpp's `llama` graph
    reads no `*.scale`). `gguf_act_by_tokenizer`: the FFN activation of a GGUF that does
    not say (`{arch}.hidden_activation` absent), as (`tokenizer.ggml.pre`, activation)
    pairs; any other file is "silu". `gguf_arch_aliases`: other `general.architecture`
    strings read as this family, as (arch, activation) pairs: the activation their
    llama.cpp graph computes whatever the file's keys say (bitnet.cpp's `bitnet-b1.58`
    and `bitnet-25` run relu2)."""
    name: str
    gguf_arch: str
    hf_architectures: tuple
    hf_model_types: tuple
    sub_norms: bool
    gguf_rope_style: str
    hf_needs_bitnet_quant: bool = False
    gguf_scale: str = "tensor"
    gguf_act_by_tokenizer: tuple = ()
    gguf_arch_aliases: tuple = ()
    # -- the options of the embedding models' backbones (Qwen3, Gemma3) ----------------
    #: BitNetConfig fields every model of the family has: (("qk_norm", True), ...)
    options: tuple = ()
    #: config.json dict -> BitNetConfig fields (None: the dict's own keys, as BitNet's)
    hf_config: Callable | None = None
    #: layer norms as config.json's checkpoints name them: (HF name, module path) pairs
    #: (default: input_layernorm and post_attention_layernorm, Llama's)
    hf_layer_norms: tuple = ()
    #: added to every norm weight of a Hugging Face file but the BitLinear input norms
    #: (Gemma's RMSNorm multiplies by 1 + w; llama.cpp's files store 1 + w, as tercomp does)
    hf_norm_offset: float = 0.0
    #: the activation of a GGUF without `{arch}.hidden_activation` and tokenizer rule
    gguf_default_act: str = "silu"
    #: GGUF keys -> BitNetConfig fields beyond the common ones: f(field_reader, arch) -> dict
    gguf_config: Callable | None = None
    #: the config must say it is ternary (quantization_config "bitnet") or the checkpoint
    #: carry BitLinear's per-projection norms: the architecture is a float model's too
    hf_needs_ternary_marker: bool = False
    # -- writing (save_gguf / save_hf) the families whose converters write more keys ----
    #: f(config, fmt) -> the reason the family's graph in a `fmt` ("gguf": llama.cpp's,
    #: "hf": transformers') would compute another network than this config's, or None
    #: (save_gguf / save_hf refuse with it)
    unwritable: Callable | None = None
    #: f(config, arch) -> [(gguf-py writer method, key, value)]: the family's own GGUF keys
    gguf_keys_out: Callable | None = None
    #: f(config) -> config.json keys beyond the common ones (hf_config's inverse)
    hf_config_out: Callable | None = None

    def gguf_activation(self, tokenizer_pre, arch=None) -> str:
        """The activation of a GGUF of this family (architecture `arch`) without an
        activation key."""
        fixed = dict(self.gguf_arch_aliases).get(arch)
        return fixed or dict(self.gguf_act_by_tokenizer).get(tokenizer_pre, self.gguf_default_act)

    def reads_gguf_arch(self, arch: str) -> bool:
        """Whether a GGUF of `general.architecture` `arch` is this family."""
        return arch == self.gguf_arch or arch in dict(self.gguf_arch_aliases)
