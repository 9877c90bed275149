"""BitNet b1.58 (llama.cpp's `bitnet` architecture, Hugging Face's BitNetForCausalLM,
BitNet b1.58 2B4T): sub-norms, tied or untied output, silu or relu2."""
from .base import Family

FAMILY = Family(name="bitnet", gguf_arch="bitnet", hf_architectures=("BitNetForCausalLM",),
                hf_model_types=("bitnet",), sub_norms=True, gguf_rope_style="neox")
