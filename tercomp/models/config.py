"""BitNetConfig: the hyperparameters of a BitNet b1.58 language model.

Field names are Hugging Face's (`config.json` of a `BitNetForCausalLM`), so a config
reads straight from a checkpoint directory; `rope_style` is tercomp's own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..errors import ConfigError    # models.ConfigError: tc.ConfigError, a model's field

HIDDEN_ACTS = ("silu", "relu2", "gelu_pytorch_tanh")
#: how an embedding model pools its hidden states (sentence-transformers' modes)
POOLINGS = ("last", "mean", "cls")
#: per-layer attention kinds (Hugging Face's `layer_types`)
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_STYLES = ("neox", "interleaved")

# config.json keys that describe the file or the training run, not the model
_METADATA_KEYS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache",
    "attention_bias", "attention_dropout", "quantization_config", "_name_or_path",
    "auto_map", "output_attentions", "output_hidden_states", "return_dict",
    "use_return_dict", "id2label", "label2id", "tokenizer_class",
    "pretraining_tp", "mlp_bias", "torchscript",
}
#: rope_scaling types: Llama 3's frequency-dependent scaling (transformers' "llama3")
ROPE_SCALINGS = ("llama3",)
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings")


@dataclass
class BitNetConfig:
    """Hyperparameters of `BitNetLM` (Hugging Face field names).

    `hidden_act` is "silu" (llama.cpp's `bitnet` default) or "relu2" (squared ReLU, BitNet
    b1.58 2B4T); `rope_style` is "neox" (rotate halves: llama.cpp's `bitnet` and HF's
    rotate_half) or "interleaved" (pairs 2i, 2i+1). Heads share K/V in groups of
    `num_attention_heads // num_key_value_heads` (GQA). `head_dim` defaults to
    hidden_size / num_attention_heads. `sub_norms` (BitNet's RMSNorms before o_proj and
    down_proj) is off for llama-architecture models; `rope_scaling` is None or Llama 3's
    {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}; `rope_freq_factors` (llama.cpp's
    `rope_freqs.weight`, head_dim / 2 divisors of the frequencies) is the same scaling as
    a GGUF stores it. `family` names the file family (models/families).

    Options of the Qwen3 / Gemma3 backbones (BitNet's embedding models):
    `proj_norms`: BitNet's `BitLinear` RMSNorm on the input of every projection (each
    of q/k/v/o/gate/up/down has its own weight). `qk_norm`: an RMSNorm over head_dim on
    every query and key head, before RoPE (Qwen3, Gemma3). `post_norms`: Gemma3's
    RMSNorms on the attention and feed-forward outputs before their residual adds.
    `scale_embeddings`: the token embedding times sqrt(hidden_size) (Gemma).
    `query_pre_attn_scalar`: attention scores scaled by its -1/2 power instead of
    head_dim's (Gemma3). `layer_types` ("full_attention" / "sliding_attention" per
    layer) with `sliding_window` W: a sliding layer's query attends to the W most recent
    positions (itself included); `rope_local_base_freq` is a sliding layer's RoPE base
    (Gemma3), rope_theta the others'. `pooling` ("last", "mean", "cls" or None) is how
    the model file says its embeddings are pooled (tc.compile_embed's default).

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
    head_dim: int | None = None
    sub_norms: bool = True
    rope_scaling: dict | None = None
    rope_freq_factors: tuple | None = None
    family: str = "bitnet"
    proj_norms: bool = False
    qk_norm: bool = False
    post_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    sliding_window: int | None = None
    layer_types: tuple | None = None
    rope_local_base_freq: float | None = None
    pooling: str | None = None

    def __post_init__(self):
        self.validate()

    @property
    def q_dim(self) -> int:
        return self.head_dim * self.num_attention_heads

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
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise ConfigError(f"{source}: field {name!r} must be a positive finite number, "
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
        if self.head_dim is None:
            if self.hidden_size % h:
                raise ConfigError(f"{source}: hidden_size {self.hidden_size} must be a multiple "
                                  f"of num_attention_heads {h} (or give head_dim)")
            self.head_dim = self.hidden_size // h
        if isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) \
                or self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"{source}: field 'head_dim' must be a positive even integer "
                              f"(RoPE rotates pairs), got {self.head_dim!r}")
        if h % kv:
            raise ConfigError(f"{source}: num_attention_heads {h} must be a multiple of "
                              f"num_key_value_heads {kv}")
        if not isinstance(self.sub_norms, bool):
            raise ConfigError(f"{source}: field 'sub_norms' must be true or false, "
                              f"got {self.sub_norms!r}")
        self.rope_scaling = _check_rope_scaling(self.rope_scaling, source)
        self._validate_backbone(source)
        if self.rope_freq_factors is not None:
            f = self.rope_freq_factors
            ok = isinstance(f, (list, tuple)) and len(f) == self.head_dim // 2 and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0
                and x < float("inf") for x in f)
            if not ok:
                raise ConfigError(f"{source}: rope_freq_factors must be {self.head_dim // 2} "
                                  f"positive finite numbers")
            self.rope_freq_factors = tuple(float(x) for x in f)

    def _validate_backbone(self, source):
        """The Qwen3 / Gemma3 options (see the class docstring)."""
        for name in ("proj_norms", "qk_norm", "post_norms", "scale_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{source}: field {name!r} must be true or false, "
                                  f"got {getattr(self, name)!r}")
        for name in ("query_pre_attn_scalar", "rope_local_base_freq"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))
                                  or not 0 < v < float("inf")):
                raise ConfigError(f"{source}: field {name!r} must be a positive finite number "
                                  f"or null, got {v!r}")
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w <= 0):
            raise ConfigError(f"{source}: field 'sliding_window' must be a positive integer "
                              f"or null, got {w!r}")
        lt = self.layer_types
        if lt is not None:
            if not isinstance(lt, (list, tuple)) or len(lt) != self.num_hidden_layers or \
                    any(t not in LAYER_TYPES for t in lt):
                raise ConfigError(f"{source}: field 'layer_types' must list one of "
                                  f"{', '.join(LAYER_TYPES)} for each of the "
                                  f"{self.num_hidden_layers} layers, got {lt!r:.200}")
            self.layer_types = tuple(lt)
            if "sliding_attention" in lt and w is None:
                raise ConfigError(f"{source}: 'layer_types' has sliding_attention layers but "
                                  f"'sliding_window' is not given")
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ConfigError(f"{source}: field 'pooling' is {self.pooling!r}; supported: "
                              f"{', '.join(POOLINGS)} (or null)")

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends through a sliding window."""
        return self.layer_types is not None and self.layer_types[layer] == "sliding_attention"

    @property
    def attention_scale(self) -> float:
        """The factor of the attention scores: query_pre_attn_scalar**-0.5, else
        head_dim**-0.5."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ConfigError(f"{source}: biased projections ('attention_bias'/'mlp_bias') "
                              f"are not supported")
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


def _check_rope_scaling(rs, source):
    """None for plain RoPE, or a checked copy of Llama 3's rope_scaling dict."""
    if rs is None or rs == {}:
        return None
    if not isinstance(rs, dict):
        raise ConfigError(f"{source}: field 'rope_scaling' must be an object, got {rs!r:.80}")
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "default":
        return None
    if kind not in ROPE_SCALINGS:
        raise ConfigError(f"{source}: field 'rope_scaling' has type {kind!r}; supported: "
                          f"{', '.join(ROPE_SCALINGS)} (or none)")
    out = {"rope_type": "llama3"}
    for k in _LLAMA3_KEYS:
        v = rs.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
            raise ConfigError(f"{source}: rope_scaling['{k}'] must be a positive number, "
                              f"got {v!r:.40}")
        out[k] = float(v)
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ConfigError(f"{source}: rope_scaling's high_freq_factor must exceed "
                          f"low_freq_factor")
    return out
