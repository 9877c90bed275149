"""Test helpers for the Qwen3 / Gemma3 backbones of BitNet's embedding models: a
float64 NumPy reference written from the published architectures (transformers'
modeling_qwen3.py and modeling_gemma3.py, BitNet's BitLinear with its input RMSNorm),
and fixture files in the published layouts: a Hugging Face directory (config.json as
transformers writes a `qwen3` / `gemma3_text` config, safetensors with float
projections and `*_proj.norm.weight`, the sentence-transformers pooling files) and a
GGUF as bitnet.cpp's utils/convert-bitnet-embedding-to-gguf.py writes it (arch
`qwen3` / `gemma3`, key_length / value_length, pooling_type, F16 tables and norms,
Gemma's norms stored as 1 + w except the `*_norm_in` ones). The GGUF projections are
I2_S as the converter packs them (`i2s_projection`), or TQ2_0 (block scale 1) with an
f32 `.scale` (the absmean: `tq2_projection`).
"""
import json
import os

import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT

import bitnet_ref as R

PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
        "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
GGUF_PROJ = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}

# scaled-down shapes of bitnet-embedding-0.6b (Qwen3) and -270m (Gemma3): head_dim
# independent of hidden / heads, GQA, sliding and full layers
SHAPES = {
    "qwen3": dict(family="qwen3", vocab=300, hidden=256, ff=512, layers=2, heads=4, kv_heads=2,
                  head_dim=128, eps=1e-6, theta=1_000_000.0),
    "gemma3": dict(family="gemma3", vocab=300, hidden=256, ff=512, layers=2, heads=2,
                   kv_heads=1, head_dim=256, eps=1e-6, theta=1_000_000.0, local_theta=10_000.0,
                   query_pre_attn_scalar=64, window=4,
                   layer_types=["sliding_attention", "full_attention"]),
}


def weights(cfg, seed=0):
    """HF-named float weights, f16-exact (so a GGUF's F16 tensors hold them exactly);
    Gemma norm weights w (applied as 1 + w) in steps of 1/64 so 1 + w is f16-exact too."""
    rng = np.random.default_rng(seed)
    h, ff, d = cfg["hidden"], cfg["ff"], cfg["head_dim"]
    q, kv = cfg["heads"] * d, cfg["kv_heads"] * d
    f16 = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    gemma = cfg["family"] == "gemma3"
    norm = (lambda n: rng.integers(-16, 17, n).astype(np.float32) / 64) if gemma else \
        (lambda n: f16(1 + 0.1 * rng.standard_normal(n)))
    w = {"embed_tokens.weight": f16(rng.standard_normal((cfg["vocab"], h)) * (0.05 if gemma else 1)),
         "norm.weight": norm(h)}
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (ff, h), "up_proj": (ff, h), "down_proj": (h, ff)}
    for i in range(cfg["layers"]):
        p = f"layers.{i}"
        names = ["input_layernorm", "post_attention_layernorm"] + \
            (["pre_feedforward_layernorm", "post_feedforward_layernorm"] if gemma else [])
        for n in names:
            w[f"{p}.{n}.weight"] = norm(h)
        for n in ("q_norm", "k_norm"):
            w[f"{p}.self_attn.{n}.weight"] = norm(d)
        for proj, (o, k) in shapes.items():
            w[f"{p}.{PROJ[proj]}.{proj}.weight"] = f16(rng.standard_normal((o, k)) * 0.05)
            w[f"{p}.{PROJ[proj]}.{proj}.norm.weight"] = f16(1 + 0.1 * rng.standard_normal(k))
    return w


# ------------------------------------------------------------------------- reference
def absmean(W):
    """BitLinear's weight quantization: (T, s) with T in {-1, 0, 1}, W ~ T * s."""
    s = max(float(np.mean(np.abs(W))), 1e-5)
    return np.clip(np.rint(W / s), -1, 1), s


def _quant_tokens(x):
    s = 127.0 / np.maximum(np.abs(x).max(-1, keepdims=True), 1e-5)
    return np.clip(np.rint(x * s), -128, 127) / s


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def reference_hidden(cfg, w, ids):
    """The final-normed hidden states [B, T, hidden] (float64) of the published network."""
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    gemma = cfg["family"] == "gemma3"
    h, nh, nkv, d, eps = cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["eps"]
    B, T = ids.shape

    def rms(x, g):      # Gemma3RMSNorm: x * (1 + w); Qwen3RMSNorm and BitLinear's: x * w
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * ((1 + g) if gemma else g)

    def bitlinear(x, p):    # BitLinear: its own (plain) RMSNorm, int8 tokens, absmean weights
        g = w[p + ".norm.weight"]
        x = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g
        t, s = absmean(w[p + ".weight"])
        return _quant_tokens(x) @ (t * s).T

    def rope(x, theta):     # rotate_half over (i, i + d/2)
        inv = theta ** (-np.arange(0, d, 2) / d)
        ang = np.arange(T)[:, None] * inv[None, :]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)

    x = w["embed_tokens.weight"][ids]
    if gemma:
        x = x * np.sqrt(h)
    scale = (cfg.get("query_pre_attn_scalar") or d) ** -0.5
    for i in range(cfg["layers"]):
        p = f"layers.{i}"
        sliding = gemma and cfg["layer_types"][i] == "sliding_attention"
        theta = cfg["local_theta"] if sliding else cfg["theta"]
        n = rms(x, w[f"{p}.input_layernorm.weight"])
        q = rms(bitlinear(n, f"{p}.self_attn.q_proj").reshape(B, T, nh, d),
                w[f"{p}.self_attn.q_norm.weight"])
        k = rms(bitlinear(n, f"{p}.self_attn.k_proj").reshape(B, T, nkv, d),
                w[f"{p}.self_attn.k_norm.weight"])
        v = bitlinear(n, f"{p}.self_attn.v_proj").reshape(B, T, nkv, d)
        q, k = rope(q, theta), rope(k, theta)
        k, v = np.repeat(k, nh // nkv, axis=2), np.repeat(v, nh // nkv, axis=2)
        s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
        qi, ki = np.arange(T)[:, None], np.arange(T)[None, :]
        allowed = ki <= qi
        if sliding:
            allowed &= ki > qi - cfg["window"]
        s = np.where(allowed, s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        o = bitlinear(np.einsum("bhqk,bkhd->bqhd", s, v).reshape(B, T, nh * d),
                      f"{p}.self_attn.o_proj")
        if gemma:
            o = rms(o, w[f"{p}.post_attention_layernorm.weight"])
        x = x + o
        m = rms(x, w[f"{p}.pre_feedforward_layernorm.weight" if gemma else
                     f"{p}.post_attention_layernorm.weight"])
        g = bitlinear(m, f"{p}.mlp.gate_proj")
        g = _gelu_tanh(g) if gemma else g / (1 + np.exp(-g))
        y = bitlinear(g * bitlinear(m, f"{p}.mlp.up_proj"), f"{p}.mlp.down_proj")
        if gemma:
            y = rms(y, w[f"{p}.post_feedforward_layernorm.weight"])
        x = x + y
    return rms(x, w["norm.weight"])


def reference_logits(cfg, w, ids):
    """Logits: the hidden states times `lm_head.weight` (untied) or the embedding (tied)."""
    head = w.get("lm_head.weight", w["embed_tokens.weight"])
    return reference_hidden(cfg, {k: v for k, v in w.items() if k != "lm_head.weight"}, ids) \
        @ np.asarray(head, np.float64).T


def reference_embeddings(cfg, w, seqs, pooling="last", normalize=True):
    """[len(seqs), hidden]: each sequence on its own, pooled and L2-normalised."""
    out = []
    for s in seqs:
        hs = reference_hidden(cfg, w, np.asarray([s]))[0]
        e = {"last": hs[-1], "mean": hs.mean(0), "cls": hs[0]}[pooling]
        out.append(e / np.linalg.norm(e) if normalize else e)
    return np.stack(out)


# ------------------------------------------------------------------------- fixtures
def write_hf(directory, cfg, w, pooling="lasttoken", prefix="model."):
    """A Hugging Face directory as published: config.json, model.safetensors (BF16-free
    float32 here), and the sentence-transformers modules.json + 1_Pooling/config.json."""
    os.makedirs(directory, exist_ok=True)
    gemma = cfg["family"] == "gemma3"
    R.save_safetensors(os.path.join(directory, "model.safetensors"),
                       {("" if k == "lm_head.weight" else prefix) + k:
                        np.ascontiguousarray(v, np.float32) for k, v in w.items()})
    conf = {"vocab_size": cfg["vocab"], "hidden_size": cfg["hidden"],
            "intermediate_size": cfg["ff"], "num_hidden_layers": cfg["layers"],
            "num_attention_heads": cfg["heads"], "num_key_value_heads": cfg["kv_heads"],
            "head_dim": cfg["head_dim"], "rms_norm_eps": cfg["eps"], "rope_theta": cfg["theta"],
            "max_position_embeddings": 64, "tie_word_embeddings": "lm_head.weight" not in w,
            "attention_bias": False, "attention_dropout": 0.0, "rope_scaling": None,
            "bos_token_id": 2, "eos_token_id": 1, "torch_dtype": "bfloat16",
            "transformers_version": "4.56.0", "use_cache": True, "initializer_range": 0.02}
    if gemma:
        conf.update(architectures=["Gemma3TextModel"], model_type="gemma3_text",
                    hidden_activation="gelu_pytorch_tanh",
                    query_pre_attn_scalar=cfg["query_pre_attn_scalar"],
                    sliding_window=cfg["window"], layer_types=cfg["layer_types"],
                    rope_local_base_freq=cfg["local_theta"], final_logit_softcapping=None,
                    attn_logit_softcapping=None, _sliding_window_pattern=6, pad_token_id=0,
                    use_bidirectional_attention=False)
    else:
        conf.update(architectures=["Qwen3Model"], model_type="qwen3", hidden_act="silu",
                    use_sliding_window=False, sliding_window=None, max_window_layers=28,
                    layer_types=["full_attention"] * cfg["layers"])
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(conf, fh)
    if pooling is not None:
        with open(os.path.join(directory, "modules.json"), "w") as fh:
            json.dump([{"idx": 0, "name": "0", "path": "",
                        "type": "sentence_transformers.models.Transformer"},
                       {"idx": 1, "name": "1", "path": "1_Pooling",
                        "type": "sentence_transformers.models.Pooling"},
                       {"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"}], fh)
        os.makedirs(os.path.join(directory, "1_Pooling"), exist_ok=True)
        modes = {m: m == pooling for m in ("cls_token", "mean_tokens", "max_tokens",
                                          "mean_sqrt_len_tokens", "weightedmean_tokens",
                                          "lasttoken")}
        with open(os.path.join(directory, "1_Pooling", "config.json"), "w") as fh:
            json.dump({"word_embedding_dimension": cfg["hidden"],
                       **{f"pooling_mode_{m}": v for m, v in modes.items()}}, fh)
    return directory


def tq2_projection(W):
    """(TQ2_0 blocks of the absmean codes with block scale 1, their type, the f32 scale
    written beside them as `.scale`)."""
    t, s = absmean(W)
    return gguf.quants.quantize(t.astype(np.float32), QT.TQ2_0), QT.TQ2_0, \
        np.array([s], np.float32)


I2_S = 36       # ggml type id of bitnet.cpp's I2_S (not in gguf-py's enum)


def i2s_projection(W):
    """As the embedding converter's quantize_to_i2_s packs W: codes -1/0/+1 as 0/1/2,
    blocks of 128 weights in 32 bytes, value 32 * j + g of a block in byte g at bits
    6 - 2j, then the float32 absmean in the first 4 of 32 trailing bytes; no `.scale`."""
    t, s = absmean(W)
    q = (t.reshape(-1, 4, 32) + 1).astype(np.uint8)
    packed = (q[:, 0] << 6) | (q[:, 1] << 4) | (q[:, 2] << 2) | q[:, 3]
    tail = np.zeros(32, np.uint8)
    tail[:4] = np.frombuffer(np.float32(s).tobytes(), np.uint8)
    return np.concatenate([packed.reshape(-1), tail]).view(np.int8), I2_S, None


def write_gguf(path, cfg, w, pooling=3, projection=tq2_projection, skip=(), gemma_keys=True):
    """As bitnet.cpp's convert-bitnet-embedding-to-gguf.py writes the model (names,
    keys, F16 tables and norms, Gemma's 1 + w), with `projection(W)` -> (data, scale)
    for the ternary projections (TQ2_0 here; the I2_S reader's tests can pass theirs)."""
    gemma = cfg["family"] == "gemma3"
    arch = "gemma3" if gemma else "qwen3"
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_block_count(cfg["layers"])
    wr.add_context_length(64)
    wr.add_embedding_length(cfg["hidden"])
    wr.add_feed_forward_length(cfg["ff"])
    wr.add_head_count(cfg["heads"])
    wr.add_head_count_kv(cfg["kv_heads"])
    wr.add_vocab_size(cfg["vocab"])
    wr.add_rope_dimension_count(cfg["head_dim"])
    wr.add_key_length(cfg["head_dim"])
    wr.add_value_length(cfg["head_dim"])
    wr.add_rope_freq_base(cfg["theta"])
    wr.add_layer_norm_rms_eps(cfg["eps"])
    wr.add_file_type(1)
    if pooling is not None:
        wr.add_uint32(f"{arch}.pooling_type", pooling)
    if gemma and gemma_keys:    # beyond the converter's keys: this fixture's scale and layers
        wr.add_float32(f"{arch}.attention.scale", cfg["query_pre_attn_scalar"] ** -0.5)
        wr.add_uint32(f"{arch}.attention.sliding_window", cfg["window"])
        wr.add_array(f"{arch}.attention.sliding_window_pattern",
                     [t == "sliding_attention" for t in cfg["layer_types"]])
    wr.add_tokenizer_model("no_vocab")
    if not gemma:       # the converter's Qwen3 override: EOS appended, for last-token pooling
        wr.add_eos_token_id(1)
        wr.add_add_eos_token(True)
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    layer = {"input_layernorm": "attn_norm", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm"}
    layer.update({"post_attention_layernorm": "post_attention_norm",
                  "pre_feedforward_layernorm": "ffn_norm",
                  "post_feedforward_layernorm": "post_ffw_norm"} if gemma else
                 {"post_attention_layernorm": "ffn_norm"})
    for proj, g in GGUF_PROJ.items():
        layer[f"{PROJ[proj]}.{proj}"] = g
        layer[f"{PROJ[proj]}.{proj}.norm"] = g + "_norm_in"
    for k, v in w.items():
        if k.startswith("layers."):
            _, i, rest = k.split(".", 2)
            name = f"blk.{i}.{layer[rest[:-len('.weight')]]}.weight"
        else:
            name = names[k]
        if name in skip:
            continue
        if name.split(".")[-2] in GGUF_PROJ.values():
            data, qtype, s = projection(np.asarray(v, np.float32))
            wr.add_tensor(name, data, raw_dtype=qtype,
                          raw_shape=None if qtype == QT.TQ2_0 else v.shape)
            if s is not None:
                wr.add_tensor(name[:-len("weight")] + "scale", s)
            continue
        v = np.asarray(v, np.float32)
        if gemma and v.ndim == 1 and not name.endswith("_norm_in.weight"):
            v = v + 1       # Gemma3RMSNorm's (1 + w), as the converter stores it
        wr.add_tensor(name, v.astype(np.float16))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def word_tokenizer(directory, vocab_size, eos=True):
    """A word-level tokenizer.json: word k is "w{k}", and (`eos`) an EOS ("</s>", id 1)
    after every text, as an embedding model's tokenizer appends for last-token pooling."""
    from tokenizers import Tokenizer, models as tm, pre_tokenizers, processors
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{k}": k for k in range(2, vocab_size)}}
    tok = Tokenizer(tm.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if eos:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                           special_tokens=[("</s>", 1)])
    tok.save(str(directory / "tokenizer.json"))
