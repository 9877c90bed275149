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


# -- traced code: clear errors, NumPy functions dispatch ----------------------------------
def test_a_loop_over_a_symbolic_dim_names_tc_scan():
    def f(x):
        s = 0
        for i in range(x.shape[0]):
            s = s + x[i]
        return s
    with pytest.raises(tc.TraceError, match="symbolic dim was used where Python needs an int") as e:
        tc.trace(f, tc.spec(("B", 3)))
    assert "tc.scan" in str(e.value) and "test_hostile_inputs.py" in str(e.value)


def test_numpy_functions_on_traced_values_run_tercomp_ops():
    def f(x):
        return np.sum(x, axis=0), np.mean(x), np.exp(x) + np.maximum(x, 0), np.float32(2) * x, 1 - x
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    got = tc.compile(f, x)(x)
    want = (x.sum(0), x.mean(), np.exp(x) + np.maximum(x, 0), 2 * x, 1 - x)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn,match", [
    (lambda x: np.fft.fft(x), "np.fft was called on a traced value; tercomp has no fft"),
    (lambda x: np.sum(x, dtype=np.float64), "np.sum on a traced value: .*dtype"),
    (lambda x: np.add.reduce(x), r"np.add.reduce .* is not supported"),
])
def test_unsupported_numpy_calls_are_trace_errors(fn, match):
    with pytest.raises(tc.TraceError, match=match):
        tc.trace(fn, np.ones(3, np.float32))


def test_empty_training_batch_is_an_input_error():
    def loss(m, x, y):
        return tc.cross_entropy(m(x), y)
    nn.manual_seed(0)
    step = tc.compile_train_step(loss, nn.Linear(4, 3), tc.optim.SGD(0.1), tc.spec(("B", 4)),
                                 tc.spec(("B",), "int32"))
    with pytest.raises(tc.InputError, match=r"the batch is empty \(no elements in x, y\)"):
        step(np.ones((0, 4), np.float32), np.zeros(0, np.int32))
    assert step.steps == 0


@pytest.mark.parametrize("dtype,shape,match", [("q7", [2], "unknown dtype 'q7'"), ("f32", [-3], "bad dim -3"),
                                               ("f32", ["__import__('os')"], "cannot read the dimension")])
def test_malformed_signatures_in_artifacts(dict_exe, tmp_path, dtype, shape, match):
    import json
    import zipfile
    from tercomp.runtime import artifact
    path = tmp_path / "m.tcm"
    dict_exe.save(str(path))
    with zipfile.ZipFile(path) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    meta = json.loads(members["signature.json"])
    meta["signature"]["inputs"][0].update(dtype=dtype, shape=shape)
    members["signature.json"] = json.dumps(artifact.seal(meta)).encode()    # digests that match
    with zipfile.ZipFile(path, "w") as zf:
        for n, data in members.items():
            zf.writestr(n, data)
    with pytest.raises(tc.ArtifactError, match=match):
        tc.load(str(path))


def test_cli_errors_are_one_line(tmp_path):
    import box          # the command line in a process of its own, forked (tests/box.py)
    binary = tmp_path / "bin.mlir"
    binary.write_bytes(b"\x00\x01\xff\xfe binary")
    exe = tc.compile(lambda x: x * 2, np.ones((3, 16), np.int8))
    exe.save(str(tmp_path / "i8.tcm"))
    for args, match in [(["opt", str(binary)], "is not UTF-8 text"),
                        (["run", str(tmp_path / "i8.tcm"), "--input", "3x16xi8=300"], "must fit in int8")]:
        rc, _, stderr = box.cli(*args, timeout=600)
        assert rc != 0 and match in stderr and "internal error" not in stderr, stderr
