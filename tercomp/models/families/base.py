"""`Family`: what distinguishes one family of ternary decoders from another."""
from __future__ import annotations

from dataclasses import dataclass


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

    def gguf_activation(self, tokenizer_pre, arch=None) -> str:
        """The activation of a GGUF of this family (architecture `arch`) without an
        activation key."""
        fixed = dict(self.gguf_arch_aliases).get(arch)
        return fixed or dict(self.gguf_act_by_tokenizer).get(tokenizer_pre, "silu")

    def reads_gguf_arch(self, arch: str) -> bool:
        """Whether a GGUF of `general.architecture` `arch` is this family."""
        return arch == self.gguf_arch or arch in dict(self.gguf_arch_aliases)
