"""Language-model families as data: one module per family, each a `Family` that maps a
file's keys and tensor names onto the one decoder (models/bitnet.py's `BitNetLM`, with
the options of its `BitNetConfig`).

    family        Hugging Face                                  GGUF general.architecture
    bitnet        BitNetForCausalLM (model_type "bitnet")       "bitnet"; bitnet.cpp's
                                                                "bitnet-b1.58", "bitnet-25"
    llama_bitnet  LlamaForCausalLM whose quantization_config    "llama" (TQ2_0 / TQ1_0
                  has quant_method "bitnet" (Falcon3-1.58bit,   projections, f16 output)
                  Llama3-8B-1.58)

Adding a family is one module here defining FAMILY, a line in FAMILIES, and a test.
"""
from __future__ import annotations

from .base import Family
from . import bitnet, llama_bitnet

FAMILIES = (bitnet.FAMILY, llama_bitnet.FAMILY)


def by_gguf_arch(arch: str):
    """The family of a GGUF `general.architecture`, or None."""
    return next((f for f in FAMILIES if f.reads_gguf_arch(arch)), None)


def by_name(name: str):
    """The family called `name` (a config's `family`), or None."""
    return next((f for f in FAMILIES if f.name == name), None)


def by_hf_config(d: dict):
    """The family of a config.json dict, by `architectures` and `model_type` (either may
    be missing; when both are there they must agree), or None."""
    archs, mt = d.get("architectures"), d.get("model_type")
    found = None
    if archs is not None:
        if not (isinstance(archs, list) and len(archs) == 1 and isinstance(archs[0], str)):
            return None
        found = next((f for f in FAMILIES if archs[0] in f.hf_architectures), None)
        if found is None:
            return None
    if mt is not None:
        by_type = next((f for f in FAMILIES if mt in f.hf_model_types), None)
        if found is not None and by_type is not found:
            return None
        found = by_type
    return found if (archs is not None or mt is not None) else FAMILIES[0]


__all__ = ["Family", "FAMILIES", "by_gguf_arch", "by_hf_config", "by_name"]
