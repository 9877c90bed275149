"""Model files: Hugging Face directories, tokenizers, malformed inputs, llama.cpp peer."""
import json
import os

import numpy as np
import pytest

import tercomp as tc
from tercomp import models

import bitnet_ref as R
import gguf
from gguf import GGMLQuantizationType as QT

CFG = dict(hidden=256, ff=512, vocab=300, heads=4, kv_heads=2, layers=1, eps=1e-5,
           theta=10000.0)
IDS = np.random.default_rng(2).integers(0, 300, (2, 12)).astype(np.int32)
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
            "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
            "attn_sub_norm": "self_attn.attn_sub_norm", "ffn_sub_norm": "mlp.ffn_sub_norm"}


def hf_config(**kw):
    return dict({"architectures": ["BitNetForCausalLM"], "model_type": "bitnet",
                 "vocab_size": 300, "hidden_size": 256, "intermediate_size": 512,
                 "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "relu2",
                 "tie_word_embeddings": False, "max_position_embeddings": 128,
                 "quantization_config": {"quant_method": "bitnet", "linear_class": "bitlinear",
                                         "quantization_mode": "offline"},
                 "transformers_version": "4.52.0", "torch_dtype": "bfloat16"}, **kw)


def write_hf(directory, packed=True, seed=0, config=None, drop=(), tokenizer=None):
    """A BitNetForCausalLM directory; returns (GGUF-named float64 weights, lm_head)."""
    os.makedirs(directory, exist_ok=True)
    w = R.random_weights(CFG, seed=seed)
    rng = np.random.default_rng(seed + 100)
    ref, st, bf = {}, {}, set()
    for name, arr in w.items():
        if name.endswith(".scale"):
            continue
        if name in ("token_embd.weight", "output_norm.weight"):
            hf = "model.embed_tokens.weight" if name.startswith("token") else "model.norm.weight"
        else:
            _, i, g, _ = name.split(".")
            hf = f"model.layers.{i}.{HF_NAMES[g]}.weight"
        if arr.dtype == np.int8 and packed:
            ws = np.float32(1.0 / w[name[:-7] + ".scale"])
            st[hf], st[hf + "_scale"] = R.hf_pack(arr), np.array([ws], np.float32)
            ref[name] = arr / np.float64(ws)            # y = (x @ T^T) / weight_scale
        elif arr.dtype == np.int8:                       # a plain float checkpoint
            st[hf] = (arr * 0.05 + 0.01 * rng.standard_normal(arr.shape)).astype(np.float32)
            t = np.clip(np.rint(st[hf] / np.abs(st[hf]).mean()), -1, 1)
            ref[name] = t * np.float64(np.float32(np.abs(st[hf].astype(np.float64)).mean()))
        else:
            st[hf], ref[name] = R.bf16(arr), R.bf16(arr).astype(np.float64)
            bf.add(hf)
    head = R.bf16(rng.standard_normal((300, 256)) * 0.1)
    st["lm_head.weight"] = head
    bf.add("lm_head.weight")
    for n in drop:
        st.pop(n)
    R.save_safetensors(os.path.join(directory, "model.safetensors"), st, bf16_names=bf)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(config or hf_config(), fh)
    if tokenizer is not None:
        tokenizer.save(os.path.join(directory, "tokenizer.json"))
    return ref, head.astype(np.float64)


def test_hf_2b4t_packed_layout(tmp_path):
    from tokenizers import Tokenizer, models as tm, pre_tokenizers
    tok = Tokenizer(tm.WordLevel({w: i for i, w in enumerate(["<unk>", "hello", "world"])},
                                 unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    ref_w, head = write_hf(tmp_path / "hf", tokenizer=tok)
    lm = models.load(tmp_path / "hf")
    c = lm.config
    assert (c.hidden_act, c.tie_word_embeddings, c.rope_style) == ("relu2", False, "neox")
    assert lm.lm_head is not None
    assert lm.tokenizer.encode("hello world").ids == [1, 2]
    ref = R.reference_logits(ref_w, CFG, IDS, act="token", hidden_act="relu2", lm_head=head)
    got = lm(IDS)          # eager (the compiled path is checked on the GGUF model)
    cos = R.cosine(got, ref)
    assert cos.min() > 0.999 and np.median(cos) > 0.999999
    assert R.top1_agreement(got, ref)[0] >= 0.95
    with pytest.raises(tc.TercompError, match="output layer"):
        models.save_gguf(lm, tmp_path / "x.gguf")     # untied: llama.cpp would differ


def test_hf_float_checkpoint_is_ternarized_by_absmean(tmp_path):
    ref_w, head = write_hf(tmp_path / "hf", packed=False, seed=1,
                           config=hf_config(quantization_config=None))
    lm = models.load(tmp_path / "hf")
    assert "layers.0.attn.q_proj.weight" in lm.parameters()     # ordinary, trainable
    ref = R.reference_logits(ref_w, CFG, IDS, act="token", hidden_act="relu2", lm_head=head)
    cos = R.cosine(lm(IDS), ref)
    assert cos.min() > 0.999 and np.median(cos) > 0.999999


@pytest.mark.parametrize("change, match", [
    (dict(frobnicate=3), "'frobnicate'"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(model_type="llama"), "model_type"),
    (dict(rope_scaling={"type": "yarn", "factor": 4}), "rope_scaling"),
])
def test_hf_bad_config(tmp_path, change, match):
    write_hf(tmp_path / "hf", config=hf_config(**change))
    with pytest.raises(models.ConfigError, match=match) as e:
        models.load(tmp_path / "hf")
    assert "config.json" in str(e.value)


def test_hf_missing_and_misshapen_tensors(tmp_path):
    write_hf(tmp_path / "a", drop=("model.layers.0.mlp.up_proj.weight_scale",))
    with pytest.raises(models.CheckpointError, match="up_proj.weight_scale"):
        models.load(tmp_path / "a")
    write_hf(tmp_path / "b", config=hf_config(intermediate_size=768))
    with pytest.raises(models.CheckpointError,
                       match=r"gate_proj.weight' has shape \[128, 256\].*\[192, 256\]"):
        models.load(tmp_path / "b")


def test_hf_packed_code_3_is_a_checkpoint_error():
    from tercomp.models.hf_io import unpack_hf_ternary
    packed = np.full((1, 4), 0b01_11_01_01, np.uint8)       # row 2 holds code 3
    with pytest.raises(models.CheckpointError, match=r"^m.safetensors: tensor 'w' holds the invalid 2-bit code 3"):
        unpack_hf_ternary(packed, 4, "m.safetensors: tensor 'w'")
    assert unpack_hf_ternary(np.full((1, 2), 0b10_10_01_00, np.uint8), 3).tolist() == [[-1, -1], [0, 0], [1, 1]]


# ------------------------------------------------------------------------ GGUF inputs
@pytest.fixture(scope="module")
def weights():
    return R.random_weights(CFG, seed=7)


def _load_error(path, match, cls=models.GGUFError):
    with pytest.raises(cls, match=match) as e:
        models.load(path)
    assert str(path) in str(e.value)
    return e.value


def test_gguf_bad_inputs(tmp_path, weights):
    w = weights
    _load_error(R.write_gguf(tmp_path / "falcon.gguf", CFG, w, arch="falcon"),
                "architecture 'falcon'; tercomp reads 'bitnet', 'llama'")
    # a bitnet model labelled llama: its sub-norms are not llama's
    _load_error(R.write_gguf(tmp_path / "llama.gguf", CFG, w, arch="llama"),
                "'blk.0.attn_sub_norm.weight': not part of a 1-layer 'llama_bitnet' model")
    _load_error(R.write_gguf(tmp_path / "miss.gguf", CFG, w, skip=("blk.0.ffn_up.weight",)),
                "'blk.0.ffn_up.weight': missing")
    q8 = gguf.quants.quantize(w["blk.0.attn_q.weight"].astype(np.float32), QT.Q8_0)
    _load_error(R.write_gguf(tmp_path / "q8.gguf", CFG, w,
                             override={"blk.0.attn_q.weight": (q8, QT.Q8_0)}),
                "'blk.0.attn_q.weight'.*Q8_0 is not supported")
    big = gguf.quants.quantize(np.ones((256, 256), np.float32), QT.TQ2_0)
    _load_error(R.write_gguf(tmp_path / "shape.gguf", CFG, w,
                             override={"blk.0.attn_k.weight": (big, QT.TQ2_0)}),
                r"'blk.0.attn_k.weight'.*\[256, 256\] contradicts the header.*\[128, 256\]")
    blocks = w["blk.0.ffn_gate.weight"].astype(np.float32)
    blocks = blocks * np.where(np.arange(512) % 2, 0.5, 0.25)[:, None]   # 2 block scales
    mixed = gguf.quants.quantize(blocks, QT.TQ2_0)
    _load_error(R.write_gguf(tmp_path / "mixed.gguf", CFG, w,
                             override={"blk.0.ffn_gate.weight": (mixed, QT.TQ2_0)}),
                "'blk.0.ffn_gate.weight'.*2 different scales")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    _load_error(tmp_path / "junk.gguf", "not a GGUF file")


def test_gguf_tq2_0_blocks_load_exactly(tmp_path, weights):
    """TQ2_0 projections go straight into tercomp's packed layout: the loaded layer's
    (T, scale) is the file's, a block whose f16 scale is 0 loads as zeros (as llama.cpp
    computes it), and a code 3 is refused with the tensor named."""
    t = weights["blk.0.ffn_gate.weight"]                               # int8 [512, 256]
    blocks = gguf.quants.quantize(t.astype(np.float32) * np.float32(0.5), QT.TQ2_0)
    raw = blocks.reshape(-1, 66).copy()
    raw[3, 64:] = np.frombuffer(np.float16(0).tobytes(), np.uint8)    # block 3: scale 0
    path = R.write_gguf(tmp_path / "z.gguf", CFG, weights,
                        override={"blk.0.ffn_gate.weight": (raw.reshape(blocks.shape), QT.TQ2_0)})
    got_t, got_s = models.load(path).layers[0].mlp.gate_proj.ternary()
    want = t.copy()
    want[3] = 0                               # K = 256: block 3 is row 3
    np.testing.assert_array_equal(got_t, want)
    assert got_s == np.float32(0.5 * weights["blk.0.ffn_gate.scale"])
    raw[5, 7] = 0b11_01_10_00                                          # a code 3 in block 5
    path = R.write_gguf(tmp_path / "c3.gguf", CFG, weights,
                        override={"blk.0.ffn_gate.weight": (raw.reshape(blocks.shape), QT.TQ2_0)})
    _load_error(path, "'blk.0.ffn_gate.weight'.*invalid TQ2_0 code 3")


def test_gguf_truncated_never_crashes(tmp_path, weights):
    whole = R.write_gguf(tmp_path / "ok.gguf", CFG, weights).read_bytes()
    for cut in (len(whole) - 1000, len(whole) // 2, 600, 40, 10):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(whole[:cut])
        _load_error(p, "GGUF")


def test_gguf_mutated_headers_never_crash(tmp_path, weights):
    """Random byte changes (mostly in the header: counts, lengths, dims, types) either
    load or raise a TercompError, quickly, without allocating what the header claims."""
    import tracemalloc
    whole = R.write_gguf(tmp_path / "ok.gguf", CFG, weights).read_bytes()
    rng = np.random.default_rng(0)
    p = tmp_path / "m.gguf"
    for i in range(150):
        b = bytearray(whole)
        for _ in range(rng.integers(1, 4)):
            pos = rng.integers(0, 3000) if rng.random() < 0.8 else rng.integers(0, len(b))
            b[pos] = rng.integers(0, 256)
        p.write_bytes(bytes(b))
        tracemalloc.start()
        try:
            models.load(p)
        except tc.TercompError:
            pass
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < 64 << 20, f"mutation {i} made loading allocate {peak >> 20} MiB"


# ------------------------------------------------------------------------- tokenizers
def test_gguf_gpt2_vocab_tokenizer_and_save_round_trip(tmp_path, weights):
    from tokenizers import pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["h e", "l l", "o Ġ", "w o", "r l"]
    tokens = alphabet + ["".join(m.split()) for m in merges]
    tokens += [f"<x{i}>" for i in range(300 - len(tokens))]
    path = R.write_gguf(tmp_path / "v.gguf", CFG, weights,
                        vocab={"model": "gpt2", "tokens": tokens, "merges": merges})
    lm = models.load(path)
    enc = lm.tokenizer.encode("hello world")
    assert tokens.index("he") in enc.ids and tokens.index("ll") in enc.ids
    assert lm.tokenizer.decode(enc.ids) == "hello world"
    models.save_gguf(lm, tmp_path / "again.gguf")
    again = models.load(tmp_path / "again.gguf")
    assert again.tokenizer.encode("hello world").ids == enc.ids


def test_gguf_llama_vocab_tokenizer(tmp_path, weights):
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁hello", "▁world", "▁", "h", "e", "l", "o", "w", "r", "d"]
    pieces += words + [f"▁w{i}" for i in range(300 - len(pieces) - len(words))]
    scores = [0.0] * 259 + [-1.0 - 0.1 * i for i in range(300 - 259)]
    path = R.write_gguf(tmp_path / "sp.gguf", CFG, weights,
                        vocab={"model": "llama", "tokens": pieces, "scores": scores})
    tok = models.load(path).tokenizer
    ids = tok.encode("hello world").ids
    assert ids == [pieces.index("▁hello"), pieces.index("▁world")]
    assert tok.decode(ids) == "hello world"
    assert tok.decode(tok.encode("hi ✓").ids) == "hi ✓"      # byte fallback


def test_hf_tokenizer_saved_as_gguf_vocabulary(tmp_path):
    from tokenizers import Tokenizer, decoders, models as tm, pre_tokenizers, trainers
    tok = Tokenizer(tm.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["def hello(world): return world + 1"] * 20,
                            trainers.BpeTrainer(vocab_size=290, special_tokens=["<s>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel
                                                .alphabet()))
    write_hf(tmp_path / "hf", config=hf_config(tie_word_embeddings=True), tokenizer=tok)
    lm = models.load(tmp_path / "hf")
    models.save_gguf(lm, tmp_path / "t.gguf")
    back = models.load(tmp_path / "t.gguf")
    text = "def hello(world): return 42"
    assert back.tokenizer.encode(text).ids == lm.tokenizer.encode(text).ids
    assert back.tokenizer.decode(back.tokenizer.encode(text).ids) == text
    assert back.gguf_vocab["tokenizer.ggml.token_type"][1][0] == 3     # <s>: control


# ------------------------------------------------------------------- llama.cpp peer
def test_llama_cpp_peer_logits(tmp_path, weights):
    """Teacher-forced logits of llama.cpp (llama-cpp-python, the `peer` extra)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = R.write_gguf(tmp_path / "peer.gguf", CFG, weights, vocab=R.peer_vocab(300))
    lm = models.load(path)
    ids = IDS[0]
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False)
    llm.eval(ids.tolist())
    theirs = np.array(llm.scores[: len(ids)], dtype=np.float64)
    ours = tc.compile(lm, tc.spec((1, len(ids)), "int32"))(ids[None])[0]
    assert R.cosine(ours, theirs).min() >= 0.999
    agree, n = R.top1_agreement(ours, theirs, margin=0.02 * np.abs(theirs).max())
    assert n == 0 or agree >= 0.95


def test_llama_cpp_agrees_on_what_save_gguf_writes(tmp_path):
    """The `bitnet` file save_gguf writes (TQ2_0 blocks of scale 1, f32 `.scale`
    tensors, the activation key): llama.cpp's logits and first 8 greedy tokens equal
    tc.compile_lm's."""
    llama_cpp = pytest.importorskip("llama_cpp")
    cfg = dict(CFG, layers=2)
    src = R.write_gguf(tmp_path / "src.gguf", cfg, R.random_weights(cfg, seed=9),
                       vocab=R.peer_vocab(cfg["vocab"]))
    models.save_gguf(models.load(src), tmp_path / "saved.gguf")
    R.check_llama_cpp_agrees(llama_cpp, tmp_path / "saved.gguf", IDS[0], "bitnet save_gguf form")


@pytest.mark.slow
def test_tiny_lm_sample(tmp_path):
    import tiny_lm
    losses, val_loss = tiny_lm.main(["--steps", "80", "--seconds", "120", "--tokens", "8",
                                     "--plot", str(tmp_path / "loss.png"),
                                     "--out", str(tmp_path / "tiny.gguf")])
    assert np.mean(losses[-10:]) < np.mean(losses[:10]) - 1.0
    assert val_loss < np.log(256) - 1.5
    try:
        import matplotlib  # noqa: F401  (the `samples` extra)
    except ImportError:
        return
    assert (tmp_path / "loss.png").stat().st_size > 0
