"""BitNetLM: the one ternary decoder every family loads into (models/families): BitNet
b1.58 as llama.cpp's `bitnet` architecture computes it, and, with the config's options
(`sub_norms` off, `head_dim`, `rope_scaling`, an untied head), llama-architecture
1.58-bit models.

Per layer (every projection an `nn.BitLinear`: ternary weights, int8 per-token
activations)::

    h = x + o_proj(attn_sub_norm(attention(rope(q_proj(n)), rope(k_proj(n)), v_proj(n))))
            with n = input_layernorm(x)
    y = h + down_proj(ffn_sub_norm(act(gate_proj(m)) * up_proj(m)))
            with m = post_attention_layernorm(h),  act = silu | relu2 (relu(.)**2)

then the final `norm` and the output layer: the token embedding itself (tied, as
llama.cpp's `bitnet` graph always does) or a separate float `lm_head` (`nn.Linear`).
Attention is causal, scaled by 1/sqrt(head_dim), with grouped K/V heads: query head h
reads K/V head h // (num_attention_heads // num_key_value_heads).

The Qwen3 / Gemma3 backbones of BitNet's embedding models are the same layer with
options (BitNetConfig): an RMSNorm on each projection's input (`proj_norms`: BitNet's
BitLinear, `attn.q_norm_in` .. `mlp.down_norm_in`), per-head q/k RMSNorms before RoPE
(`qk_norm`: `attn.q_norm`, `attn.k_norm`), norms of the attention and feed-forward
outputs (`post_norms`: `attn_post_norm`, `ffn_post_norm`), GELU (tanh), the embedding
times sqrt(hidden), scores scaled by query_pre_attn_scalar**-0.5, and sliding-window
layers with their own RoPE base. Gemma's (1 + w) norm weights are stored as 1 + w
(families/gemma3.py), as llama.cpp's files keep them.

Module tree (stable names; parameters are named after it)::

    lm.embed_tokens            nn.Embedding [vocab, hidden]
    lm.layers[i].input_layernorm, .post_attention_layernorm     nn.RMSNorm
    lm.layers[i].attn          .q_proj .k_proj .v_proj .o_proj (BitLinear), .attn_sub_norm
    lm.layers[i].mlp (= .ffn)  .gate_proj .up_proj .down_proj (BitLinear), .ffn_sub_norm
                               (the sub-norms are None without config.sub_norms)
    lm.norm                    nn.RMSNorm
    lm.lm_head                 nn.Linear [vocab, hidden], or None when tied
"""
from __future__ import annotations

import copy

import numpy as np

from .. import nn
from ..errors import TraceError, ConfigError, UnsupportedError
from ..tracing import api as _t
from ..tracing.tracer import apply
from .config import BitNetConfig


def rope_tables(config: BitNetConfig, positions, local: bool = False
                ) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of the rotation angles pos * inv_freq[i], i < head_dim/2, as float32
    arrays of shape [len(positions), head_dim // 2] (computed in float64); inv_freq is
    theta**(-2i/head_dim), scaled as config.rope_scaling (Llama 3) or divided by
    config.rope_freq_factors (llama.cpp's form of the same) say. `local`: the tables of
    a sliding-window layer (theta = config.rope_local_base_freq, unscaled: Gemma3)."""
    pos = np.asarray(positions, dtype=np.float64).reshape(-1, 1)
    inv_freq = rope_frequencies(config, local)
    ang = pos * inv_freq[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope_frequencies(config: BitNetConfig, local: bool = False) -> np.ndarray:
    """The head_dim/2 rotation frequencies (float64), as transformers computes them."""
    d = config.head_dim
    if local and config.rope_local_base_freq is not None:
        return float(config.rope_local_base_freq) ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    inv = float(config.rope_theta) ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    rs = config.rope_scaling
    if rs is not None:          # Llama 3: low frequencies slowed by `factor`, a smooth band
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        inv = np.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    if config.rope_freq_factors is not None:
        inv = inv / np.asarray(config.rope_freq_factors, np.float64)
    return inv


def apply_rope(x, cos, sin, style: str):
    """Rotate x [B, T, heads, D] by the tables cos/sin [T, D/2] ("neox": the pairs are
    (i, i + D/2); "interleaved": (2i, 2i + 1)): the `tern.rope` op."""
    return apply("rope", x, cos, sin, style=style)


#: the BitLinear projections of a block, by block attribute
PROJECTION_NAMES = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
                    "mlp": ("gate_proj", "up_proj", "down_proj")}


def _placeholder(in_features: int, out_features: int) -> nn.BitLinear:
    """An all-zero stored layer (2 bits per weight) for loaders that fill in every weight:
    a random float init would cost 4 bytes per weight only to be thrown away."""
    return nn.StoredBitLinear.zeros(in_features, out_features)


class Attention(nn.Module):
    def __init__(self, config: BitNetConfig, linear=nn.BitLinear):
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = (c.num_attention_heads,
                                                            c.num_key_value_heads, c.head_dim)
        self.rope_style = c.rope_style
        self.scale = c.attention_scale
        self.window = None      # set by DecoderLayer for a sliding-window layer
        self.q_proj = linear(c.hidden_size, c.q_dim)
        self.k_proj = linear(c.hidden_size, c.kv_dim)
        self.v_proj = linear(c.hidden_size, c.kv_dim)
        self.attn_sub_norm = nn.RMSNorm(c.q_dim, eps=c.rms_norm_eps) if c.sub_norms else None
        self.o_proj = linear(c.q_dim, c.hidden_size)
        norm = lambda n, on: nn.RMSNorm(n, eps=c.rms_norm_eps) if on else None  # noqa: E731
        self.q_norm, self.k_norm = norm(c.head_dim, c.qk_norm), norm(c.head_dim, c.qk_norm)
        # BitNet's BitLinear: an RMSNorm of each projection's own on its input
        self.q_norm_in, self.k_norm_in, self.v_norm_in = (norm(c.hidden_size, c.proj_norms)
                                                          for _ in range(3))
        self.o_norm_in = norm(c.q_dim, c.proj_norms)

    def forward(self, x, cos, sin, cache=None):
        """x [B, T, hidden] (normed), cos/sin [T, head_dim/2] -> [B, T, hidden]. With a
        layer `cache` (models/kv_cache.py), k and v go into it and q attends to every
        row it holds; without one, to this call's rows, causally."""
        b, t = x.shape[0], x.shape[1]
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        g = h // kv
        q = _norm(self.q_norm, _norm(self.q_norm_in, x, self.q_proj).reshape(b, t, h, d))
        k = _norm(self.k_norm, _norm(self.k_norm_in, x, self.k_proj).reshape(b, t, kv, d))
        q = apply_rope(q, cos, sin, self.rope_style)
        k = apply_rope(k, cos, sin, self.rope_style)
        v = _norm(self.v_norm_in, x, self.v_proj).reshape(b, t, kv, d)
        if cache is not None:
            out = cache.attend(q, k, v, scale=self.scale, window=self.window).reshape(b, t, h * d)
            return self._out(out)
        # GQA without copies: the g query heads of a K/V head are stacked along the rows
        q = q.reshape(-1, t, kv, g, d).transpose((0, 2, 3, 1, 4)).reshape(-1, kv, g * t, d)
        k = k.transpose((0, 2, 3, 1))                                     # [B, KV, D, T]
        v = v.transpose((0, 2, 1, 3))                                     # [B, KV, T, D]
        scores = (q @ k) * np.float32(self.scale)                         # [B, KV, g*T, T]
        causal = np.tril(np.ones((t, t), dtype=bool))
        if self.window is not None:     # query i sees keys i - window + 1 .. i
            causal &= ~np.tril(np.ones((t, t), dtype=bool), -self.window)
        causal = np.tile(causal, (g, 1))
        scores = _t.where(causal, scores, np.float32(-1e30))
        out = _t.softmax(scores, axis=-1) @ v                             # [B, KV, g*T, D]
        out = out.reshape(-1, kv, g, t, d).transpose((0, 3, 1, 2, 4)).reshape(-1, t, h * d)
        return self._out(out)

    def _out(self, out):
        out = out if self.attn_sub_norm is None else self.attn_sub_norm(out)
        return _norm(self.o_norm_in, out, self.o_proj)


def _norm(norm, x, proj=None):
    """`norm(x)` (x itself where the model has no such norm), then `proj` if given."""
    x = x if norm is None else norm(x)
    return x if proj is None else proj(x)


class FeedForward(nn.Module):
    def __init__(self, config: BitNetConfig, linear=nn.BitLinear):
        c = config
        self.hidden_act = c.hidden_act
        self.gate_proj = linear(c.hidden_size, c.intermediate_size)
        self.up_proj = linear(c.hidden_size, c.intermediate_size)
        self.ffn_sub_norm = nn.RMSNorm(c.intermediate_size, eps=c.rms_norm_eps) \
            if c.sub_norms else None
        self.down_proj = linear(c.intermediate_size, c.hidden_size)
        norm = (lambda n: nn.RMSNorm(n, eps=c.rms_norm_eps)) if c.proj_norms else (lambda n: None)
        self.gate_norm_in, self.up_norm_in = norm(c.hidden_size), norm(c.hidden_size)
        self.down_norm_in = norm(c.intermediate_size)

    def activation(self, gate):
        """The gate's activation: silu, relu2 (relu(gate)**2) or gelu_pytorch_tanh (GELU's
        tanh approximation, as Gemma uses)."""
        if self.hidden_act == "silu":
            return _t.silu(gate)
        if self.hidden_act == "gelu_pytorch_tanh":
            return _t.gelu(gate)
        gate = _t.relu(gate)
        return gate * gate

    def forward(self, x):
        y = self.activation(_norm(self.gate_norm_in, x, self.gate_proj)) \
            * _norm(self.up_norm_in, x, self.up_proj)
        y = y if self.ffn_sub_norm is None else self.ffn_sub_norm(y)
        return _norm(self.down_norm_in, y, self.down_proj)


class DecoderLayer(nn.Module):
    """`input_layernorm` before attention, `post_attention_layernorm` before the
    feed-forward block (Llama's names), and with config.post_norms Gemma3's norms of the
    two blocks' outputs, `attn_post_norm` and `ffn_post_norm` (Hugging Face's Gemma3
    `post_attention_layernorm` and `post_feedforward_layernorm`; its
    `pre_feedforward_layernorm` is `post_attention_layernorm` here)."""

    def __init__(self, config: BitNetConfig, linear=nn.BitLinear, sliding: bool = False):
        eps = config.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=eps)
        self.attn = Attention(config, linear)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=eps)
        self.mlp = FeedForward(config, linear)
        post = config.post_norms
        self.attn_post_norm = nn.RMSNorm(config.hidden_size, eps=eps) if post else None
        self.ffn_post_norm = nn.RMSNorm(config.hidden_size, eps=eps) if post else None
        self.sliding = sliding
        if sliding:
            self.attn.window = config.sliding_window

    @property
    def ffn(self) -> FeedForward:
        """The feed-forward block (llama.cpp's name for `mlp`)."""
        return self.mlp

    def forward(self, x, cos, sin, cache=None):
        h = x + _norm(self.attn_post_norm, self.attn(self.input_layernorm(x), cos, sin, cache))
        return h + _norm(self.ffn_post_norm, self.mlp(self.post_attention_layernorm(h)))


class BitNetLM(nn.Module):
    """A BitNet b1.58 causal language model; see the module docstring for the graph.

    `forward(ids)` maps int32 token ids [B, T] to float32 logits [B, T, vocab_size]
    (T static when traced; B may be symbolic). `tokenizer` is a `tokenizers.Tokenizer`
    (or None) set by `models.load`; `gguf_vocab` keeps a GGUF file's vocabulary keys so
    `save_gguf` writes them back.

    >>> from tercomp import models
    >>> cfg = models.BitNetConfig(vocab_size=300, hidden_size=256, intermediate_size=512,
    ...                           num_hidden_layers=2, num_attention_heads=4,
    ...                           num_key_value_heads=2)
    >>> lm = models.BitNetLM(cfg)
    >>> exe = tc.compile(lm, tc.spec(("B", 16), "int32"))
    >>> exe(np.zeros((1, 16), np.int32)).shape
    (1, 16, 300)
    """

    def __init__(self, config: BitNetConfig, init: bool = True):
        """`init=False` leaves the weights unset (zero ternary projections, zero embedding,
        no random numbers drawn): for loaders, which assign every weight afterwards."""
        if not isinstance(config, BitNetConfig):
            raise ConfigError(f"BitNetLM expects a models.BitNetConfig, got "
                              f"{type(config).__name__}")
        config.validate()
        self.config = config
        c = config
        if init:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
            # std 1/sqrt(hidden): tied logits (unit-RMS hidden states . embedding) start O(1)
            self.embed_tokens.weight *= np.float32(1.0 / np.sqrt(c.hidden_size))
        else:
            self.embed_tokens = nn.Embedding.__new__(nn.Embedding)
            self.embed_tokens.weight = np.zeros((c.vocab_size, c.hidden_size), np.float32)
        linear = nn.BitLinear if init else _placeholder
        self.layers = [DecoderLayer(c, linear, c.is_sliding(i)) for i in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.lm_head = None
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear.__new__(nn.Linear) if not init else \
                nn.Linear(c.hidden_size, c.vocab_size, bias=False)
            if not init:
                self.lm_head.in_features, self.lm_head.out_features = c.hidden_size, c.vocab_size
                self.lm_head.weight = np.zeros((c.vocab_size, c.hidden_size), np.float32)
                self.lm_head.bias = None
        self.tokenizer = None
        self.gguf_vocab = None     # the tokenizer.ggml.* keys of a loaded GGUF, for save_gguf

    def rope_tables(self, positions):
        """(cos, sin) float32 [len(positions), head_dim/2] for these absolute positions."""
        return rope_tables(self.config, positions)

    def hidden_states(self, ids, cache=None):
        """The final-normed hidden states [B, T, hidden] (before the output layer). With
        a `cache` (models/kv_cache.py: ids [1, T], T may be symbolic) the tokens sit at
        the cache's positions and attend to everything it holds."""
        shape = tuple(getattr(ids, "shape", np.shape(ids)))
        if len(shape) != 2:
            raise TraceError(f"BitNetLM expects token ids of shape [B, T], got {shape}")
        t = shape[1]
        c = self.config
        if cache is not None:
            pos = cache.positions(ids)
            tables = [tuple(_t.take(tab, pos, axis=0)
                            for tab in rope_tables(c, np.arange(cache.max_seq), local))
                      for local in (False, True)]
        elif not isinstance(t, (int, np.integer)):
            raise TraceError(f"BitNetLM.forward needs a static sequence length, got {t!r}",
                             hint="trace with tc.spec((\"B\", T), \"int32\") and a fixed T, "
                                  "or use tc.compile_lm for generation")
        elif t > self.config.max_position_embeddings:
            raise TraceError(f"sequence length {t} exceeds max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        else:
            tables = [rope_tables(c, np.arange(t), local) for local in (False, True)]
        x = self.embed_tokens(ids)
        if c.scale_embeddings:      # Gemma: the embedding times sqrt(hidden)
            x = x * np.float32(np.sqrt(c.hidden_size))
        for i, layer in enumerate(self.layers):
            cos, sin = tables[int(layer.sliding and c.rope_local_base_freq is not None)]
            x = layer(x, cos, sin, None if cache is None else cache.layer(i))
        return self.norm(x)

    def logits(self, h):
        """The output layer on hidden states [..., hidden] -> [..., vocab]."""
        if self.lm_head is not None:
            return self.lm_head(h)
        if isinstance(self.embed_tokens, nn.StoredEmbedding):   # its table, widened in registers
            return nn.StoredLinear(self.embed_tokens.table)(h)
        return _t.matmul(h, self.embed_tokens.weight, transpose_b=True)

    def with_stored_output(self, dtype: str, table=None) -> "BitNetLM":
        """A shallow copy whose output layer reads one table stored as `dtype`
        ("float16", or "int8" with a scale per row: nn.StoredTable; `table`: that table,
        made already), and whose token embedding reads the same table when tied to it,
        else its own float16 table where float16 holds it exactly (a stored one as it
        is); "float32" gives self, or a copy whose stored f16 tables are widened to
        float32 layers. A stored table of `dtype` is read as it is, not copied; the
        layers are shared, not copied."""
        stored = (nn.StoredEmbedding, nn.StoredLinear)
        if dtype == "float32":      # the model's own arrays: a stored f16 table widened
            if not isinstance(self.embed_tokens, stored) and not isinstance(self.lm_head, stored):
                return self
            view = copy.copy(self)
            for name in ("embed_tokens", "lm_head"):
                if isinstance(getattr(self, name), stored):
                    setattr(view, name, getattr(self, name).trainable())
            return view
        view = copy.copy(self)
        head = self.lm_head if self.lm_head is not None else self.embed_tokens
        if table is None and isinstance(head, stored) and head.table.dtype == dtype:
            table = head.table      # the loaded table itself (a GGUF's f16 bytes)
        table = table if table is not None else nn.StoredTable.from_weight(head.weight, dtype)
        view.lm_head = nn.StoredLinear(table)
        if self.lm_head is None:
            view.embed_tokens = nn.StoredEmbedding(table)
        elif isinstance(self.embed_tokens, nn.StoredEmbedding):
            pass        # an untied embedding stored already (a GGUF's f16 table): as it is
        else:       # an untied embedding: f16 where that is exact (a GGUF's f16 table)
            emb = nn.StoredTable.from_weight(self.embed_tokens.weight, "float16")
            w = self.embed_tokens.weight
            if all(np.array_equal(emb.values[i:i + 4096], w[i:i + 4096])   # bounded temps
                   for i in range(0, len(w), 4096)):
                view.embed_tokens = nn.StoredEmbedding(emb)
        return view

    def projections(self):
        """(name, block, attribute) of every BitLinear projection, in layer order:
        ("layers.0.attn.q_proj", layers[0].attn, "q_proj"), ..."""
        for i, layer in enumerate(self.layers):
            for block in ("attn", "mlp"):
                owner = getattr(layer, block)
                for attr in PROJECTION_NAMES[block]:
                    yield f"layers.{i}.{block}.{attr}", owner, attr

    def make_trainable(self, freeze=None) -> "BitNetLM":
        """Make the model trainable in place (what `models.load(path, trainable=True)`
        does) and return it: every stored ternary projection becomes an ordinary
        BitLinear whose float latent weights quantize back to exactly its codes and scale
        (`nn.StoredBitLinear.trainable`), so the first forward computes what the stored
        model computes, and training moves the latents through the straight-through
        estimators. Embedding, norms and an untied output layer become (or stay) float32
        parameters (a GGUF's f16 tables, kept as stored layers by the loader, widened).

        `freeze` keeps parameters fixed, as `requires_grad = False` does in PyTorch: a
        glob pattern or a list of them over the parameter names (`embed_tokens`,
        `layers.0`, `*.attn.*`, `*norm*`; a pattern matches a name or any dotted prefix
        of it), or a predicate `name -> bool` (see `nn.Module.freeze`). A frozen
        projection stays stored (2-bit codes and scale, bit-identical); a frozen float
        array stays as it is, read as a constant.

        >>> lm = models.load("model.gguf").make_trainable(freeze=["embed_tokens", "layers.0"])
        >>> "embed_tokens.weight" in lm.parameters()
        False
        """
        for name in ("embed_tokens", "lm_head"):    # a GGUF's f16 tables: float32 parameters
            layer = getattr(self, name)
            if isinstance(layer, (nn.StoredEmbedding, nn.StoredLinear)):
                setattr(self, name, layer.trainable())
        stored = {}
        for name, owner, attr in self.projections():
            layer = getattr(owner, attr)
            if isinstance(layer, nn.StoredBitLinear):
                stored[name] = layer
                setattr(owner, attr, layer.trainable())
        if freeze is not None:
            frozen = set(self.freeze(freeze))
            for name, owner, attr in self.projections():
                if name in stored and f"{name}.weight" in frozen:
                    setattr(owner, attr, stored[name])  # the 2-bit form, as it was loaded
        return self

    def forward(self, ids, cache=None):
        """Logits [B, T, vocab] of token ids [B, T]; `cache` as in hidden_states."""
        return self.logits(self.hidden_states(ids, cache))
