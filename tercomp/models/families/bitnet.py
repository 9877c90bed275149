"""BitNet b1.58 (llama.cpp's `bitnet` architecture, Hugging Face's BitNetForCausalLM,
BitNet b1.58 2B4T): sub-norms, tied or untied output, silu or relu2.

No GGUF converter writes the activation (`bitnet.hidden_activation`): llama.cpp's
convert_hf_to_gguf.py and bitnet.cpp's both leave it out, and llama.cpp's `bitnet` graph
runs silu whatever the file says. The released `bitnet` checkpoints tell themselves
apart by their tokenizer instead: BitNet b1.58 2B4T (relu2) is the one with Llama 3's
BPE vocabulary (`tokenizer.ggml.pre` "llama-bpe", 128256 tokens); 1bitLLM's
bitnet_b1_58 models (silu) carry Llama 2's sentencepiece one. A file that gives
`bitnet.hidden_activation` (tercomp's `save_gguf` always does) is read as it says.

bitnet.cpp (microsoft/BitNet, its llama.cpp fork) names 2B4T's GGUF `bitnet-b1.58`
(utils/convert-hf-to-gguf-bitnet.py, the published ggml-model-i2_s.gguf) or, in its
first 2025 release, `bitnet-25` (utils/convert-ms-to-gguf-bitnet.py). Both are this
decoder with the same tensor names; their graph (`build_bitnet_158`) always computes
relu2, rotates q/k as NeoX does (neither converter permutes the rows), and reads an
optional untied `output.weight` and `rope_freqs.weight`."""
from .base import Family

FAMILY = Family(name="bitnet", gguf_arch="bitnet", hf_architectures=("BitNetForCausalLM",),
                hf_model_types=("bitnet",), sub_norms=True, gguf_rope_style="neox",
                gguf_scale="tensor", gguf_act_by_tokenizer=(("llama-bpe", "relu2"),),
                gguf_arch_aliases=(("bitnet-b1.58", "relu2"), ("bitnet-25", "relu2")))
