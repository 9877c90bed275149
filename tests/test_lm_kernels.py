"""The hand-written CPU kernels of a language model's step (kernel="cpu"):
cached_attention (kernels/attention/attention_cpu.py), rms_norm, rope and the slot caches'
kv_scatter (kernels/rows/rows_cpu.py),
each compiled alone with a dynamic row count and checked against the op's reference,
and the IR they leave (one dispatch, no masked linalg)."""
import numpy as np
import pytest

import tercomp as tc
from conftest import run_filecheck
from tercomp.tracing.tracer import apply


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_cpu_attention_kernel_matches_reference(kv_dtype):
    # the hand-written dispatch, one for every T, against the op's reference; a cache
    # longer than one 256-row chunk of the online softmax, read at positions on both
    # sides of the chunk boundary, with one query and with several
    s, h, kv, d = 600, 4, 2, 16
    r = np.random.default_rng(3)
    k = r.standard_normal((s, kv, d)).astype(kv_dtype)
    v = r.standard_normal((s, kv, d)).astype(kv_dtype)

    def attend(q, kc, vc, start):
        return apply("cached_attention", q, kc, vc, start, scale=0.3, kernel="cpu")
    specs = (tc.spec(("T", h, d)), tc.spec((s, kv, d), kv_dtype), tc.spec((s, kv, d), kv_dtype),
             tc.spec((), "int32"))
    exe = tc.compile(attend, *specs, cache=False)
    graph = tc.trace(attend, *specs)
    el = "f16" if kv_dtype == "float16" else "f32"
    run_filecheck(exe.ir("mlir"), rf"""
# CHECK: stream.executable private @tern_attention_4x2x16x600_{el}
# CHECK-NOT: scf.if
# CHECK: flow.dispatch @tern_attention_4x2x16x600_{el}::@tern_attention_4x2x16x600_{el}
# CHECK-NOT: linalg.generic
""")
    for t, start in ((1, 0), (1, 255), (1, 256), (3, 254), (4, 520), (2, 598), (7, 300), (40, 250)):
        q = r.standard_normal((t, h, d)).astype(np.float32)
        want = tc.ops.interpret(graph, q, k, v, np.int32(start))[0]
        np.testing.assert_allclose(exe(q, k, v, np.int32(start)), want, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_cpu_attention_query_blocks_equal_one_query_at_a_time(monkeypatch, kv_dtype):
    # queries QBLOCK at a time (a block reads its last query's rows, the earlier queries'
    # extra rows at weight 0; 16-lane FMA chains) give the one-query-at-a-time kernel's
    # floats bit for bit: blocks that straddle the 256-row chunk boundary, and a
    # remainder of T
    from tercomp.kernels.attention import attention_cpu
    s, h, kv, d = 600, 4, 2, 32
    r = np.random.default_rng(5)
    k = r.standard_normal((s, kv, d)).astype(kv_dtype)
    v = r.standard_normal((s, kv, d)).astype(kv_dtype)

    def attend(q, kc, vc, start):
        return apply("cached_attention", q, kc, vc, start, scale=0.3, kernel="cpu")
    specs = (tc.spec(("T", h, d)), tc.spec((s, kv, d), kv_dtype),
             tc.spec((s, kv, d), kv_dtype), tc.spec((), "int32"))
    blocked = tc.compile(attend, *specs, cache=False)
    monkeypatch.setattr(attention_cpu, "QBLOCK", 1)
    single = tc.compile(attend, *specs, cache=False)
    assert attention_cpu.QBLOCK == 1 and blocked.ir("mlir") != single.ir("mlir")
    for t, start in ((2 * 8 + 3, 245), (40, 0), (9, 590)):
        q = r.standard_normal((t, h, d)).astype(np.float32)
        np.testing.assert_array_equal(blocked(q, k, v, np.int32(start)),
                                      single(q, k, v, np.int32(start)))

def _windowed_attention(q, k, v, positions, scale, window):
    """Brute force, float64: query t at positions[t] over rows max(0, p - window + 1)..p."""
    g = q.shape[1] // k.shape[1]
    out = np.empty(q.shape)
    for t, p in enumerate(positions):
        lo = max(0, p - window + 1)
        kk = np.repeat(k[lo:p + 1].astype(np.float64), g, axis=1)
        vv = np.repeat(v[lo:p + 1].astype(np.float64), g, axis=1)
        sc = np.einsum("hd,shd->hs", q[t].astype(np.float64), kk) * scale
        w = np.exp(sc - sc.max(-1, keepdims=True))
        out[t] = np.einsum("hs,shd->hd", w / w.sum(-1, keepdims=True), vv)
    return out


@pytest.mark.parametrize("kernel", ["cpu", "generic"])
def test_sliding_window_attention_sees_only_the_window(kernel):
    # a window of 300 over a 600-row cache: the cpu kernel's first chunk then starts
    # off a 256-row chunk boundary; queries before, at and past the window's length
    s, h, kv, d, win = 600, 4, 2, 16, 300
    r = np.random.default_rng(5)
    k = r.standard_normal((s, kv, d)).astype(np.float16)
    v = r.standard_normal((s, kv, d)).astype(np.float16)

    def attend(q, kc, vc, start):
        return apply("cached_attention", q, kc, vc, start, scale=0.3, window=win, kernel=kernel)
    specs = (tc.spec(("T", h, d)), tc.spec((s, kv, d), "float16"),
             tc.spec((s, kv, d), "float16"), tc.spec((), "int32"))
    exe = tc.compile(attend, *specs, cache=False)
    graph = tc.trace(attend, *specs)
    if kernel == "cpu":
        run_filecheck(exe.ir("mlir"), """
# CHECK: stream.executable private @tern_attention_4x2x16x600_f16_w300
# CHECK: flow.dispatch @tern_attention_4x2x16x600_f16_w300
""")
    for t, start in ((1, 0), (1, 299), (1, 300), (3, 297), (1, 599), (40, 280)):
        q = r.standard_normal((t, h, d)).astype(np.float32)
        want = _windowed_attention(q, k, v, list(range(start, start + t)), 0.3, win)
        np.testing.assert_allclose(tc.ops.interpret(graph, q, k, v, np.int32(start))[0], want,
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(exe(q, k, v, np.int32(start)), want, rtol=1e-4, atol=1e-4)


def test_attention_window_is_checked():
    for bad in (0, -3, 2.5, True):
        with pytest.raises(tc.TercompError, match="window must be a positive integer"):
            tc.trace(lambda q, kc, start: apply("cached_attention", q, kc, kc, start, scale=1.0,
                                                window=bad),
                     tc.spec((1, 4, 8)), tc.spec((16, 2, 8)), tc.spec((), "int32"))


def test_attention_kernel_is_checked():
    with pytest.raises(tc.TercompError, match="kernel must be one of generic, cpu"):
        tc.trace(lambda q, kc, start: apply("cached_attention", q, kc, kc, start, scale=1.0,
                                            kernel="gpu"),
                 tc.spec((1, 4, 8)), tc.spec((16, 2, 8)), tc.spec((), "int32"))


@pytest.mark.parametrize("kernel", ["cpu", "generic"])
def test_rms_norm_kernel_matches_reference(kernel):
    n = 40
    w = np.random.default_rng(4).standard_normal(n).astype(np.float32)

    def norm(x):
        return apply("rms_norm", x, w, eps=1e-5, kernel=kernel)
    exe = tc.compile(norm, tc.spec(("R", n)), cache=False)
    graph = tc.trace(norm, tc.spec(("R", n)))
    if kernel == "cpu":
        run_filecheck(exe.ir("mlir"), r"""
# CHECK: [[MAP:#map[0-9]*]] = affine_map<()[s0] -> (s0 ceildiv 4)>
# CHECK: stream.executable private @tern_rms_norm_40
# CHECK: workgroups(%[[M:.*]]: index)
# CHECK: affine.apply [[MAP]]()[%[[M]]]
# CHECK-NOT: linalg.generic
# CHECK: flow.dispatch @tern_rms_norm_40::@tern_rms_norm_40
""")
    r = np.random.default_rng(5)
    for rows in (1, 3, 4, 8, 9, 17):        # one workgroup of 4 rows, partial, several
        x = (r.standard_normal((rows, n)) * 3).astype(np.float32)
        np.testing.assert_allclose(exe(x), tc.ops.interpret(graph, x)[0], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("style,kernel", [("neox", "cpu"), ("neox", "generic"),
                                          ("interleaved", "cpu"), ("interleaved", "generic")])
def test_rope_matches_reference(style, kernel):
    h, d = 3, 32
    r = np.random.default_rng(6)

    def rope(x, cos, sin):
        return apply("rope", x, cos, sin, style=style, kernel=kernel)
    specs = (tc.spec(("T", h, d)), tc.spec(("T", d // 2)), tc.spec(("T", d // 2)))
    exe = tc.compile(rope, *specs, cache=False)
    # the hand-written kernel, one per style; the generic lowering is one linalg.generic
    # over x viewed as pairs (no slices and concatenation: copies)
    run_filecheck(exe.ir("mlir"), r"""
# CHECK: flow.dispatch @tern_rope_3x32::@tern_rope_3x32
""" if (style, kernel) == ("neox", "cpu") else r"""
# CHECK: flow.dispatch @tern_rope_i_3x32::@tern_rope_i_3x32
""" if kernel == "cpu" else r"""
# CHECK-NOT: flow.dispatch
# CHECK: tensor.expand_shape
# CHECK: linalg.generic
# CHECK-NOT: tensor.concat
# CHECK: tensor.collapse_shape
""")
    for t in (1, 5, 11):
        x = r.standard_normal((t, h, d)).astype(np.float32)
        ang = r.uniform(0, 6, (t, d // 2))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
        x1, x2 = (x[..., :d // 2], x[..., d // 2:]) if style == "neox" else (x[..., 0::2], x[..., 1::2])
        c, s = cos[:, None], sin[:, None]
        y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
        want = np.concatenate([y1, y2], -1) if style == "neox" else np.stack([y1, y2], -1).reshape(t, h, d)
        np.testing.assert_allclose(exe(x, cos, sin), want, rtol=1e-6, atol=1e-6)



@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_kv_write_kernel_matches_reference(kv_dtype):
    # the in-place dispatch (a result tied to the cache operand), one workgroup a row, for
    # a symbolic row count: rows into several slots, one slot's rows apart, the last
    # position of a slot, and no row at all; every other row of the cache is kept
    n, s, kv, d = 3, 40, 2, 32

    def write(cache, rows, slots, pos):
        return apply("kv_scatter", cache, rows, slots, pos, kernel="cpu")
    specs = (tc.spec((n, s, kv, d), kv_dtype), tc.spec(("T", kv, d), kv_dtype),
             tc.spec(("T",), "int32"), tc.spec(("T",), "int32"))
    exe = tc.compile(write, *specs, cache=False)
    graph = tc.trace(write, *specs)
    el = "f16" if kv_dtype == "float16" else "f32"
    run_filecheck(exe.ir("mlir"), rf"""
# CHECK: stream.executable private @tern_kv_write_3x40x64_{el}
# CHECK: %[[C:.*]] = flow.dispatch @tern_kv_write_3x40x64_{el}::@tern_kv_write_3x40x64_{el}[%{{{{.*}}}}](%[[X:[a-z0-9_]+]], {{{{.*}}}}) : (tensor<3x40x64x{el}>, {{{{.*}}}}) -> %[[X]]
# CHECK-NOT: iree_linalg_ext.scatter
""")
    r = np.random.default_rng(7)
    cache = r.standard_normal((n, s, kv, d)).astype(kv_dtype)
    for slots, pos in (([0, 1, 2], [5, 0, 39]), ([1, 1, 1, 1], [10, 11, 12, 13]), ([2], [7]),
                       ([], [])):
        slots, pos = np.array(slots, np.int32), np.array(pos, np.int32)
        rows = r.standard_normal((slots.size, kv, d)).astype(kv_dtype)
        want = tc.ops.interpret(graph, cache, rows, slots, pos)[0]
        np.testing.assert_array_equal(exe(cache, rows, slots, pos), want)


def test_interleaved_rope_kernel_equals_the_generic_lowering():
    # the interleaved kernel writes the FMAs the generic's x1 c - x2 s and x2 c + x1 s are
    # contracted to (x1 c + -(x2 s), x2 c + x1 s): IREE's floats bit for bit, so a llama
    # model's logits do not move with the kernel
    style = "interleaved"
    h, d = 4, 64
    r = np.random.default_rng(7)
    specs = (tc.spec(("T", h, d)), tc.spec(("T", d // 2)), tc.spec(("T", d // 2)))
    exes = [tc.compile(lambda x, c, s, k=k: apply("rope", x, c, s, style=style, kernel=k),
                       *specs, cache=False) for k in ("cpu", "generic")]
    x = (r.standard_normal((9, h, d)) * 5).astype(np.float32)
    ang = r.uniform(0, 60, (9, d // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    np.testing.assert_array_equal(exes[0](x, cos, sin), exes[1](x, cos, sin))

def test_row_kernels_are_checked():
    with pytest.raises(tc.TercompError, match="kernel must be one of generic, cpu"):
        tc.trace(lambda x: apply("rms_norm", x, np.ones(8, np.float32), kernel="gpu"), tc.spec((2, 8)))
    with pytest.raises(tc.TercompError, match="style must be one of neox, interleaved"):
        tc.trace(lambda x, c: apply("rope", x, c, c, style="half"), tc.spec((2, 1, 8)), tc.spec((2, 4)))
    with pytest.raises(tc.TercompError, match=r"rope: expects x \[\.\.\., T, H, D\]"):
        tc.trace(lambda x, c: apply("rope", x, c, c), tc.spec((2, 1, 8)), tc.spec((3, 4)))
    # a kernel asked for where it does not fit is refused where the op is made, not
    # swapped for the generic lowering
    with pytest.raises(tc.TercompError, match="rope kernel 'cpu' cannot emit rope") as e:
        tc.trace(lambda x, c: apply("rope", x, c, c, style="interleaved", kernel="cpu"),
                 tc.spec(("T", 3, 24)), tc.spec(("T", 12)))
    assert "test_lm_kernels.py" in str(e.value) and "generic" in e.value.hint
    with pytest.raises(tc.TercompError, match="rms_norm kernel 'cpu' cannot emit rms_norm"):
        tc.trace(lambda x: apply("rms_norm", x, np.ones(60, np.float32), kernel="cpu"),
                 tc.spec(("R", 60)))
