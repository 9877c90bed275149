"""Model files as an attacker writes them: every case is a TercompError naming the file
and the key or tensor, in bounded time and memory (run in a child process with an
address-space limit and a timeout), and a failed save leaves the existing file whole. The long
campaigns (2,000 cases per format, byte-level and structure-aware) run with -m fuzz."""
import json
import os
import struct

import numpy as np
import pytest

import tercomp as tc
from tercomp import models

import bitnet_ref as R
import box
from test_models_formats import CFG, hf_config, write_hf


@pytest.fixture(scope="module")
def weights():
    return R.random_weights(CFG, seed=3)


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory, weights):
    return R.write_gguf(tmp_path_factory.mktemp("g") / "ok.gguf", CFG, weights).read_bytes()


def load_in_a_box(path, limit_gib=2, timeout=60):
    """models.load(path) in a child process (tests/box.py: a fork of a process that
    imported tercomp) under an address-space limit: (exit code, output). The child prints
    the TercompError it got; anything else is a failure."""
    code = ("import resource, sys\n"
            f"resource.setrlimit(resource.RLIMIT_AS, ({limit_gib << 30}, {limit_gib << 30}))\n"
            "import tercomp as tc\nfrom tercomp import models\n"
            "try:\n    models.load(sys.argv[1])\n    print('LOADED')\n"
            "except tc.TercompError as e:\n    print('TercompError:', e)\n")
    return box.run(code, path, timeout=timeout)


def assert_refused(path, *patterns):
    rc, out = load_in_a_box(path)
    assert rc == 0 and out.startswith("TercompError:"), out[-2000:]
    assert str(path) in out, out
    for p in patterns:
        assert p in out, out


# -- a GGUF header walker for the tests (positions of counts and tensor fields) -----------
SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def header_positions(b: bytes):
    """{key: position of its value}, [(name, pos of type field, pos of offset field)]."""
    pos = 8
    n_t, n_kv = struct.unpack_from("<QQ", b, pos)
    pos += 16

    def string(p):
        n = struct.unpack_from("<Q", b, p)[0]
        return b[p + 8:p + 8 + n].decode(), p + 8 + n

    def skip(vt, p):
        if vt in SCALAR:
            return p + SCALAR[vt]
        if vt == 8:
            return string(p)[1]
        et, count = struct.unpack_from("<IQ", b, p)
        p += 12
        for _ in range(count):
            p = skip(et, p)
        return p
    keys = {}
    for _ in range(n_kv):
        k, pos = string(pos)
        vt = struct.unpack_from("<I", b, pos)[0]
        keys[k] = pos
        pos = skip(vt, pos + 4)
    tensors = []
    for _ in range(n_t):
        name, pos = string(pos)
        nd = struct.unpack_from("<I", b, pos)[0]
        pos += 4 + 8 * nd
        tensors.append((name, pos, pos + 4))
        pos += 12
    return keys, tensors


def patched(tmp_path, b, fname, edits):
    b = bytearray(b)
    for pos, fmt, value in edits:
        struct.pack_into("<" + fmt, b, pos, value)
    p = tmp_path / fname
    p.write_bytes(bytes(b))
    return p


# -- GGUF ------------------------------------------------------------------------------------
def test_an_array_key_declaring_2_62_elements(tmp_path, weights):
    """~600 KB, one array key claiming 2^62 elements and holding none: gguf-py alone
    looped until memory ran out."""
    vocab = {"model": "llama", "tokens": [f"t{i}" for i in range(300)], "scores": [0.0] * 300}
    b = R.write_gguf(tmp_path / "v.gguf", CFG, weights, vocab=vocab).read_bytes()
    keys, _ = header_positions(b)
    p = patched(tmp_path, b, "bomb.gguf", [(keys["tokenizer.ggml.scores"] + 8, "Q", 1 << 62)])
    assert_refused(p, "'tokenizer.ggml.scores'", "elements")


@pytest.mark.slow     # the bomb tests above hit the same count limit from a patched header
def test_a_well_formed_array_past_the_limit(tmp_path, weights):
    import gguf
    from tercomp.models.gguf_scan import MAX_ARRAY
    wr = gguf.GGUFWriter(str(tmp_path / "big.gguf"), "bitnet")
    wr.add_array("general.junk", np.zeros(MAX_ARRAY + 1, np.uint8).tolist())
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.close()
    assert_refused(tmp_path / "big.gguf", "'general.junk'", "at most")


def test_tensor_data_that_overlaps_or_is_unaligned_or_retyped(tmp_path, good_gguf):
    _, tensors = header_positions(good_gguf)
    (_, _, off0), (_, _, off1) = tensors[0], tensors[1]
    first = struct.unpack_from("<Q", good_gguf, off0)[0]
    assert_refused(patched(tmp_path, good_gguf, "overlap.gguf", [(off1, "Q", first)]),
                   "overlaps")
    assert_refused(patched(tmp_path, good_gguf, "unaligned.gguf", [(off1, "Q", first + 4)]),
                   "not aligned")
    f32 = [t for t in tensors if t[0].endswith("norm.weight")][0]
    assert_refused(patched(tmp_path, good_gguf, "retyped.gguf", [(f32[1], "I", 1)]),  # F32 -> F16
                   repr(f32[0]))


@pytest.mark.parametrize("key,value,pattern", [
    ("bitnet.rope.freq_base", float("inf"), "rope_theta"),
    ("bitnet.attention.layer_norm_rms_epsilon", float("inf"), "rms_norm_eps"),
])
def test_non_finite_hyperparameters(tmp_path, good_gguf, key, value, pattern):
    keys, _ = header_positions(good_gguf)
    assert_refused(patched(tmp_path, good_gguf, "inf.gguf", [(keys[key] + 4, "f", value)]),
                   pattern)


def test_non_finite_weights_and_misplaced_tensors(tmp_path, weights):
    w = dict(weights)
    emb = w["token_embd.weight"].copy()
    emb[7, 3] = np.nan
    assert_refused(R.write_gguf(tmp_path / "nan.gguf", CFG, {**w, "token_embd.weight": emb}),
                   "'token_embd.weight'", "NaN")
    norm_scale = {**w, "blk.0.attn_norm.scale": np.float32(2.0)}
    assert_refused(R.write_gguf(tmp_path / "ns.gguf", CFG, norm_scale),
                   "'blk.0.attn_norm.scale'")
    flat = {**w, "token_embd.weight": w["token_embd.weight"].reshape(-1)}
    assert_refused(R.write_gguf(tmp_path / "flat.gguf", CFG, flat), "'token_embd.weight'")


def test_a_string_where_an_id_belongs_and_an_atomic_save(tmp_path, weights):
    """A bos_token_id that is a string: loading used to accept it and a later save_gguf
    failed half-way, leaving the existing file cut to 24 bytes."""
    vocab = {"model": "llama", "tokens": [f"t{i}" for i in range(300)], "scores": [0.0] * 300}
    bad = R.write_gguf(tmp_path / "s.gguf", CFG, weights,
                       vocab={**vocab, "raw": [("add_string", "tokenizer.ggml.bos_token_id", "1")]})
    assert_refused(bad, "'tokenizer.ggml.bos_token_id'", "expected a uint32")
    good = R.write_gguf(tmp_path / "g.gguf", CFG, weights, vocab=vocab)
    lm = models.load(good)
    lm.gguf_vocab = {**lm.gguf_vocab, "tokenizer.ggml.bos_token_id": ("uint32", "1")}
    target = tmp_path / "existing.gguf"
    target.write_bytes(good.read_bytes())
    with pytest.raises(models.GGUFError, match="'tokenizer.ggml.bos_token_id'"):
        models.save_gguf(lm, target)
    assert target.read_bytes() == good.read_bytes()           # untouched


def test_a_save_that_fails_half_way_leaves_the_file(tmp_path, weights, monkeypatch):
    from tercomp.models import gguf_write
    path = R.write_gguf(tmp_path / "keep.gguf", CFG, weights)
    before = path.read_bytes()
    lm = models.load(path)

    def broken(w, model, cfg, arch, ternary_type):
        w.add_name("half")
        raise tc.TercompError("disk full (simulated)")
    monkeypatch.setattr(gguf_write, "_write", broken)
    with pytest.raises(tc.TercompError, match="disk full"):
        models.save_gguf(lm, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == []


def test_fifos_and_devices_are_named_not_missing(tmp_path):
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    assert_refused(fifo, "is a FIFO")
    link = tmp_path / "zero.gguf"
    os.symlink("/dev/zero", link)
    assert_refused(link, "character device")


# -- Hugging Face ----------------------------------------------------------------------------
def test_hf_shards_fifos_links_and_configs(tmp_path):
    d = tmp_path / "hf"
    write_hf(d)
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    # a second shard redefining a tensor
    import shutil
    shutil.copy(d / "model-00001-of-00002.safetensors", d / "model-00002-of-00002.safetensors")
    assert_refused(d, "is defined again")
    os.unlink(d / "model-00002-of-00002.safetensors")
    os.mkfifo(d / "model-00002-of-00002.safetensors")
    assert_refused(d, "is a FIFO")
    os.unlink(d / "model-00002-of-00002.safetensors")
    os.symlink("/dev/zero", d / "model-00002-of-00002.safetensors")
    assert_refused(d, "character device")
    os.unlink(d / "model-00002-of-00002.safetensors")
    cfg = hf_config()
    for bad, pattern in ((("[" * 1000) + ("]" * 1000), "nested too deeply"),
                         (json.dumps({**cfg, "head_dim": {}}), "head_dim"),
                         (json.dumps({**cfg, "rope_theta": 1e999}), "rope_theta")):
        (d / "config.json").write_text(bad)
        assert_refused(d, pattern)


def test_hf_nan_weight(tmp_path):
    d = tmp_path / "nan"
    write_hf(d)
    from safetensors.numpy import load_file, save_file
    t = load_file(str(d / "model.safetensors"))
    t["model.norm.weight"] = t["model.norm.weight"].astype(np.float32)
    t["model.norm.weight"][0] = np.inf
    save_file(t, str(d / "model.safetensors"))
    assert_refused(d, "'model.norm.weight'", "infinite")


# -- campaigns -------------------------------------------------------------------------------
def _gguf_cases(good, n, rng):
    keys, tensors = header_positions(good)
    fields = [p + 4 for p in keys.values()] + [p for _, p, _ in tensors] + [p for *_, p in tensors]
    for i in range(n):
        b = bytearray(good)
        if i % 2:          # structure-aware: a count, type or offset field set to an edge value
            pos = int(rng.choice(fields))
            edge = int(rng.choice([0, 1, 2, 3, 9, 30, 255, 2 ** 31, 2 ** 32 - 1]))
            struct.pack_into("<I", b, pos, edge % 2 ** 32)
        else:              # byte-level, mostly in the header
            for _ in range(int(rng.integers(1, 6))):
                pos = int(rng.integers(0, 4000)) if rng.random() < 0.8 else int(rng.integers(0, len(b)))
                b[pos] = int(rng.integers(0, 256))
        yield bytes(b)


def _run_gguf_campaign(tmp_path, good, n):
    rng = np.random.default_rng(n)
    p = tmp_path / "c.gguf"
    loaded = refused = 0
    for b in _gguf_cases(good, n, rng):
        p.write_bytes(b)
        try:
            lm = models.load(p)
            out = lm(np.array([[1, 2, 3]]))      # a model that loads computes numbers (or
        except tc.TercompError:                  # says why it cannot: a context of 1)
            refused += 1
            continue
        assert np.isfinite(out).all()
        loaded += 1
    return loaded, refused


def test_gguf_mutations_sample(tmp_path, good_gguf):
    loaded, refused = _run_gguf_campaign(tmp_path, good_gguf, 120)
    assert refused > 0


@pytest.mark.fuzz
def test_gguf_mutations_campaign(tmp_path, good_gguf):
    loaded, refused = _run_gguf_campaign(tmp_path, good_gguf, 2000)
    assert loaded + refused == 2000 and refused > 0


def _run_hf_campaign(tmp_path, n):
    d = tmp_path / "hfc"
    write_hf(d)
    good_cfg = (d / "config.json").read_text()
    good_st = (d / "model.safetensors").read_bytes()
    header = struct.unpack_from("<Q", good_st, 0)[0] + 8
    rng = np.random.default_rng(n)
    refused = 0
    for i in range(n):
        cfg, st = bytearray(good_cfg.encode()), bytearray(good_st)
        if i % 3 == 0:       # config.json bytes
            for _ in range(int(rng.integers(1, 4))):
                cfg[int(rng.integers(0, len(cfg)))] = int(rng.integers(32, 127))
        elif i % 3 == 1:     # the safetensors JSON header
            for _ in range(int(rng.integers(1, 4))):
                st[int(rng.integers(0, header))] = int(rng.integers(0, 256))
        else:                # structure-aware: a config value replaced
            c = json.loads(good_cfg)
            k = str(rng.choice(sorted(c)))
            c[k] = [None, -1, 0, 1e30, "x", {}, [], True, 2 ** 40][int(rng.integers(0, 9))]
            cfg = bytearray(json.dumps(c).encode())
        (d / "config.json").write_bytes(bytes(cfg))
        (d / "model.safetensors").write_bytes(bytes(st))
        try:
            lm = models.load(d)
            out = lm(np.array([[1, 2, 3]]))
        except tc.TercompError:
            refused += 1
            continue
        assert np.isfinite(out).all()
    return refused


def test_hf_mutations_sample(tmp_path):
    assert _run_hf_campaign(tmp_path, 60) > 0


@pytest.mark.fuzz
def test_hf_mutations_campaign(tmp_path):
    assert _run_hf_campaign(tmp_path, 2000) > 0
