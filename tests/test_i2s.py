"""bitnet.cpp's I2_S GGUF files, read and written.

What bitnet.cpp writes (microsoft/BitNet src/ggml-bitnet-mad.cpp `quantize_i2_s`, 2024
and current x86 versions, and utils/convert-hf-to-gguf-bitnet.py `quantize_to_i2_s`;
its llama.cpp fork's ggml.c for the type): GGML type 36, row-major weights cut into
blocks of 128, weight j of a block in byte j % 32 at bits 6 - 2 * (j // 32) as the code
w + 1; after the n / 4 code bytes the float32 tensor scale (max |W|), then padding to
n / 4 + 32 bytes (llama-quantize leaves the padding uninitialized). 2B4T's file is arch
`bitnet-b1.58` (earlier `bitnet-25`): relu2, NeoX RoPE, sub-norms, tied embedding (f16),
norms f32, file_type 40, no `*.scale` tensors and no activation key.

The writer here is the test's own, written from those facts, not tercomp's."""
import dataclasses
import re

import numpy as np
import pytest

import gguf

import tercomp as tc
from tercomp import models
from tercomp import ternary_pack as tp

import bitnet_ref as R

# 2B4T's shape scaled down: GQA 2:1, head_dim 64, relu2, theta 500000
CFG = dict(hidden=256, ff=512, vocab=300, heads=4, kv_heads=2, layers=1, eps=1e-5,
           theta=500000.0, ctx=256)
IDS = np.random.default_rng(3).integers(0, 300, (1, 12))


def i2s_bytes(t, scale, pad=b"\0" * 28):
    """An I2_S tensor's data, packed weight by weight as quantize_i2_s does."""
    codes = (t.reshape(-1) + 1).astype(np.uint8)
    out = np.zeros(codes.size // 4, np.uint8)
    for j in range(128):
        blocks = codes[j::128]
        out[np.arange(blocks.size) * 32 + j % 32] |= blocks << (6 - 2 * (j // 32))
    return np.concatenate([out, np.frombuffer(np.float32(scale).tobytes() + pad, np.uint8)])


def write_i2s(path, cfg, w, arch="bitnet-b1.58", override=None, pad=b"\0" * 28):
    """`w` (bitnet_ref.random_weights) as bitnet.cpp's converter + llama-quantize write
    2B4T; `override` gives a tensor's raw I2_S bytes."""
    override = override or {}
    wr = gguf.GGUFWriter(str(path), arch)
    wr.add_name("bitnet2b")
    wr.add_vocab_size(cfg["vocab"])
    wr.add_context_length(cfg["ctx"])
    wr.add_embedding_length(cfg["hidden"])
    wr.add_block_count(cfg["layers"])
    wr.add_feed_forward_length(cfg["ff"])
    wr.add_rope_dimension_count(cfg["hidden"] // cfg["heads"])
    wr.add_head_count(cfg["heads"])
    wr.add_head_count_kv(cfg["kv_heads"])
    wr.add_rope_freq_base(cfg["theta"])
    wr.add_layer_norm_rms_eps(cfg["eps"])
    wr.add_file_type(40)                                 # LLAMA_FTYPE_MOSTLY_I2_S
    for name, arr in w.items():
        if name.endswith(".scale"):
            continue
        if arr.dtype == np.int8:
            data = override.get(name)
            if data is None:
                data = i2s_bytes(arr, w[name[:-7] + ".scale"], pad)
            wr.add_tensor(name, data.view(np.int8), raw_shape=arr.shape, raw_dtype=36)
        elif name == "token_embd.weight":
            wr.add_tensor(name, arr.astype(np.float16))
        else:
            wr.add_tensor(name, arr)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


@pytest.fixture(scope="module")
def weights():
    w = R.random_weights(CFG, seed=11)
    w["token_embd.weight"] = w["token_embd.weight"].astype(np.float16).astype(np.float32)
    return w


def test_i2s_codec_is_the_documented_layout():
    t = np.random.default_rng(0).integers(-1, 2, (6, 512)).astype(np.int8)
    assert (tp.to_i2_s(t) == i2s_bytes(t, 1.0)[:-32]).all()
    np.testing.assert_array_equal(tp.from_i2_s(tp.to_i2_s(t), 6, 512), tp.pack_ternary(t))



def test_relayout_of_a_large_matrix_in_row_blocks():
    """A matrix of several row blocks is re-laid block by block (the last one short) and
    a code 3 in any block is caught."""
    rng = np.random.default_rng(1)
    t = rng.integers(-1, 2, (2049, 2048)).astype(np.int8)
    packed = tp.from_i2_s(tp.to_i2_s(t), *t.shape)
    np.testing.assert_array_equal(packed, tp.pack_ternary(t))
    codes = tp.to_i2_s(t)
    codes[-1] |= 0xC0                   # a code 3 in the last row's last byte
    assert tp.from_i2_s(codes, *t.shape) is None

@pytest.mark.parametrize("arch", ["bitnet-b1.58", "bitnet-25"])
def test_2b4t_i2s_file_computes_what_the_tq2_0_file_does(tmp_path, weights, arch):
    """The same weights as I2_S (bitnet.cpp's file, trailing padding bytes arbitrary as
    llama-quantize leaves them) and as TQ2_0 (block scale 1, `.scale`): identical layers
    and logits, and both the float64 reference's."""
    i2s = models.load(write_i2s(tmp_path / "i2s.gguf", CFG, weights, arch=arch,
                                pad=bytes(range(28))))
    tq2 = models.load(R.write_gguf(tmp_path / "tq2.gguf", CFG, weights, block_scale=1.0,
                                   hidden_act="relu2"))
    c = i2s.config
    assert (c.family, c.hidden_act, c.rope_style, c.sub_norms, c.tie_word_embeddings,
            c.rope_theta) == ("bitnet", "relu2", "neox", True, True, 500000.0)
    for p in R.PROJ:
        block, proj = models.gguf_io.PROJECTIONS[p]
        a = getattr(getattr(i2s.layers[0], block), proj)
        b = getattr(getattr(tq2.layers[0], block), proj)
        assert isinstance(a, tc.nn.StoredBitLinear)
        np.testing.assert_array_equal(a._packed, b._packed)
        assert a._scale == b._scale == np.float32(weights[f"blk.0.{p}.scale"])
    ours = i2s(IDS)
    np.testing.assert_array_equal(ours, tq2(IDS))
    if arch == "bitnet-b1.58":      # and through compile_lm (the second one a cache hit)
        a = tc.compile_lm(i2s, max_seq=16).prefill(IDS[0])
        np.testing.assert_array_equal(a, tc.compile_lm(tq2, max_seq=16).prefill(IDS[0]))
        assert R.cosine(a, ours[0]).min() > 0.999      # f16 KV cache and output table
    ref = R.reference_logits({k: v.astype(np.float64) for k, v in weights.items()}, CFG, IDS,
                             act="token", hidden_act="relu2")
    assert R.cosine(ours[0], ref[0]).min() > 0.999
    assert R.top1_agreement(ours[0], ref[0], margin=0.05)[0] >= 0.95


def test_save_gguf_i2s_round_trip(tmp_path):
    """save_gguf(..., ternary_type="I2_S") writes bitnet.cpp's layout (the test's own
    packer reproduces its bytes) and loads back to the same layers and logits; a
    projection whose K needs tercomp's padding (ff 384) goes through int8 values."""
    cfg = models.BitNetConfig(vocab_size=300, hidden_size=256, intermediate_size=384,
                              num_hidden_layers=1, num_attention_heads=4,
                              num_key_value_heads=2, hidden_act="relu2", sub_norms=True,
                              family="bitnet", rope_style="neox", tie_word_embeddings=True)
    lm = models.BitNetLM(cfg)
    models.save_gguf(lm, tmp_path / "m.gguf", ternary_type="I2_S")
    back = models.load(tmp_path / "m.gguf")
    f = models.gguf_io._File(tmp_path / "m.gguf")
    assert f.field("general.architecture") == "bitnet-b1.58" and f.field("general.file_type") == 40
    t, s = lm.layers[0].mlp.down_proj.ternary()
    assert f.tensors["blk.0.ffn_down.weight"].tensor_type.name == "I2_S"
    assert bytes(np.asarray(f.tensors["blk.0.ffn_down.weight"].data)) == i2s_bytes(t, s).tobytes()
    for p in R.PROJ:
        block, proj = models.gguf_io.PROJECTIONS[p]
        ta, sa = getattr(getattr(lm.layers[0], block), proj).ternary()
        tb, sb = getattr(getattr(back.layers[0], block), proj).ternary()
        np.testing.assert_array_equal(ta, tb)
        assert sa == sb
    np.testing.assert_array_equal(lm(IDS), back(IDS))
    with pytest.raises(tc.TercompError, match="ternary_type='Q4_0'; it is one of TQ2_0, I2_S"):
        models.save_gguf(lm, tmp_path / "x.gguf", ternary_type="Q4_0")
    # bitnet-b1.58's graph reads an untied output.weight (llama.cpp's `bitnet` does not)
    untied = models.BitNetLM(dataclasses.replace(cfg, tie_word_embeddings=False,
                                                 intermediate_size=256))
    models.save_gguf(untied, tmp_path / "u.gguf", ternary_type="I2_S")
    back = models.load(tmp_path / "u.gguf")
    assert back.lm_head is not None and not back.config.tie_word_embeddings
    np.testing.assert_array_equal(untied(IDS), back(IDS))


def _load_error(path, match):
    with pytest.raises(models.GGUFError, match=match) as e:
        models.load(path)
    assert str(path) in str(e.value)


def test_bad_i2s_files(tmp_path, weights):
    """Each a GGUFError naming the file and the tensor, before anything is loaded."""
    name = "blk.0.ffn_up.weight"
    t, s = weights[name], weights["blk.0.ffn_up.scale"]
    good = i2s_bytes(t, s)
    # the codes without the 32-byte scale block: the next tensor follows the codes
    _load_error(write_i2s(tmp_path / "noscale.gguf", CFG, weights,
                          override={name: good[:-32]}),
                rf"'{name}': I2_S data of 131072 weights is 32768 code bytes.*tensor scale "
                r"is missing")
    # the last tensor of the file cut short: its size does not match its shape
    last = "blk.0.ffn_down.weight"
    short = i2s_bytes(weights[last], weights["blk.0.ffn_down.scale"])[:-40]
    _load_error(write_i2s(tmp_path / "short.gguf", CFG, weights, override={last: short}),
                rf"'{last}': I2_S data .*size does not match its shape")
    nan = good.copy()
    nan[-32:-28] = np.frombuffer(np.float32(np.nan).tobytes(), np.uint8)
    _load_error(write_i2s(tmp_path / "nan.gguf", CFG, weights, override={name: nan}),
                rf"'{name}': its I2_S tensor scale .* is nan, not a finite positive")
    bad = good.copy()
    bad[5] = 0xFF
    _load_error(write_i2s(tmp_path / "c3.gguf", CFG, weights, override={name: bad}),
                rf"'{name}': holds the invalid I2_S code 3")
    huge = good.copy()
    huge[-32:-28] = np.frombuffer(np.float32(3e38).tobytes(), np.uint8)
    _load_error(write_i2s(tmp_path / "huge.gguf", CFG, weights, override={name: huge}),
                rf"'{name}': its I2_S scale 3e\+38 .* not a float32 from 1.18e-38 to 65504")


def test_rows_of_64_weight_blocks_and_unwritable_models(tmp_path):
    """A row that is not whole 128-weight blocks (what bitnet.cpp's ARM blocks of 64 can
    hold) is refused by the scan, naming the ARM layout; save_gguf refuses I2_S for a
    model it cannot write so (no sub-norms: not bitnet.cpp's architecture; K % 128)."""
    cfg = dict(CFG, ff=320)
    w = R.random_weights(cfg, seed=2)
    _load_error(write_i2s(tmp_path / "arm.gguf", cfg, w),
                r"'blk.0.ffn_down.weight': dims \[320, 256\] are not whole blocks of 128 "
                r"\(bitnet.cpp's ARM builds quantize I2_S in blocks of 64")
    base = dict(vocab_size=300, hidden_size=256, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2)
    llama = models.BitNetLM(models.BitNetConfig(intermediate_size=512, sub_norms=False,
                                                family="llama_bitnet", **base))
    with pytest.raises(tc.TercompError, match="I2_S files are bitnet.cpp's BitNet "
                                              "architectures; this 'llama_bitnet' model"):
        models.save_gguf(llama, tmp_path / "l.gguf", ternary_type="I2_S")
    narrow = models.BitNetLM(models.BitNetConfig(intermediate_size=320, sub_norms=True,
                                                 family="bitnet", **base))
    with pytest.raises(tc.TercompError, match="whole 128-weight blocks; this model has "
                                              "projections with 320 inputs"):
        models.save_gguf(narrow, tmp_path / "n.gguf", ternary_type="I2_S")
    assert not (tmp_path / "l.gguf").exists() and not (tmp_path / "n.gguf").exists()


def test_an_i2s_file_chats_as_its_tq2_0_twin(tmp_path, capsys):
    """The README's I2_S line: a relu2 BitNet with a vocabulary and a chat template saved
    as bitnet.cpp's I2_S and as TQ2_0 gives the same reply to `tercomp generate --chat`."""
    from tokenizers import Tokenizer as BPE, decoders, models as bpe, pre_tokenizers, trainers
    from tercomp.cli import main
    from tercomp.models.tokenizer import Tokenizer
    from tercomp.runtime.chat import ChatTemplate
    tok = BPE(bpe.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["Hello! How are you today?"] * 8, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|user|>", "<|assistant|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    cfg = models.BitNetConfig(vocab_size=tok.get_vocab_size(), hidden_size=128,
                              intermediate_size=256, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=1,
                              hidden_act="relu2", sub_norms=True, family="bitnet",
                              rope_style="neox", tie_word_embeddings=True)
    tc.nn.manual_seed(0)           # a reply that is not only whitespace, whatever ran before
    lm = models.BitNetLM(cfg)
    lm.tokenizer = Tokenizer(tok, ChatTemplate(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}", eos_token="<|end|>"))
    replies = {}
    for kind in ("I2_S", "TQ2_0"):
        path = tmp_path / f"ggml-model-{kind.lower()}.gguf"
        models.save_gguf(lm, path, ternary_type=kind)
        capsys.readouterr()
        assert main(["generate", str(path), "--chat", "Hello!", "-n", "12", "--no-cache"]) == 0
        out, err = capsys.readouterr()
        replies[kind] = (out, re.search(r"decode: (\d+) tokens", err).group(1))
    assert models.gguf_io._File(tmp_path / "ggml-model-i2_s.gguf").field(
        "general.architecture") == "bitnet-b1.58"
    assert replies["I2_S"] == replies["TQ2_0"], replies
    assert replies["I2_S"][0].strip() and int(replies["I2_S"][1]) > 0, replies


def _char_vocab_model(tmp_path, **shape):
    """A random bitnet-arch GGUF whose tokens are single characters (bench/lm.py's
    writer and bench/peers.py's vocabulary: no space prefix, no BOS), as loaded."""
    import sys
    import types
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent.parent / "bench"))
    import lm as bench_lm
    import peers
    a = types.SimpleNamespace(arch="bitnet", act=None, **shape)
    bench_lm.write_model(tmp_path / "src.gguf", a, tokens=peers.char_tokens(a.vocab))
    return models.load(tmp_path / "src.gguf"), peers, a


def test_save_gguf_keeps_how_the_file_tokenizes(tmp_path):
    """`add_space_prefix` / `add_bos_token` of a loaded GGUF are written back: without
    them llama.cpp would tokenize the same text with a BOS and a space prefix."""
    lm, _, _ = _char_vocab_model(tmp_path, hidden=256, ffn=512, vocab=300, layers=1,
                                 heads=2, kv_heads=2)
    for kind in ("I2_S", "TQ2_0"):
        out = tmp_path / f"{kind}.gguf"
        models.save_gguf(lm, out, ternary_type=kind)
        keys = models.gguf_scan.scan(out)
        assert keys["tokenizer.ggml.add_space_prefix"] is False, kind
        assert keys["tokenizer.ggml.add_bos_token"] is False, kind
        back = models.load(out)
        assert back.tokenizer.encode("abc").ids == lm.tokenizer.encode("abc").ids


def test_bitnet_cpp_runs_what_save_gguf_writes(tmp_path):
    """bitnet.cpp (the build TERCOMP_BITNET_CPP_BIN names: its `llama-embedding`) reads
    the I2_S file `save_gguf` writes and computes tercomp's logits."""
    import os
    d = os.environ.get("TERCOMP_BITNET_CPP_BIN")
    if not d or not os.access(os.path.join(d, "llama-embedding"), os.X_OK):
        pytest.skip("TERCOMP_BITNET_CPP_BIN (a bitnet.cpp bin directory with "
                    "llama-embedding) is not set")
    lm, peers, a = _char_vocab_model(tmp_path, hidden=256, ffn=512, vocab=512, layers=2,
                                     heads=4, kv_heads=4)
    models.save_gguf(lm, tmp_path / "i2s.gguf", ternary_type="I2_S")
    ours_lm = models.load(tmp_path / "i2s.gguf")
    ids = [int(i) for i in np.random.default_rng(1).integers(1, a.vocab, 24)]
    ours = np.asarray(ours_lm(np.array([ids]))[0], np.float32)
    src = gguf.GGUFReader(tmp_path / "src.gguf")          # the tied f16 table, as written
    table = np.asarray(next(t.data for t in src.tensors if t.name == "token_embd.weight"),
                       np.float32).reshape(a.vocab, a.hidden)
    theirs = peers.embedding_logits(peers.PEERS["bitnet.cpp"], d, str(tmp_path / "i2s.gguf"),
                                    ids, table, 2)
    assert R.cosine(ours, theirs).min() > 0.995
    assert R.top1_agreement(ours, theirs, margin=0.05)[0] >= 0.95
