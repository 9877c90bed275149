"""nn.BitConv1d / BitConv2d: BitLinear's quantization on im2col rows, against NumPy
(ternary_pack's references); the packed artifact (ternary pass -> ternary_matmul)
against the eager layer; straight-through gradients; a compiled training step."""
import numpy as np
import pytest

import tercomp as tc
from conftest import run_filecheck
from tercomp import nn
from tercomp import ternary_pack as tp

rng = np.random.default_rng(7)


def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def np_rows(x, kernel, stride, pad):
    """im2col from the definition: row (n, p) = x_pad[n, :, p*s + k] for every (c, k)."""
    nd = len(kernel)
    xp = np.pad(x, [(0, 0), (0, 0)] + [(pad, pad)] * nd)
    out = [(xp.shape[2 + i] - kernel[i]) // stride + 1 for i in range(nd)]
    rows = np.zeros((x.shape[0],) + tuple(out) + (x.shape[1],) + tuple(kernel), np.float32)
    for p in np.ndindex(*out):
        for k in np.ndindex(*kernel):
            at = tuple(p[i] * stride + k[i] for i in range(nd))
            rows[(slice(None),) + p + (slice(None),) + k] = xp[(slice(None), slice(None)) + at]
    return rows.reshape(-1, x.shape[1] * int(np.prod(kernel))), out


def np_bitconv(layer, x, stride, pad):
    t, s = layer.ternary()
    rows, out = np_rows(x, layer.kernel_size, stride, pad)
    g, o = layer.groups, layer.out_channels
    k = rows.shape[1] // g
    ys = []
    for gi in range(g):
        r = rows[:, gi * k:(gi + 1) * k]
        if layer.act_quant:
            q, sx = tp.act_quant(r)
            r = q / sx
        ys.append(r @ t[gi * (o // g):(gi + 1) * (o // g)].reshape(o // g, -1).T.astype(np.float32) * s)
    y = np.concatenate(ys, axis=1).reshape((x.shape[0],) + tuple(out) + (o,))
    y = np.moveaxis(y, -1, 1)
    return y + layer.bias.reshape((o,) + (1,) * len(out)) if layer.bias is not None else y


@pytest.mark.parametrize("cls, x_shape, kw", [
    (nn.BitConv2d, (2, 4, 6, 5), dict(padding=1, bias=True)),
    (nn.BitConv2d, (2, 4, 7, 6), dict(stride=2, groups=2)),
    (nn.BitConv2d, (1, 3, 5, 5), dict(act_quant=False)),
    (nn.BitConv1d, (2, 4, 9), dict(padding=1, stride=2, bias=True)),
])
def test_bitconv_is_bitlinear_on_patches(cls, x_shape, kw):
    nn.manual_seed(2)
    layer = cls(x_shape[1], 6, 3, **kw)
    assert layer.weight.shape == (6, x_shape[1] // kw.get("groups", 1)) + (3,) * (len(x_shape) - 2)
    t, s = layer.ternary()
    assert set(np.unique(t)) <= {-1, 0, 1} and s == np.float32(max(np.abs(layer.weight).mean(), 1e-5))
    x = f32(*x_shape)
    want = np_bitconv(layer, x, kw.get("stride", 1), kw.get("padding", 0))
    np.testing.assert_allclose(layer(x), want, rtol=1e-5, atol=1e-5)


class Net(nn.Module):
    def __init__(self):
        self.conv1 = nn.BitConv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.BitConv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.fc = nn.BitLinear(8 * 2 * 2, 4)

    def forward(self, x):
        h = tc.max_pool(tc.relu(self.bn(self.conv1(x))), 2)
        return self.fc(nn.Flatten()(tc.relu(self.conv2(h))))


def test_the_packed_artifact_computes_the_layer():
    nn.manual_seed(3)
    model = Net()
    x = f32(5, 3, 8, 8)
    model(x)                                   # some running statistics
    model.eval()
    exe = tc.compile(model, tc.spec(("B", 3, 8, 8)))
    for batch in (1, 5):
        np.testing.assert_allclose(exe(x[:batch]), model(x[:batch]), rtol=1e-4, atol=1e-4)
    run_filecheck(exe.ir("ternary"), """
CHECK-LABEL: func.func @forward(%x: tensor<?x3x8x8xf32>
CHECK:       %[[P:.*]] = "tern.constant"() {value = dense_resource<__elided__> : tensor<8x{{(8|16|32)}}xi8>}
CHECK:       "tern.ternary_matmul"(%{{.*}}, %[[P]]) {act_quant = true, {{(codes = "offset", )?}}k = 27 : i64, n = 8 : i64
CHECK-NOT:   "tern.conv"
CHECK:       "tern.ternarize"
CHECK:       "tern.matmul"{{.*}}tensor<2x?x36xf32>, tensor<2x4x36xf32>
CHECK:       "tern.ternary_matmul"{{.*}}k = 32 : i64, n = 4 : i64
""")


@pytest.mark.parametrize("cls, x_shape, kw", [
    (nn.BitConv2d, (3, 16, 9, 8), dict(padding=1)),                    # K = 144 of 256 packed
    (nn.BitConv2d, (3, 32, 9, 9), dict(stride=2, padding=1, dilation=2)),
    (nn.BitConv1d, (3, 48, 13), dict(padding=2, stride=2)),            # 1-D: a height of 1
])
def test_patches_are_quantized_from_the_padded_input_in_one_dispatch(cls, x_shape, kw):
    """Where the avx2 / avx512 ternary kernel takes the patch matmul, one dispatch quantizes
    the patches straight from the padded input (kernels/ternary/im2col_quant.py): no f32
    patch rows, and the codes of the im2col-then-quantize path, so the layer's numbers."""
    nn.manual_seed(6)
    from tercomp.kernels.table import avx2_fits, avx512_fits, host_cpu_features
    layer = cls(x_shape[1], 8, 3, **kw)
    k = x_shape[1] * 3 ** (len(x_shape) - 2)
    if not (avx512_fits(k, 8) and "avx512_vnni" in host_cpu_features()
            or avx2_fits(k, 8) and "avx2" in host_cpu_features()):
        pytest.skip("the host has neither kernel for this K")
    exe = tc.compile(layer, tc.spec(("B",) + x_shape[1:]), cache=False)
    mlir = exe.ir("mlir")
    # (the avx512-tall kernel's own dispatch where M is whole blocks of 16 rows: 4x4 outputs)
    assert ("tern_im2col_quant_" in mlir or "tern_lanes_quant_" in mlir) \
        and "tern_avx2_quant_" not in mlir
    x = np.random.default_rng(11).standard_normal(x_shape).astype(np.float32) * 2
    x[0, :, 1] = 50.0                                   # an outlier in some patches only
    for batch in (1, 3):
        want = np_bitconv(layer, x[:batch], kw.get("stride", 1), kw.get("padding", 0)) \
            if kw.get("dilation", 1) == 1 else layer(x[:batch])
        np.testing.assert_allclose(exe(x[:batch]), want, rtol=1e-5, atol=1e-5)


def test_amx_leaves_patch_rows_to_the_avx512_dispatch():
    """Where "auto" gives a patch matmul the amx row (N a multiple of 32, M no multiple
    of 16 for avx512-tall), the patches still go from the padded input through
    im2col_quant's one dispatch into avx512's kernel (no second int8 copy of them as B
    tiles): the layer's numbers at every batch."""
    from tercomp.kernels.ternary import amx
    if not amx.enable():
        pytest.skip("the host lacks AMX-INT8")
    nn.manual_seed(8)
    layer = nn.BitConv1d(1024, 512, 3, padding=1)       # N x K = 1.5M weights (amx.MIN_WEIGHTS)
    exe = tc.compile(layer, tc.spec(("B", 1024, 13)), cache=False)
    assert 'strategy = "amx"' in exe.ir("ternary")
    mlir = exe.ir("mlir")
    assert "tern_im2col_quant_" in mlir and "tern_avx512_gemv_" in mlir
    assert "tern_amx" not in mlir
    x = np.random.default_rng(12).standard_normal((5, 1024, 13)).astype(np.float32) * 2
    for batch in (1, 2, 5):
        np.testing.assert_allclose(exe(x[:batch]), np_bitconv(layer, x[:batch], 1, 1),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_shape, kw, spec", [
    ((3, 8, 16, 16), dict(padding=1), "B"),              # 16 positions a row: vector loads
    ((2, 16, 8, 8), dict(padding=1), "B"),               # 8 a row: 2 loads a column
    ((2, 16, 4, 4), dict(padding=1), "B"),               # 4 a row: 4 loads a column
    ((2, 8, 32, 32), dict(stride=2, padding=1), "B"),    # stride 2: 32 floats, the evens
    ((2, 8, 16, 16), dict(stride=2, padding=1), "B"),    # stride 2, 8 a row: masked loads
    ((2, 32, 8, 8), dict(kernel_size=1, stride=2), "B"), # 1x1, K = 32, 4 a row at stride 2
    ((2, 3, 16, 16), dict(padding=1), "B"),              # K = 27 (a stem): KB = 8
    ((4, 8, 6, 6), dict(padding=1), 4),                  # 36 positions, M = 144: blocks
                                                         # across images, [M, N] out,
                                                         # 6 a row: gathered
    ((2, 64, 16, 16), dict(padding=1), "B"),             # K = 576 in planes of 144
    ((16, 64, 9, 9), dict(stride=2, padding=1), 16),     # K = 576, odd size, stride 2
])
def test_tall_kernel_matches_the_layer(x_shape, kw, spec):
    """Where M is whole blocks of 16 patch rows, the avx512-tall kernel takes the patch
    matmul (rows of x in the vector lanes, its own quantize dispatch from the padded
    input, the output in NCHW where each image's positions are whole blocks): the
    layer's numbers at every batch."""
    from tercomp.kernels.table import VNNI, host_cpu_features
    if VNNI not in host_cpu_features():
        pytest.skip("host CPU lacks AVX-512 VNNI")
    nn.manual_seed(8)
    kw = dict(kw)
    ksize = kw.pop("kernel_size", 3)
    layer = nn.BitConv2d(x_shape[1], 12, ksize, **kw)
    shape = (spec,) + x_shape[1:] if spec == "B" else x_shape
    exe = tc.compile(layer, tc.spec(shape), cache=False)
    assert 'strategy = "avx512-tall"' in exe.ir("ternary")
    assert "tern_lanes_quant_" in exe.ir("mlir")
    assert ("tern_amax_map_" in exe.ir("mlir")) == (ksize > 1)     # 3x3: the absmax map
    x = np.random.default_rng(12).standard_normal(x_shape).astype(np.float32) * 2
    x[0, :, 1] = 40.0
    for batch in ((1, x_shape[0]) if spec == "B" else (x_shape[0],)):
        np.testing.assert_allclose(exe(x[:batch]), layer(x[:batch]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_shape, kw", [
    ((2, 64, 16, 16), dict(padding=1)),                      # 16 a row: one load a column
    ((2, 64, 8, 8), dict(padding=1)),                        # 8 a row: two
    ((2, 64, 4, 4), dict(padding=1)),                        # 4 a row: four, every row a border
    ((2, 64, 16, 16), dict(stride=2, padding=1)),            # stride 2, 8 a row
    ((1, 64, 32, 32), dict(stride=2, padding=1)),            # stride 2, 16 a row: 32 floats
    ((2, 64, 16, 16), dict(padding=((2, 0), (0, 2)))),       # one-sided pads
    ((2, 64, 16, 16), dict(padding=2, dilation=2)),
])
def test_tall_kernel_reads_the_unpadded_input(x_shape, kw):
    """Where K is four whole planes of kernel positions (64 channels at 3x3: K = 576),
    the tall kernel's quantize reads the convolution's unpadded input with masked loads
    at the borders (no pad copy): the layer's numbers, with outliers on the border rows
    and columns (the absmax through the masked map)."""
    from tercomp.kernels.table import VNNI, host_cpu_features
    if VNNI not in host_cpu_features():
        pytest.skip("host CPU lacks AVX-512 VNNI")
    nn.manual_seed(5)
    layer = nn.BitConv2d(64, 8, 3, **kw)
    exe = tc.compile(layer, tc.spec(("B",) + x_shape[1:]), cache=False)
    mlir = exe.ir("mlir")
    assert 'strategy = "avx512-tall"' in exe.ir("ternary") and "_unpadded" in mlir
    x = np.random.default_rng(2).standard_normal(x_shape).astype(np.float32)
    x[0, :, 0] = 30.0
    x[-1, 3, :, -1] = -50.0
    for batch in (1, x_shape[0]):
        np.testing.assert_allclose(exe(x[:batch]), layer(x[:batch]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(padding=1), dict(padding=2, dilation=2)])
def test_tall_kernel_takes_a_1d_conv_with_its_absmax_map(kw):
    """A BitConv1d whose patch rows are whole blocks of 16 (64 positions): the tall
    kernel with the per-position absmax map over a [N, C, W] input (no height), an
    outlier in one position only: the layer's numbers."""
    from tercomp.kernels.table import VNNI, host_cpu_features
    if VNNI not in host_cpu_features():
        pytest.skip("host CPU lacks AVX-512 VNNI")
    nn.manual_seed(3)
    layer = nn.BitConv1d(16, 8, 3, **kw)
    exe = tc.compile(layer, tc.spec(("B", 16, 64)), cache=False)
    assert 'strategy = "avx512-tall"' in exe.ir("ternary") and "_amap" in exe.ir("mlir")
    x = np.random.default_rng(1).standard_normal((3, 16, 64)).astype(np.float32)
    x[0, :, 5] = 30.0
    np.testing.assert_allclose(exe(x), layer(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cin, size, kw", [
    (8, 10, dict(kernel_size=3, padding=1)),
    (8, 11, dict(kernel_size=3, stride=2, padding=1)),
    (8, 9, dict(kernel_size=1, stride=2)),
    (4, 7, dict(kernel_size=3)),
    (4, 9, dict(kernel_size=3, padding=2, dilation=2)),
])
def test_compiled_value_and_gradients_match_the_layer(cin, size, kw):
    """With the weights traced as inputs (a gradient), the compiled value and gradients
    (x's through the unslices of its cotangent's planes) are the eager layer's, at every
    batch: strides, a 1x1, no padding, dilation. The quantized patches are strided slices
    of the padded input, one a kernel offset (IREE vectorizes those; the im2col generic's
    window map it compiled to scalar code), except with dilation, whose windows a
    max_pool cannot take: tern.im2col and the rows' act_quant there."""
    nn.manual_seed(9)
    layer = nn.BitConv2d(cin, 6, **kw)

    def loss(m, x):
        y = m(x)
        return tc.sum(y * y * tc.sum(x))
    f = tc.value_and_grad(loss, argnums=(0, 1))
    exe = tc.compile(f, layer, tc.spec(("B", cin, size, size)), cache=False)
    dilated = kw.get("dilation", 1) > 1
    assert "tern.custom_vjp" not in exe.ir("tern")     # too small for a kernel fed at run time
    assert ("tern.im2col" in exe.ir("tern")) == dilated
    assert exe.ir("tern").count("tern.slice") >= (0 if dilated else kw["kernel_size"] ** 2)
    x = np.random.default_rng(13).standard_normal((3, cin, size, size)).astype(np.float32)
    x[0, :, 2] = 30.0
    for batch in (1, 3):
        (v, (gm, gx)), (wv, (wgm, wgx)) = exe(layer, x[:batch]), f(layer, x[:batch])
        np.testing.assert_allclose(v, wv, rtol=1e-5)
        np.testing.assert_allclose(gx, wgx, rtol=1e-4, atol=1e-5 * np.abs(wgx).max())
        for k in wgm:
            np.testing.assert_allclose(gm[k], wgm[k], rtol=1e-4, atol=1e-5 * np.abs(wgm[k]).max())


@pytest.mark.parametrize("size", [4, 10])
def test_static_batch_gradients_match_the_layer(size):
    """At a static batch the weight's cotangent is one 2-D matmul over every image's
    positions where an image has few (4x4: 16 < BATCHED_LHS_MIN_N), a batched matmul
    summed over the images otherwise (10x10), both behind IREE fences: the eager
    layer's numbers either way."""
    from tercomp.ops.linalg import BATCHED_LHS_MIN_N
    assert (size * size < BATCHED_LHS_MIN_N) == (size == 4)
    nn.manual_seed(5)
    layer = nn.BitConv2d(8, 6, 3, padding=1)

    def loss(m, x):
        y = m(x)
        return tc.sum(y * y)
    f = tc.value_and_grad(loss, argnums=(0, 1))
    x = np.random.default_rng(3).standard_normal((3, 8, size, size)).astype(np.float32)
    (v, (gm, gx)), (wv, (wgm, wgx)) = tc.compile(f, layer, x, cache=False)(layer, x), f(layer, x)
    np.testing.assert_allclose(v, wv, rtol=1e-5)
    np.testing.assert_allclose(gx, wgx, rtol=1e-4, atol=1e-5 * np.abs(wgx).max())
    np.testing.assert_allclose(gm["weight"], wgm["weight"], rtol=1e-4, atol=1e-5 * np.abs(wgm["weight"]).max())


def test_straight_through_gradients_and_a_training_step():
    nn.manual_seed(4)
    layer = nn.BitConv2d(3, 4, 3, padding=1)
    x, g = f32(2, 3, 5, 5), f32(2, 4, 5, 5)

    def loss(m, x):
        return tc.sum(m(x) * g)

    grads = tc.grad(loss)(layer, x)
    # STE: dW = g_rows^T @ act_quant(rows), as BitLinear's
    rows, _ = np_rows(x, (3, 3), 1, 1)
    q, sx = tp.act_quant(rows)
    g_rows = np.moveaxis(g, 1, -1).reshape(-1, 4)
    np.testing.assert_allclose(grads["weight"], (g_rows.T @ (q / sx)).reshape(4, 3, 3, 3), rtol=1e-4, atol=1e-4)
    compiled = tc.compile(tc.grad(loss), layer, x)(layer, x)
    np.testing.assert_allclose(compiled["weight"], grads["weight"], rtol=1e-4, atol=1e-4)

    model = Net()
    xs, ys = f32(16, 3, 8, 8), np.arange(16, dtype=np.int32) % 4

    def ce(m, x, y):
        return tc.cross_entropy(m(x), y)

    step = tc.compile_train_step(ce, model, tc.optim.AdamW(1e-2), tc.spec(("B", 3, 8, 8)),
                                 tc.spec(("B",), "int32"))
    losses = [step(xs, ys) for _ in range(15)]
    assert losses[-1] < 0.7 * losses[0], losses
    assert not np.allclose(step.buffers()["bn.running_mean"], 0)


def test_a_training_steps_conv_forward_runs_on_the_ternary_kernel():
    """compile_train_step: a BitConv2d whose shape the avx512-tall kernel takes runs its
    forward there, the latent weights ternarized and packed every call (tern.ternary_pack
    in the step; a static batch large enough: passes/ternary.py RUNTIME_MIN_WORK); the
    gradients are the columns form's (a custom_vjp). The SGD step's loss and updated
    weights are the eager layer's."""
    from tercomp.kernels.table import VNNI, host_cpu_features
    if VNNI not in host_cpu_features():
        pytest.skip("host CPU lacks AVX-512 VNNI")
    nn.manual_seed(21)
    layer = nn.BitConv2d(64, 64, 3, padding=1)
    x = np.random.default_rng(22).standard_normal((64, 64, 8, 8)).astype(np.float32)
    target = np.random.default_rng(23).standard_normal((64, 64, 8, 8)).astype(np.float32)

    def mse(m, x, t):
        return tc.mean((m(x) - t) ** 2)
    w0 = np.array(layer.weight)
    want_loss, want_grads = tc.value_and_grad(mse)(layer, x, target)
    step = tc.compile_train_step(mse, layer, tc.optim.SGD(0.1), x, target)
    ir = step.exe.ir("ternary")
    assert "tern.ternary_pack" in ir and 'strategy = "avx512-tall"' in ir and "tern.custom_vjp" in ir
    loss = step(x, target)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-4)     # a mean of 262144 f32 squares
    np.testing.assert_allclose(step.params()["weight"], w0 - 0.1 * want_grads["weight"],
                               rtol=1e-5, atol=1e-6)


def test_bad_bitconv_arguments():
    with pytest.raises(tc.TercompError, match=r"groups=3 must divide in_channels=4"):
        nn.BitConv2d(4, 6, 3, groups=3)
    with pytest.raises(tc.TercompError, match=r"padding must be \"same\" or \"valid\""):
        nn.BitConv2d(4, 6, 3, padding="full")
    with pytest.raises(tc.TercompError, match=r"stride must be positive"):
        nn.BitConv1d(4, 6, 3, stride=-1)
    with pytest.raises(tc.TercompError, match=r"kernel spans 3 on spatial dim 0"):
        nn.BitConv2d(4, 6, 3)(f32(1, 4, 2, 2))
    with pytest.raises(tc.TercompError, match=r"expects an input \[N, C, H, W\]"):
        nn.BitConv2d(4, 6, 3)(f32(4, 5, 5))


@pytest.mark.slow
def test_cnn_digits_sample_reaches_97_percent_from_the_packed_artifact(capsys):
    import cnn_digits        # samples/ is on sys.path (tests/conftest.py); ~2 min
    assert cnn_digits.main([]) >= 0.97
    assert "3 ternary matmuls in the artifact" in capsys.readouterr().out
