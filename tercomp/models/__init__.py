"""Language models and their file formats.

    from tercomp import models
    lm = models.load("model.gguf")            # or a Hugging Face directory
    logits = tc.compile(lm, tc.spec(("B", 32), "int32"))(ids)
    models.save_gguf(lm, "out.gguf")          # bitnet architecture, TQ2_0
    models.save_hf(lm, "out_dir")             # config.json + model.safetensors
    lm = models.load("model.gguf", trainable=True)   # float latents: fine-tune it

`BitNetConfig` (Hugging Face field names) and `BitNetLM` (an nn.Module, the one
decoder) are in `bitnet.py`/`config.py`; the families it loads (BitNet, llama-architecture
1.58-bit models, the Qwen3 / Gemma3 backbones of BitNet's embedding models) in
`families/`; its KV-cache protocol in `kv_cache.py`; GGUF reading in `gguf_io.py` and writing in `gguf_write.py`, Hugging Face
directories (`load_hf`, `save_hf`) in `hf_io.py`, tokenizers in `tokenizer.py`.
"""
import os as _os

from ..errors import ModelFileError
from ..runtime.files import check_regular
from .config import BitNetConfig, ConfigError
from .bitnet import BitNetLM, rope_tables, apply_rope
from .gguf_io import GGUFError, load_gguf
from .gguf_write import save_gguf
from .hf_io import CheckpointError, load_hf, save_hf


def load(path, trainable: bool = False, freeze=None) -> BitNetLM:
    """A BitNetLM from a `.gguf` file or a Hugging Face directory (config.json +
    *.safetensors), chosen by what `path` is; `lm.tokenizer` is set when the checkpoint
    has one (else None: token ids always work).

    The ternary projections load frozen (2-bit codes and their scale). With
    `trainable=True` they hold float latent weights instead, chosen so that the first
    forward computes exactly what the stored model computes, and train through the
    straight-through estimators (embedding and norms are parameters either way);
    `freeze=` keeps parameters fixed: name patterns (`["embed_tokens", "layers.0",
    "*norm*"]`) or a predicate `name -> bool`, as `BitNetLM.make_trainable` describes.

    >>> lm = models.load("bitnet.gguf")
    >>> exe = tc.compile(lm, tc.spec(("B", 64), "int32"))
    >>> lm = models.load("bitnet.gguf", trainable=True, freeze="embed_tokens")
    >>> step = tc.compile_train_step(loss_fn, lm, tc.optim.AdamW(1e-4), x, y)
    """
    lm = _load(path)
    if trainable:
        return lm.make_trainable(freeze)
    if freeze is not None:
        lm.freeze(freeze)
    return lm


def _load(path) -> BitNetLM:
    if not isinstance(path, (str, _os.PathLike)) or isinstance(_os.fspath(path), bytes):
        raise ConfigError(f"models.load expects a path (str or os.PathLike) of a .gguf file "
                          f"or a Hugging Face directory, got {type(path).__name__} {path!r:.80}",
                          hint="e.g. models.load('model.gguf'); decode a bytes path with "
                               "os.fsdecode")
    path = _os.fspath(path)
    if _os.path.isdir(path):
        if not _os.path.isfile(_os.path.join(path, "config.json")):
            raise CheckpointError(f"{path}: a directory without config.json is not a "
                                  f"Hugging Face checkpoint")
        return load_hf(path)
    if not _os.path.lexists(path):
        raise ModelFileError(f"{path}: no such file or directory")
    check_regular(path, "model", GGUFError)     # a FIFO, a device, a link to /dev/zero
    with open(path, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}) and not a directory",
                        hint="models.load reads .gguf files and Hugging Face directories")
    return load_gguf(path)


__all__ = ["BitNetConfig", "BitNetLM", "ConfigError", "GGUFError", "CheckpointError", "load",
           "load_gguf", "load_hf", "save_gguf", "save_hf", "rope_tables", "apply_rope"]
