"""A GGUF's f16 tables and 2-bit codes go through models.load and tc.compile_lm as the
file keeps them (issue #33, "every size": no f32 widening of the embedding): the
generator's weights are the file's tensor bytes, its f16 tables read as f16, and a
load grows a process by about the file, not by its tables widened to f32."""
import argparse
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import tercomp as tc
from tercomp import models, nn
from tercomp.ops import interpret
from tercomp.codegen.params import MIN_ELEMENTS

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import lm as bench_lm  # noqa: E402  (bench/lm.py: the writer of the 8B / 2B4T shapes)

# Llama3-8B-1.58's form (llama arch, GQA, untied f16 output table), scaled down
SHAPE = argparse.Namespace(hidden=256, ffn=512, vocab=4096, layers=1, heads=4, kv_heads=2,
                           arch="llama", act=None)
IDS = np.array([1, 17, 300, 4095, 2], np.int32)
_BYTES = {"f16": 2, "f32": 4, "i8": 1, "ui8": 1}


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lm_memory") / "llama-small.gguf")
    bench_lm.write_model(path, SHAPE)
    return path


def file_weight_bytes(path) -> int:
    """What the file's tensors hold as tercomp keeps them: float tensors as stored,
    TQ2_0 projections as their 2-bit codes (the f16 block scale of each 256 is one
    tensor scale, inline), the tensors under MIN_ELEMENTS left inline in the module."""
    import gguf
    total = 0
    for t in gguf.GGUFReader(path).tensors:
        n = int(t.n_elements)
        if n < MIN_ELEMENTS:
            continue
        total += n // 4 if t.tensor_type.name == "TQ2_0" else int(t.n_bytes)
    return total


def parameters(mlir: str) -> dict:
    """{name: (shape, element type)} of the module's parameter globals."""
    out = {}
    for name, dims, et in re.findall(r"util\.global private @(\S+) = #flow\.parameter\.named"
                                     r"<[^>]*> : tensor<([0-9x]+)x([a-z0-9]+)>", mlir):
        out[name] = (tuple(int(d) for d in dims.split("x")), et)
    return out


def test_the_loader_keeps_f16_tables_as_stored(gguf_file):
    lm = models.load(gguf_file)
    v, h = SHAPE.vocab, SHAPE.hidden
    assert isinstance(lm.embed_tokens, nn.StoredEmbedding)
    assert isinstance(lm.lm_head, nn.StoredLinear)
    assert lm.embed_tokens.weight.dtype == np.float16 and lm.embed_tokens.weight.shape == (v, h)
    assert lm.lm_head.weight.dtype == np.float16
    import gguf
    file = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(gguf_file).tensors}
    np.testing.assert_array_equal(lm.embed_tokens.weight, file["token_embd.weight"])
    np.testing.assert_array_equal(lm.lm_head.weight, file["output.weight"])
    # not parameters: training widens them (make_trainable), as it does the projections
    assert not any(n.startswith(("embed_tokens", "lm_head")) for n in lm.parameters())
    lm.make_trainable()
    assert lm.embed_tokens.weight.dtype == np.float32 and lm.lm_head.weight.dtype == np.float32
    assert "embed_tokens.weight" in lm.parameters() and "lm_head.weight" in lm.parameters()
    np.testing.assert_array_equal(lm.lm_head.weight, file["output.weight"].astype(np.float32))


def test_the_generator_weights_are_the_files_bytes(gguf_file):
    """compile_lm with the f16 output table: the module's parameters are the file's two
    f16 tables (no f32 [vocab, hidden] anywhere) and the packed codes, byte for byte as
    many as the file's tensors, and its logits are the float32 model's."""
    lm = models.load(gguf_file)
    gen = tc.compile_lm(lm, max_seq=16, kv_dtype="float32", output_dtype="float16", cache=False)
    params = parameters(gen.exe.ir("mlir"))
    v, h = SHAPE.vocab, SHAPE.hidden
    tables = [p for p in params.values() if p[0] == (v, h)]
    assert sorted(tables) == [((v, h), "f16")] * 2, params
    weights = sum(int(np.prod(s)) * _BYTES[et] for s, et in params.values())
    assert weights == file_weight_bytes(gguf_file)
    assert len(gen.exe._weights) <= os.path.getsize(gguf_file)
    # the logits of the model with its tables widened to float32 (as the loader kept
    # them before): tc.compile of the stored model reads the f16 tables too
    wide = lm.with_stored_output("float32")
    assert wide.embed_tokens.weight.dtype == np.float32 and wide.lm_head.weight.dtype == np.float32
    (ref,) = interpret(tc.trace(wide, IDS[None]), IDS[None])     # the reference interpreter
    ref = ref[0]
    stored = tc.compile(lm, IDS[None])(IDS[None])[0]
    np.testing.assert_allclose(stored, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    got = gen.prefill(IDS)      # the cached step: BitLinear's int8 rounding may flip a few
    cos = (got * ref).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert cos.min() >= 0.999, cos
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.8


_LOAD_RSS = """
import json, re, sys
from tercomp import models
models.load(sys.argv[2])                 # the loader's imports, once
def status(key):                         # KiB; VmHWM is this process's own peak (ru_maxrss
    with open("/proc/self/status") as f: # keeps the forking parent's across exec)
        return int(re.search(key + r":\\s+(\\d+)", f.read()).group(1))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")                         # the peak from here on
before = status("VmRSS")
lm = models.load(sys.argv[1])
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="reads Linux's /proc")
def test_a_load_grows_the_process_by_about_the_file(tmp_path, gguf_file):
    """models.load, in a fresh process, of a file that is mostly f16 tables (2 x 16 MiB):
    its peak grows by the tables as they are plus the file's pages read into the map
    meanwhile (each tensor's dropped once it is copied), not by the tables widened to
    float32 (measured before: 88 MiB for this 35 MiB file; now 57 MiB)."""
    path = str(tmp_path / "tables.gguf")
    bench_lm.write_model(path, argparse.Namespace(**{**vars(SHAPE), "hidden": 2048,
                                                     "heads": 16, "kv_heads": 4}))
    size = os.path.getsize(path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(tc.__file__)))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    out = subprocess.run([sys.executable, "-c", _LOAD_RSS, path, gguf_file], capture_output=True,
                         text=True, timeout=120, env=env, check=True)
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    grown = (rss["peak"] - rss["before"]) * 1024
    assert grown <= 1.75 * size + (8 << 20), (grown / 2**20, size / 2**20)


def test_a_non_finite_f16_table_is_refused_by_name(gguf_file, tmp_path):
    import gguf
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(open(gguf_file, "rb").read())
    t = next(t for t in gguf.GGUFReader(gguf_file).tensors if t.name == "output.weight")
    with open(bad, "r+b") as f:      # two values of row 4000
        f.seek(int(t.data_offset) + 2 * (SHAPE.hidden * 4000 + 3))
        f.write(np.array([np.nan, np.inf], np.float16).tobytes())
    with pytest.raises(tc.TercompError, match=r"tensor 'output.weight': holds 2 NaN or infinite"):
        models.load(str(bad))
