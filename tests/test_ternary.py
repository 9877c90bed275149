"""BitLinear, the ternary ops and the `ternary` pass, end to end."""
import numpy as np
import pytest

import tercomp as tc
from tercomp import nn
from tercomp.errors import TercompError
from tercomp import ternary_pack as tp
from tercomp.ops.interpret import interpret
from tercomp.tracing.tracer import apply
from tests.conftest import run_filecheck


class MLP(nn.Module):
    def __init__(self):
        nn.manual_seed(0)
        self.fc1 = nn.BitLinear(12, 16, bias=True)
        self.fc2 = nn.BitLinear(16, 5, act_quant=False)

    def forward(self, x):
        return self.fc2(tc.relu(self.fc1(x)))


def _bitlinear_ref(layer, x):
    t, s = tp.absmean_ternarize(layer.weight)
    xq = x
    if layer.act_quant:
        q, qs = tp.act_quant(x)
        xq = q / qs
    y = (xq.astype(np.float64) @ (t.astype(np.float64) * np.float64(s)).T).astype(np.float32)
    return y + layer.bias if layer.bias is not None else y


def _mlp_ref(m, x):
    return _bitlinear_ref(m.fc2, np.maximum(_bitlinear_ref(m.fc1, x), 0))


X = np.random.default_rng(1).standard_normal((2, 3, 12)).astype(np.float32)


@pytest.mark.parametrize("strategy", ["off", "auto", "addsub", "int8", "f32", "vnni", "blocked"])
def test_bitlinear_mlp_matches_reference(strategy):
    m = MLP()
    exe = tc.compile(m, X, ternary=strategy, cache=False)
    np.testing.assert_allclose(exe(X), _mlp_ref(m, X), rtol=1e-5, atol=1e-5)
    if strategy != "off":
        run_filecheck(exe.ir("ternary"), f"""
# CHECK-LABEL: func.func @forward(
# CHECK-NOT: "tern.ternarize"
# CHECK-NOT: "tern.matmul"
# CHECK: "tern.ternary_matmul"({{{{.*}}}}strategy = "{'blocked' if strategy == 'auto' else strategy}"
# CHECK-NOT: "tern.ternarize"
# CHECK-NOT: "tern.matmul"
# CHECK: "tern.ternary_matmul"
# CHECK-NOT: "tern.matmul"
""")


def test_bool_constant_beside_a_data_tiled_kernel():
    """A causal-mask-like bool constant feeding a batch matmul's consumer, in a module the
    "blocked" kernel compiles with IREE's data tiling: IREE 3.13 miscompiles i1 constants
    there, so they are stored as i8 and narrowed in the module."""
    mask = np.tile(np.tril(np.ones((8, 8), dtype=bool)), (2, 1))
    fc = nn.BitLinear(8, 8)

    def f(a, b):
        s = tc.where(mask, (fc(a) @ b) * np.float32(0.5), np.float32(-1e30))
        return tc.softmax(s, axis=-1)

    a = np.random.default_rng(2).standard_normal((1, 2, 16, 8)).astype(np.float32)
    b = np.random.default_rng(3).standard_normal((1, 2, 8, 8)).astype(np.float32)
    exe = tc.compile(f, a, b, ternary="blocked", cache=False)
    s = np.where(mask, (_bitlinear_ref(fc, a) @ b) * 0.5, -1e30)
    e = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(exe(a, b), e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    run_filecheck(exe.ir("mlir"), """
# CHECK: arith.constant dense{{.*}} : tensor<16x8xi8>
# CHECK: arith.trunci {{.*}} : i8 to i1
""")


def test_no_f32_weight_constant_remains():
    m = MLP()
    g = tc.passes.run_pipeline(tc.trace(m, X), [("ternary", {"strategy": "auto"}), "simplify"])
    consts = [op.attrs["value"] for op in g.ops if op.opname == "constant"]
    shapes = {(16, 12), (5, 16)}
    assert not [c for c in consts if c.dtype == np.float32 and c.shape in shapes]
    packed = [c for c in consts if c.dtype == np.int8]
    assert sorted(c.shape for c in packed) == [(5, tp.padded_k(16) // 4), (16, tp.padded_k(12) // 4)]
    assert [op.attrs["act_quant"] for op in g.ops if op.opname == "ternary_matmul"] == [True, False]


@pytest.mark.parametrize("strategy,codes", [("avx2", "offset"), ("addsub", None)])
def test_pass_stores_the_codes_its_kernel_reads(strategy, codes):
    """The pass re-codes a constant weight to the format its kernel reads fastest (the
    avx2 kernel multiplies the offset codes w + 1 as unsigned bytes) and says so in the
    op's `codes`; the tern interpreter gives the traced model's result either way."""
    from tercomp.kernels.table import AVX2, host_cpu_features
    if strategy == "avx2" and AVX2 not in host_cpu_features():
        pytest.skip("host CPU lacks AVX2")
    nn.manual_seed(3)
    layer = nn.BitLinear(256, 8)
    x = np.random.default_rng(2).standard_normal((3, 256)).astype(np.float32)
    traced = tc.trace(layer, x)
    g = tc.passes.run_pipeline(traced, [("ternary", {"strategy": strategy})])
    (op,) = [op for op in g.ops if op.opname == "ternary_matmul"]
    assert op.attrs.get("codes") == codes
    packed = op.operands[1].producer.attrs["value"].view(np.uint8)
    signed = tp.pack_ternary(tp.absmean_ternarize(layer.weight)[0])
    np.testing.assert_array_equal(packed, tp.to_offset_codes(signed) if codes else signed)
    np.testing.assert_allclose(interpret(g, x)[0], interpret(traced, x)[0], rtol=1e-5,
                               atol=1e-6)


def test_a_weight_read_twice_is_recoded_once():
    """Two kernels reading one stored weight (one constant after cse) share one re-coded
    constant, which keeps the weight's name: one 2-bit copy at run time, whatever the
    codes."""
    from tercomp.kernels.table import AVX2, host_cpu_features
    if AVX2 not in host_cpu_features():
        pytest.skip("host CPU lacks AVX2")
    t = np.random.default_rng(4).choice([-1, 0, 1], size=(8, 256)).astype(np.int8)
    layer = nn.BitLinear.from_ternary(t, 0.5)
    x = np.random.default_rng(5).standard_normal((2, 256)).astype(np.float32)
    traced = tc.passes.run_pipeline(tc.trace(lambda x: layer(x) + layer(x * 2.0), x), ["cse"])
    (signed,) = [op.results[0].name for op in traced.ops
                 if op.opname == "constant" and op.results[0].type.dtype == "i8"]
    g = tc.passes.run_pipeline(traced, [("ternary", {"strategy": "avx2"})])
    consts = [op.results[0] for op in g.ops
              if op.opname == "constant" and op.results[0].type.dtype == "i8"]
    mms = [op for op in g.ops if op.opname == "ternary_matmul"]
    assert len(consts) == 1 and consts[0].name == signed
    assert [op.operands[1] for op in mms] == consts * 2
    assert all(op.attrs["codes"] == "offset" for op in mms)
    np.testing.assert_allclose(interpret(g, x)[0], interpret(traced, x)[0], rtol=1e-5,
                               atol=1e-5)


def test_straight_through_gradients():
    m = MLP()
    x = X[0]

    def loss(model, x):
        return tc.sum(model(x) ** 2)

    exe = tc.compile(tc.grad(loss, argnums=(0, 1)), m, x, cache=False)
    gm, gx = exe(m, x)
    # hand-derived: quantizers pass gradients straight through
    f1, f2 = m.fc1, m.fc2
    xq1 = _quant(x)
    w1 = _tern(f1.weight)
    h = xq1 @ w1.T + f1.bias
    a = np.maximum(h, 0)
    w2 = _tern(f2.weight)
    y = a @ w2.T
    gy = 2 * y
    gw2 = gy.T @ a
    ga = gy @ w2
    gh = ga * (h > 0)
    gw1 = gh.T @ xq1
    gb1 = gh.sum(0)
    gxr = gh @ w1
    tol = dict(rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gm["fc2.weight"], gw2, **tol)
    np.testing.assert_allclose(gm["fc1.weight"], gw1, **tol)
    np.testing.assert_allclose(gm["fc1.bias"], gb1, **tol)
    np.testing.assert_allclose(gx, gxr, **tol)


def _quant(x):
    q, s = tp.act_quant(x)
    return (q / s).astype(np.float64)


def _tern(w):
    t, s = tp.absmean_ternarize(w)
    return t.astype(np.float64) * np.float64(s)


def test_unknown_strategy():
    with pytest.raises(TercompError, match="addsub"):
        tc.compile(MLP(), X, ternary="fast")


def test_bitlinear_bad_dims():
    with pytest.raises(TercompError, match="last dim must be 12"):
        tc.trace(MLP(), np.zeros((3, 7), np.float32))
    with pytest.raises(TercompError):
        nn.BitLinear(0, 4)


def test_eager_ops_match_numpy():
    w = np.random.default_rng(2).standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_allclose(_apply("ternarize", w), _tern(w).astype(np.float32), rtol=1e-6)
    np.testing.assert_allclose(_apply("act_quant", w), _quant(w).astype(np.float32), rtol=1e-6)


def _apply(name, *a):
    from tercomp.tracing.tracer import apply
    return apply(name, *a)


@pytest.mark.parametrize("codes", ["signed", "offset"])
def test_ternary_pack_lowers_to_one_generic_over_the_planes(codes):
    """tern.ternary_pack: the padded t [N, KP] viewed [N, 4, KB], one generic ORing each
    plane's 2-bit code into its byte; the bytes pack_ternary (and to_offset_codes) give."""
    rng = np.random.default_rng(3)
    t = (rng.integers(-1, 2, (6, 300)) * 0.25).astype(np.float32)     # K = 300 pads to 512

    def fn(t):
        return apply("ternary_pack", t, codes=codes)
    exe = tc.compile(fn, t, cache=False)
    run_filecheck(exe.ir("mlir"), r"""
# CHECK-LABEL: func.func @forward
# CHECK:       tensor.pad %{{.*}} low[0, 0] high[0, 212]
# CHECK:       tensor.expand_shape %{{.*}} {{\[}}[0], [1, 2]] output_shape [6, 4, 128]
# CHECK:       linalg.generic {{.*}}iterator_types = ["parallel", "parallel", "reduction"]{{.*}} ins(%{{.*}} : tensor<6x4x128xf32>) outs(%{{.*}} : tensor<6x128xi8>)
# CHECK:         arith.ori
""")
    packed = tp.pack_ternary(np.sign(t).astype(np.int8))
    want = tp.to_offset_codes(packed) if codes == "offset" else packed
    np.testing.assert_array_equal(exe(t).view(np.uint8), want)


def test_a_computed_ternary_weight_takes_the_hosts_kernel_packed_every_call():
    """A matmul on ternarize of a weight traced as an input (a gradient's, a training
    step's) gets the host's hand-scheduled kernel with the weight packed at run time
    (ternary_pack, the output times max |T|) where the table gives it one and the
    matmul is large enough (RUNTIME_MIN_WORK: M x N x K, a symbolic M's known factor);
    its gradients are the f32 graph's (autodiff ran before the pass). Value and
    gradients as the hand-derived ones; a symbolic batch keeps the f32 matmul."""
    from tercomp.kernels.table import VNNI, host_cpu_features
    from tercomp.passes.ternary import RUNTIME_MIN_WORK
    if VNNI not in host_cpu_features():
        pytest.skip("host CPU lacks AVX-512 VNNI (no hand-scheduled kernel fits this shape)")
    nn.manual_seed(4)
    layer = nn.BitLinear(256, 256)
    x = np.random.default_rng(5).standard_normal((1024, 256)).astype(np.float32)
    assert 1024 * 256 * 256 >= RUNTIME_MIN_WORK

    def loss(m, x):
        return tc.sum(m(x) ** 2)
    f = tc.value_and_grad(loss, argnums=(0, 1))
    exe = tc.compile(f, layer, x, cache=False)
    run_filecheck(exe.ir("ternary"), r"""
# CHECK: %[[P:.*]] = "tern.ternary_pack"(%{{.*}}) {codes = "offset"} : (tensor<256x256xf32>) -> tensor<256x64xi8>
# CHECK: %[[Y:.*]] = "tern.ternary_matmul"(%{{.*}}, %[[P]]) {act_quant = true, codes = "offset", k = 256 : i64, n = 256 : i64, scale = 1.0 : f64, strategy = "{{avx512|avx512-tall}}"}
# CHECK: "tern.mul"(%[[Y]], %{{.*}}) : (tensor<1024x256xf32>, tensor<f32>)
""")
    v, (gm, gx) = exe(layer, x)
    xq, w = _quant(x), _tern(layer.weight)
    y = xq @ w.T
    np.testing.assert_allclose(v, (y ** 2).sum(), rtol=2e-4)     # a sum of 262144 f32 squares
    np.testing.assert_allclose(gm["weight"], (2 * y).T @ xq, rtol=1e-4, atol=1e-2)
    np.testing.assert_allclose(gx, (2 * y) @ w, rtol=1e-4, atol=1e-3)
    symbolic = tc.compile(f, layer, tc.spec(("B", 256)), cache=False)
    assert "tern.ternary_pack" not in symbolic.ir("ternary")
