"""The f32 GEMM kernels of the kernel table (kernels/dense/gemm_avx512.py): matmul of a
shared matrix by a batch ("shared") and tern.matmul_sum (a batch of products summed),
against NumPy at tile edges (one-vector columns, rows not a multiple of 8, K chunks that
are not 96), their lowering (FileCheck), and a convolution's gradients through them."""
from __future__ import annotations

import numpy as np
import pytest

import tercomp as tc
from tercomp import nn
from tercomp.ir import TensorType
from tercomp.kernels import table as kt
from tercomp.kernels.dense import gemm_avx512 as gemm
from tercomp.tracing.tracer import apply
from conftest import run_filecheck

needs_avx512 = pytest.mark.skipif(kt.AVX512F not in kt.host_cpu_features(),
                                  reason="host CPU lacks AVX-512")


def _f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_tiles_cover_the_shapes_the_rows_take():
    assert gemm.tiles(64, 576, 1024) == (8, 2, 64, 96)
    assert gemm.tiles(4608, 512, 16) == (16, 1, 16, 64)       # a 4x4 image: one vector
    assert gemm.tiles(20, 27, 48) == (4, 1, 48, 27)           # 20 rows: tiles of 4; K = 27 whole
    assert gemm.tiles(64, 200, 64)[3] == 50                   # K chunks divide K
    assert gemm.tiles(64, 64, 40) is None                     # N not a multiple of 16
    assert not gemm.fits(1, 64, 256, 256) and gemm.fits(1, 256, 256, 256)  # 2^22 MACs: IREE's


@needs_avx512
@pytest.mark.parametrize("batch, m, k, n", [(16, 64, 72, 256), (256, 20, 27, 160), (128, 64, 200, 16)])
def test_shared_matmul_kernel_matches_numpy(batch, m, k, n):
    rng = np.random.default_rng(m + k)
    a, x = _f32(rng, m, k), _f32(rng, batch, k, n)
    f = lambda a, x: apply("matmul", a, x, kernel="avx512-f32")     # noqa: E731
    exe = tc.compile(f, a, x, cache=False)
    np.testing.assert_allclose(exe(a, x), a @ x, rtol=1e-5, atol=1e-4)


@needs_avx512
def test_a_matrix_product_runs_as_a_batch_of_one(m=256, k=784, n=512):
    """A 2-D product (an MLP's backward: g @ W, g^T @ x) takes the shared kernel as a
    batch of one; x @ W^T (a Linear's forward, W often a constant) keeps IREE's."""
    rng = np.random.default_rng(m + k + n)
    a, x = _f32(rng, m, k), _f32(rng, k, n)
    exe = tc.compile(lambda a, x: tc.matmul(a, x), a, x, cache=False)
    assert 'kernel = "avx512-f32"' in exe.ir("ternary")
    assert f"flow.dispatch @tern_gemm_avx512_shared_1x{m}x{k}x{n}" in exe.ir("mlir")
    np.testing.assert_allclose(exe(a, x), a @ x, rtol=1e-5, atol=1e-4)
    nn.manual_seed(3)
    layer = nn.Linear(k, n, bias=False)                 # x @ W^T (transpose_b)
    exe = tc.compile(layer, a, cache=False)
    assert 'kernel = "avx512-f32"' not in exe.ir("ternary")
    np.testing.assert_allclose(exe(a), a @ np.asarray(layer.weight).T, rtol=1e-5, atol=1e-4)


@needs_avx512
@pytest.mark.parametrize("batch, m, k, n", [(64, 32, 24, 400), (32, 16, 576, 64)])
def test_matmul_sum_kernel_matches_numpy(batch, m, k, n):
    rng = np.random.default_rng(m + n)
    a, x = _f32(rng, batch, m, n), _f32(rng, batch, k, n)
    f = lambda a, x: apply("matmul_sum", a, x, kernel="avx512-f32")  # noqa: E731
    exe = tc.compile(f, a, x, cache=False)
    np.testing.assert_allclose(exe(a, x), np.einsum("bmn,bkn->mk", a, x), rtol=1e-4, atol=1e-3)


@needs_avx512
def test_the_kernels_lowering():
    """matmul_sum: x's rows broadcast against a transposed to [B, N, M], the [K, M] sum
    transposed back (and NumPy's numbers); the shared matmul one dispatch."""
    rng = np.random.default_rng(4)
    a, x = _f32(rng, 16, 64, 256), _f32(rng, 16, 72, 256)
    exe = tc.compile(lambda a, x: apply("matmul_sum", a, x, kernel="avx512-f32"), a, x, cache=False)
    np.testing.assert_allclose(exe(a, x), np.einsum("bmn,bkn->mk", a, x), rtol=1e-4, atol=1e-3)
    run_filecheck(exe.ir("mlir"), """
# CHECK: stream.executable private @tern_gemm_avx512_sum_16x72x256x64
# CHECK: memref.alloca() alignment = 64 : memref<64x64xf32>
# CHECK: vector.fma
# CHECK: func.func @forward
# CHECK: linalg.generic {{.*}} ins(%{{.*}} : tensor<16x64x256xf32>) outs(%{{.*}} : tensor<16x256x64xf32>)
# CHECK: %[[C:.*]] = flow.dispatch @tern_gemm_avx512_sum_16x72x256x64::@tern_gemm_avx512_sum_16x72x256x64
# CHECK-SAME: (tensor<16x72x256xf32>, tensor<16x256x64xf32>, index) -> tensor<72x64xf32>
# CHECK: linalg.generic {{.*}} ins(%[[C]] : tensor<72x64xf32>) outs(%{{.*}} : tensor<64x72xf32>)
""")
    w = np.ones((64, 72), np.float32)
    exe = tc.compile(lambda w, x: tc.matmul(w, x), w, x, cache=False)
    assert 'kernel = "avx512-f32"' in exe.ir("ternary")
    run_filecheck(exe.ir("mlir"), """
# CHECK: flow.dispatch @tern_gemm_avx512_shared_16x64x72x256::@tern_gemm_avx512_shared_16x64x72x256
# CHECK-SAME: (tensor<64x72xf32>, tensor<16x72x256xf32>, index) -> tensor<16x64x256xf32>
""")


@needs_avx512
def test_a_convolutions_gradients_run_on_the_gemm_kernels():
    """The columns form's VJP of a BitConv2d (weights traced as inputs): the input's
    cotangent W^T @ g and the weight's sum over the images are the kernels' (the ternary
    pass settles them), and equal the eager layer's."""
    nn.manual_seed(1)
    layer = nn.BitConv2d(16, 32, 3, padding=1)
    x = np.random.default_rng(2).standard_normal((16, 16, 16, 16)).astype(np.float32)

    def loss(m, x):
        y = m(x)
        return tc.sum(y * y * 0.01)
    f = tc.value_and_grad(loss, argnums=(0, 1))
    exe = tc.compile(f, layer, x, cache=False)
    ir = exe.ir("ternary")
    assert '"tern.matmul_sum"' in ir and ir.count('kernel = "avx512-f32"') >= 2
    (v, (gm, gx)), (wv, (wgm, wgx)) = exe(layer, x), f(layer, x)
    np.testing.assert_allclose(v, wv, rtol=1e-4)
    np.testing.assert_allclose(gx, wgx, rtol=1e-4, atol=1e-5 * np.abs(wgx).max())
    np.testing.assert_allclose(gm["weight"], wgm["weight"], rtol=1e-4,
                               atol=1e-5 * np.abs(wgm["weight"]).max())


def test_other_targets_and_hosts_keep_the_generic_lowering():
    t = [TensorType((64, 72), "f32"), TensorType((16, 72, 256), "f32")]
    for targets, features in ((["vulkan"], None), (["llvm-cpu-generic"], None),
                              (["llvm-cpu"], ("avx2",))):
        assert kt.choose("matmul", t, {"transpose_b": False}, targets, features) is None
    assert kt.choose("matmul", t, {"transpose_b": False}, ["llvm-cpu"], ("avx512f",)) is not None
