"""Ternary packing (tercomp/ternary_pack.py), the compiled ternary matmul kernels
(tercomp/kernels/ternary/builder.py, ternary_vnni.py) against their NumPy reference, and
the strategy table that picks them (tercomp/kernels/ternary/strategies.py)."""
from __future__ import annotations

import os
import subprocess
import tempfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run_filecheck
from tercomp.errors import TercompError
from tercomp.ternary_pack import (KO_MAX, absmean_ternarize, act_quant, k_split,
                                      pack_ternary, padded_k, ternary_matmul_reference,
                                      from_offset_codes, to_offset_codes, unpack_ternary)

iree_rt = pytest.importorskip("iree.runtime")
from iree.compiler import ir  # noqa: E402
from iree.compiler.dialects import arith, func  # noqa: E402

from tercomp.kernels import host  # noqa: E402
from tercomp.kernels.ternary import amx, avx512  # noqa: E402
from tercomp.kernels.ternary import blocked as ternary_blocked  # noqa: E402
from tercomp.codegen.iree_session import (HOST_CPU_FLAGS, build_and_compile,  # noqa: E402
                                          new_session)
from tercomp.kernels import table as kernel_table  # noqa: E402
from tercomp.kernels.table import (AVX2, GEMV_MAX_M, VNNI,  # noqa: E402
                                          host_cpu_features)
from tercomp.kernels.ternary.strategies import (NAMES, STRATEGIES, TABLE,  # noqa: E402
                                                check_strategy, choose_strategy,
                                                emit_ternary_matmul, flags_for,
                                                strategy_flags, weight_codes)


def random_ternary(rng, n, k, p_zero=0.4):
    return rng.choice(np.array([-1, 0, 1], np.int8), size=(n, k),
                      p=[(1 - p_zero) / 2, p_zero, (1 - p_zero) / 2])


# ------------------------------------------------------------------ layout and packing
@pytest.mark.parametrize("k,kp", [(1, 4), (3, 4), (4, 4), (5, 8), (100, 128), (256, 256),
                                  (257, 512), (784, 1024), (4096, 4096), (11008, 11008),
                                  (16384, 16384), (16385, 16896), (20000, 20480)])
def test_padded_k(k, kp):
    assert padded_k(k) == kp


@given(st.integers(1, 1 << 17))
def test_k_split_is_i16_safe(k):
    kb = padded_k(k) // 4
    ko, ki = k_split(kb)
    assert ko * ki == kb
    assert ko <= KO_MAX and ko * 4 * 127 < 32767
    assert 0 <= 4 * kb - k < 4 * ki  # the padding is less than one (KI x 4) block


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 9), k=st.integers(1, 300), seed=st.integers(0, 2**32 - 1))
def test_pack_unpack_round_trip(n, k, seed):
    t = random_ternary(np.random.default_rng(seed), n, k)
    packed = pack_ternary(t)
    assert packed.dtype == np.uint8 and packed.shape == (n, padded_k(k) // 4)
    np.testing.assert_array_equal(unpack_ternary(packed, k), t)


@pytest.mark.parametrize("n,k", [(3, 1000), (1, 4097), (2, 16385)])
def test_pack_unpack_round_trip_large_k(n, k):
    t = random_ternary(np.random.default_rng(k), n, k)
    np.testing.assert_array_equal(unpack_ternary(pack_ternary(t), k), t)


@pytest.mark.parametrize("k", [7, 300])
def test_planar_layout(k):
    """T[n, c] lands in byte c % KB of row n, bits 2*(c // KB); codes +1=0b01, -1=0b10."""
    kb = padded_k(k) // 4
    for c in (0, 1, k // 2, k - 1):
        for value, code in ((1, 0b01), (-1, 0b10)):
            t = np.zeros((2, k), np.int8)
            t[1, c] = value
            expected = np.zeros((2, kb), np.uint8)
            expected[1, c % kb] = code << (2 * (c // kb))
            np.testing.assert_array_equal(pack_ternary(t), expected)


def test_pack_accepts_any_integer_dtype():
    t = np.array([[1, -1, 0, 1, 1]])
    np.testing.assert_array_equal(pack_ternary(t.astype(np.int64)), pack_ternary(t.astype(np.int8)))


# ----------------------------------------------------------------------------- errors
def test_pack_rejects_non_ternary_values():
    t = np.zeros((3, 5), np.int8)
    t[1, 2], t[2, 4] = 2, -3
    with pytest.raises(TercompError, match=r"2 value\(s\).*e\.g\. 2 at index \(1, 2\)"):
        pack_ternary(t)
    for wide in (np.array([[0, 1, 255]], np.uint8), np.array([[1, 300, -1]], np.int64)):
        with pytest.raises(TercompError, match=r"1 value\(s\).*e\.g\. (255|300) at index"):
            pack_ternary(wide)


@pytest.mark.parametrize("bad", [np.zeros((2, 4), np.float32), np.zeros((2, 4), bool),
                                 np.zeros(4, np.int8), np.zeros((2, 2, 4), np.int8),
                                 np.zeros((0, 4), np.int8)])
def test_pack_rejects_wrong_dtype_rank_or_empty(bad):
    with pytest.raises(TercompError):
        pack_ternary(bad)


def test_unpack_rejects_invalid_code():
    packed = pack_ternary(np.ones((2, 8), np.int8))
    packed[1, 1] |= 0b11 << 4
    with pytest.raises(TercompError, match=r"1 invalid 2-bit code.*row 1 byte 1 plane 2"):
        unpack_ternary(packed, 8)


@pytest.mark.parametrize("packed,k", [(np.zeros((2, 2), np.float32), 8),
                                      (np.zeros(2, np.uint8), 8),
                                      (np.zeros((2, 2), np.uint16), 8),
                                      (np.zeros((2, 2), np.uint8), 9),   # 2 bytes hold 8
                                      (np.zeros((2, 2), np.uint8), 0)])
def test_unpack_rejects_bad_arguments(packed, k):
    with pytest.raises(TercompError):
        unpack_ternary(packed, k)


def test_unpack_rejects_nonzero_padding():
    packed = pack_ternary(np.ones((1, 8), np.int8))  # K = 8: no padding
    with pytest.raises(TercompError, match="padding column 7"):
        unpack_ternary(packed, 7)


# ------------------------------------------------------------------------ quantizers
def test_absmean_ternarize():
    w = np.array([[0.5, -2.0, 0.0], [1.5, 0.4, -0.6]], np.float32)
    t, scale = absmean_ternarize(w)
    assert scale.dtype == np.float32 and scale == np.float32(5.0 / 6.0)
    assert t.dtype == np.int8
    np.testing.assert_array_equal(t, [[1, -1, 0], [1, 0, -1]])
    t0, s0 = absmean_ternarize(np.zeros((3, 4)))
    assert not t0.any() and s0 == np.float32(1e-5)
    assert absmean_ternarize(np.array([[0.5, 1.5]]))[0].tolist() == [[0, 1]]  # half-even
    with pytest.raises(TercompError):
        absmean_ternarize(np.ones((2, 2), np.int32))
    with pytest.raises(TercompError):
        absmean_ternarize(np.array([[1.0, np.nan]]))


def test_act_quant_range_and_scale():
    x = np.random.default_rng(0).standard_normal((5, 33)).astype(np.float32) * 3
    x[2] = 0.0
    xq, s = act_quant(x)
    assert xq.dtype == np.float32 and s.shape == (5, 1)
    np.testing.assert_array_equal(xq, np.rint(xq))
    assert xq.min() >= -127 and xq.max() <= 127
    np.testing.assert_array_equal(np.abs(xq).max(axis=1), [127, 127, 0, 127, 127])
    assert s[2, 0] == np.float32(127 / 1e-5)
    np.testing.assert_allclose(xq / s, x, atol=np.abs(x).max() / 127)


def test_offset_codes_are_w_plus_one_in_the_same_layout():
    """to_offset_codes stores w + 1 (TQ2_0's codes) in the planar layout, the padding
    columns as 0b01 (a zero weight); from_offset_codes undoes it; the reference reads
    either format."""
    rng = np.random.default_rng(5)
    t = random_ternary(rng, 7, 301)
    packed = pack_ternary(t)
    off = to_offset_codes(packed)
    kb = packed.shape[1]
    codes = np.stack([(off >> (2 * j)) & 3 for j in range(4)], axis=1).reshape(7, 4 * kb)
    np.testing.assert_array_equal(codes[:, :301].astype(np.int8) - 1, t)
    assert (codes[:, 301:] == 1).all()
    np.testing.assert_array_equal(from_offset_codes(off), packed)
    x = rng.standard_normal((3, 301))
    np.testing.assert_array_equal(
        ternary_matmul_reference(x, off, 301, 0.5, True, codes="offset"),
        ternary_matmul_reference(x, packed, 301, 0.5, True))
    # rows of 8 bytes and of 3 (K = 27 and 9) whose whole matrix is a multiple of 8 bytes
    for k in (27, 9):
        t = random_ternary(rng, 16, k)
        off = to_offset_codes(pack_ternary(t))
        kb = off.shape[1]
        codes = np.stack([(off >> (2 * j)) & 3 for j in range(4)], axis=1).reshape(16, 4 * kb)
        np.testing.assert_array_equal(codes[:, :k].astype(np.int8) - 1, t)
    with pytest.raises(TercompError, match="code format 'tq2'"):
        ternary_matmul_reference(x, packed, 301, 0.5, True, codes="tq2")


def test_reference_is_dense_matmul():
    rng = np.random.default_rng(1)
    t = random_ternary(rng, 6, 21)
    x = rng.standard_normal((4, 21))
    ref = ternary_matmul_reference(x, pack_ternary(t), 21, 0.25, act_quant=False)
    np.testing.assert_allclose(ref, 0.25 * x @ t.T, rtol=1e-12)
    xq, s = act_quant(x)
    ref = ternary_matmul_reference(x, pack_ternary(t), 21, 0.25, act_quant=True)
    np.testing.assert_allclose(ref, 0.25 * (xq @ t.T) / s, rtol=1e-12)


# ------------------------------------------------------------------ compiled kernels
DYN = None


def tensor_type(m, k):
    m = ir.ShapedType.get_dynamic_size() if m is None else m
    return ir.RankedTensorType.get([m, k], ir.F32Type.get())


def compile_functions(functions, flags):
    """functions: name -> (m, k, builder(x) -> y). Returns the loaded module."""
    def build():
        for name, (m, k, body) in functions.items():
            func.FuncOp.from_py_func(tensor_type(m, k), name=name)(body)
    _, vmfb = build_and_compile(build, [*HOST_CPU_FLAGS, *flags])
    return iree_rt.load_vm_flatbuffer(vmfb, driver="local-task")


# (name, M, K, N): K % 4 != 0, K <= 256 (KO = 1) and K > 256 (KO > 1), odd N, M = 1.
KERNEL_CASES = [("m1", 1, 37, 5), ("m3", 3, 301, 7), ("dyn", DYN, 301, 7)]


def assert_matches_reference(y, ref, act_quant_on):
    # int paths: exact integer sums, only the final f32 scaling rounds; the f32 path
    # without quantization sums in another order, which matters near cancellation.
    atol = 0.0 if act_quant_on else 1e-5 * np.abs(ref).max()
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=atol)


# Without activation quantization the integer-only kernels (avx2, vnni, blocked and the
# vnni dispatch) emit the f32 kernel itself, so only the strategies with a kernel of
# their own for it are compiled again without it.
OWN_NOQUANT = ("addsub", "dispatch", "int8", "f32")


@pytest.mark.parametrize("strategy,aq", [(s, True) for s in NAMES] +
                         [(s, False) for s in OWN_NOQUANT],
                         ids=[f"{s}-act_quant" for s in NAMES] + [f"{s}-noquant" for s in OWN_NOQUANT])
def test_kernel_matches_reference(strategy, aq):
    rng = np.random.default_rng(7)
    weights, functions = {}, {}
    cases = [(name, m, k, n) for name, m, k, n in KERNEL_CASES
             if STRATEGIES[strategy].fits(kernel_table.ternary_types(m, k, n), {"k": k, "n": n})]
    if not cases:
        pytest.skip(f"{strategy} fits none of these shapes (it has tests of its own below)")
    for name, m, k, n in cases:
        t, scale = absmean_ternarize(rng.standard_normal((n, k)).astype(np.float32))
        packed = pack_ternary(t)
        weights[name] = (packed, scale)
        functions[name] = (m, k, lambda x, p=packed, k=k, n=n, s=scale: emit_ternary_matmul(
            x, p, k, n, s, strategy=strategy, act_quant=aq))
    mod = compile_functions(functions, strategy_flags(strategy))
    for name, m, k, n in cases:
        packed, scale = weights[name]
        # a dynamic M on both sides of the dispatch's GEMV / blocked threshold
        for batch in ([m] if m is not None else [2, GEMV_MAX_M + 1]):
            x = (rng.standard_normal((batch, k)) * 2).astype(np.float32)
            y = mod[name](x).to_host()
            assert y.shape == (batch, n) and y.dtype == np.float32
            ref = ternary_matmul_reference(x, packed, k, scale, aq)
            assert_matches_reference(y, ref, aq)


@pytest.mark.parametrize("strategy", ["addsub", "int8", "vnni", "blocked", "dispatch", "avx2",
                                      "avx512"])
def test_kernel_with_runtime_packed_weights(strategy):
    """`packed` may be a tensor<N x KB x i8> function argument instead of a constant."""
    row = STRATEGIES[strategy]
    if row.needs_feature and row.feature not in host_cpu_features():
        pytest.skip(f"host CPU lacks {row.feature}")
    rng = np.random.default_rng(11)
    # the hand-scheduled kernels take K/4 a multiple of 32 (avx2) or 64 (avx512) only
    k, n = (256, 8) if row.needs_feature else (45, 6)
    t, scale = absmean_ternarize(rng.standard_normal((n, k)).astype(np.float32))
    packed = pack_ternary(t)

    def build():
        p_type = ir.RankedTensorType.get(list(packed.shape), ir.IntegerType.get_signless(8))

        @func.FuncOp.from_py_func(tensor_type(DYN, k), p_type)
        def main(x, p):
            return emit_ternary_matmul(x, p, k, n, scale, strategy=strategy, act_quant=True)

    _, vmfb = build_and_compile(build, [*HOST_CPU_FLAGS, *strategy_flags(strategy)])
    mod = iree_rt.load_vm_flatbuffer(vmfb, driver="local-task")
    for batch in (3, GEMV_MAX_M + 5):
        x = rng.standard_normal((batch, k)).astype(np.float32)
        y = mod.main(x, packed.view(np.int8)).to_host()
        assert_matches_reference(y, ternary_matmul_reference(x, packed, k, scale, True), True)


@pytest.mark.parametrize("n,rows", [(6, 2), (7, 1), (6, 6)])
def test_blocked_unpacks_block_by_block(monkeypatch, n, rows):
    """Several blocks of NT weight rows (the largest divisor of N that fits BLOCK_BYTES),
    a prime N (NT = 1) and one block, at a static and a dynamic M."""
    k = 301
    monkeypatch.setattr(ternary_blocked, "BLOCK_BYTES", rows * padded_k(k))
    assert ternary_blocked.block_rows(n, padded_k(k)) == rows
    rng = np.random.default_rng(n)
    t = random_ternary(rng, n, k)
    packed = pack_ternary(t)
    mod = compile_functions({
        name: (m, k, lambda x: emit_ternary_matmul(x, packed, k, n, 0.5, strategy="blocked",
                                                   act_quant=True))
        for name, m in (("static", 9), ("dyn", DYN))}, strategy_flags("blocked"))
    for name, batch in (("static", 9), ("dyn", 1), ("dyn", 13)):
        x = rng.standard_normal((batch, k)).astype(np.float32)
        y = mod[name](x).to_host()
        assert_matches_reference(y, ternary_matmul_reference(x, packed, k, 0.5, True), True)


def test_addsub_i16_partial_sums_at_the_overflow_bound():
    """K = 16384 gives KO = 64, the largest i16-safe split: every |partial| = 64*4*127."""
    k = 16384
    assert k_split(padded_k(k) // 4)[0] == KO_MAX
    t = np.stack([np.ones(k, np.int8), -np.ones(k, np.int8), random_ternary(
        np.random.default_rng(3), 1, k)[0]])
    packed = pack_ternary(t)
    mod = compile_functions({"main": (1, k, lambda x: emit_ternary_matmul(
        x, packed, k, 3, 0.5, strategy="addsub", act_quant=True))}, strategy_flags("addsub"))
    x = np.full((1, k), 3.0, np.float32)
    y = mod.main(x).to_host()
    np.testing.assert_allclose(y[0, :2], [0.5 * 3.0 * k, -0.5 * 3.0 * k], rtol=1e-6)
    assert_matches_reference(y, ternary_matmul_reference(x, packed, k, 0.5, True), True)


@pytest.mark.parametrize("m,k,n", [(1, 4096, 40), (3, 4096, 9), (DYN, 2050, 5),
                                   (1, 16385, 3)])
def test_vnni_matches_reference_at_full_vector_tiles(m, k, n):
    """The "vnni" kernel at widths where its 512-byte KB tiles (vpdpbusd) are used, K not
    always a multiple of 4, with rows of all +1 / all -1 (largest |sum|) and random ones."""
    rng = np.random.default_rng(k + n)
    t = random_ternary(rng, n, k)
    t[0], t[1] = 1, -1
    packed = pack_ternary(t)
    mod = compile_functions({"main": (m, k, lambda x: emit_ternary_matmul(
        x, packed, k, n, 0.75, strategy="vnni", act_quant=True))}, strategy_flags("vnni"))
    for batch in ([m] if m is not None else [1, 4]):
        x = (rng.standard_normal((batch, k)) * 3).astype(np.float32)
        x[:, 0] = 100.0  # one outlier: most of the row quantizes to small codes
        y = mod.main(x).to_host()
        assert_matches_reference(y, ternary_matmul_reference(x, packed, k, 0.75, True), True)
    x = np.full((1 if m is None else m, k), 2.0, np.float32)
    y = mod.main(x).to_host()
    np.testing.assert_allclose(y[:, :2], [[0.75 * 2.0 * k, -0.75 * 2.0 * k]] * x.shape[0],
                               rtol=1e-6)


needs_avx2 = pytest.mark.skipif(AVX2 not in host_cpu_features(), reason="host CPU lacks AVX2")


@needs_avx2
@pytest.mark.parametrize("m,k,n,codes", [(1, 128, 4, "signed"), (3, 4093, 12, "offset"),
                                         (8, 2048, 8, "signed"), (DYN, 8192, 40, "offset"),
                                         (DYN, 1152, 8, "offset")])
def test_avx2_gemv_matches_reference(m, k, n, codes):
    """The hand-scheduled kernel where it applies (K/4 a multiple of 32, N of 4, K not
    always a multiple of 4), on signed codes (remapped in registers) and on the offset
    codes the ternary pass stores for it: rows of all +1 / all -1 (the largest |sum|,
    which the i16 pair sums must hold: 16 chunks of 128 weights summed in i16 at
    K = 8192), an outlier that leaves most of x small, and M in whole blocks of 4 rows of
    x (the GEMM loop), a remainder (the GEMV loop) and both, against the reference,
    exactly."""
    _check_kernel_exactly("avx2", m, k, n, codes, [m] if m is not None else [1, 4, 7, 13])


def _check_kernel_exactly(strategy, m, k, n, codes, batches):
    """The `strategy` kernel of a [n, k] ternary matrix in `codes` whose first rows are
    all +1 and all -1, compiled for M = m, against the reference, exactly, for each
    batch size: x with an outlier, and x of all 2 (the largest sums)."""
    rng = np.random.default_rng(k + n)
    t = random_ternary(rng, n, k)
    t[0], t[1] = 1, -1
    packed = pack_ternary(t)
    coded = to_offset_codes(packed) if codes == "offset" else packed
    mod = compile_functions({"main": (m, k, lambda x: emit_ternary_matmul(
        x, coded, k, n, 0.75, strategy=strategy, act_quant=True, codes=codes))},
        strategy_flags(strategy))
    for batch in batches:
        x = (rng.standard_normal((batch, k)) * 3).astype(np.float32)
        x[:, 0] = 100.0
        y = mod.main(x).to_host()
        assert_matches_reference(y, ternary_matmul_reference(x, packed, k, 0.75, True), True)
        x = np.full((batch, k), 2.0, np.float32)
        np.testing.assert_allclose(mod.main(x).to_host()[:, :2],
                                   [[0.75 * 2.0 * k, -0.75 * 2.0 * k]] * batch, rtol=1e-6)


@needs_avx2
def test_avx2_gemv_with_runtime_packed_weights_and_the_ir_it_dispatches():
    """`packed` as a function argument; the module holds one stream.executable per weight
    shape, reached by flow.dispatch, whose loop multiplies with vpmaddubsw, and (M
    symbolic) one quantize dispatch that both matmuls of the same x read."""
    k, n = 256, 8
    rng = np.random.default_rng(5)
    packed = pack_ternary(random_ternary(rng, n, k))
    text = {}

    def build():
        p_type = ir.RankedTensorType.get(list(packed.shape), ir.IntegerType.get_signless(8))

        @func.FuncOp.from_py_func(tensor_type(DYN, k), p_type)
        def main(x, p):
            a = emit_ternary_matmul(x, p, k, n, 0.5, strategy="avx2", act_quant=True)
            b = emit_ternary_matmul(x, p, k, n, 0.25, strategy="avx2", act_quant=True)
            return arith.addf(a, b)

    text, vmfb = build_and_compile(build, [*HOST_CPU_FLAGS, *strategy_flags("avx2")])
    run_filecheck(text, r"""
# CHECK:     stream.executable private @tern_avx2_quant_64
# CHECK:     stream.executable private @tern_avx2_gemv_8x64_q
# CHECK:       llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"
# CHECK-NOT: stream.executable
# CHECK:     %[[Q:.*]]:2 = flow.dispatch @tern_avx2_quant_64::@tern_avx2_quant_64[%{{.*}}](%arg0, %{{.*}}) : (tensor<?x256xf32>{%{{.*}}}, index) -> (tensor<?x256xi8>{%{{.*}}}, tensor<?x2xf32>{%{{.*}}})
# CHECK-NOT: @tern_avx2_quant_64
# CHECK:     flow.dispatch @tern_avx2_gemv_8x64_q::@tern_avx2_gemv_8x64_q[%{{.*}}](%[[Q]]#0, %[[Q]]#1, %arg1,
# CHECK-NOT: @tern_avx2_quant_64
# CHECK:     flow.dispatch @tern_avx2_gemv_8x64_q::@tern_avx2_gemv_8x64_q[%{{.*}}](%[[Q]]#0, %[[Q]]#1, %arg1,
""")
    mod = iree_rt.load_vm_flatbuffer(vmfb, driver="local-task")
    for batch in (1, 4, 6):     # no whole block of 4 rows, one, one and a remainder
        x = rng.standard_normal((batch, k)).astype(np.float32)
        ref = ternary_matmul_reference(x, packed, k, 0.75, True)
        np.testing.assert_allclose(mod.main(x, packed.view(np.int8)).to_host(), ref,
                                   rtol=1e-5, atol=1e-5 * np.abs(ref).max())


needs_vnni = pytest.mark.skipif(VNNI not in host_cpu_features(),
                                reason="host CPU lacks AVX-512 VNNI")


@needs_vnni
@pytest.mark.parametrize("m,k,n,codes,batches", [
    (1, 256, 4, "signed", None),                # one chunk, one GEMV step
    (3, 4093, 12, "offset", None),              # K % 4 != 0, the decode's own quantization
    (5, 1536, 20, "offset", None),              # a block of 4 rows of x and a GEMV row
    (16, 2048, 36, "signed", None),             # 4 blocks; 36 rows: workgroups of 8, 4, none
    (DYN, 16384, 8, "offset", (1, 4, 5, 16, 128)),  # the largest K (8 K-chunks); 1..16 blocks
    (DYN, 1280, 68, "signed", (1, 3, 13, 128)),     # 68 rows: a partial tile of 32 rows
    # blocks of 8, 4 and 2 rows of x and the GEMV row in every combination (M = 2..15,
    # a batched decode's sizes), 1536 x 4096 as in the 700M model's projections
    (DYN, 1536, 4096, "offset", (2, 3, 6, 7, 8, 15)),
    (DYN, 1024, 40, "signed", (8, 14)),
    # K below the packed 768 / 1024: the quantize dispatch reads x unpadded and writes
    # the zero columns (a 3x3x64 conv's patch rows; K = 1000); K % 8 != 0: a padded copy
    (DYN, 576, 64, "offset", (1, 4, 7, 33)),
    (DYN, 1000, 8, "signed", (5, 8)),
    (DYN, 2050, 8, "offset", (4, 9)),
])
def test_avx512_matches_reference(m, k, n, codes, batches):
    """The AVX-512 VNNI kernel where it applies (K/4 a multiple of 64, N of 4), on signed
    and offset codes: rows of all +1 / all -1 (the largest sums), an outlier that leaves
    most of x small, M in whole blocks of 4 rows of x (the GEMM loop over tiles of 16
    weight rows), remainders (the GEMV loop) and both, against the reference, exactly."""
    _check_kernel_exactly("avx512", m, k, n, codes, batches or [m])


@needs_vnni
def test_avx512_gemm_in_k_chunks_matches_reference():
    """Past K_WHOLE_MAX packed bytes the GEMM loop runs K in chunks of K_CHUNK, the
    partial sums of each tile step kept across chunks: K = 4 chunks and 64 bytes (a
    short last chunk), in blocks of 8, 4 and 2 rows of x and the GEMV row, 68 weight
    rows (a partial tile), exactly against the reference."""
    kb = 4 * avx512.K_CHUNK + avx512.CHUNK
    assert avx512.k_chunk(kb) == avx512.K_CHUNK < kb and kb % avx512.K_CHUNK
    _check_kernel_exactly("avx512", DYN, 4 * kb, 68, "offset", (8, 15, 22))


@needs_vnni
def test_avx512_gemm_without_gfni_matches_reference(monkeypatch):
    """On an AVX-512 VNNI host without GFNI (Cascade Lake) the GEMM loop decodes each
    plane with a shift and an and instead of gf2p8affineqb: the same numbers, exactly,
    in blocks of 8, 4 and 2 rows and the GEMV row."""
    monkeypatch.setattr(avx512, "host_cpu_features", lambda: frozenset({VNNI}))
    _check_kernel_exactly("avx512", DYN, 1536, 36, "offset", (7, 8, 11))


@needs_vnni
@pytest.mark.parametrize("m,k,n,codes", [
    (16, 256, 8, "signed"),         # one block of 16 rows of x, signed codes remapped
    (80, 1152, 12, "offset"),       # a superblock of 4 blocks and one more; K in planes
                                    # of 288 (q_columns), the weights regrouped from 320
    (64, 576, 8, "signed"),         # a 3x3x64 conv's K: planes of 144, not the packed 192
    (32, 600, 4, "offset"),         # planes of 160 (K / 4 = 150 rounded up) from 256
    (272, 27, 4, "offset"),         # 17 blocks over two workgroups; KB = 8: masked decode
    (32, 4608, 8, "signed"),        # a 3x3x512 conv's K
    (48, 9, 8, "offset"),           # KB = 4: a row shorter than the decode's 16 bytes
])
def test_avx512_tall_matches_reference(m, k, n, codes):
    """The rows-in-lanes kernel for M >> N (x [M, K] not from a convolution: its
    quantize dispatch gathers the rows of each block), on signed and offset codes,
    against the reference, exactly."""
    _check_kernel_exactly("avx512-tall", m, k, n, codes, [m])


@needs_vnni
def test_avx512_tall_takes_an_m_of_whole_blocks_of_16_only():
    """"auto" gives the tall kernel an M whose known factor (static, or a symbolic M's
    coefficient) is a multiple of 16, with N at most 512; other M, or wider N, keep
    avx512. Asked for by name, an M that is not a multiple of 16 is refused."""
    import sympy
    from tercomp.ir import TensorType
    b = sympy.Symbol("B")
    for m, want in [(16, "avx512-tall"), (1024 * b, "avx512-tall"), (8, "avx512"),
                    (72 * b, "avx512"), (b, "avx512")]:
        types = [TensorType((m, 576), "f32"), TensorType((64, 192), "i8")]
        assert kernel_table.choose("ternary_matmul", types, {"k": 576, "n": 64},
                                   features=[VNNI]).kernel == want, m
    types = [TensorType((1024 * b, 1536), "f32"), TensorType((4096, 384), "i8")]
    assert kernel_table.choose("ternary_matmul", types, {"k": 1536, "n": 4096},
                               features=[VNNI]).kernel == "avx512"
    packed = pack_ternary(random_ternary(np.random.default_rng(0), 8, 256))
    with pytest.raises(TercompError, match="'avx512-tall' cannot emit"):
        _emit_with("tensor<24x256xf32>", packed, 256, 8, "avx512-tall")


@needs_vnni
def test_avx512_dispatches_its_executable_only_where_its_shape_fits():
    """One stream.executable per weight shape, multiplying with vpdpbusd, after the avx2
    kernel's quantize dispatch. Where its shape does not fit, "avx512" asked for by name is
    refused, and "auto" gives a K whose K/4 is a multiple of 32 but not of 64 the avx2
    kernel, an N not a multiple of 4 a portable one: every one exact."""
    rng = np.random.default_rng(3)
    cases = {"fits": (256, 8), "avx2": (128, 8), "portable": (256, 7)}
    chosen = {c: choose_strategy(DYN, k, n) for c, (k, n) in cases.items()}
    assert chosen["fits"] == "avx512" and chosen["avx2"] == "avx2"
    assert chosen["portable"] not in ("avx512", "avx2")
    packed = {c: pack_ternary(random_ternary(rng, n, k)) for c, (k, n) in cases.items()}
    for c in ("avx2", "portable"):
        k, n = cases[c]
        with pytest.raises(TercompError, match="'avx512' cannot emit"):
            _emit_with(f"tensor<?x{k}xf32>", packed[c], k, n, "avx512")
    functions = {c: (DYN, k, lambda x, p=packed[c], k=k, n=n: emit_ternary_matmul(
        x, p, k, n, 0.5, strategy="auto", act_quant=True)) for c, (k, n) in cases.items()}

    def build():
        for c, (m, k, body) in functions.items():
            func.FuncOp.from_py_func(tensor_type(m, k), name=c)(body)
    text, vmfb = build_and_compile(build, [*HOST_CPU_FLAGS,
                                           *flags_for(set(chosen.values()), ["llvm-cpu"])])
    run_filecheck(text, r"""
# CHECK-DAG: stream.executable private @tern_avx512_gemv_8x64_q
# CHECK-DAG:   llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"
# CHECK-DAG: stream.executable private @tern_avx2_gemv_8x32_q
# CHECK-LABEL: func.func @fits
# CHECK:       %[[Q:.*]]:2 = flow.dispatch @tern_avx2_quant_64::@tern_avx2_quant_64
# CHECK:       flow.dispatch @tern_avx512_gemv_8x64_q::@tern_avx512_gemv_8x64_q[%{{.*}}](%[[Q]]#0, %[[Q]]#1,
# CHECK-LABEL: func.func @avx2
# CHECK:       flow.dispatch @tern_avx2_gemv_8x32_q::@tern_avx2_gemv_8x32_q
# CHECK-LABEL: func.func @portable
# CHECK-NOT:   flow.dispatch @tern_avx
""")
    mod = iree_rt.load_vm_flatbuffer(vmfb, driver="local-task")
    for c, (k, n) in cases.items():
        for batch in (1, 6):
            x = rng.standard_normal((batch, k)).astype(np.float32)
            ref = ternary_matmul_reference(x, packed[c], k, 0.5, True)
            assert_matches_reference(mod[c](x).to_host(), ref, True)


needs_amx = pytest.mark.skipif(not amx.enable(), reason="host CPU lacks AMX-INT8, or Linux "
                               "did not grant this process its tile data")


@needs_amx
@pytest.mark.parametrize("m,k,n,batches", [
    # below MIN_M (avx512's branch of the scf.if), one block and the rows past it (avx512's
    # GEMM and GEMV loops in the same dispatch), groups of blocks and one left over;
    # packed K 384: three chunks, no tail
    (DYN, 1536, 96, (1, 15, 16, 17, 48, 130, 300)),      # 300: superblocks of 8, 8 and 2
    # a last block of 8 or more rows padded with zero rows (a batched decode's 8 rows),
    # 7 left over through avx512's loops
    (DYN, 1536, 64, (7, 8, 9, 24, 39)),
    (DYN, 4096, 64, (8, 24)),
    (32, 4096, 64, None),                    # a static M of two blocks: one group
    (DYN, 6912, 64, (80,)),                  # packed K 1728: 13 chunks and a 64-column tail
    (DYN, 256, 32, (16, 21, 31)),            # packed K 64, below a chunk: the tail alone
])
def test_amx_matches_reference(m, k, n, batches, monkeypatch):
    """The AMX kernel (whole blocks of 16 rows of x through tdpbusd, the rest through the
    avx512 loops of the same dispatch) against the reference, exactly: rows of all +1 /
    all -1, an outlier, x of all 2. The K = 1536 and 4096 cases with a last block of 8
    or more rows padded too (amx.PAD 8, not the default)."""
    _check_kernel_exactly("amx", m, k, n, "offset", batches or [m])
    if m is None and k in (1536, 4096) and n == 64:
        monkeypatch.setattr(amx, "PAD", 8)
        _check_kernel_exactly("amx", m, k, n, "offset", batches)


@needs_amx
def test_amx_dispatches_the_b_tiles_of_x_once_for_every_matmul_of_it():
    """A symbolic M, no branch on it: one quantize dispatch writes x's codes, statistics
    and B tiles, and both matmuls of the same x read them, the kernel multiplying with
    tdpbusd. Below 8 rows (a decode) the same dispatches run: no tile is written or
    read, and the rows go through avx512's loops. The module runs in IREE's own
    iree-run-module too: its quantize dispatch asks Linux for the tiles."""
    k, n = 1024, 32
    rng = np.random.default_rng(3)
    packed = to_offset_codes(pack_ternary(random_ternary(rng, n, k)))

    def build():
        @func.FuncOp.from_py_func(tensor_type(DYN, k))
        def main(x):
            a = emit_ternary_matmul(x, packed, k, n, 0.5, strategy="amx", act_quant=True,
                                    codes="offset")
            b = emit_ternary_matmul(x, packed, k, n, 0.25, strategy="amx", act_quant=True,
                                    codes="offset")
            return arith.addf(a, b)
    text, vmfb = build_and_compile(build, [*HOST_CPU_FLAGS, *strategy_flags("amx")])
    run_filecheck(text, r"""
# CHECK-DAG: stream.executable private @tern_amx_quant_256
# CHECK-DAG: stream.executable private @tern_amx_gemm_32x256_offset_q
# CHECK-DAG:   llvm.call_intrinsic "llvm.x86.tdpbusd.internal"
# CHECK-LABEL: func.func @main
# CHECK-NOT:   scf.if
# CHECK:       %[[Q:.*]]:3 = flow.dispatch @tern_amx_quant_256::@tern_amx_quant_256
# CHECK:       flow.dispatch @tern_amx_gemm_32x256_offset_q::@tern_amx_gemm_32x256_offset_q[%{{.*}}](%[[Q]]#0, %[[Q]]#1, %[[Q]]#2,
# CHECK-NOT:   flow.dispatch @tern_amx_quant_256
# CHECK:       flow.dispatch @tern_amx_gemm_32x256_offset_q::@tern_amx_gemm_32x256_offset_q[%{{.*}}](%[[Q]]#0, %[[Q]]#1, %[[Q]]#2,
""")
    mod = iree_rt.load_vm_flatbuffer(vmfb, driver="local-task")
    for batch in (3, 16, 37):
        x = rng.standard_normal((batch, k)).astype(np.float32)
        ref = 0.75 * ternary_matmul_reference(x, from_offset_codes(packed), k, 1.0, True)
        np.testing.assert_allclose(mod.main(x).to_host(), ref, rtol=1e-5, atol=1e-4)
    # a fresh process that never asked Linux for the tiles: the module asks itself
    import iree._runtime_libs as libs
    tool = os.path.join(os.path.dirname(libs.__file__), "iree-run-module")
    with tempfile.TemporaryDirectory() as d:
        x = rng.standard_normal((37, k)).astype(np.float32)
        paths = [os.path.join(d, f) for f in ("m.vmfb", "x.npy", "y.npy")]
        with open(paths[0], "wb") as f:
            f.write(vmfb)
        np.save(paths[1], x)
        r = subprocess.run([tool, f"--module={paths[0]}", "--device=local-task",
                            "--function=main", f"--input=@{paths[1]}", f"--output=@{paths[2]}"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        ref = 0.75 * ternary_matmul_reference(x, from_offset_codes(packed), k, 1.0, True)
        np.testing.assert_allclose(np.load(paths[2]), ref, rtol=1e-5, atol=1e-4)


def test_auto_takes_amx_for_a_prefill_on_a_host_with_amx():
    """With AMX-INT8 the table gives the AMX kernel to M of 16 and more and to a symbolic
    M, where avx512 fits and N is a multiple of 32; a static M below 16 (a decode's, a
    batched decode's), N of 4 but not 32, and a matrix under a million weights (its
    compile costs more than it saves: amx.MIN_WEIGHTS) keep avx512."""
    amx_host = ("avx2", "avx512f", "avx512bw", VNNI, "amx_int8", "amx_tile")
    for m in (16, 128, 512, None):
        assert choose_strategy(m, 4096, 4096, features=amx_host) == "amx"
        assert choose_strategy(m, 14336, 4096, features=amx_host) == "amx"
        assert choose_strategy(m, 4096, 4100, features=amx_host) == "avx512"
    for m in (1, 4, 8, 15):
        assert choose_strategy(m, 4096, 4096, features=amx_host) == "avx512"
    assert choose_strategy(None, 1024, 1024, features=amx_host) == "amx"
    assert choose_strategy(None, 1024, 992, features=amx_host) == "avx512"
    assert choose_strategy(None, 256, 512, features=amx_host) == "avx512"
    assert weight_codes("amx", 4096, 4096) == "offset"


def test_amx_is_refused_where_it_cannot_run(monkeypatch):
    """Asked for by name: refused without AMX, and without Linux's grant of the tile data
    the table does not see the feature at all."""
    monkeypatch.setattr(kernel_table, "target_features", lambda targets: frozenset({VNNI}))
    with pytest.raises(TercompError, match="'amx' needs a CPU with amx_int8"):
        check_strategy("amx", ["llvm-cpu"])
    monkeypatch.undo()
    monkeypatch.setattr(kernel_table, "host_cpu_features",
                        lambda: frozenset({VNNI, "amx_int8", "amx_tile"}))
    monkeypatch.setattr(amx, "enable", lambda: False)
    assert "amx_int8" not in kernel_table.target_features(["llvm-cpu"])
    monkeypatch.setattr(amx, "enable", lambda: True)
    assert "amx_int8" in kernel_table.target_features(["llvm-cpu"])
    # Linux is asked only where the host has the features
    monkeypatch.setattr(host, "host_cpu_features", lambda: frozenset({VNNI}))
    assert host.enable_amx.__wrapped__() is False


@pytest.mark.parametrize("features,fast", [
    (("avx2", "avx512f", "avx512bw", VNNI), "avx512"),     # Sapphire Rapids, Zen 4
    (("avx2", "avx_vnni"), "avx2"),                         # Alder Lake: 256-bit VNNI only
    (("avx2",), "avx2")])                                   # Zen 3
def test_auto_takes_avx512_only_on_a_host_with_avx512_vnni(features, fast):
    """The table settles the kernel from the features it is given (not this host's): the
    avx512 kernel on a host with AVX-512 VNNI, at every M, where the packed K/4 is a
    multiple of 64 (every K above 256: padded_k pads it to a multiple of 256); the avx2
    kernel where it is a multiple of 32 only or the host lacks AVX-512 VNNI."""
    for m in (1, 3, 4, 16, 128, None):
        assert choose_strategy(m, 4096, 4096, features=features) == fast
        assert choose_strategy(m, 1536, 4096, features=features) == fast
        # a 3x3 conv's patch rows at 128 and 64 channels: packed K 1280 and 768
        assert choose_strategy(m, 1152, 4096, features=features) == fast
        # (M a multiple of 16 and N <= 512: the rows-in-lanes kernel, where there is VNNI)
        assert choose_strategy(m, 576, 64, features=features) == (
            "avx512-tall" if fast == "avx512" and m and m % 16 == 0 else fast)
        # packed K/4 = 32, a multiple of 32 but not of 64
        assert choose_strategy(m, 128, 4096, features=features) == "avx2"
        # Llama-3-8B's down projection: past the avx2 kernel's largest K
        assert choose_strategy(m, 14336, 4096, features=features) == (
            "avx512" if fast == "avx512" else choose_strategy(m, 14336, 4096, features=()))
    assert weight_codes("avx512", 4096, 4096) == weight_codes("avx512", 1152, 4096) == "offset"
    assert weight_codes("avx512", 4096, 4098) == "signed"


def test_avx512_is_refused_where_it_cannot_compile(monkeypatch):
    monkeypatch.setattr(kernel_table, "target_features", lambda targets: frozenset({AVX2}))
    with pytest.raises(TercompError, match="'avx512' needs a CPU with avx512_vnni"):
        check_strategy("avx512", ["llvm-cpu"])
    with pytest.raises(TercompError, match="does not compile for llvm-cpu-generic"):
        check_strategy("avx512", ["llvm-cpu-generic"])
    assert choose_strategy(1, 4096, 4096) == "avx2"


def test_avx2_is_refused_where_it_cannot_compile(monkeypatch):
    monkeypatch.setattr(kernel_table, "target_features", lambda targets: frozenset())
    with pytest.raises(TercompError, match="'avx2' needs a CPU with avx2"):
        check_strategy("avx2", ["llvm-cpu"])
    with pytest.raises(TercompError, match="does not compile for llvm-cpu-generic"):
        check_strategy("avx2", ["llvm-cpu-generic"])
    assert choose_strategy(1, 4096, 4096) == "addsub"


@pytest.mark.parametrize("k,n,fits", [(4096, 4096, True), (1536, 4100, True),
                                      (4000, 4096, True), (64, 4096, False),
                                      (4096, 4098, False)])
def test_avx2_is_auto_only_where_its_shape_fits(k, n, fits):
    """Where the packed K/4 is a multiple of 32 (K = 4000 is packed as 4096; 64 as 64)
    and N of 4."""
    assert choose_strategy(1, k, n, features=(AVX2,)) == ("avx2" if fits else "addsub")
    assert choose_strategy(128, k, n, features=(AVX2,)) == ("avx2" if fits else "blocked")
    assert choose_strategy(None, k, n, features=(AVX2,)) == ("avx2" if fits else "dispatch")


@pytest.mark.parametrize("kernel", ["avx2", "generic"])
def test_widening_matmul_matches_numpy(kernel):
    """tern.widening_matmul (an LM's output layer: f32 x, f16 or int8 weights widened in
    the kernel) through tc.compile at a symbolic batch, against NumPy: the hand-written
    GEMVs (f16, and int8 with a per-row scale) with an N that leaves tail rows (389: 25
    workgroups of 16 rows, each read as 4 streams of 4 rows, the last one of 5 rows, a
    stream step and a tail row), and the generic contraction for f16 and int8, with and
    without a scale."""
    import tercomp as tc
    from tercomp.tracing.tracer import apply
    if kernel == "avx2" and AVX2 not in host_cpu_features():
        pytest.skip("host CPU lacks AVX2")
    rng = np.random.default_rng(2)
    n = 389
    scale = rng.uniform(0.5, 2, n).astype(np.float32)
    cases = [(rng.standard_normal((n, 48)).astype(np.float16), None),
             (rng.integers(-127, 128, (n, 48)).astype(np.int8), scale),
             (rng.integers(-127, 128, (n, 48)).astype(np.int8), None)]
    for w, sc in cases:
        if kernel == "avx2" and (w.dtype == np.int8) != (sc is not None):
            continue            # the avx2 kernels: f16 alone, int8 with a scale
        extra = () if sc is None else (sc,)
        exe = tc.compile(lambda x, w=w, extra=extra: apply("widening_matmul", x, w, *extra, kernel=kernel),
                         tc.spec(("B", 48), "float32"), cache=False)
        if kernel == "avx2":
            el = "f16" if sc is None else "i8"
            run_filecheck(exe.ir("mlir"), rf"""
# CHECK: stream.executable private @[[NAME:tern_avx2_{el}_gemv_{n}x48(_m[0-9]+)?]]
# CHECK: flow.dispatch @[[NAME]]::@[[NAME]][%{{{{.*}}}}](%arg0, %{{{{.*}}}}) : (tensor<?x48xf32>{{%{{{{.*}}}}}}, tensor<{n}x48x{el}>, {f"tensor<{n}xf32>, " if sc is not None else ""}index) -> tensor<?x{n}xf32>
""")
        for b in (1, 3, 8, 9, 13):
            x = rng.standard_normal((b, 48)).astype(np.float32)
            ref = x.astype(np.float64) @ w.astype(np.float64).T
            if sc is not None:
                ref = ref * sc
            np.testing.assert_allclose(exe(x), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_widening_vnni_matches_int8_activations_in_numpy():
    """The int8 table's avx512-vnni output layer (x quantized to int8 a row at a time,
    vpdpbusd on the offset weights) through tc.compile at a symbolic batch, against
    NumPy's act_quant codes times the table (float64): every M path of the kernel (one
    row left over: the 4-stream GEMV; 2-7: a zero-padded block of 8; blocks of 8; a
    block and a leftover), a row of zeros (its logits 0), weights at -128 and 127, and an
    N that leaves tail rows (389 over 25 workgroups of 16 rows: a stream step, then 1-5
    rows one by one); and at K = 2304 (blocks of 7 rows of x: 16 KiB of codes)."""
    import tercomp as tc
    from tercomp.ternary_pack import act_quant
    from tercomp.tracing.tracer import apply
    if VNNI not in host_cpu_features():
        pytest.skip("host CPU lacks AVX-512 VNNI")
    rng = np.random.default_rng(3)
    for n, k, batches in ((389, 192, (1, 2, 7, 8, 9, 13, 16, 19)), (37, 2304, (1, 6, 7, 15))):
        w = rng.integers(-128, 128, (n, k)).astype(np.int8)
        w[0, :] = -128
        w[1, :] = 127
        scale = rng.uniform(0.5, 2, n).astype(np.float32)
        exe = tc.compile(lambda x: apply("widening_matmul", x, w, scale, kernel="avx512-vnni"),
                         tc.spec(("B", k), "float32"), cache=False)
        for b in batches:
            x = (rng.standard_normal((b, k)) * rng.uniform(0.1, 10, (b, 1))).astype(np.float32)
            x[b // 2] = 0
            xq, s = act_quant(x)
            ref = (xq.astype(np.float64) @ w.astype(np.float64).T) / s * scale
            got = exe(x)
            assert not got[b // 2].any()
            np.testing.assert_allclose(got, ref, rtol=2e-6, atol=1e-6 * np.abs(ref).max())


@pytest.mark.parametrize("features,decode,symbolic", [((VNNI,), "vnni", "dispatch-vnni"),
                                                     ((), "addsub", "dispatch")])
def test_choose_strategy_per_shape_and_cpu(features, decode, symbolic):
    # N = 4098 (not a multiple of 4): neither hand-scheduled kernel takes it
    def pick(m, targets=("llvm-cpu",)):
        return choose_strategy(m, 4096, 4098, targets, features=features)
    assert pick(1) == pick(GEMV_MAX_M) == decode
    assert pick(GEMV_MAX_M + 1) == pick(128) == "blocked"
    assert pick(None) == symbolic
    # the generic x86-64 target has no VNNI whatever the host has
    assert choose_strategy(None, 64, 64, ["llvm-cpu-generic"]) == "dispatch"
    assert choose_strategy(1, 64, 64, ["llvm-cpu-generic"]) == "addsub"


@pytest.mark.parametrize("targets", [["vulkan"], ["cuda"], ["llvm-cpu", "vulkan"],
                                     ["llvm-cpu", "cuda"]])
def test_auto_never_picks_a_cpu_only_kernel_for_a_gpu(targets):
    for m in (None, 1, 2, 8, 128):
        s = choose_strategy(m, 4096, 4096, targets, features=(VNNI,))
        assert all(t in STRATEGIES[s].targets for t in targets)
        assert s == "addsub"


def test_every_strategy_is_in_one_table():
    """The strategies are the ternary_matmul rows of the one kernel table, and each has
    an emitter."""
    assert TABLE == kernel_table.rows("ternary_matmul")
    assert NAMES == tuple(r.kernel for r in TABLE)
    assert {"dispatch-vnni", "dispatch", "avx512-tall", "amx", "avx512", "avx2", "vnni", "blocked",
            "addsub", "int8", "f32"} == set(NAMES)
    for r in TABLE:
        assert r.targets and r.why and callable(r.emit.kernel) and callable(r.fits)
        assert r.codes in ("signed", "offset")


def test_strategy_flags():
    assert strategy_flags("addsub") == []
    assert strategy_flags("vnni") == []
    assert strategy_flags("blocked") == strategy_flags("dispatch") == strategy_flags("int8")[:2]
    assert "--iree-opt-data-tiling=true" in strategy_flags("int8")
    for bad in ("auto", "off", "llvm-cpu", "", None):
        with pytest.raises(TercompError):
            strategy_flags(bad)
    assert flags_for({"int8", "addsub"}, ["llvm-cpu"]) == strategy_flags("int8")
    # an op the pass did not settle has no kernel, so no flags either
    with pytest.raises(TercompError):
        flags_for({"auto"}, ["llvm-cpu"])


@pytest.mark.parametrize("strategy", ["vnni", "blocked", "dispatch", "dispatch-vnni", "avx2",
                                      "avx512"])
def test_cpu_only_kernels_are_refused_for_gpus(strategy):
    with pytest.raises(TercompError, match=f"{strategy!r} does not compile for vulkan") as e:
        check_strategy(strategy, ["llvm-cpu", "vulkan"])
    assert "addsub" in e.value.hint and strategy not in e.value.hint
    with pytest.raises(TercompError, match="does not compile for cuda"):
        flags_for({strategy}, ["cuda"])
    assert check_strategy(strategy, ["llvm-cpu"]) == strategy


def _emit_with(x_type, packed, k, n, strategy="addsub", codes="signed"):
    session, ctx = new_session()
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            def body(x):
                return emit_ternary_matmul(x, packed, k, n, 1.0, strategy=strategy,
                                           act_quant=True, codes=codes)
            func.FuncOp.from_py_func(ir.Type.parse(x_type))(body)


@pytest.mark.parametrize("x_type,shape,k,n,strategy", [
    ("tensor<1x8xf32>", (3, 2), 8, 3, "fast"),            # unknown strategy
    ("tensor<1x8xf32>", (3, 2), 8, 4, "addsub"),          # N mismatch
    ("tensor<1x8xf32>", (3, 1), 8, 3, "addsub"),          # 1 byte holds only 4 columns
    ("tensor<1x9xf32>", (3, 2), 8, 3, "addsub"),          # x's K differs
    ("tensor<1x8xf16>", (3, 2), 8, 3, "addsub"),          # not f32
    ("tensor<2x1x8xf32>", (3, 2), 8, 3, "addsub"),        # not 2-D
])
def test_emit_rejects_bad_arguments(x_type, shape, k, n, strategy):
    with pytest.raises(TercompError):
        _emit_with(x_type, np.zeros(shape, np.uint8), k, n, strategy)


@pytest.mark.parametrize("strategy,k,error", [
    ("addsub", 128, "does not read 'offset' 2-bit codes"),
    ("avx2", 8, "ternary strategy 'avx2' cannot emit ternary_matmul of operands "
                r"\[1, 8\] f32, \[4, 2\] i8: it takes packed weights \[N, KB\] with KB a "
                "multiple of 32")])
def test_emit_refuses_offset_codes_that_the_kernel_does_not_read(strategy, k, error):
    """Only a kernel whose `weight_codes` are "offset" (avx2, where its shape fits) takes
    them; anything else would read w + 1 as w. A kernel asked for by name where it does
    not fit is refused, not replaced by another."""
    with pytest.raises(TercompError, match=error):
        _emit_with(f"tensor<1x{k}xf32>", np.zeros((4, k // 4), np.uint8), k, 4, strategy,
                   codes="offset")


def test_emit_rejects_a_mistyped_runtime_packed_value():
    session, ctx = new_session()
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            @func.FuncOp.from_py_func(tensor_type(1, 8), ir.Type.parse("tensor<3x2xi16>"))
            def main(x, p):
                with pytest.raises(TercompError, match="tensor<3xKBxi8>"):
                    emit_ternary_matmul(x, p, 8, 3, 1.0, strategy="addsub", act_quant=True)
                return x


def test_emit_rejects_invalid_codes():
    with pytest.raises(TercompError, match="0b11"):
        _emit_with("tensor<1x8xf32>", np.full((3, 2), 0b11, np.uint8), 8, 3)


