"""Test helpers: a float64 NumPy reference of llama.cpp's `bitnet` graph, and fixture
files written with gguf's own writer and safetensors.

The reference reads the weights straight from the GGUF file with gguf-py (independently
of tercomp's loader) and follows src/models/bitnet.cpp of llama.cpp: RMSNorm, Q/K/V
projections (times the optional `.scale`), NeoX RoPE (llama.cpp's rope type for
LLM_ARCH_BITNET), causal GQA softmax attention scaled by 1/sqrt(head_dim), attn_sub_norm,
output projection, residual; RMSNorm, gate/up, act(gate) * up, ffn_sub_norm, down,
residual; output_norm; logits = h @ token_embd^T.

`act` says how the input of each ternary projection is treated: "none" (llama.cpp's
graph in exact arithmetic), "token" (int8 per token, BitLinear's rule) or "block"
(int8 per 256-block, close to llama.cpp's Q8_K activations).
"""
import numpy as np

import gguf
from gguf import GGMLQuantizationType as QT
from tokenizers import pre_tokenizers

import tercomp as tc
from tercomp import models

PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


# ------------------------------------------------------------------------- reference
def read_gguf_weights(path):
    """{name: float64 array in NumPy (row-major [out, in]) order} and the metadata dict."""
    r = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    w = {}
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(list(t.shape)))
        w[t.name] = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type) \
            .astype(np.float64).reshape(shape)
    return w, meta


def _quant(x, act):
    if act == "none":
        return x
    if act == "token":
        s = 127.0 / np.maximum(np.abs(x).max(-1, keepdims=True), 1e-5)
        return np.clip(np.rint(x * s), -127, 127) / s
    b = x.reshape(*x.shape[:-1], -1, 256)
    s = 127.0 / np.maximum(np.abs(b).max(-1, keepdims=True), 1e-30)
    return (np.clip(np.rint(b * s), -127, 127) / s).reshape(x.shape)


def reference_logits(w, cfg, ids, act="none", rope="neox", hidden_act="silu", lm_head=None):
    """Logits [B, T, vocab] (float64). `w` uses GGUF names; a projection's matrix is
    `w[name + '.weight'] * w.get(name + '.scale', 1)`; the sub-norms are applied where
    `w` has them. `cfg`: dict with hidden, heads, kv_heads, layers, eps, theta, and
    optionally head_dim and inv_freq (the head_dim/2 rotation frequencies)."""
    h, nh, nkv, eps, theta = (cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["eps"],
                              cfg["theta"])
    d = cfg.get("head_dim", h // nh)
    B, T = ids.shape

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * g

    def lin(x, name):
        m = w[name + ".weight"] * (float(w[name + ".scale"].reshape(-1)[0])
                                   if name + ".scale" in w else 1.0)
        return _quant(x, act) @ m.T

    inv_freq = cfg.get("inv_freq", theta ** (-np.arange(0, d, 2) / d))
    ang = np.arange(T)[:, None] * np.asarray(inv_freq)[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rot(x):                                  # x [B, T, H, d]
        if rope == "neox":
            a, b = x[..., : d // 2], x[..., d // 2:]
            return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return out

    x = w["token_embd.weight"][ids]
    mask = np.tril(np.ones((T, T), bool))
    for i in range(cfg["layers"]):
        p = f"blk.{i}."
        n = rms(x, w[p + "attn_norm.weight"])
        q = rot(lin(n, p + "attn_q").reshape(B, T, nh, d))
        k = rot(lin(n, p + "attn_k").reshape(B, T, nkv, d))
        v = lin(n, p + "attn_v").reshape(B, T, nkv, d)
        g = nh // nkv
        k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)   # head j reads kv j // g
        s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d)
        s = np.where(mask, s, -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        pr /= pr.sum(-1, keepdims=True)
        a = np.einsum("bhqk,bkhd->bqhd", pr, v).reshape(B, T, nh * d)
        if p + "attn_sub_norm.weight" in w:
            a = rms(a, w[p + "attn_sub_norm.weight"])
        x = x + lin(a, p + "attn_output")
        m = rms(x, w[p + "ffn_norm.weight"])
        gate = lin(m, p + "ffn_gate")
        gate = gate / (1 + np.exp(-gate)) if hidden_act == "silu" else np.maximum(gate, 0) ** 2
        f = gate * lin(m, p + "ffn_up")
        if p + "ffn_sub_norm.weight" in w:
            f = rms(f, w[p + "ffn_sub_norm.weight"])
        x = x + lin(f, p + "ffn_down")
    x = rms(x, w["output_norm.weight"])
    return x @ (w["token_embd.weight"] if lm_head is None else lm_head).T


# -------------------------------------------------------------------------- fixtures
def random_weights(cfg, seed=0):
    """GGUF-named float32 norms/embedding and int8 ternary projections (+ scales)."""
    rng = np.random.default_rng(seed)
    h, ff, v = cfg["hidden"], cfg["ff"], cfg["vocab"]
    kv = h // cfg["heads"] * cfg["kv_heads"]
    w = {"token_embd.weight": (rng.standard_normal((v, h)) * 0.5).astype(np.float32),
         "output_norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)}
    shapes = {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h),
              "ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff)}
    for i in range(cfg["layers"]):
        for n, size in (("attn_norm", h), ("attn_sub_norm", h), ("ffn_norm", h),
                        ("ffn_sub_norm", ff)):
            w[f"blk.{i}.{n}.weight"] = (1 + 0.1 * rng.standard_normal(size)).astype(np.float32)
        for n, shape in shapes.items():
            w[f"blk.{i}.{n}.weight"] = rng.choice(np.array([-1, 0, 1], np.int8), size=shape,
                                                  p=[0.3, 0.4, 0.3])
            w[f"blk.{i}.{n}.scale"] = np.float32(rng.uniform(0.02, 0.08))
    return w


def write_gguf(path, cfg, w, qtype=QT.TQ2_0, block_scale=0.5, arch="bitnet", with_scale=True,
               float_type=QT.F32, hidden_act=None, skip=(), vocab=None, override=None):
    """A GGUF file written with gguf's writer: projections as `qtype` with every block
    scale `block_scale` (and, with_scale, the f32 `.scale` tensor), the rest `float_type`;
    `override` gives a tensor's (data, raw type) as is. cfg's optional head_dim is
    written as the key/value lengths."""
    override = override or {}
    wr = gguf.GGUFWriter(str(path), arch)
    if "head_dim" in cfg:
        wr.add_key_length(cfg["head_dim"])
        wr.add_value_length(cfg["head_dim"])
        wr.add_rope_dimension_count(cfg["head_dim"])
        wr.add_vocab_size(cfg["vocab"])
    wr.add_context_length(cfg.get("ctx", 128))
    wr.add_embedding_length(cfg["hidden"])
    wr.add_block_count(cfg["layers"])
    wr.add_feed_forward_length(cfg["ff"])
    wr.add_head_count(cfg["heads"])
    wr.add_head_count_kv(cfg["kv_heads"])
    wr.add_layer_norm_rms_eps(cfg["eps"])
    wr.add_rope_freq_base(cfg["theta"])
    if hidden_act:
        wr.add_string(f"{arch}.hidden_activation", hidden_act)
    if vocab:
        wr.add_tokenizer_model(vocab["model"])
        wr.add_token_list(vocab["tokens"])
        if "merges" in vocab:
            wr.add_token_merges(vocab["merges"])
        if "scores" in vocab:
            wr.add_token_scores(vocab["scores"])
        if "chat_template" in vocab:
            wr.add_chat_template(vocab["chat_template"])
        if "bos" in vocab:
            wr.add_bos_token_id(vocab["bos"])
        if "eos" in vocab:
            wr.add_eos_token_id(vocab["eos"])
        for method, key, value in vocab.get("raw", ()):      # keys as a hostile file has them
            getattr(wr, method)(key, value)
    for name, arr in w.items():
        if name in skip:
            continue
        if name in override:
            data, raw = override[name]
            wr.add_tensor(name, data, raw_dtype=raw)
        elif name.endswith(".scale"):
            if with_scale:
                wr.add_tensor(name, np.array([arr], np.float32))
        elif arr.dtype == np.int8:
            vals = arr.astype(np.float32) * np.float32(block_scale)
            if qtype in (QT.F32, QT.F16):
                wr.add_tensor(name, vals.astype(np.float16 if qtype == QT.F16 else np.float32))
            else:
                wr.add_tensor(name, gguf.quants.quantize(vals, qtype), raw_dtype=qtype)
        elif float_type == QT.F32:
            wr.add_tensor(name, arr)
        elif float_type == QT.F16:
            wr.add_tensor(name, arr.astype(np.float16))
        else:
            wr.add_tensor(name, gguf.quants.quantize(arr, float_type), raw_dtype=float_type)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


#: A one-layer GQA model: the small LM the generator's runtime tests compile
TINY_CFG = dict(hidden=256, ff=256, vocab=300, heads=4, kv_heads=2, layers=1, eps=1e-5,
                theta=10000.0, ctx=128)


def tiny_gguf(directory):
    """TINY_CFG's random model (seed 7) written as a GGUF in `directory`."""
    return write_gguf(directory / "tiny.gguf", TINY_CFG, random_weights(TINY_CFG, seed=7))


def cosine(a, b):
    a = np.asarray(a, np.float64).reshape(-1, a.shape[-1])
    b = np.asarray(b, np.float64).reshape(-1, b.shape[-1])
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def top1_agreement(a, b, margin=0.0):
    """Share of positions where the top-1 of `a` equals that of `b`, counting only the
    positions where b's top-1 leads its runner-up by more than `margin`."""
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    srt = np.sort(b, -1)
    keep = (srt[:, -1] - srt[:, -2]) > margin
    return float((a.argmax(-1) == b.argmax(-1))[keep].mean()), int(keep.sum())


# ------------------------------------------------------------ Hugging Face fixtures
def hf_pack(t):
    """transformers' 2B4T packing, written here from its description: codes T + 1, output
    row j * rows + r in bits 2j..2j+1 of packed row r, rows = ceil(out / 4)."""
    out = t.shape[0]
    rows = -(-out // 4)
    codes = np.zeros((4 * rows, t.shape[1]), np.uint8)
    codes[:out] = (t + 1).astype(np.uint8)
    packed = np.zeros((rows, t.shape[1]), np.uint8)
    for j in range(4):
        packed |= codes[j * rows:(j + 1) * rows] << (2 * j)
    return packed


def bf16(x):
    """float32 values that are exactly representable in bfloat16 (truncated)."""
    return (np.asarray(x, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def save_safetensors(path, tensors, bf16_names=()):
    """Write with safetensors' serializer; names in `bf16_names` are stored as BF16."""
    import safetensors
    keep, specs = [], {}
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if name in bf16_names:
            arr, dt = (arr.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16), "bfloat16"
        else:
            dt = {np.dtype(np.float32): "float32", np.dtype(np.uint8): "uint8",
                  np.dtype(np.float16): "float16"}[arr.dtype]
        keep.append(arr)
        specs[name] = safetensors.TensorSpec(dtype=dt, shape=list(arr.shape),
                                             data_ptr=arr.ctypes.data, data_len=arr.nbytes)
    with open(path, "wb") as fh:
        fh.write(bytes(safetensors.serialize(specs)))


def peer_vocab(size: int) -> dict:
    """A gpt2-style GGUF vocabulary of `size` tokens that llama.cpp loads (it refuses one
    without merges): the byte-level alphabet, one merge and its token, then fillers."""
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["\u0120\u0120"]
    tokens += [f"<x{i}>" for i in range(size - len(tokens))]
    return {"model": "gpt2", "tokens": tokens, "merges": ["\u0120 \u0120"]}


# ------------------------------------------------------------------- llama.cpp peer
def peer_logits(llm, ids):
    """llama.cpp's logits [T, vocab] (float64) of token ids, teacher-forced from a fresh
    context (`llm` a llama_cpp.Llama made with logits_all=True)."""
    llm.reset()
    llm.eval([int(t) for t in ids])
    return np.array(llm.scores[: len(ids)], dtype=np.float64)


def peer_greedy(llm, prompt, n):
    """llama.cpp's first `n` greedy tokens after `prompt`, by argmax of its logits."""
    llm.reset()
    llm.eval([int(t) for t in prompt])
    out = []
    for _ in range(n):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


def check_llama_cpp_agrees(llama_cpp, path, ids, label: str) -> None:
    """llama.cpp (the `peer` extra) and tc.compile_lm on the same file: teacher-forced
    logits (cosine >= 0.999 at every position, top-1 >= 0.95 at clear-margin ones) and
    the first 8 greedy tokens after ids[:4]; prints the cosines."""
    ids = np.asarray(ids, np.int32)
    peer = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True,
                           verbose=False)
    gen = tc.compile_lm(models.load(path), max_seq=64)
    ours, theirs = gen.prefill(ids), peer_logits(peer, ids)
    cos = cosine(ours, theirs)
    top1, n = top1_agreement(ours, theirs, margin=0.05)
    print(f"{label}: llama.cpp cosine min {cos.min():.6f} mean {cos.mean():.6f}, "
          f"top-1 {top1:.3f} of {n}")
    assert cos.min() >= 0.999 and top1 >= 0.95, (cos.min(), top1, n)
    gen.reset()
    assert gen.generate(ids[:4], max_new_tokens=8).tolist() == peer_greedy(peer, ids[:4], 8)
