"""The Qwen3 and Gemma3 backbones of BitNet's embedding models (families qwen3 and
gemma3): loaded from a Hugging Face directory and from a GGUF as bitnet.cpp's converter
writes them, at scaled-down shapes, against the float64 reference written from the
published architectures (tests/backbone_ref.py)."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file

import tercomp as tc
from tercomp import models

import backbone_ref as B
import bitnet_ref as R
from tercomp.models.gguf_io import _GGUFReader

IDS = np.array([[5, 17, 42, 7, 99, 3, 250, 11], [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)


def check(got, want):
    cos = R.cosine(got, want)
    top1, n = R.top1_agreement(got, want, margin=0.05)
    assert cos.min() >= 0.999 and top1 >= 0.95 and n > 0, (cos.min(), top1, n)


@pytest.fixture(scope="module", params=sorted(B.SHAPES))
def files(request, tmp_path_factory):
    cfg = B.SHAPES[request.param]
    w = B.weights(cfg, seed=len(request.param))
    d = tmp_path_factory.mktemp(request.param)
    return cfg, w, B.write_hf(d / "hf", cfg, w), B.write_gguf(d / "m.gguf", cfg, w)


def test_hf_directory_loads_and_agrees(files):
    cfg, w, hf, _ = files
    lm = models.load(hf)
    c = lm.config
    gemma = cfg["family"] == "gemma3"
    assert (c.family, c.proj_norms, c.qk_norm, c.post_norms, c.scale_embeddings, c.head_dim,
            c.pooling, c.tie_word_embeddings) == \
        (cfg["family"], True, True, gemma, gemma, cfg["head_dim"], "last", True)
    if gemma:
        assert c.layer_types == tuple(cfg["layer_types"]) and c.sliding_window == cfg["window"]
        assert c.hidden_act == "gelu_pytorch_tanh" and c.rope_local_base_freq == 10000.0
    check(lm(IDS), B.reference_logits(cfg, w, IDS))


@pytest.mark.parametrize("projection", ["i2s", "tq2"])
def test_gguf_loads_and_agrees(files, projection, tmp_path):
    cfg, w, _, path = files
    if projection == "i2s":     # the file bitnet.cpp publishes: I2_S projections
        path = B.write_gguf(tmp_path / "i2s.gguf", cfg, w, projection=B.i2s_projection)
    lm = models.load(path)
    c = lm.config
    assert (c.family, c.proj_norms, c.qk_norm, c.head_dim, c.pooling) == \
        (cfg["family"], True, True, cfg["head_dim"], "last")
    if cfg["family"] == "gemma3":
        assert c.query_pre_attn_scalar == pytest.approx(cfg["query_pre_attn_scalar"])
        assert c.sliding_window == cfg["window"] and c.layer_types[0] == "sliding_attention"
    check(lm(IDS), B.reference_logits(cfg, w, IDS))


def test_a_gemma3_gguf_with_the_converters_keys_only(tmp_path):
    """bitnet.cpp's converter writes no window, layer pattern or attention scale: the
    file then means what llama.cpp's gemma3 graph computes (a sliding layer every 6 of
    RoPE base 10000, attention over all positions, scores times head_dim**-0.5)."""
    cfg = {**B.SHAPES["gemma3"], "layers": 7}
    w = B.weights(cfg)
    c = models.load(B.write_gguf(tmp_path / "m.gguf", cfg, w, gemma_keys=False)).config
    assert c.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert (c.sliding_window, c.rope_local_base_freq, c.attention_scale) == \
        (64, 10000.0, 256 ** -0.5)


def test_an_untied_head(files, tmp_path):
    cfg, w, _, _ = files
    rng = np.random.default_rng(7)
    w = {**w, "lm_head.weight": rng.standard_normal((cfg["vocab"], cfg["hidden"]))
         .astype(np.float16).astype(np.float32)}
    want = B.reference_logits(cfg, w, IDS)
    for path in (B.write_hf(tmp_path / "hf", cfg, w, prefix=""),      # a base-model layout
                 B.write_gguf(tmp_path / "m.gguf", cfg, w)):
        lm = models.load(path)
        assert lm.config.tie_word_embeddings is False and lm.lm_head is not None
        check(lm(IDS), want)


@pytest.mark.parametrize("max_batch", [1, 2])
def test_compile_lm_generates_as_the_forward_computes(files, max_batch):
    """Prefill and decode past the sliding window (Gemma3's layer 0: a window of 4 in a
    16-row cache) against the float64 reference, which masks keys more than 4 back:
    the single-sequence cache (max_batch=1) and the slots of the batched generator."""
    cfg, w, hf, _ = files
    lm = models.load(hf)
    want = B.reference_logits(cfg, w, IDS)
    if cfg["family"] == "gemma3":       # the window changes these logits: a real check
        full = {**cfg, "layer_types": ["full_attention"] * cfg["layers"]}
        assert R.cosine(B.reference_logits(full, w, IDS)[:, 5:], want[:, 5:]).min() < 0.99
    gen = tc.compile_lm(lm, max_seq=16, output_dtype="float32", kv_dtype="float32",
                        max_batch=max_batch)
    n = 3                               # a prompt inside the window, then decode past it
    if max_batch == 1:
        got = [np.concatenate([gen.prefill(IDS[0][:n])] + [gen.decode(int(t))[None]
                                                          for t in IDS[0][n:-1]])]
        got.append(gen.prefill(IDS[1]))     # a prefill longer than the window
    else:
        heads = [gen.prefill(IDS[1][:n + 2], slot=0), gen.prefill(IDS[0][:n], slot=1)]
        steps = []
        for i in range(IDS.shape[1] - 1 - n):      # both sequences step together
            toks = [IDS[0][n + i]] + ([IDS[1][n + 2 + i]] if n + 2 + i < IDS.shape[1] - 1 else [])
            steps.append(gen.step(toks, [1, 0][:len(toks)]))
        got = [np.concatenate([heads[1]] + [s[0][None] for s in steps]),
               np.concatenate([heads[0]] + [s[1][None] for s in steps if len(s) > 1])]
    for g, want_seq in zip(got, want):
        check(g[None], want_seq[None, :len(g)])
        assert len(g) >= 7


@pytest.mark.parametrize("ternary_type", ["TQ2_0", "I2_S"])
def test_save_gguf_round_trip(files, ternary_type, tmp_path):
    """save_gguf of a model loaded from either format loads back with the same config
    and identical logits."""
    cfg, w, hf, path = files
    for src in (hf, path):
        lm = models.load(src)
        out = tmp_path / f"{ternary_type}.gguf"
        models.save_gguf(lm, out, ternary_type=ternary_type)
        back = models.load(out)
        assert back.config == lm.config
        np.testing.assert_array_equal(back(IDS), lm(IDS))


def test_save_gguf_writes_the_embedding_converters_layout(files, tmp_path):
    """A file bitnet.cpp's embedding converter wrote (I2_S projections, F16 tables and
    norms) saved again as I2_S: the same tensors, types and bytes; the same keys plus
    the activation and the name."""
    cfg, w, _, _ = files
    conv = B.write_gguf(tmp_path / "conv.gguf", cfg, w, projection=B.i2s_projection)
    models.save_gguf(models.load(conv), tmp_path / "out.gguf", ternary_type="I2_S")
    a, b = _GGUFReader(str(conv)), _GGUFReader(str(tmp_path / "out.gguf"))
    ta, tb = ({t.name: t for t in r.tensors} for r in (a, b))
    assert sorted(ta) == sorted(tb)
    for name, t in ta.items():
        assert (t.tensor_type.name, list(t.shape)) == (tb[name].tensor_type.name,
                                                       list(tb[name].shape)), name
        np.testing.assert_array_equal(np.asarray(t.data), np.asarray(tb[name].data))
    arch = "gemma3" if cfg["family"] == "gemma3" else "qwen3"
    assert set(b.fields) - set(a.fields) == {"general.name", f"{arch}.hidden_activation"}
    assert set(a.fields) <= set(b.fields)


def test_save_hf_round_trip(files, tmp_path):
    cfg, w, hf, path = files
    for src in (hf, path):
        lm = models.load(src)
        models.save_hf(lm, tmp_path / "out")
        back = models.load(tmp_path / "out")
        assert back.config == lm.config and back.config.pooling == "last"
        np.testing.assert_array_equal(back(IDS), lm(IDS))
    conf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert conf["architectures"] == [{"qwen3": "Qwen3ForCausalLM",
                                      "gemma3": "Gemma3ForCausalLM"}[cfg["family"]]]
    st = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert "model.layers.1.mlp.down_proj.norm.weight" in st
    if cfg["family"] == "gemma3":       # Gemma's norms as the w of (1 + w), as published
        np.testing.assert_array_equal(st["model.layers.0.post_feedforward_layernorm.weight"],
                                      w["layers.0.post_feedforward_layernorm.weight"])


def test_save_hf_keeps_a_gemma_norm_that_float32_w_would_not(tmp_path):
    # 1 + w = 1e-3: float32(w) = float32(1e-3 - 1) does not give 1e-3 back; written as
    # float64, it loads back exactly
    cfg = B.SHAPES["gemma3"]
    lm = models.load(B.write_hf(tmp_path / "hf", cfg, B.weights(cfg)))
    lm.layers[0].attn.q_norm.weight[:3] = np.float32([1e-3, -2.5e-7, 3.0])
    models.save_hf(lm, tmp_path / "out")
    back = models.load(tmp_path / "out")
    np.testing.assert_array_equal(back.layers[0].attn.q_norm.weight, lm.layers[0].attn.q_norm.weight)
    np.testing.assert_array_equal(back(IDS), lm(IDS))


def test_save_refuses_what_the_family_graph_would_not_compute(files, tmp_path):
    cfg, w, hf, _ = files
    lm = models.load(hf)
    lm.config.hidden_act = "relu2"
    for save in (models.save_gguf, models.save_hf):
        with pytest.raises(tc.TercompError, match="hidden_act is 'relu2', where the"):
            save(lm, tmp_path / "x")
    assert not (tmp_path / "x").exists()
    if cfg["family"] == "gemma3":       # llama.cpp's gemma3 fixes the local RoPE base
        lm = models.load(hf)
        lm.config.rope_local_base_freq = 5000.0
        with pytest.raises(tc.TercompError, match="RoPE base is 5000.0"):
            models.save_gguf(lm, tmp_path / "y.gguf")
        models.save_hf(lm, tmp_path / "hf2")
        assert models.load(tmp_path / "hf2").config.rope_local_base_freq == 5000.0


def test_projection_norms_on_some_layers_only(files, tmp_path):
    cfg, w, _, _ = files
    w = {k: v for k, v in w.items() if k != "layers.1.mlp.down_proj.norm.weight"}
    B.write_hf(tmp_path / "hf", cfg, w)
    with pytest.raises(models.CheckpointError,
                       match=r"model\.safetensors: per-projection norm tensors on some "
                             r"projections only.*layers\.1\.mlp\.down_proj\.norm\.weight"):
        models.load(tmp_path / "hf")
    B.write_gguf(tmp_path / "m.gguf", cfg, w)
    with pytest.raises(models.GGUFError,
                       match=r"m\.gguf: tensor 'blk\.1\.ffn_down_norm_in\.weight': missing.*"
                             r"some projections only"):
        models.load(tmp_path / "m.gguf")


def test_unknown_pooling_type_is_refused(files, tmp_path):
    cfg, w, _, _ = files
    B.write_gguf(tmp_path / "m.gguf", cfg, w, pooling=4)
    with pytest.raises(models.ConfigError, match=r"m\.gguf: key '\w+\.pooling_type': "
                                                 r"pooling type 4 is not supported"):
        models.load(tmp_path / "m.gguf")
    B.write_hf(tmp_path / "hf", cfg, w, pooling="max_tokens")
    with pytest.raises(models.ConfigError, match=r"1_Pooling/config\.json: pooling "
                                                 r"pooling_mode_max_tokens is not supported"):
        models.load(tmp_path / "hf")


def test_a_float_qwen3_is_not_a_ternary_model(tmp_path):
    cfg = B.SHAPES["qwen3"]
    w = {k: v for k, v in B.weights(cfg).items() if not k.endswith("_proj.norm.weight")}
    B.write_hf(tmp_path, cfg, w)
    with pytest.raises(models.ConfigError, match="is a float model"):
        models.load(tmp_path)


def test_soft_capping_is_refused(tmp_path):
    cfg = B.SHAPES["gemma3"]
    B.write_hf(tmp_path, cfg, B.weights(cfg))
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["final_logit_softcapping"] = 30.0
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(models.ConfigError, match="final_logit_softcapping"):
        models.load(tmp_path)
