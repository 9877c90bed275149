"""What a re-run of the loaders' probe still found (issue 36), each a TercompError in
bounded time and memory: TQ2_0 block scales times `.scale` tensors that overflow,
underflow or are too large to give finite logits; a safetensors shard whose header is
not one, however large the file; paths that are not paths; a nested signature.json."""
import io
import time
import zipfile

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import tercomp as tc
from tercomp import models, nn
from tercomp.runtime import artifact

import bitnet_ref as R
from test_models_formats import write_hf

CFG = dict(hidden=256, ff=512, vocab=300, heads=4, kv_heads=2, layers=1, eps=1e-5,
           theta=10000.0)


@pytest.fixture(scope="module")
def weights():
    return R.random_weights(CFG, seed=5)


@pytest.mark.parametrize("block, scale, shown", [
    (60000.0, 1e35, "60000 times its '.scale' 1e\\+35 is 6e\\+39"),      # inf in float32
    (1e-4, 1e-45, "0.000100017 times its '.scale' 1.4013e-45 is 1.40153e-49"),  # 0 in f32
    (0.5, 3e38, "0.5 times its '.scale' 3e\\+38 is 1.5e\\+38"),        # finite, NaN logits
    (1.0, 3e38, "1 times its '.scale' 3e\\+38 is 3e\\+38"),
])
def test_tq2_0_weight_scales_that_cannot_give_finite_logits(tmp_path, weights, block, scale,
                                                             shown):
    """The TQ2_0 fast path (StoredBitLinear.from_packed) checks the product as the old
    path did, and a finite product past MAX_WEIGHT_SCALE is refused as well."""
    w = dict(weights)
    w["blk.0.ffn_up.scale"] = np.float32(scale)
    path = R.write_gguf(tmp_path / "s.gguf", CFG, w, block_scale=block)
    with pytest.raises(models.GGUFError, match=rf"^{path}: tensor 'blk.0.ffn_up.weight': its "
                                               rf"TQ2_0 scale {shown}, not a float32 from "
                                               rf"1.18e-38 to 65504"):
        models.load(path)


def test_the_largest_allowed_scale_loads_and_gives_finite_logits(tmp_path, weights):
    w = dict(weights)
    w["blk.0.ffn_up.scale"] = np.float32(65504.0)
    lm = models.load(R.write_gguf(tmp_path / "s.gguf", CFG, w, block_scale=1.0))
    assert np.isfinite(lm(np.arange(8)[None])).all()


@pytest.mark.parametrize("ws, shown", [(1e-30, "1e\\+30"), (np.float32(3e38), "3.33333e-39")])
def test_hf_weight_scales_that_cannot_give_finite_logits(tmp_path, ws, shown):
    """transformers' weight_scale divides the output: a tiny one is a huge layer scale."""
    d = tmp_path / "hf"
    write_hf(d)
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.0.mlp.up_proj.weight_scale"] = np.array([ws], np.float32)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(models.CheckpointError,
                       match=rf"model.safetensors: tensor 'model.layers.0.mlp.up_proj"
                             rf".weight_scale' gives the layer the scale {shown}, not a float32 "
                             rf"from 1.18e-38"):
        models.load(d)


def test_from_packed_checks_its_scale():
    packed = np.zeros((2, 64), np.uint8)
    for bad in (np.inf, np.nan, 0.0, -1.0, 1e39):
        with pytest.raises(tc.TercompError, match="scale must be one finite positive"):
            nn.StoredBitLinear.from_packed(packed, 256, bad)


def _hf_dir(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(
        '{"model_type": "bitnet", "vocab_size": 300, "hidden_size": 256, '
        '"intermediate_size": 512, "num_hidden_layers": 1, "num_attention_heads": 4, '
        '"num_key_value_heads": 2, "rms_norm_eps": 1e-5, "hidden_act": "relu2"}')
    return d


@pytest.mark.parametrize("header, match", [
    (b"\xff" * 8, "not a safetensors file \\(a header of 18446744073709551615 bytes"),
    ((200_000_000).to_bytes(8, "little") + b"{", "a header of 200000000 bytes"),
    ((10).to_bytes(8, "little") + b"[[[[[[[[[[", "header is not a JSON object"),
    ((2).to_bytes(8, "little") + b"{}", "its header describes 0 bytes of tensor data, but "
                                        "5368709110 follow it"),
])
def test_a_safetensors_shard_is_refused_by_its_header(tmp_path, header, match):
    """A 5 GiB sparse shard whose header is not one: refused after reading the header,
    not the file."""
    d = _hf_dir(tmp_path)
    with open(d / "model.safetensors", "wb") as f:
        f.write(header)
        f.truncate(5 << 30)
    t0 = time.perf_counter()
    with pytest.raises(models.CheckpointError, match=match):
        models.load(d)
    assert time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize("path", [3, None, b"model.gguf", 2.5])
def test_load_of_something_that_is_not_a_path(path):
    with pytest.raises(tc.TercompError, match="models.load expects a path"):
        models.load(path)


def test_a_deeply_nested_signature_json():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("module.vmfb", b"\0" * 16)
        zf.writestr("signature.json", "[" * 200_000 + "]" * 200_000)
    with pytest.raises(tc.ArtifactError, match="signature.json is nested too deeply"):
        artifact.read_bytes(buf.getvalue(), "deep.tcm")
