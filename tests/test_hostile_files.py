"""Files are read and written safely: regular files only, size limits, umask-honest
modes, symlinks written through, devices and FIFOs refused, all-or-nothing loads."""
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

import tercomp as tc
from tercomp import nn
from tercomp.runtime import compile_cache


@pytest.fixture(scope="module")
def exe():
    nn.manual_seed(0)
    return tc.compile(nn.Linear(4, 3), tc.spec(("B", 4), "float32"))


@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "pipe"
    os.mkfifo(p)
    return p


def _in_subprocess(code, *args, timeout=60):
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    return r.returncode, r.stdout + r.stderr


_LOAD = ("import sys, tercomp as tc\ntry:\n    tc.load(sys.argv[1])\nexcept tc.ArtifactError as e:\n"
         "    print('ArtifactError:', e)\n")


@pytest.mark.parametrize("path,kind", [("/dev/zero", "character device"), ("/tmp", "directory")])
def test_load_refuses_devices_and_directories(path, kind):
    rc, out = _in_subprocess(_LOAD, path)
    assert rc == 0 and "ArtifactError" in out and kind in out, out


def test_load_of_a_fifo_does_not_block(fifo):
    rc, out = _in_subprocess(_LOAD, fifo, timeout=60)     # a blocking open would time out
    assert rc == 0 and "a FIFO" in out, out


def test_load_size_limit(exe, tmp_path, monkeypatch):
    path = tmp_path / "m.tcm"
    exe.save(str(path))
    monkeypatch.setenv("TERCOMP_MAX_FILE_BYTES", "1000")
    with pytest.raises(tc.ArtifactError, match="more than the 1000 bytes"):
        tc.load(str(path))


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_saved_files_follow_the_umask(exe, tmp_path, umask):
    old = os.umask(umask)
    try:
        exe.save(str(tmp_path / "m.tcm"))
        tc.save_checkpoint(str(tmp_path / "c.safetensors"), nn.Linear(2, 2))
    finally:
        os.umask(old)
    for name in ("m.tcm", "c.safetensors"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o666 & ~umask, name


def test_replacing_keeps_the_existing_mode(exe, tmp_path):
    path = tmp_path / "m.tcm"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    exe.save(str(path))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert tc.load(str(path)).signature.function == exe.signature.function


def test_save_writes_through_a_symlink(exe, tmp_path):
    target = tmp_path / "real.tcm"
    target.write_bytes(b"old")
    link = tmp_path / "link.tcm"
    link.symlink_to(target)
    exe.save(str(link))
    assert link.is_symlink() and os.readlink(link) == str(target)
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(tc.load(str(target))(x), exe(x))


def test_save_refuses_a_fifo_and_a_device(exe, fifo):
    with pytest.raises(tc.ArtifactError, match="will not replace .* a FIFO"):
        exe.save(str(fifo))
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    with pytest.raises(tc.ArtifactError, match="will not replace .* device"):
        exe.save("/dev/null")


def test_save_into_a_missing_directory_is_an_error(exe, tmp_path):
    with pytest.raises(tc.ArtifactError, match="directory .*missing.* does not exist"):
        exe.save(str(tmp_path / "missing" / "m.tcm"))
    assert not (tmp_path / "missing").exists()
    with pytest.raises(tc.TercompError, match="directory .*missing.* does not exist") as e:
        tc.save_checkpoint(str(tmp_path / "missing" / "c.safetensors"), nn.Linear(2, 2))
    assert ".tmp" not in str(e.value)


def test_cli_output_into_a_missing_directory(tmp_path):
    src = tmp_path / "model.py"
    src.write_text("import tercomp as tc\ndef f(x):\n    return tc.tanh(x)\n")
    r = subprocess.run([sys.executable, "-m", "tercomp.cli", "compile", f"{src}:f", "--example", "2,3:f32",
                        "-o", str(tmp_path / "nowhere" / "f.tcm")], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "does not exist" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "nowhere").exists()


def test_a_cache_entry_must_match_its_key(exe, tmp_path, monkeypatch):
    monkeypatch.setenv("TERCOMP_CACHE_DIR", str(tmp_path))
    nn.manual_seed(1)
    other = tc.compile(nn.Linear(4, 3), tc.spec(("B", 4), "float32"), cache=False)
    nn.manual_seed(2)
    model = nn.Linear(4, 3)
    first = tc.compile(model, tc.spec(("B", 4), "float32"))
    key = first.meta["cache_key"]
    assert tc.compile(model, tc.spec(("B", 4), "float32")).meta["cache_hit"]
    other.save(compile_cache.entry_path(key))           # another model's artifact copied in
    again = tc.compile(model, tc.spec(("B", 4), "float32"))
    assert not again.meta["cache_hit"]
    x = np.ones((2, 4), np.float32)
    np.testing.assert_allclose(again(x), first(x), rtol=1e-6)


def test_load_checkpoint_with_a_mismatched_optimizer_state_changes_nothing(tmp_path):
    def loss(m, x, y):
        return tc.mean((m(x) - y) ** 2)
    nn.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32)
    sgd = tc.compile_train_step(loss, model, tc.optim.SGD(0.1, momentum=0.9), x, y)
    sgd(x, y)
    path = str(tmp_path / "c.safetensors")
    tc.save_checkpoint(path, sgd)                        # SGD momentum state
    nn.manual_seed(5)
    other = nn.Linear(3, 2)
    adam = tc.compile_train_step(loss, other, tc.optim.AdamW(0.1), x, y)
    before = {k: v.copy() for k, v in adam.params().items()}
    with pytest.raises(tc.TercompError, match="optimizer state"):
        tc.load_checkpoint(path, adam)
    for k, v in adam.params().items():
        np.testing.assert_array_equal(v, before[k])
