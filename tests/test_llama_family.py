"""Llama-architecture 1.58-bit models (models/families/llama_bitnet.py), at the shapes of
Falcon3-1B-Instruct-1.58bit and Llama3-8B-1.58-100B-tokens scaled down (their vocabulary
size, GQA ratio, head_dim, rope_theta, RoPE scaling and untied head kept; fewer and
narrower layers):

- as Hugging Face writes them: `LlamaForCausalLM`, `quantization_config` quant_method
  "bitnet", projections packed 4 per byte (transformers' integrations/bitnet.py order)
  with a `weight_scale`, no sub-norms, bf16 embedding and lm_head;
- as llama.cpp's converter writes them: GGUF `llama` architecture, q/k rows permuted for
  its interleaved RoPE, TQ2_0 or TQ1_0 projections whose block scale is the weight scale,
  an f16 `output.weight`, Llama 3's scaling as `rope_freqs.weight`.

Each loads, agrees with a float64 reference (cosine >= 0.999, top-1 >= 0.95 at
clear-margin positions), and generates through tc.compile_lm; with llama-cpp-python
installed, llama.cpp's logits and greedy tokens on the GGUF agree too."""
import json
import os

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import tercomp as tc
from tercomp import models

import bitnet_ref as R

SHAPES = {
    # Falcon3-1B-Instruct-1.58bit: vocab 131072, GQA 8/4, head_dim 256, theta 1000042
    "falcon3_1b": dict(vocab=131072, hidden=256, ff=512, heads=8, kv_heads=4, head_dim=256,
                       layers=2, theta=1000042.0, eps=1e-6, rope_scaling=None),
    # Llama3-8B-1.58-100B-tokens: vocab 128256, GQA 32/8, head_dim 128, Llama 3 scaling
    "llama3_8b": dict(vocab=128256, hidden=256, ff=512, heads=8, kv_heads=2, head_dim=128,
                      layers=2, theta=500000.0, eps=1e-5,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192}),
}
IDS = np.random.default_rng(11).integers(0, 1000, (1, 16)).astype(np.int64)


def inv_freq(cfg):
    """The rotation frequencies, Llama 3's scaling applied (transformers' formula)."""
    d = cfg["head_dim"]
    inv = cfg["theta"] ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    rs = cfg["rope_scaling"]
    if rs is None:
        return inv
    lo_wl = rs["original_max_position_embeddings"] / rs["low_freq_factor"]
    hi_wl = rs["original_max_position_embeddings"] / rs["high_freq_factor"]
    out = []
    for f in inv:
        wl = 2 * np.pi / f
        if wl < hi_wl:
            out.append(f)
        elif wl > lo_wl:
            out.append(f / rs["factor"])
        else:
            s = (rs["original_max_position_embeddings"] / wl - rs["low_freq_factor"]) / \
                (rs["high_freq_factor"] - rs["low_freq_factor"])
            out.append((1 - s) * f / rs["factor"] + s * f)
    return np.array(out)


def weights(cfg, seed=0):
    """GGUF-named weights in Hugging Face's q/k row order: ternary int8 projections with
    one float32 scale each (`.scale`), f32 norms, float embedding and output."""
    rng = np.random.default_rng(seed)
    h, ff, v = cfg["hidden"], cfg["ff"], cfg["vocab"]
    q, kv = cfg["heads"] * cfg["head_dim"], cfg["kv_heads"] * cfg["head_dim"]
    w = {"token_embd.weight": R.bf16(rng.standard_normal((v, h)) * 0.5).astype(np.float32),
         "output_norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32),
         "output.weight": R.bf16(rng.standard_normal((v, h)) * 0.2).astype(np.float32)}
    shapes = {"attn_q": (q, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, q),
              "ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff)}
    for i in range(cfg["layers"]):
        for g in ("attn_norm", "ffn_norm"):
            w[f"blk.{i}.{g}.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        for g, shape in shapes.items():
            w[f"blk.{i}.{g}.weight"] = rng.integers(-1, 2, shape).astype(np.int8)
            w[f"blk.{i}.{g}.scale"] = np.float32(rng.uniform(0.5, 1.5) / np.sqrt(shape[1]) * 4)
    return w


HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
            "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def write_hf_llama(directory, cfg, w):
    os.makedirs(directory, exist_ok=True)
    st, bf = {}, set()
    for name, arr in w.items():
        if name.endswith(".scale"):
            continue
        if name in ("token_embd.weight", "output.weight", "output_norm.weight"):
            hf = {"token_embd.weight": "model.embed_tokens.weight",
                  "output.weight": "lm_head.weight", "output_norm.weight": "model.norm.weight"}[name]
        else:
            _, i, g, _ = name.split(".")
            hf = f"model.layers.{i}.{HF_NAMES[g]}.weight"
        if arr.dtype == np.int8:            # packed, output divided by weight_scale
            st[hf] = R.hf_pack(arr)
            st[hf + "_scale"] = np.array([1.0 / w[name[:-7] + ".scale"]], np.float32)
        elif name in ("token_embd.weight", "output.weight"):
            st[hf] = arr
            bf.add(hf)
        else:
            st[hf] = arr
    R.save_safetensors(os.path.join(directory, "model.safetensors"), st, bf16_names=bf)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": cfg["vocab"], "hidden_size": cfg["hidden"],
              "intermediate_size": cfg["ff"], "num_hidden_layers": cfg["layers"],
              "num_attention_heads": cfg["heads"], "num_key_value_heads": cfg["kv_heads"],
              "head_dim": cfg["head_dim"], "rms_norm_eps": cfg["eps"], "rope_theta": cfg["theta"],
              "rope_scaling": cfg["rope_scaling"], "max_position_embeddings": 64,
              "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False,
              "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "pretraining_tp": 1,
              "torch_dtype": "bfloat16", "transformers_version": "4.52.0",
              "quantization_config": {"quant_method": "bitnet", "linear_class": "bitlinear",
                                      "quantization_mode": "offline"}}
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(config, fh)


def permute(m, n_head):
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (for interleaved RoPE)."""
    return m.reshape(n_head, 2, m.shape[0] // n_head // 2, *m.shape[1:]).swapaxes(1, 2) \
        .reshape(m.shape)


def rope_factors(cfg):
    """convert_hf_to_gguf's `rope_freqs` for Llama 3: the divisors of the frequencies."""
    base = cfg["theta"] ** (-np.arange(0, cfg["head_dim"], 2, dtype=np.float64) / cfg["head_dim"])
    return (base / inv_freq(cfg)).astype(np.float32)


def write_gguf_llama(path, cfg, w, qtype=QT.TQ2_0, vocab=None):
    """As convert_hf_to_gguf + llama-quantize write it: q/k rows permuted, each
    projection's scale as its blocks' scale (no `.scale` tensor), f16 tables."""
    out, override = {}, {}
    for name, arr in w.items():
        if name.endswith(".scale"):
            continue
        if arr.dtype == np.int8:
            t = permute(arr, cfg["heads"]) if ".attn_q." in name else \
                permute(arr, cfg["kv_heads"]) if ".attn_k." in name else arr
            vals = t.astype(np.float32) * w[name[:-7] + ".scale"]
            override[name] = (gguf.quants.quantize(vals, qtype), qtype)
        elif name in ("token_embd.weight", "output.weight"):
            override[name] = (arr.astype(np.float16), QT.F16)
        out[name] = arr
    if cfg["rope_scaling"] is not None:
        out["rope_freqs.weight"] = rope_factors(cfg)
    return R.write_gguf(path, {**cfg, "ctx": 64}, out, arch="llama", with_scale=False,
                        override=override, vocab=vocab)


def reference(cfg, w, ids, gguf_stored=False, f16_output=False):
    """float64 logits of the model; `gguf_stored`: as the GGUF stores it (f16 tables,
    and each weight scale in its blocks' f16 scale); `f16_output`: the output layer
    rounded to f16, as tc.compile_lm stores it by default."""
    ref_cfg = {**cfg, "inv_freq": inv_freq(cfg)}
    ww = {k: (np.float64(v) if k.endswith(".scale") else v.astype(np.float64)) for k, v in w.items()}
    tables = ("token_embd.weight", "output.weight") if gguf_stored else \
        ("output.weight",) if f16_output else ()
    for k in tables:
        ww[k] = w[k].astype(np.float16).astype(np.float64)
    if gguf_stored:
        for k in w:
            if k.endswith(".scale"):
                ww[k] = np.float64(np.float16(w[k]))
    return R.reference_logits(ww, ref_cfg, ids, act="token", lm_head=ww["output.weight"])


def check(got, want):
    cos = R.cosine(got, want)
    top1, n = R.top1_agreement(got, want, margin=0.05)
    assert cos.min() >= 0.999 and top1 >= 0.95 and n > 0, (cos.min(), top1, n)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def family_files(request, tmp_path_factory):
    cfg = SHAPES[request.param]
    w = weights(cfg, seed=len(request.param))
    d = tmp_path_factory.mktemp(request.param)
    write_hf_llama(d / "hf", cfg, w)
    return cfg, w, d / "hf", write_gguf_llama(d / "m.gguf", cfg, w)


def test_hf_llama_bitnet_loads_and_agrees(family_files):
    cfg, w, hf, _ = family_files
    lm = models.load(hf)
    c = lm.config
    assert (c.family, c.sub_norms, c.head_dim, c.tie_word_embeddings, c.vocab_size) == \
        ("llama_bitnet", False, cfg["head_dim"], False, cfg["vocab"])
    assert lm.layers[0].attn.attn_sub_norm is None and lm.layers[0].mlp.ffn_sub_norm is None
    check(lm(IDS)[0], reference(cfg, w, IDS)[0])


def test_gguf_llama_loads_and_agrees(family_files):
    cfg, w, _, path = family_files
    lm = models.load(path)
    assert (lm.config.family, lm.config.rope_style) == ("llama_bitnet", "interleaved")
    assert (lm.config.rope_freq_factors is None) == (cfg["rope_scaling"] is None)
    check(lm(IDS)[0], reference(cfg, w, IDS, gguf_stored=True)[0])


@pytest.mark.parametrize("qtype", [QT.TQ1_0])
def test_gguf_llama_tq1_0(family_files, tmp_path, qtype):
    cfg, w, _, _ = family_files
    lm = models.load(write_gguf_llama(tmp_path / "tq1.gguf", cfg, w, qtype))
    check(lm(IDS)[0], reference(cfg, w, IDS, gguf_stored=True)[0])


@pytest.mark.parametrize("source", ["gguf", pytest.param("hf", marks=pytest.mark.slow)])
def test_llama_bitnet_generates_as_it_computes(family_files, source):
    """The compiled generator (f16 output table, f32 cache) of each file (the Hugging
    Face directory's under -m slow: its loading is checked by the forward above, and the
    generator is the one decoder's whichever file it came from)."""
    cfg, w, hf, path = family_files
    for src, stored in {"hf": ((hf, False),), "gguf": ((path, True),)}[source]:
        want = reference(cfg, w, IDS, gguf_stored=stored, f16_output=True)[0]
        gen = tc.compile_lm(models.load(src), max_seq=32, kv_dtype="float32")
        check(gen.prefill(IDS[0].astype(np.int32)), want)
        gen.reset()
        gen.prefill(IDS[0, :6].astype(np.int32))
        rows = np.stack([gen.decode(int(t)) for t in IDS[0, 6:]])
        check(rows, want[6:])


def test_a_float_llama_is_not_a_ternary_model(tmp_path, family_files):
    cfg, w, hf, _ = family_files
    config = json.loads((hf / "config.json").read_text())
    del config["quantization_config"]
    d = tmp_path / "float"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(models.ConfigError, match="float model, not a ternary one"):
        models.load(d)
    config.update(quantization_config={"quant_method": "bitnet"}, model_type="mistral")
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(models.ConfigError, match="not a ternary family"):
        models.load(d)


def projections(lm):
    """{name: (ternary codes, scale)} of every projection of `lm`."""
    return {f"{i}.{blk}.{p}": getattr(getattr(layer, blk), p).ternary()
            for i, layer in enumerate(lm.layers) for blk, p in
            (("attn", "q_proj"), ("attn", "k_proj"), ("attn", "v_proj"), ("attn", "o_proj"),
             ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))}


def test_save_gguf_writes_the_llama_arch(family_files, tmp_path):
    """A loaded llama-arch GGUF saves and loads back with identical logits; the same
    model loaded from Hugging Face saves to the layout llama.cpp's converter writes
    (q/k rows permuted, the scale in the f16 block scale, rope_freqs)."""
    cfg, w, hf, path = family_files
    lm = models.load(path)
    models.save_gguf(lm, tmp_path / "back.gguf")
    back = models.load(tmp_path / "back.gguf")
    assert (back.config.family, back.config.rope_freq_factors) == \
        ("llama_bitnet", lm.config.rope_freq_factors)
    np.testing.assert_array_equal(back(IDS), lm(IDS))
    r = gguf.GGUFReader(str(tmp_path / "back.gguf"))
    assert r.fields["general.architecture"].contents() == "llama"
    types = {t.name: t.tensor_type for t in r.tensors}
    assert (types["blk.0.attn_q.weight"], types["output.weight"], types["token_embd.weight"]) \
        == (QT.TQ2_0, QT.F16, QT.F16)
    assert not any(n.endswith(".scale") for n in types)
    models.save_gguf(models.load(hf), tmp_path / "from_hf.gguf")
    from_hf = models.load(tmp_path / "from_hf.gguf")
    assert from_hf.config.rope_style == "interleaved"
    mine, theirs = projections(from_hf), projections(lm)
    for name, (t, s) in theirs.items():
        np.testing.assert_array_equal(mine[name][0], t, err_msg=name)
        assert abs(mine[name][1] / s - 1) < 1e-3, name      # one f16 rounding apart
    check(from_hf(IDS)[0], lm(IDS)[0])


def peer_file(path, cfg, seed):
    """A converter-form llama GGUF at the family's shape with a small vocabulary (a
    tokenizer llama.cpp loads; the size changes nothing else it reads) and ~unit-gain
    projections, so that llama.cpp's per-256-block int8 activations and BitLinear's
    per-token ones round to the same function."""
    cfg = dict(cfg, vocab=2048)
    w = weights(cfg, seed=seed)
    for k in w:
        if k.endswith(".scale"):
            w[k] = np.float32(w[k] / 4)
    return cfg, write_gguf_llama(path, cfg, w, vocab=R.peer_vocab(cfg["vocab"]))


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_llama_cpp_agrees_on_the_llama_gguf(tmp_path, shape):
    """Teacher-forced logits and the first 8 greedy tokens of llama.cpp (the `peer`
    extra) on the converter's form and on the file save_gguf writes from it."""
    llama_cpp = pytest.importorskip("llama_cpp")
    cfg, path = peer_file(tmp_path / "m.gguf", SHAPES[shape], seed=5)
    models.save_gguf(models.load(path), tmp_path / "saved.gguf")
    ids = IDS[0] % cfg["vocab"]
    for src in (path, tmp_path / "saved.gguf"):
        R.check_llama_cpp_agrees(llama_cpp, src, ids, f"{shape} {src.name}")
