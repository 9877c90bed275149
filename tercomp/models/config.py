"""BitNetConfig: the hyperparameters of a BitNet b1.58 language model.

Field names are Hugging Face's (`config.json` of a `BitNetForCausalLM`), so a config
reads straight from a checkpoint directory; `rope_style` is tercomp's own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import TercompError

HIDDEN_ACTS = ("silu", "relu2")
ROPE_STYLES = ("neox", "interleaved")

# config.json keys that describe the file or the training run, not the model
_METADATA_KEYS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
    "attention_bias", "attention_dropout", "quantization_config", "_name_or_path",
    "auto_map", "output_attentions", "output_hidden_states", "return_dict",
    "use_return_dict", "id2label", "label2id", "tokenizer_class", "head_dim",
    "rope_scaling", "pretraining_tp", "mlp_bias", "torchscript",
}


class ConfigError(TercompError):
    """A model configuration with a missing, unknown or unsupported field."""


@dataclass
class BitNetConfig:
    """Hyperparameters of `BitNetLM` (Hugging Face field names).

    `hidden_act` is "silu" (llama.cpp's `bitnet` default) or "relu2" (squared ReLU, BitNet
    b1.58 2B4T); `rope_style` is "neox" (rotate halves: llama.cpp's `bitnet` and HF's
    rotate_half) or "interleaved" (pairs 2i, 2i+1). Heads share K/V in groups of
    `num_attention_heads // num_key_value_heads` (GQA).

    >>> cfg = BitNetConfig(vocab_size=300, hidden_size=256, intermediate_size=512,
    ...                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> cfg.head_dim
    64
    """
    vocab_size: int = 32000
    hidden_size: int = 2560
    intermediate_size: int = 6912
    num_hidden_layers: int = 30
    num_attention_heads: int = 20
    num_key_value_heads: int = 5
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    hidden_act: str = "silu"
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2048
    rope_style: str = "neox"

    def __post_init__(self):
        self.validate()

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.num_key_value_heads

    def validate(self, source: str = "BitNetConfig"):
        """Raise ConfigError naming the field when a value is out of range."""
        ints = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "max_position_embeddings")
        for name in ints:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{source}: field {name!r} must be a positive integer, "
                                  f"got {v!r}")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"{source}: field {name!r} must be a positive number, "
                                  f"got {v!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"{source}: field 'hidden_act' is {self.hidden_act!r}; "
                              f"supported: {', '.join(HIDDEN_ACTS)}")
        if self.rope_style not in ROPE_STYLES:
            raise ConfigError(f"{source}: field 'rope_style' is {self.rope_style!r}; "
                              f"supported: {', '.join(ROPE_STYLES)}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"{source}: field 'tie_word_embeddings' must be true or false, "
                              f"got {self.tie_word_embeddings!r}")
        h, kv = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size % h or h % kv:
            raise ConfigError(f"{source}: hidden_size {self.hidden_size} must be a multiple of "
                              f"num_attention_heads {h}, and that of num_key_value_heads {kv}")
        if self.head_dim % 2:
            raise ConfigError(f"{source}: the head dim {self.head_dim} must be even for RoPE")

    @classmethod
    def from_dict(cls, d: dict, source: str = "config") -> "BitNetConfig":
        """Build from a `config.json` dict: metadata keys are ignored, unknown keys and
        values that would change the model unsupported are ConfigErrors naming the field."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {}
        for k, v in d.items():
            if k in fields:
                kw[k] = v
            elif k not in _METADATA_KEYS:
                raise ConfigError(f"{source}: unknown field {k!r}",
                                  hint=f"known fields: {', '.join(sorted(fields))}")
        if d.get("rope_scaling") not in (None, {}):
            raise ConfigError(f"{source}: field 'rope_scaling' = {d['rope_scaling']!r} is not "
                              f"supported (plain RoPE only)")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ConfigError(f"{source}: biased projections ('attention_bias'/'mlp_bias') "
                              f"are not supported")
        hd = d.get("head_dim")
        if hd is not None and "hidden_size" in d and "num_attention_heads" in d \
                and hd * d["num_attention_heads"] != d["hidden_size"]:
            raise ConfigError(f"{source}: field 'head_dim' = {hd!r} contradicts hidden_size / "
                              f"num_attention_heads")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if k not in kw]
        if missing:
            raise ConfigError(f"{source}: missing field(s) {', '.join(map(repr, missing))}")
        kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
        for k in ("rms_norm_eps", "rope_theta"):
            if isinstance(kw.get(k), int) and not isinstance(kw.get(k), bool):
                kw[k] = float(kw[k])
        try:
            cfg = cls.__new__(cls)
            for f in dataclasses.fields(cls):
                setattr(cfg, f.name, kw.get(f.name, f.default))
        except TypeError as e:  # pragma: no cover - defensive
            raise ConfigError(f"{source}: {e}") from None
        cfg.validate(source)
        return cfg

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
