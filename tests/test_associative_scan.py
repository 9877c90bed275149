"""tc.associative_scan: against a sequential loop (every length 1..9, reverse, another
axis, a pytree), its gradient against float64 finite differences, compiled, and errors."""
import numpy as np
import pytest

import tercomp as tc
from tercomp.errors import TercompError

rng = np.random.default_rng(2)


def linear(a, b):
    """Composition of h -> a h + b maps: the recurrence h_t = a_t h_{t-1} + b_t."""
    (a1, b1), (a2, b2) = a, b
    return a1 * a2, a2 * b1 + b2


def loop_linear(a, b, reverse=False):
    h, out = np.zeros_like(b[0]), np.zeros_like(b)
    for t in (range(len(a) - 1, -1, -1) if reverse else range(len(a))):
        h = a[t] * h + b[t]
        out[t] = h
    return out


@pytest.mark.parametrize("n", range(1, 10))
def test_matches_a_sequential_loop(n):
    x = rng.standard_normal((n, 3))
    np.testing.assert_allclose(tc.associative_scan(lambda p, q: p + q, x), np.cumsum(x, 0), atol=1e-12)
    np.testing.assert_array_equal(tc.associative_scan(tc.maximum, x), np.maximum.accumulate(x, 0))
    a, b = rng.uniform(0.5, 1.0, (n, 3)), rng.standard_normal((n, 3))
    for rev in (False, True):
        _, h = tc.associative_scan(linear, (a, b), reverse=rev)
        np.testing.assert_allclose(h, loop_linear(a, b, rev), rtol=1e-12, atol=1e-12)


def test_other_axis_and_dict_pytree():
    a, b = rng.uniform(0.5, 1.0, (2, 6)), rng.standard_normal((2, 6))
    out = tc.associative_scan(lambda p, q: {"a": p["a"] * q["a"], "b": q["a"] * p["b"] + q["b"]},
                              {"a": a, "b": b}, axis=1)
    np.testing.assert_allclose(out["b"], loop_linear(a.T, b.T).T, rtol=1e-12)


def _loss(a, b, w):
    _, h = tc.associative_scan(linear, (a, b))
    return tc.sum(tc.tanh(h) * w)


def test_gradient_against_finite_differences():
    a, b, w = rng.uniform(0.5, 1.0, (7, 3)), rng.standard_normal((7, 3)), rng.standard_normal((7, 3))
    ga, gb = tc.grad(_loss, argnums=(0, 1))(a, b, w)
    da, db, eps = rng.standard_normal(a.shape), rng.standard_normal(b.shape), 1e-6
    fd = (float(_loss(a + eps * da, b + eps * db, w)) - float(_loss(a - eps * da, b - eps * db, w))) / (2 * eps)
    assert abs(float(np.sum(ga * da) + np.sum(gb * db)) - fd) < 1e-7 * max(1, abs(fd))


def test_compiled_value_and_gradient():
    a, b, w = (rng.uniform(0.5, 1.0, (16, 4)).astype(np.float32), rng.standard_normal((16, 4)).astype(np.float32),
               rng.standard_normal((16, 4)).astype(np.float32))
    exe = tc.compile(tc.value_and_grad(_loss, argnums=(0, 1)), a, b, w)
    value, (ga, gb) = exe(a, b, w)
    want_v, (wa, wb) = tc.value_and_grad(_loss, argnums=(0, 1))(*[x.astype(np.float64) for x in (a, b, w)])
    np.testing.assert_allclose(value, want_v, rtol=1e-5)
    np.testing.assert_allclose(ga, wa, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(gb, wb, rtol=1e-4, atol=1e-5)


def test_errors():
    x = np.ones((5, 3), np.float32)
    with pytest.raises(TercompError, match=r"into \[1, 3\]f32") as e:
        tc.trace(lambda x: tc.associative_scan(lambda p, q: (p + q)[:1], x), x)
    assert e.value.loc.file.endswith("test_associative_scan.py")
    with pytest.raises(TercompError, match=r"into \[.*\]i32"):
        tc.trace(lambda x: tc.associative_scan(lambda p, q: (p + q).astype("int32"), x), x)
    with pytest.raises(TercompError, match="symbolic size T.*static length"):
        tc.trace(lambda x: tc.associative_scan(lambda p, q: p + q, x), tc.spec(("T", 3)))
    with pytest.raises(TercompError, match="different lengths"):
        tc.trace(lambda x, y: tc.associative_scan(lambda p, q: p, (x, y)), x, np.ones((4, 3), np.float32))
