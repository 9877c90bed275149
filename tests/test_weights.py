"""Weight storage: constants inline in the .vmfb, or named parameters in an .irpa archive
(`tc.compile(..., weights="inline" | "irpa" | "auto")`, tercomp.codegen.params)."""
import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import tercomp as tc
from conftest import run_filecheck
from tercomp import nn
from tercomp.codegen import params


class MLP(nn.Module):
    def __init__(self):
        nn.manual_seed(0)
        self.fc1 = nn.Linear(128, 256)
        self.fc2 = nn.Linear(256, 64)

    def forward(self, x):
        return self.fc2(tc.relu(self.fc1(x)))


class BitMLP(nn.Module):
    def __init__(self):
        nn.manual_seed(1)
        self.fc1 = nn.BitLinear(1024, 1024, bias=True)
        self.fc2 = nn.BitLinear(1024, 256, act_quant=False)

    def forward(self, x):
        return self.fc2(tc.relu(self.fc1(x)))


def _x(k, rows=3):
    return np.random.default_rng(0).standard_normal((rows, k)).astype(np.float32)


def _pair(model, k, **kw):
    """The model compiled with inline weights and with an .irpa archive."""
    spec = tc.spec(("B", k), "float32")
    return (tc.compile(model, spec, weights="inline", cache=False, **kw),
            tc.compile(model, spec, weights="irpa", cache=False, **kw))


@pytest.fixture(scope="module")
def mlp_pair():
    return _pair(MLP(), 128)


@pytest.fixture(scope="module")
def bit_pair():
    return _pair(BitMLP(), 1024, ternary="auto")


def test_mlp_inline_and_irpa_agree(mlp_pair):
    inline, irpa = mlp_pair
    assert (inline.meta["weights"], irpa.meta["weights"]) == ("inline", "irpa")
    assert inline.weights is None and irpa.weights is not None
    # the weights (>= 4096 elements) are parameters; the biases (256, 64) stay inline
    assert irpa.meta["parameters"] == ["fc1.weight", "fc2.weight"]
    x = _x(128)
    np.testing.assert_array_equal(irpa(x), inline(x))


@pytest.mark.parametrize("strategy", ["auto", "addsub"])
def test_bitlinear_inline_and_irpa_agree(bit_pair, strategy):
    # "auto" is the int8 kernel for a dynamic batch; "addsub" the masked add/sub one
    inline, irpa = bit_pair if strategy == "auto" else _pair(BitMLP(), 1024, ternary=strategy)
    # only the packed 2-bit weights are parameters: no f32 copy of them is left
    assert irpa.meta["parameters"] == ["packed", "packed_1"]
    x = _x(1024)
    np.testing.assert_array_equal(irpa(x), inline(x))


def test_irpa_vmfb_is_much_smaller(mlp_pair, bit_pair):
    for inline, irpa in (mlp_pair, bit_pair):
        assert irpa.vmfb_size * 4 < inline.vmfb_size, (irpa.vmfb_size, inline.vmfb_size)
        # the bytes moved from the vmfb into the archive
        assert len(irpa.weights) >= inline.vmfb_size - irpa.vmfb_size


def test_mlir_reads_named_parameters(mlp_pair):
    run_filecheck(mlp_pair[1].ir("mlir"), r"""
# CHECK:       util.global private @[[W1:fc1\.weight]] = #flow.parameter.named<"model"::"[[W1]]"> : tensor<256x128xf32>
# CHECK:       util.global private @[[W2:fc2\.weight]] = #flow.parameter.named<"model"::"[[W2]]"> : tensor<64x256xf32>
# CHECK-LABEL: func.func @forward(
# CHECK-NOT:   arith.constant {{.*}} : tensor<256x128xf32>
# CHECK:       %{{.*}} = util.global.load immutable @[[W1]] : tensor<256x128xf32>
# CHECK-NOT:   arith.constant {{.*}} : tensor<64x256xf32>
# CHECK:       %{{.*}} = util.global.load immutable @[[W2]] : tensor<64x256xf32>
# CHECK:       return
""")
    run_filecheck(mlp_pair[0].ir("mlir"), r"""
# CHECK-NOT:   util.global
# CHECK-LABEL: func.func @forward(
# CHECK:       arith.constant dense_resource<__elided__> : tensor<256x128xf32>
# CHECK-NOT:   util.global.load
""")


def test_packed_ternary_weights_are_parameters(bit_pair):
    run_filecheck(bit_pair[1].ir("mlir"), r"""
# CHECK:       util.global private @[[P:packed]] = #flow.parameter.named<"model"::"[[P]]"> : tensor<1024x256xi8>
# CHECK:       util.global private @[[P1:packed_1]] = #flow.parameter.named<"model"::"[[P1]]"> : tensor<256x256xi8>
# CHECK-LABEL: func.func @forward(
# CHECK-NOT:   arith.constant {{.*}} : tensor<1024x256xi8>
# CHECK:       util.global.load immutable @[[P]] : tensor<1024x256xi8>
# CHECK-NOT:   arith.constant {{.*}} : tensor<256x256xi8>
# CHECK:       util.global.load immutable @[[P1]] : tensor<256x256xi8>
""")


def test_save_load_round_trip(bit_pair, tmp_path):
    _, irpa = bit_pair
    path = str(tmp_path / "bit.tcm")
    irpa.save(path)
    with zipfile.ZipFile(path) as zf:
        assert sorted(zf.namelist()) == ["module.vmfb", "signature.json", "weights.irpa"]
        assert zf.read("weights.irpa") == irpa.weights
        meta = json.loads(zf.read("signature.json"))
    assert meta["weights_scope"] == "model"
    x = _x(1024, rows=5)
    np.testing.assert_array_equal(tc.load(path)(x), irpa(x))


def test_irpa_artifact_runs_without_the_compiler(mlp_pair, tmp_path):
    _, irpa = mlp_pair
    path = str(tmp_path / "mlp.tcm")
    irpa.save(path)
    x = _x(128)
    np.save(tmp_path / "x.npy", x)
    script = (
        "import sys, numpy as np\n"
        "sys.modules['iree.compiler'] = None\n"
        "import tercomp as tc\n"
        f"np.save({str(tmp_path / 'y.npy')!r}, tc.load({path!r})(np.load({str(tmp_path / 'x.npy')!r})))\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), irpa(x))


def test_corrupted_weights_member_is_an_artifact_error(mlp_pair, tmp_path):
    path = tmp_path / "mlp.tcm"
    mlp_pair[1].save(str(path))
    with zipfile.ZipFile(path) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    w = bytearray(members["weights.irpa"])
    w[len(w) // 2] ^= 0x40                        # one bit of one weight
    members["weights.irpa"] = bytes(w)
    bad = tmp_path / "bad.tcm"
    with zipfile.ZipFile(bad, "w") as zf:
        for n, data in members.items():
            zf.writestr(n, data)
    with pytest.raises(tc.ArtifactError, match="sha256 of weights.irpa"):
        tc.load(str(bad))


def test_compile_cache_keeps_the_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("TERCOMP_CACHE_DIR", str(tmp_path))
    m = MLP()
    first = tc.compile(m, tc.spec(("B", 128)), weights="irpa")
    again = tc.compile(m, tc.spec(("B", 128)), weights="irpa")
    assert (first.meta["cache_hit"], again.meta["cache_hit"]) == (False, True)
    assert again.weights == first.weights
    # other weight values of the same shapes: the same module text, another cache entry
    m.fc1.weight = m.fc1.weight * 2
    other = tc.compile(m, tc.spec(("B", 128)), weights="irpa")
    assert not other.meta["cache_hit"]
    x = _x(128)
    assert not np.array_equal(other(x), first(x))


def test_auto_picks_irpa_above_the_size_threshold(monkeypatch):
    small = tc.compile(MLP(), tc.spec(("B", 128)), cache=False)
    assert small.meta["weights"] == "inline" and small.weights is None
    monkeypatch.setattr(params, "AUTO_IRPA_BYTES", 1024)
    big = tc.compile(MLP(), tc.spec(("B", 128)), cache=False)
    assert big.meta["weights"] == "irpa" and big.weights is not None


def test_small_constants_stay_inline_in_irpa_mode():
    nn.manual_seed(0)
    exe = tc.compile(nn.Linear(8, 4), tc.spec(("B", 8)), weights="irpa", cache=False)
    assert exe.weights is None and exe.meta["parameters"] == []


def test_unknown_weights_mode():
    with pytest.raises(tc.TercompError, match="unknown weights mode 'disk'"):
        tc.compile(lambda x: x + 1.0, np.ones(3, np.float32), weights="disk")


def test_graph_is_unchanged_after_lowering_with_parameters():
    nn.manual_seed(0)
    g = tc.trace(nn.Linear(128, 64), tc.spec(("B", 128)))
    before = [op.attrs["value"] for op in g.ops if op.opname == "constant"]
    exe = tc.compile(g, weights="irpa", cache=False)
    after = [op.attrs["value"] for op in g.ops if op.opname == "constant"]
    assert all(a is b for a, b in zip(before, after)) and exe.meta["parameters"]
