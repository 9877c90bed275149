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


# -- check_numerics -------------------------------------------------------------------
def _model(x, y):
    a = tc.exp(x)                                          # line +1: Inf for large x
    b = tc.log(y)                                          # line +2: NaN for negative y
    masked = tc.where(x > 0, x, np.float32(-np.inf))       # an Inf that only flows on
    return a + b, tc.softmax(masked, axis=0)


_LINE = _model.__code__.co_firstlineno


@pytest.fixture(scope="module")
def checked():
    return tc.compile(_model, np.ones(3, np.float32), np.ones(3, np.float32), check_numerics=True)


def test_check_numerics_passes_finite_values_and_masks(checked):
    x, y = np.array([1, -1, 2], np.float32), np.ones(3, np.float32)
    got = checked(x, y)
    np.testing.assert_allclose(got[0], np.exp(x), rtol=1e-6)
    assert got[1][1] == 0.0                                 # the -inf mask did not fire


@pytest.mark.parametrize("x,y,match", [
    ([1, 2, 3], [1, -1, 1], rf"test_numerics.py:{_LINE + 2}\b.*tern.log produced a NaN \(value %log\)"),
    ([100, 2, 3], [1, 1, 1], rf"test_numerics.py:{_LINE + 1}\b.*tern.exp produced an Inf \(value %exp\)"),
    ([np.nan, 2, 3], [1, 1, 1], r"input %x contains a NaN"),
])
def test_check_numerics_names_the_first_op_and_line(checked, x, y, match):
    with pytest.raises(tc.NumericsError, match=match):
        checked(np.array(x, np.float32), np.array(y, np.float32))


def test_check_numerics_survives_save_and_load(checked, tmp_path):
    checked.save(str(tmp_path / "m.tcm"))
    with pytest.raises(tc.NumericsError, match="tern.log produced a NaN"):
        tc.load(str(tmp_path / "m.tcm"))(np.ones(3, np.float32), -np.ones(3, np.float32))


def test_check_numerics_from_the_environment(monkeypatch):
    monkeypatch.setenv("TERCOMP_CHECK_NUMERICS", "1")
    exe = tc.compile(lambda x: tc.sqrt(x), np.ones(2, np.float32))
    with pytest.raises(tc.NumericsError, match="tern.sqrt produced a NaN"):
        exe(-np.ones(2, np.float32))
    monkeypatch.setenv("TERCOMP_CHECK_NUMERICS", "0")
    assert np.isnan(tc.compile(lambda x: tc.sqrt(x), np.ones(2, np.float32))(-np.ones(2, np.float32))).all()


def test_labels_out_of_range():
    logits, labels = np.zeros((2, 4), np.float32), np.array([1, 7], np.int32)
    with pytest.raises(tc.TercompError, match=r"label 7 at index \[1\] is outside \[0, 4\)"):
        tc.cross_entropy(logits, labels)                    # eager
    exe = tc.compile(tc.cross_entropy, logits, labels, check_numerics=True)
    assert np.isclose(exe(logits, np.array([0, 3], np.int32)), np.log(4.0))
    with pytest.raises(tc.NumericsError, match=r"a label outside \[0, 4\) reached cross_entropy"):
        exe(logits, labels)


def test_train_step_with_check_numerics_names_the_op_and_keeps_the_weights():
    def loss(m, x, y):
        return tc.cross_entropy(m(x), y)
    nn.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = np.ones((2, 4), np.float32), np.array([0, 2], np.int32)
    step = tc.compile_train_step(loss, model, tc.optim.SGD(0.1), x, y, check_numerics=True)
    step(x, y)
    before = {k: v.copy() for k, v in step.params().items()}
    with pytest.raises(tc.NumericsError, match="outside \\[0, 3\\)"):
        step(x, np.array([0, 5], np.int32))
    for k, v in step.params().items():
        np.testing.assert_array_equal(v, before[k])


def test_a_nan_batch_fires_on_nan_in_a_bitlinear_train_step():
    class Net(nn.Module):
        def __init__(self):
            self.fc = nn.BitLinear(8, 4)

        def forward(self, x):
            return self.fc(x)

    def loss(m, x, y):
        return tc.cross_entropy(m(x), y)
    nn.manual_seed(0)
    x, y = np.ones((2, 8), np.float32), np.array([0, 1], np.int32)
    step = tc.compile_train_step(loss, Net(), tc.optim.SGD(0.1), x, y)
    step(x, y)
    before = {k: v.copy() for k, v in step.params().items()}
    x[0, 3] = np.nan
    with pytest.raises(tc.TercompError, match="the loss is nan; the update was skipped"):
        step(x, y)
    for k, v in step.params().items():
        np.testing.assert_array_equal(v, before[k])
