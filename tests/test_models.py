"""BitNet language models: llama.cpp's `bitnet` graph, GGUF and Hugging Face checkpoints.

Fixture files are written here with gguf's writer and safetensors; logits are checked
against the float64 NumPy reference of llama.cpp's graph in bitnet_ref.py.
"""
import json

import numpy as np
import pytest

import tercomp as tc
from tercomp import models, nn
from tercomp import ternary_pack as tp
from tercomp.passes import run_pipeline

import bitnet_ref as R
from gguf import GGMLQuantizationType as QT

CFG = dict(hidden=256, ff=512, vocab=300, heads=4, kv_heads=2, layers=2, eps=1e-5,
           theta=10000.0)
IDS = np.random.default_rng(1).integers(0, 300, (2, 16)).astype(np.int32)


def assert_matches(got, ref):
    """Logits equal up to f32 rounding. Rounding can move one activation across an int8
    rounding boundary now and then, which shifts that position's logits by ~1%: so every
    position must be close and the typical one very close."""
    cos = R.cosine(got, ref)
    assert cos.min() > 0.999 and np.median(cos) > 0.999999, (cos.min(), np.median(cos))
    assert R.top1_agreement(got, ref)[0] >= 0.95


@pytest.fixture(scope="module")
def tq2(tmp_path_factory):
    """A TQ2_0 GGUF (block scale 0.5, f32 .scale tensors, GQA 4/2 heads, silu)."""
    w = R.random_weights(CFG)
    path = R.write_gguf(tmp_path_factory.mktemp("gguf") / "tq2.gguf", CFG, w)
    return path, w


def test_config_from_gguf(tq2):
    lm = models.load(tq2[0])
    c = lm.config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
            c.num_attention_heads, c.num_key_value_heads) == (300, 256, 512, 2, 4, 2)
    assert (c.hidden_act, c.rope_style, c.tie_word_embeddings) == ("silu", "neox", True)
    assert lm.lm_head is None and lm.tokenizer is None
    q = lm.layers[1].attn.q_proj
    assert isinstance(q, nn.BitLinear) and q.parameters() == {}    # stored: frozen
    assert lm.layers[0].ffn is lm.layers[0].mlp
    assert q._packed.nbytes == 256 * 256 // 4                      # 2 bits per weight


def test_compiled_logits_match_llamacpp_reference(tq2):
    path, _ = tq2
    lm = models.load(path)
    w, _ = R.read_gguf_weights(path)
    exe = tc.compile(lm, tc.spec(("B", 16), "int32"))               # ternary="auto"
    got = exe(IDS)
    assert got.shape == (2, 16, 300) and got.dtype == np.float32
    # the same graph with BitLinear's per-token int8 activations: equal up to f32 rounding
    assert_matches(got, R.reference_logits(w, CFG, IDS, act="token"))
    # llama.cpp's graph in exact arithmetic: only the activation quantization differs
    ref = R.reference_logits(w, CFG, IDS, act="none")
    assert R.cosine(got, ref).min() > 0.999
    agree, n = R.top1_agreement(got, ref, margin=0.02 * np.abs(ref).max())
    assert n >= 16 and agree >= 0.95
    # a symbolic batch: batch 1 gives the rows of batch 2
    np.testing.assert_allclose(exe(IDS[:1]), got[:1], rtol=1e-5, atol=1e-4)


def test_static_shape_compile_matches_reference(tq2):
    """A static (1, 64) batch picks the data-tiled "blocked" kernel; the causal mask is
    then a bool constant inside a data-tiled attention dispatch (it used to fail in IREE)."""
    path, _ = tq2
    w, _ = R.read_gguf_weights(path)
    ids = np.random.default_rng(2).integers(0, 300, (1, 64)).astype(np.int32)
    exe = tc.compile(models.load(path), tc.spec(ids.shape, "int32"))
    assert_matches(exe(ids), R.reference_logits(w, CFG, ids, act="token"))


def test_ternary_pass_repacks_gguf_values_losslessly(tq2):
    path, w = tq2
    lm = models.load(path)
    g = run_pipeline(tc.trace(lm, tc.spec(("B", 16), "int32")),
                     [("ternary", {"strategy": "auto"})])
    mms = [op for op in g.ops if op.opname == "ternary_matmul"]
    assert len(mms) == 7 * CFG["layers"]
    assert not [op for op in g.ops if op.opname == "ternarize"]
    # the pass sees the layers in module order: q k v o gate up down per block
    for i, op in enumerate(mms):
        name = f"blk.{i // 7}.{R.PROJ[i % 7]}"
        packed = op.operands[1].producer.attrs["value"]
        if op.attrs.get("codes") == "offset":        # re-coded for the avx2 kernel
            packed = tp.from_offset_codes(packed)
        t = tp.unpack_ternary(packed, int(op.attrs["k"]))
        np.testing.assert_array_equal(t, w[name + ".weight"], err_msg=name)
        assert np.float32(op.attrs["scale"]) == np.float32(0.5 * w[name + ".scale"])


def test_tq1_0_f16_relu2_against_reference(tmp_path):
    cfg = dict(CFG, layers=1)
    w = R.random_weights(cfg, seed=3)
    path = R.write_gguf(tmp_path / "tq1.gguf", cfg, w, qtype=QT.TQ1_0, block_scale=0.25,
                        float_type=QT.F16, hidden_act="relu2")
    lm = models.load(path)
    assert lm.config.hidden_act == "relu2"
    t, s = lm.layers[0].mlp.down_proj.ternary()
    np.testing.assert_array_equal(t, w["blk.0.ffn_down.weight"])
    assert s == np.float32(0.25 * w["blk.0.ffn_down.scale"])
    ref = R.reference_logits(R.read_gguf_weights(path)[0], cfg, IDS, act="token",
                             hidden_act="relu2")
    got = lm(IDS)                                    # eager: the ops' NumPy references
    assert_matches(got, ref)


def test_float_ternary_projection_without_scale(tmp_path):
    """F32 projections holding ternary * one magnitude are stored weights too."""
    cfg = dict(CFG, layers=1)
    w = R.random_weights(cfg, seed=4)
    path = R.write_gguf(tmp_path / "f32.gguf", cfg, w, qtype=QT.F32, block_scale=0.125,
                        with_scale=False)
    lm = models.load(path)
    t, s = lm.layers[0].attn.k_proj.ternary()
    np.testing.assert_array_equal(t, w["blk.0.attn_k.weight"])
    assert s == np.float32(0.125)
    ref = R.reference_logits(R.read_gguf_weights(path)[0], cfg, IDS, act="token")
    assert_matches(lm(IDS), ref)


def test_interleaved_rope_matches_reference():
    cfg = models.BitNetConfig(vocab_size=300, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                              rope_style="interleaved", rope_theta=500000.0)
    nn.manual_seed(5)
    lm = models.BitNetLM(cfg)
    w = _gguf_named(lm)
    ref = R.reference_logits(w, dict(CFG, layers=1, kv_heads=1, theta=500000.0), IDS,
                             act="token", rope="interleaved")
    assert_matches(lm(IDS), ref)


def _gguf_named(lm):
    """An in-memory BitNetLM's weights under GGUF names, float64, ternarized as compiled."""
    w = {"token_embd.weight": lm.embed_tokens.weight.astype(np.float64),
         "output_norm.weight": lm.norm.weight.astype(np.float64)}
    for i, layer in enumerate(lm.layers):
        mods = {"attn_q": layer.attn.q_proj, "attn_k": layer.attn.k_proj,
                "attn_v": layer.attn.v_proj, "attn_output": layer.attn.o_proj,
                "ffn_gate": layer.mlp.gate_proj, "ffn_up": layer.mlp.up_proj,
                "ffn_down": layer.mlp.down_proj}
        for n, m in mods.items():
            t, s = m.ternary()
            w[f"blk.{i}.{n}.weight"] = t.astype(np.float64) * float(s)
        for n, m in (("attn_norm", layer.input_layernorm), ("attn_sub_norm",
                     layer.attn.attn_sub_norm), ("ffn_norm", layer.post_attention_layernorm),
                     ("ffn_sub_norm", layer.mlp.ffn_sub_norm)):
            w[f"blk.{i}.{n}.weight"] = m.weight.astype(np.float64)
    return w


def test_save_gguf_round_trip(tmp_path):
    cfg = models.BitNetConfig(vocab_size=300, hidden_size=256, intermediate_size=768,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              hidden_act="relu2", rope_theta=1e4)
    nn.manual_seed(6)
    lm = models.BitNetLM(cfg)                       # ordinary (float, absmean) BitLinears
    models.save_gguf(lm, tmp_path / "rt.gguf")
    back = models.load(tmp_path / "rt.gguf")
    assert back.config == cfg
    for a, b in zip(_projections(lm), _projections(back)):
        (ta, sa), (tb, sb) = a.ternary(), b.ternary()
        np.testing.assert_array_equal(ta, tb)
        assert sa == sb
    np.testing.assert_array_equal(lm(IDS), back(IDS))
    # and again from the loaded (stored-scale) model: the file is reproduced exactly
    models.save_gguf(back, tmp_path / "rt2.gguf")
    assert (tmp_path / "rt.gguf").read_bytes() == (tmp_path / "rt2.gguf").read_bytes()


def _projections(lm):
    for layer in lm.layers:
        a, m = layer.attn, layer.mlp
        yield from (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)


def test_save_gguf_refuses_untied(tmp_path):
    cfg = models.BitNetConfig(vocab_size=300, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                              tie_word_embeddings=False)
    with pytest.raises(tc.TercompError, match="output layer"):
        models.save_gguf(models.BitNetLM(cfg), tmp_path / "x.gguf")


def test_from_ternary_keeps_scale_and_trains_nothing():
    t = np.random.default_rng(0).choice([-1, 0, 1], size=(8, 256)).astype(np.int8)
    layer = nn.BitLinear.from_ternary(t, 0.03)
    tt, s = layer.ternary()
    np.testing.assert_array_equal(tt, t)
    assert s == np.float32(0.03)
    assert layer.parameters() == {}
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    xq, xs = tp.act_quant(x)
    np.testing.assert_allclose(layer(x), xq @ t.T.astype(np.float32) * 0.03 / xs, rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(tc.TercompError, match="not in"):
        nn.BitLinear.from_ternary(np.full((2, 4), 2), 1.0)
    with pytest.raises(tc.TercompError, match="scale"):
        nn.BitLinear.from_ternary(t, -1.0)


def test_config_json_round_trip_and_errors(tmp_path):
    cfg = models.BitNetConfig(vocab_size=300, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    d = dict(cfg.to_dict(), transformers_version="4.50", torch_dtype="bfloat16",
             model_type="bitnet")
    assert models.BitNetConfig.from_dict(json.loads(json.dumps(d))) == cfg
    with pytest.raises(models.ConfigError, match="'frobnicate'"):
        models.BitNetConfig.from_dict(dict(d, frobnicate=1), source="x/config.json")
    with pytest.raises(models.ConfigError, match="hidden_act"):
        models.BitNetConfig.from_dict(dict(d, hidden_act="gelu"))
    with pytest.raises(models.ConfigError, match="num_key_value_heads"):
        models.BitNetConfig.from_dict(dict(d, num_key_value_heads=3))


def test_ternary_pass_uses_the_stored_scale():
    from conftest import run_filecheck
    t = np.random.default_rng(0).choice([-1, 0, 1], size=(64, 256)).astype(np.int8)
    layer = nn.BitLinear.from_ternary(t, 2.5)
    g = tc.trace(layer, tc.spec(("B", 256), "float32"))
    run_filecheck(str(g), """
# CHECK: "tern.act_quant"
# CHECK: %[[P:.*]] = "tern.constant"() {{.*}} : () -> tensor<64x64xi8>
# CHECK: "tern.ternary_weight"(%[[P]]) {k = 256 : i64, scale = 2.5
# CHECK: "tern.matmul"
""")
    out = run_pipeline(g, [("ternary", {"strategy": "auto"})])
    run_filecheck(str(out), """
# CHECK-NOT: "tern.ternary_weight"
# CHECK: "tern.ternary_matmul"({{.*}}) {act_quant = true, {{(codes = "offset", )?}}k = 256 : i64, n = 64 : i64, scale = 2.5
# CHECK-NOT: "tern.matmul"
""")
    # the stored bytes reach the kernel as they are (re-coded where its kernel reads the
    # offset codes): no repacking at compile time
    packed = [op.attrs["value"] for op in out.ops if op.opname == "constant"
              and op.results[0].type.dtype == "i8"]
    (mm,) = [op for op in out.ops if op.opname == "ternary_matmul"]
    if mm.attrs.get("codes") == "offset":
        packed = [tp.from_offset_codes(p) for p in packed]
    assert len(packed) == 1 and np.array_equal(packed[0].view(np.uint8), layer._packed)
    # without the pass (ternary="off") ternary_weight unpacks them: the same numbers
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32)
    ref = tc.compile(layer, tc.spec(("B", 256), "float32"), cache=False)(x)
    off = tc.compile(layer, tc.spec(("B", 256), "float32"), ternary="off", cache=False)
    np.testing.assert_allclose(off(x), ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(layer(x), ref, rtol=1e-5, atol=1e-4)
