"""Llama-architecture 1.58-bit models (Falcon3-1B/3B/7B/10B-Instruct-1.58bit,
Llama3-8B-1.58-100B-tokens): a Llama decoder whose projections are BitLinear layers
(transformers' bitnet integration: packed uint8 weights and a `weight_scale`, per-token
int8 activations), no sub-norms, an untied output layer, Llama 3 RoPE scaling. As GGUF:
llama.cpp's `llama` architecture with TQ2_0 / TQ1_0 projections whose block scale is the
weight scale, q/k rows permuted for interleaved RoPE, and an f16 `output.weight`."""
from .base import Family

FAMILY = Family(name="llama_bitnet", gguf_arch="llama", hf_architectures=("LlamaForCausalLM",),
                hf_model_types=("llama",), sub_norms=False, gguf_rope_style="interleaved",
                hf_needs_bitnet_quant=True, gguf_scale="block")
