"""Tampered artifacts: every member is digested (signature.json too), what signature.json
says is checked against the compiled module (a larger max_seq or vocabulary than the
module's would run past its cache or its output table), and the zip itself is checked
before anything is inflated (duplicated or unknown members, zip bombs)."""
import json
import zipfile

import numpy as np
import pytest

import tercomp as tc
from tercomp import models
from tercomp.runtime import artifact

import bitnet_ref as R

CFG = R.TINY_CFG
MAX_SEQ = 16
PROMPT = [5, 17, 250, 3]


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    return tc.compile_lm(models.load(R.tiny_gguf(tmp_path_factory.mktemp("lm"))), max_seq=MAX_SEQ)


@pytest.fixture(scope="module")
def lm_path(gen, tmp_path_factory):
    path = tmp_path_factory.mktemp("art") / "lm.tcm"
    gen.save(str(path))
    return path


@pytest.fixture(scope="module")
def fn_path(tmp_path_factory):
    exe = tc.compile(lambda x, i: (x * 2.0, i + 1), tc.spec(("B", 8)), tc.spec((3,), "int32"))
    path = tmp_path_factory.mktemp("art") / "fn.tcm"
    exe.save(str(path))
    return path


def members_of(path) -> list:
    with zipfile.ZipFile(path) as zf:
        return [(i.filename, zf.read(i)) for i in zf.infolist()]


def write_zip(path, members, compress=zipfile.ZIP_STORED):
    with zipfile.ZipFile(path, "w", compression=compress) as zf:
        for name, data in members:
            zf.writestr(name, data)
    return path


def edited(src, dst, edit, reseal=True):
    """`src` with `edit(meta)` applied to its signature.json, digests recomputed unless
    reseal=False (so the check after the digests is the one that must catch it)."""
    out = []
    for name, data in members_of(src):
        if name == "signature.json":
            meta = json.loads(data)
            edit(meta)
            data = json.dumps(artifact.seal(meta) if reseal else meta).encode()
        out.append((name, data))
    return write_zip(dst, out)


def test_an_untampered_lm_artifact_loads_and_runs(gen, lm_path):
    loaded = tc.load(str(lm_path))
    assert loaded.max_seq == MAX_SEQ and loaded.vocab_size == CFG["vocab"]
    np.testing.assert_array_equal(loaded.generate(PROMPT, max_new_tokens=6),
                                  gen.generate(PROMPT, max_new_tokens=6))


def test_the_digest_covers_signature_json(lm_path, tmp_path):
    def more_rows(meta):
        meta["lm"]["max_seq"] = 64
    with pytest.raises(tc.ArtifactError, match="sha256 of signature.json does not match"):
        tc.load(str(edited(lm_path, tmp_path / "a.tcm", more_rows, reseal=False)))

    def renamed(meta):
        meta["content_hash"] = "0" * 64
    with pytest.raises(tc.ArtifactError, match="content_hash"):
        tc.load(str(edited(lm_path, tmp_path / "b.tcm", renamed, reseal=False)))


@pytest.mark.parametrize("key, value, match", [
    ("max_seq", 64, r"max_seq 64, .* caches \[64, 2, 64\] f16; the module's are \[16, 2, 64\] f16"),
    ("max_seq", 8, r"caches \[8, 2, 64\] f16; the module's are \[16, 2, 64\] f16"),
    ("kv_dtype", "f32", r"\[16, 2, 64\] f32; the module's are \[16, 2, 64\] f16"),
    ("max_seq", "16", "max_seq is '16', not a positive int"),
    ("vocab_size", 1000, "vocab_size is 1000, the module's logits have 300 columns"),
    ("num_hidden_layers", 2, "2 layers need 4 KV caches, the module has 2"),
    ("num_key_value_heads", 4, r"caches \[16, 4, 64\] f16"),
    ("head_dim", None, "head_dim is None, not a positive int"),
])
def test_lm_metadata_is_checked_against_the_module(lm_path, tmp_path, key, value, match):
    def edit(meta):
        target = meta["lm"] if key in meta["lm"] else meta["lm"]["config"]
        target[key] = value
    with pytest.raises(tc.ArtifactError, match=r"signature.json does not describe its module: .*" + match):
        tc.load(str(edited(lm_path, tmp_path / "t.tcm", edit)))


@pytest.mark.parametrize("edit, match", [
    (lambda s: s["inputs"][0].update(shape=["B", 9]), r"input x has shape \[B, 9\] in it and \[\?, 8\]"),
    (lambda s: s["inputs"][0].update(dtype="f16"), "input x is f16 in it and f32 in the module"),
    (lambda s: s["inputs"][1].update(shape=[3, 1]), r"input i has shape \[3, 1\] in it and \[3\]"),
    (lambda s: s["outputs"].pop(), "it names 1 outputs, the module's forward has 2"),
    (lambda s: s["outputs"][1].update(shape=[4]), r"output .* has shape \[4\] in it and \[3\]"),
])
def test_a_signature_is_checked_against_the_module(fn_path, tmp_path, edit, match):
    with pytest.raises(tc.ArtifactError, match=r"does not describe its module: " + match):
        tc.load(str(edited(fn_path, tmp_path / "t.tcm", lambda meta: edit(meta["signature"]))))


def test_a_signature_naming_another_function(fn_path, tmp_path):
    with pytest.raises(tc.ArtifactError, match="names the function 'main', but the module has forward"):
        tc.load(str(edited(fn_path, tmp_path / "t.tcm", lambda meta: meta["signature"].update(function="main"))))


def test_an_untampered_function_artifact_loads_and_runs(fn_path):
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    y, i = tc.load(str(fn_path))(x, np.arange(3, dtype=np.int32))
    np.testing.assert_array_equal(y, x * 2)
    np.testing.assert_array_equal(i, [1, 2, 3])


def test_an_artifact_of_format_1_is_refused_by_name(fn_path, tmp_path):
    with pytest.raises(tc.ArtifactError, match="older tercomp .*format 1.* do not cover signature.json"):
        tc.load(str(edited(fn_path, tmp_path / "t.tcm", lambda meta: meta.update(format_version=1))))


@pytest.mark.parametrize("which", ["signature.json", "module.vmfb"])
def test_duplicated_members_are_refused(fn_path, tmp_path, which):
    members = members_of(fn_path)
    twin = [(n, d) for n, d in members if n == which]
    with pytest.warns(UserWarning, match="Duplicate name"):    # zipfile's own warning
        path = write_zip(tmp_path / "d.tcm", members + twin)
    with pytest.raises(tc.ArtifactError, match=f"two members named '{which}'"):
        tc.load(str(path))


def test_unknown_members_are_refused(fn_path, tmp_path):
    path = write_zip(tmp_path / "u.tcm", members_of(fn_path) + [("run.sh", b"echo hi")])
    with pytest.raises(tc.ArtifactError, match="unexpected member 'run.sh'"):
        tc.load(str(path))


def test_a_zip_bomb_is_refused_before_it_inflates(fn_path, tmp_path):
    """64 MiB of zeros deflate to 64 KiB: the ratio of the 6.8 MB member that inflated
    to 6 GiB (a bare MemoryError before)."""
    path = tmp_path / "bomb.tcm"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members_of(fn_path):
            zf.writestr(name, data)
        info = zipfile.ZipInfo("weights.irpa")
        info.compress_type = zipfile.ZIP_DEFLATED
        with zf.open(info, "w") as f:
            zero = bytes(1 << 20)
            for _ in range(64):
                f.write(zero)
    assert path.stat().st_size < 1 << 20
    with pytest.raises(tc.ArtifactError, match=r"weights.irpa would inflate to 67108864 bytes, more "
                                               r"than 100 times its \d+ compressed bytes.*zip bomb"):
        tc.load(str(path))


def test_inflating_past_the_size_limit_is_refused(fn_path, tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    # half random bytes: deflates about 2x, well within the ratio
    vmfb = dict(members_of(fn_path))["module.vmfb"]
    big = vmfb + (rng.integers(0, 256, 2 << 20, dtype=np.uint8).tobytes() + bytes(2 << 20))
    path = write_zip(tmp_path / "big.tcm", [(n, big if n == "module.vmfb" else d) for n, d in members_of(fn_path)],
                     compress=zipfile.ZIP_DEFLATED)
    monkeypatch.setenv("TERCOMP_MAX_FILE_BYTES", str(3 << 20))   # the file fits, its contents do not
    assert path.stat().st_size < 3 << 20
    with pytest.raises(tc.ArtifactError, match=r"module.vmfb would inflate to \d+ bytes, past the "
                                               r"3145728 bytes an artifact may hold"):
        tc.load(str(path))


def test_a_deflated_artifact_within_the_ratio_loads(fn_path, tmp_path):
    path = write_zip(tmp_path / "z.tcm", members_of(fn_path), compress=zipfile.ZIP_DEFLATED)
    x = np.ones((1, 8), np.float32)
    np.testing.assert_array_equal(tc.load(str(path))(x, np.zeros(3, np.int32))[0], x * 2)


def test_a_member_longer_than_its_header_says_is_corrupt(fn_path, tmp_path):
    """A header that under-declares a member: it is read to its declared size only, and
    the CRC then fails (nothing past the declaration is inflated)."""
    data = bytearray(write_zip(tmp_path / "l.tcm", members_of(fn_path), compress=zipfile.ZIP_DEFLATED)
                     .read_bytes())
    with zipfile.ZipFile(tmp_path / "l.tcm") as zf:
        info = zf.getinfo("module.vmfb")
    central = data.find(b"PK\x01\x02")          # the central directory entry of module.vmfb
    while data[central + 46:central + 46 + len(b"module.vmfb")] != b"module.vmfb":
        central = data.find(b"PK\x01\x02", central + 4)
    smaller = info.file_size // 2
    data[central + 24:central + 28] = smaller.to_bytes(4, "little")        # uncompressed size
    local = info.header_offset
    data[local + 22:local + 26] = smaller.to_bytes(4, "little")
    (tmp_path / "l.tcm").write_bytes(bytes(data))
    with pytest.raises(tc.ArtifactError, match="corrupt"):
        tc.load(str(tmp_path / "l.tcm"))
