"""NaN and Inf propagate through every lowering and every ternary strategy: a
comparison with NaN is false, so selects and float->int conversions must not hide it."""
import numpy as np
import pytest

import tercomp as tc
from tercomp import nn


def _bad_rows():
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    x[0, 5], x[1, 7] = np.nan, np.inf
    return x


def test_maximum_minimum_relu_keep_nan():
    a = np.array([np.nan, 1.0, -np.inf, 2.0], np.float32)
    b = np.array([0.0, np.nan, 0.0, 1.0], np.float32)
    exe = tc.compile(lambda a, b: (tc.maximum(a, b), tc.minimum(a, b), tc.relu(a)), a, b)
    got = exe(a, b)
    want = (np.maximum(a, b), np.minimum(a, b), np.maximum(a, 0))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    for g, w in zip((tc.maximum(a, b), tc.minimum(a, b), tc.relu(a)), want):   # eager: the reference
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("ternary", ["off", "addsub", "int8", "f32", "vnni"])
def test_bitlinear_propagates_nan_and_inf(ternary):
    nn.manual_seed(0)
    layer = nn.BitLinear(64, 32)
    x = _bad_rows()
    y = tc.compile(layer, x, ternary=ternary)(x)
    assert not np.isfinite(y[:2]).any(), y[:2]          # rows with a NaN or an Inf
    np.testing.assert_allclose(y[2], layer(x)[2], rtol=1e-4, atol=1e-4)
