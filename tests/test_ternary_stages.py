"""A BitLinear model through each compile stage, checked with FileCheck: traced tern IR,
the `ternary` pass's packed rewrite, and the linalg MLIR of each kernel strategy."""
import numpy as np
import pytest

import tercomp as tc
from conftest import run_filecheck
from tercomp import nn
from tercomp.kernels.table import AVX2, VNNI, host_cpu_features

K, N = 256, 128          # packed: [N, K/4] i8


def _compile(strategy):
    nn.manual_seed(0)
    return tc.compile(nn.BitLinear(K, N), tc.spec(("B", K), "float32"), ternary=strategy,
                      weights="inline", cache=False)


@pytest.fixture(scope="module")
def addsub():
    return _compile("addsub")


@pytest.fixture(scope="module")
def int8():
    return _compile("int8")


def test_traced_tern(addsub):
    run_filecheck(addsub.ir("tern"), r"""
# CHECK-LABEL: func.func @forward(%x: tensor<?x256xf32>
# CHECK:       %[[W:.*]] = "tern.constant"() {value = dense_resource<__elided__> : tensor<128x256xf32>}
# CHECK:       %[[Q:.*]] = "tern.act_quant"(%x) : (tensor<?x256xf32>) -> tensor<?x256xf32>
# CHECK:       %[[T:.*]] = "tern.ternarize"(%[[W]]) : (tensor<128x256xf32>) -> tensor<128x256xf32>
# CHECK:       %[[Y:.*]] = "tern.matmul"(%[[Q]], %[[T]]) {kernel = "generic", transpose_b = true} : (tensor<?x256xf32>, tensor<128x256xf32>) -> tensor<?x128xf32>
# CHECK:       "func.return"(%[[Y]])
""")


def test_ternary_pass_packs_the_weights(addsub):
    run_filecheck(addsub.ir("ternary"), r"""
# CHECK-LABEL: func.func @forward(%x: tensor<?x256xf32>
# CHECK:       %[[P:.*]] = "tern.constant"() {value = dense_resource<__elided__> : tensor<128x64xi8>}
# CHECK:       %[[Y:.*]] = "tern.ternary_matmul"(%x, %[[P]]) {act_quant = true, k = 256 : i64, n = 128 : i64, scale = {{.*}} : f64, strategy = "addsub"} : (tensor<?x256xf32>, tensor<128x64xi8>) -> tensor<?x128xf32>
# CHECK:       "func.return"(%[[Y]])
""")
    # CHECK-NOTs alone cover the whole stage: no quantizer, no dense matmul, no f32 weights
    run_filecheck(addsub.ir("ternary"), r"""
# CHECK-NOT: "tern.ternarize"
# CHECK-NOT: "tern.act_quant"
# CHECK-NOT: "tern.matmul"
# CHECK-NOT: "tern.constant"() {{.*}}xf32>
""")


def test_addsub_lowers_to_masked_add_sub_with_i16_sums(addsub):
    run_filecheck(addsub.ir("mlir"), r"""
# CHECK-LABEL: func.func @forward(%arg0: tensor<?x256xf32>) -> tensor<?x128xf32>
# CHECK:       %[[W:.*]] = arith.constant dense_resource<__elided__> : tensor<128x64xi8>
# CHECK-NOT:   arith.constant dense_resource
# CHECK:       %[[XQ:.*]] = linalg.generic {{.*}} ins(%arg0, %{{.*}} : tensor<?x256xf32>, tensor<?xf32>) outs(%{{.*}} : tensor<?x256xi16>)
# CHECK:         arith.fptosi %{{.*}} : f32 to i16
# CHECK:       %[[WE:.*]] = tensor.expand_shape %[[W]]
# CHECK:       %[[ACC:.*]] = linalg.generic {{.*}} iterator_types = ["parallel", "parallel", "reduction", "parallel"]} ins({{.*}}, %[[WE]] : {{.*}}) outs(%{{.*}} : tensor<?x128x{{[0-9]+}}xi16>)
# CHECK-NEXT:  ^bb0({{.*}}: i8, %[[OUT:.*]]: i16):
# CHECK:         arith.andi %{{.*}}, %{{.*}} : i8
# CHECK:         arith.select %{{.*}}, %{{.*}}, %{{.*}} : i16
# CHECK-NOT:     arith.muli
# CHECK:         %[[SUM:.*]] = arith.addi %[[OUT]], %{{.*}} : i16
# CHECK-NEXT:    linalg.yield %[[SUM]] : i16
# CHECK:       linalg.generic {{.*}} ins(%[[ACC]] : tensor<?x128x{{[0-9]+}}xi16>) outs(%{{.*}} : tensor<?x128xi32>)
# CHECK:         arith.extsi %{{.*}} : i16 to i32
# CHECK:       return
""")
    run_filecheck(addsub.ir("mlir"), r"""
# CHECK-NOT: linalg.matmul
# CHECK-NOT: tensor<128x256xf32>
""")


def test_int8_lowers_to_an_i8_matmul(int8):
    run_filecheck(int8.ir("mlir"), r"""
# CHECK-LABEL: func.func @forward(%arg0: tensor<?x256xf32>) -> tensor<?x128xf32>
# CHECK:       %[[W:.*]] = arith.constant dense_resource<__elided__> : tensor<128x64xi8>
# CHECK-NOT:   arith.constant dense_resource
# CHECK:       %[[XQ:.*]] = linalg.generic {{.*}} outs(%{{.*}} : tensor<?x256xi8>)
# CHECK:         arith.fptosi %{{.*}} : f32 to i8
# CHECK:       %[[U:.*]] = linalg.generic {{.*}} ins(%[[W]] : tensor<128x64xi8>) outs(%{{.*}} : tensor<128x4x64xi8>)
# CHECK:       %[[WT:.*]] = tensor.collapse_shape %[[U]] {{.*}} into tensor<128x256xi8>
# CHECK:       linalg.matmul {{.*}} ins(%[[XQ]], %[[WT]] : tensor<?x256xi8>, tensor<128x256xi8>) outs(%{{.*}} : tensor<?x128xi32>)
# CHECK:       return
""")
    run_filecheck(int8.ir("mlir"), r"""
# CHECK-NOT: tensor<128x256xf32>
""")


@pytest.fixture(scope="module")
def dispatch():
    return _compile("dispatch")


def _agrees_with_f32_at_every_batch(exe):
    """The module against the f32 strategy at batch sizes on both sides of the GEMV limit."""
    x = np.random.default_rng(1).standard_normal((9, K)).astype(np.float32)
    ref = _compile("f32")
    for b in (1, 4, 5, 9):
        np.testing.assert_allclose(exe(x[:b]), ref(x[:b]), rtol=1e-6, atol=1e-6)


def test_auto_takes_one_kernel_for_every_batch_on_an_avx2_host():
    """On an AVX2 host, "auto" with a symbolic batch is the host's hand-scheduled kernel
    (avx512 with AVX-512 VNNI, else avx2; amx takes only a million weights and more): one
    flow.dispatch reading the one 2-bit
    constant, whatever the batch size, after the dispatch that quantizes x, no branch on
    the batch, and no optimization barrier (a host-side op that would split the command
    buffer). The constant holds the offset codes w + 1 that the kernel multiplies
    directly."""
    if AVX2 not in host_cpu_features():
        pytest.skip("host CPU lacks AVX2")
    kernel = "avx512" if VNNI in host_cpu_features() else "avx2"
    quant, codes, name = ("tern_avx2_quant_64", "2", f"tern_{kernel}_gemv_128x64_offset_q")
    operands = ", ".join(f"%[[Q]]#{i}" for i in range(int(codes)))
    auto = _compile("auto")
    run_filecheck(auto.ir("ternary"), rf"""
# CHECK: "tern.ternary_matmul"(%x, %{{{{.*}}}}) {{act_quant = true, codes = "offset", {{{{.*}}}}strategy = "{kernel}"}}
""")
    run_filecheck(auto.ir("mlir"), rf"""
# CHECK-LABEL: func.func @forward(%arg0: tensor<?x256xf32>) -> tensor<?x128xf32>
# CHECK:       %[[W:.*]] = arith.constant dense_resource<__elided__> : tensor<128x64xi8>
# CHECK-NOT:   arith.constant dense_resource
# CHECK-NOT:   scf.if
# CHECK-NOT:   util.optimization_barrier
# CHECK:       %[[Q:.*]]:{codes} = flow.dispatch @{quant}::@{quant}[%{{{{.*}}}}](%arg0, %{{{{.*}}}})
# CHECK-NOT:   scf.if
# CHECK:       flow.dispatch @{name}::@{name}[%{{{{.*}}}}]({operands}, %[[W]], %{{{{.*}}}}, %{{{{.*}}}})
# CHECK-NOT:   scf.if
# CHECK:       return
""")
    _agrees_with_f32_at_every_batch(auto)


def test_symbolic_batch_dispatches_at_run_time(dispatch):
    """"dispatch" (auto's choice for a symbolic batch without AVX2): one 2-bit constant,
    and an scf.if on the batch size between a decode kernel that reads it (addsub) and the
    blocked kernel that unpacks slices of it inside a loop: no whole unpacked copy. The
    barrier keeps IREE from folding each branch's view of it into a constant of its own."""
    auto = dispatch
    run_filecheck(auto.ir("ternary"), r"""
# CHECK: "tern.ternary_matmul"(%x, %{{.*}}) {{{.*}}strategy = "dispatch"}
""")
    run_filecheck(auto.ir("mlir"), r"""
# CHECK-LABEL: func.func @forward(%arg0: tensor<?x256xf32>) -> tensor<?x128xf32>
# CHECK:       %[[W:.*]] = arith.constant dense_resource<__elided__> : tensor<128x64xi8>
# CHECK-NOT:   arith.constant dense_resource
# CHECK:       %[[M:.*]] = tensor.dim %arg0, %{{.*}} : tensor<?x256xf32>
# CHECK:       %[[P:.*]] = util.optimization_barrier %[[W]] : tensor<128x64xi8>
# CHECK:       %[[SMALL:.*]] = arith.cmpi ule, %[[M]], %c4 : index
# CHECK:       %[[Y:.*]] = scf.if %[[SMALL]] -> (tensor<?x128xf32>) {
# CHECK-NOT:     linalg.matmul
# CHECK:         {{.*}}%[[P]]{{[ ,\[].*}}tensor<128x64xi8>
# CHECK-NOT:     linalg.matmul
# CHECK:         scf.yield %{{.*}} : tensor<?x128xf32>
# CHECK-NEXT:  } else {
# CHECK:         scf.for %[[N0:.*]] = %{{.*}} iter_args(%[[ACC:.*]] = %{{.*}}) -> (tensor<?x128xi32>) {
# CHECK:           %[[WS:.*]] = tensor.extract_slice %[[P]][%[[N0]], 0] [128, 64] [1, 1]
# CHECK:           %[[U:.*]] = linalg.generic {{.*}} ins(%[[WS]] : tensor<128x64xi8>) outs(%{{.*}} : tensor<128x4x64xi8>)
# CHECK:           %[[WT:.*]] = tensor.collapse_shape %[[U]]
# CHECK:           %[[YB:.*]] = linalg.matmul {{.*}} ins(%{{.*}}, %[[WT]] : tensor<?x256xi8>, tensor<128x256xi8>)
# CHECK:           tensor.insert_slice %[[YB]] into %[[ACC]][0, %[[N0]]] [%[[M]], 128]
# CHECK:         scf.yield %{{.*}} : tensor<?x128xf32>
# CHECK-NEXT:  }
# CHECK-NEXT:  return %[[Y]]
""")
    _agrees_with_f32_at_every_batch(auto)


def test_both_strategies_compute_the_same(addsub, int8):
    x = np.random.default_rng(0).standard_normal((4, K)).astype(np.float32)
    np.testing.assert_allclose(addsub(x), int8(x), rtol=1e-5, atol=1e-5)


def test_4096_bitlinear_module_is_a_twelfth_of_f32_linear():
    """The issue's size check, through tc.compile: 2-bit packed vs f32, both inline."""
    nn.manual_seed(0)
    spec = tc.spec((1, 4096), "float32")
    bit = tc.compile(nn.BitLinear(4096, 4096), spec, ternary="addsub", weights="inline",
                     cache=False)
    dense = tc.compile(nn.Linear(4096, 4096, bias=False), spec, weights="inline", cache=False)
    assert bit.vmfb_size * 12 <= dense.vmfb_size, (bit.vmfb_size, dense.vmfb_size)
