"""BitNet b1.58 2B4T as GGUF, in the form llama.cpp's convert_hf_to_gguf.py (`--outtype
tq2_0`) writes microsoft/bitnet-b1.58-2B-4T, at its shape scaled down: vocabulary 128256,
GQA 4:1, head_dim 128, rope_theta 500000, relu2, sub-norms, tied embedding; 2 layers,
hidden 512.

What that converter writes (conversion/bitnet.py and base.py of llama.cpp, read for the
facts): arch `bitnet`; the TextModel keys (block_count, context_length,
embedding_length, feed_forward_length, head_count, head_count_kv, rope.freq_base,
layer_norm_rms_epsilon, file_type) plus rope.scaling.type "linear" with factor 1.0; no
`hidden_activation`, no rope.dimension_count, no key_length (the config has no
head_dim); the packed projections dequantized (codes / weight_scale) and then
ternarized again by absmean, so each one is stored as codes * mean|codes / weight_scale|
(the weight scale times the share of non-zero codes) in the TQ2_0 block scale, no
`*.scale` tensors; token_embd f16 and no output.weight (tied); norms f32. Its vocabulary
step (sentencepiece) cannot read 2B4T's tokenizer.json; the files that exist carry the
Llama 3 BPE vocabulary as the gpt2 path writes it (tokenizer.ggml.model "gpt2", pre
"llama-bpe"), which is also how tercomp tells 2B4T (relu2) from 1bitLLM's silu models
(models/families/bitnet.py).

llama.cpp's `bitnet` graph computes silu whatever the file says (src/models/bitnet.cpp
passes LLM_FFN_SILU; ggml-org/llama.cpp#25885 and #26751 would change it, neither is
merged), so it computes a different function on a 2B4T file than the model does: the
agreement test compares the file's layout by reading it with tercomp's activation set
to silu, and measures the relu2 difference."""
import copy

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import tercomp as tc
from tercomp import models

import bitnet_ref as R

SHAPE = dict(vocab=128256, hidden=512, ff=1280, heads=4, kv_heads=1, head_dim=128, layers=2,
             theta=500000.0, eps=1e-5, ctx=4096)
SPECIAL = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128009: "<|eot_id|>"}
IDS = np.random.default_rng(24).integers(0, 5000, (1, 16)).astype(np.int64)


def hf_weights(cfg, seed=0):
    """2B4T's checkpoint in GGUF names: ternary codes with transformers' weight_scale
    (the layer computes x @ codes.T / weight_scale), bf16 embedding, norms."""
    rng = np.random.default_rng(seed)
    h, ff, v, kv = cfg["hidden"], cfg["ff"], cfg["vocab"], cfg["kv_heads"] * cfg["head_dim"]
    w = {"token_embd.weight": R.bf16(rng.standard_normal((v, h)) * 0.5),
         "output_norm.weight": R.bf16(1 + 0.1 * rng.standard_normal(h))}
    shapes = {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h),
              "ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff)}
    for i in range(cfg["layers"]):
        for g, size in (("attn_norm", h), ("attn_sub_norm", h), ("ffn_norm", h),
                        ("ffn_sub_norm", ff)):
            w[f"blk.{i}.{g}.weight"] = R.bf16(1 + 0.1 * rng.standard_normal(size))
        for g, shape in shapes.items():
            w[f"blk.{i}.{g}.weight"] = rng.choice(np.array([-1, 0, 1], np.int8), size=shape,
                                                  p=[0.3, 0.4, 0.3])
            # 1 / weight_scale = the layer's scale; ~unit gain per projection
            w[f"blk.{i}.{g}.weight_scale"] = np.float32(
                np.sqrt(shape[1] * 0.6) / rng.uniform(0.6, 1.2))
    return w


def converter_values(codes, weight_scale):
    """convert_hf_to_gguf's float32 projection: codes / weight_scale, then its absmean
    ternarization (scale = mean |w|, round(w / scale) clamped, times scale)."""
    w = codes.astype(np.float32) / np.float32(weight_scale)
    scale = np.float32(np.abs(w).mean())
    iscale = np.float32(1) / scale
    return (np.clip(np.round(w * iscale), -1, 1) / iscale).astype(np.float32)


def vocab_2b4t(size):
    """Llama 3's vocabulary as the converter's gpt2 path writes it (a stand-in: the
    byte-level alphabet, one merge, fillers, the special tokens at their ids)."""
    v = R.peer_vocab(size)
    tokens = list(v["tokens"])
    types = [1] * size
    for i, t in SPECIAL.items():
        if i < size:
            tokens[i], types[i] = t, 3
    return {**v, "tokens": tokens, "types": types, "bos": min(128000, size - 2),
            "eos": min(128001, size - 1)}


def write_gguf_2b4t(path, cfg, hw, hidden_activation=None, pre="llama-bpe", rope_factor=1.0):
    """The GGUF that convert_hf_to_gguf.py --outtype tq2_0 writes (see the module
    docstring); `hidden_activation` adds the key no converter writes; `pre` None leaves
    out `tokenizer.ggml.pre`."""
    wr = gguf.GGUFWriter(str(path), "bitnet")
    wr.add_name("Bitnet B1.58 2B 4T")
    wr.add_block_count(cfg["layers"])
    wr.add_context_length(cfg["ctx"])
    wr.add_embedding_length(cfg["hidden"])
    wr.add_feed_forward_length(cfg["ff"])
    wr.add_head_count(cfg["heads"])
    wr.add_head_count_kv(cfg["kv_heads"])
    wr.add_rope_freq_base(cfg["theta"])
    wr.add_layer_norm_rms_eps(cfg["eps"])
    wr.add_file_type(gguf.LlamaFileType.MOSTLY_TQ2_0)
    wr.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    wr.add_rope_scaling_factor(rope_factor)
    if hidden_activation:
        wr.add_string("bitnet.hidden_activation", hidden_activation)
    v = vocab_2b4t(cfg["vocab"])
    wr.add_tokenizer_model("gpt2")
    if pre:
        wr.add_tokenizer_pre(pre)
    wr.add_token_list(v["tokens"])
    wr.add_token_types(v["types"])
    wr.add_token_merges(v["merges"])
    wr.add_bos_token_id(v["bos"])
    wr.add_eos_token_id(v["eos"])
    for name, arr in hw.items():
        if name.endswith(".weight_scale"):
            continue
        if arr.dtype == np.int8:
            vals = converter_values(arr, hw[name[:-7] + ".weight_scale"])
            wr.add_tensor(name, gguf.quants.quantize(vals, QT.TQ2_0), raw_dtype=QT.TQ2_0)
        elif name == "token_embd.weight":
            wr.add_tensor(name, arr.astype(np.float16))
        else:
            wr.add_tensor(name, arr.astype(np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def stored_weights(hw):
    """The file's model in GGUF names, float64: each projection's codes and its stored
    block scale (f16 of the converter's value), the f16 embedding (the tied output)."""
    w = {}
    for name, arr in hw.items():
        if name.endswith(".weight_scale"):
            continue
        if arr.dtype == np.int8:
            vals = converter_values(arr, hw[name[:-7] + ".weight_scale"])
            w[name] = arr.astype(np.float64)
            w[name[:-7] + ".scale"] = np.float64(np.float16(np.abs(vals).max()))
        else:
            w[name] = arr.astype(np.float16 if name == "token_embd.weight" else np.float32) \
                .astype(np.float64)
    return w


def reference(cfg, w, ids, hidden_act="relu2"):
    """float64 logits of `stored_weights`, with BitLinear's int8 per-token activations."""
    return R.reference_logits(w, cfg, ids, act="token", hidden_act=hidden_act)


def check(got, want):
    cos = R.cosine(got, want)
    top1, n = R.top1_agreement(got, want, margin=0.05)
    assert cos.min() >= 0.999 and top1 >= 0.95 and n > 0, (cos.min(), top1, n)


def with_activation(lm, act):
    """A shallow copy of `lm` whose FFNs use `act` (its weights shared)."""
    out = copy.copy(lm)
    out.layers = [copy.copy(layer) for layer in lm.layers]
    for layer in out.layers:
        layer.mlp = copy.copy(layer.mlp)
        layer.mlp.hidden_act = act
    return out


@pytest.fixture(scope="module")
def model_2b4t(tmp_path_factory):
    hw = hf_weights(SHAPE, seed=7)
    path = write_gguf_2b4t(tmp_path_factory.mktemp("2b4t") / "2b4t.gguf", SHAPE, hw)
    return stored_weights(hw), models.load(path)


def test_2b4t_gguf_loads_as_2b4t(model_2b4t):
    w, lm = model_2b4t
    c = lm.config
    assert (c.family, c.hidden_act, c.sub_norms, c.tie_word_embeddings, c.rope_style) == \
        ("bitnet", "relu2", True, True, "neox")
    assert (c.vocab_size, c.head_dim, c.num_attention_heads // c.num_key_value_heads,
            c.rope_theta, c.rope_freq_factors) == (128256, 128, 4, 500000.0, None)
    check(lm(IDS)[0], reference(SHAPE, w, IDS)[0])


@pytest.mark.slow     # tests/test_i2s.py runs a 2B4T-layout model through compile_lm, faster
def test_2b4t_generates_as_the_reference(model_2b4t):
    """Greedy tokens of tc.compile_lm equal the float64 reference's: the reference's
    argmax after each prefix of prompt + our tokens is our next token."""
    w, lm = model_2b4t
    prompt = IDS[0, :8]
    ours = tc.compile_lm(lm, max_seq=32).generate(prompt.astype(np.int32), max_new_tokens=8)
    ref = reference(SHAPE, w, np.concatenate([prompt, ours])[None])[0]
    assert ref[7:15].argmax(-1).tolist() == ours.tolist()


def test_the_activation_comes_from_the_key_or_the_tokenizer(tmp_path):
    """No key: relu2 with Llama 3's BPE vocabulary (2B4T), silu otherwise (1bitLLM's);
    a key is read as it says."""
    small = dict(SHAPE, vocab=600)
    hw = hf_weights(dict(small, layers=1), seed=1)
    for act, pre, want in ((None, "llama-bpe", "relu2"), (None, None, "silu"),
                           ("silu", "llama-bpe", "silu"), ("relu2", None, "relu2")):
        path = write_gguf_2b4t(tmp_path / f"{act}-{pre}.gguf", dict(small, layers=1), hw,
                               hidden_activation=act, pre=pre)
        assert models.load(path).config.hidden_act == want, (act, pre)


def test_a_linear_rope_factor_divides_the_frequencies(tmp_path):
    """llama.cpp divides positions by rope.scaling.factor (the converter writes 1.0)."""
    small = dict(SHAPE, vocab=600, layers=1)
    path = write_gguf_2b4t(tmp_path / "lin.gguf", small, hf_weights(small, 2), rope_factor=4.0)
    assert models.load(path).config.rope_freq_factors == (4.0,) * 64


def test_llama_cpp_reads_the_2b4t_layout(tmp_path):
    """llama.cpp on a file of the same form (a 4096-token vocabulary: llama.cpp reads
    nothing differently for 128256): its graph runs silu, so tercomp set to silu must
    agree with it (layout, GQA, head_dim, sub-norms, tied output, block scales, rope
    keys); the relu2 model itself differs from what llama.cpp computes."""
    llama_cpp = pytest.importorskip("llama_cpp")
    shape = dict(SHAPE, vocab=4096)
    path = write_gguf_2b4t(tmp_path / "2b4t.gguf", shape, hf_weights(shape, seed=8))
    peer = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True,
                           verbose=False)
    lm = models.load(path)
    assert lm.config.hidden_act == "relu2"
    theirs = R.peer_logits(peer, IDS[0] % 4096)
    gen = tc.compile_lm(with_activation(lm, "silu"), max_seq=64)
    ours = gen.prefill((IDS[0] % 4096).astype(np.int32))
    cos = R.cosine(ours, theirs)
    top1, n = R.top1_agreement(ours, theirs, margin=0.05)
    relu2 = R.cosine(lm((IDS % 4096))[0], theirs)
    print(f"2b4t form, silu: llama.cpp cosine min {cos.min():.6f} mean {cos.mean():.6f}, "
          f"top-1 {top1:.3f} of {n}; the relu2 model vs llama.cpp: cosine min "
          f"{relu2.min():.4f}")
    assert cos.min() >= 0.999 and top1 >= 0.95, (cos.min(), top1, n)
    gen.reset()
    prompt = IDS[0, :8] % 4096
    assert gen.generate(prompt.astype(np.int32), max_new_tokens=8).tolist() == \
        R.peer_greedy(peer, prompt, 8)
