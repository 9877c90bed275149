"""Language models and their file formats.

    from tercomp import models
    lm = models.load("model.gguf")            # or a Hugging Face directory
    logits = tc.compile(lm, tc.spec(("B", 32), "int32"))(ids)
    models.save_gguf(lm, "out.gguf")          # bitnet architecture, TQ2_0

`BitNetConfig` (Hugging Face field names) and `BitNetLM` (an nn.Module) are in
`bitnet.py`/`config.py`; GGUF reading and writing in `gguf_io.py`, Hugging Face
directories in `hf_io.py`, tokenizers in `tokenizer.py`.
"""
from .config import BitNetConfig, ConfigError
from .bitnet import BitNetLM, rope_tables, apply_rope

__all__ = ["BitNetConfig", "BitNetLM", "ConfigError", "rope_tables", "apply_rope"]
