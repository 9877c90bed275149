"""A compiled module skips the input checks for inputs of the shapes and dtypes of the
last call that passed them, and only for those: every other call is checked."""
import numpy as np
import pytest

import tercomp as tc


@pytest.fixture(scope="module")
def exe():
    return tc.compile(lambda a, b: a * b + 1.0, tc.spec(("B", 4), "float32"),
                      tc.spec(("B", 4), "float32"), cache=False)


def test_repeated_calls_stay_checked(exe):
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for _ in range(2):
        np.testing.assert_allclose(exe(x, x), x * x + 1.0)
    with pytest.raises(tc.InputError, match="dtype"):
        exe(x, x.astype(np.float64))
    with pytest.raises(tc.InputError, match="B"):
        exe(x, x[:1])
    with pytest.raises(tc.InputError):
        exe(x)
    # a non-contiguous view of the same shape goes through the checks (and a copy)
    wide = np.zeros((2, 8), np.float32)[:, ::2]
    np.testing.assert_allclose(exe(x, wide), np.ones((2, 4)))
    np.testing.assert_allclose(exe(x[:1], x[:1]), x[:1] * x[:1] + 1.0)


def test_results_are_copies_of_every_dtype_and_size():
    """Results come back by mapping each buffer view directly (no DeviceArray): f32,
    i32, bool (an i1 buffer read as i8), a zero-size result, and a copy that a later
    call does not overwrite."""
    exe = tc.compile(lambda x: (x * 2.0, tc.cast(x, "int32"), x > 2.0, x[:, :0]),
                     tc.spec(("B", 3), "float32"), cache=False)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    a, i, b, e = exe(x)
    assert (a.dtype, i.dtype, b.dtype, e.dtype, e.shape) == (
        np.float32, np.int32, np.bool_, np.float32, (2, 0))
    np.testing.assert_array_equal(a, x * 2)
    np.testing.assert_array_equal(i, x.astype(np.int32))
    np.testing.assert_array_equal(b, x > 2)
    exe(x + 10.0)
    np.testing.assert_array_equal(a, x * 2)
