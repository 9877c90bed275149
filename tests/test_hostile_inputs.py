"""Call-time inputs are checked against the compiled structure (pytree keys and order,
dtypes, shapes, symbolic dims) before IREE sees them, with messages that say what was
expected and what came; a fuzz campaign throws arbitrary values at a compiled module."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import tercomp as tc
from tercomp import nn


def _pair(d):
    return d["w"] @ d["x"], tc.tanh(d["x"])


@pytest.fixture(scope="module")
def dict_exe():
    return tc.compile(_pair, {"w": tc.spec(("N", 4)), "x": tc.spec((4, "M"))})


@pytest.fixture(scope="module")
def grad_exe():
    def loss(m, x):
        return tc.sum(m(x) ** 2)
    nn.manual_seed(0)
    return tc.compile(tc.grad(loss), nn.Linear(4, 3), np.ones((2, 4), np.float32)), loss


W, X = np.ones((3, 4), np.float32), np.ones((4, 2), np.float32)


@pytest.mark.parametrize("args,match", [
    (({"x": X, "y": W},), r"missing \['w'\], unexpected \['y'\]"),
    (({"w": W},), r"missing \['x'\]"),
    (({"w": W, "x": X, "z": X},), r"unexpected \['z'\]"),
    ((None,), "expected a dict with keys"),
    (([W, X],), "expected a dict with keys"),
    (({"w": W.tolist(), "x": X},), r"input d.w \(argument 0.w\): expected an array of shape \[N, 4\] f32, got a list of 3"),
    (({"w": None, "x": X},), "input d.w .*got None"),
    (({"w": W, "x": X}, X), "takes 1 argument, got 2"),
    ((), "takes 1 argument, got 0"),
    (({"w": W, "x": np.ones((5, 2), np.float32)},), "dim 0 must be 4"),
    (({"w": W.astype(np.float64), "x": X},), "expected dtype f32, got f64"),
    (({"w": np.ones((3, 4), np.float32), "x": np.ones((4, 2, 1), np.float32)},), "rank 3 instead of 2"),
])
def test_wrong_structure_is_an_input_error(dict_exe, args, match):
    with pytest.raises(tc.InputError, match=match):
        dict_exe(*args)


def test_the_right_structure_runs(dict_exe):
    y, t = dict_exe({"x": X, "w": W})      # key order does not matter, as in JAX
    np.testing.assert_allclose(y, W @ X)
    np.testing.assert_allclose(t, np.tanh(X), rtol=1e-6)


def test_symbolic_dims_must_agree():
    exe = tc.compile(lambda a, b: a + b, tc.spec(("B", 3)), tc.spec(("B", 3)))
    with pytest.raises(tc.InputError, match=r"dim 0 \(B\) is 4 but B = 2"):
        exe(np.ones((2, 3), np.float32), np.ones((4, 3), np.float32))


def test_module_arguments_match_by_parameter_names(grad_exe):
    exe, loss = grad_exe
    nn.manual_seed(1)
    model = nn.Linear(4, 3)
    x = np.ones((2, 4), np.float32)
    got = exe(model, x)
    assert set(got) == {"weight", "bias"}
    with pytest.raises(tc.InputError, match=r"missing \['bias'\]"):
        exe({"weight": model.weight}, x)
    with pytest.raises(tc.InputError, match="expected a dict with keys"):
        exe(x, x)


_VALUES = st.recursive(
    st.one_of(st.none(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=3),
              st.builds(lambda shape, dt: np.zeros(shape, dt),
                        st.lists(st.integers(0, 5), max_size=3).map(tuple),
                        st.sampled_from([np.float32, np.float64, np.int32, np.int8, np.bool_]))),
    lambda children: st.one_of(st.lists(children, max_size=3), st.tuples(children, children),
                               st.dictionaries(st.sampled_from(["w", "x", "y", 0]), children, max_size=3)),
    max_leaves=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(st.lists(_VALUES, max_size=3))
def test_call_time_inputs_fuzz(dict_exe, args):
    try:
        y, t = dict_exe(*args)
    except tc.InputError:
        return
    d = args[0]          # whatever was accepted must be the right structure, and right
    np.testing.assert_allclose(y, np.asarray(d["w"]) @ np.asarray(d["x"]), rtol=1e-6)
