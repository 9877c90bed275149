"""Fuzz campaigns over the input surfaces (IR text is in test_parser_fuzz.py, call-time
inputs in test_hostile_inputs.py): random op graphs traced, compiled and compared with
NumPy, artifact bytes, and command-line arguments. Every outcome is a right answer or a
TercompError: never a crash, a hang or another exception. CI runs a small budget;
`pytest -m fuzz` runs the long campaigns."""
import contextlib
import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import tercomp as tc
from tercomp import cli, nn

# -- random op graphs --------------------------------------------------------------------
_UNARY = {"tanh": tc.tanh, "relu": tc.relu, "abs": tc.abs, "neg": tc.negative, "sigmoid": tc.sigmoid,
          "exp_clip": lambda x: tc.exp(tc.clip(x, -5.0, 5.0)), "square": tc.square, "silu": tc.silu}
_BINARY = {"add": tc.add, "sub": tc.subtract, "mul": tc.multiply, "max": tc.maximum, "min": tc.minimum}
_STEP = st.one_of(
    st.tuples(st.just("unary"), st.sampled_from(sorted(_UNARY))),
    st.tuples(st.just("binary"), st.sampled_from(sorted(_BINARY)), st.integers(0, 8)),
    st.tuples(st.just("const"), st.sampled_from(sorted(_BINARY)), st.floats(-2, 2, width=32)),
    st.tuples(st.just("reduce"), st.sampled_from(["sum", "mean", "max"]), st.integers(0, 1)),
    st.tuples(st.just("shape"), st.sampled_from(["transpose", "flatten_back", "softmax", "swap"])),
)


def _program(steps):
    """A function of x [3, 4] built from `steps`; the same code runs eagerly (NumPy)
    and traced, so the eager result is the reference."""
    def f(x):
        vals = [x]
        for step in steps:
            v = vals[-1]
            kind = step[0]
            if kind == "unary":
                v = _UNARY[step[1]](v)
            elif kind == "binary":
                other = vals[step[2] % len(vals)]
                if tuple(other.shape) != tuple(v.shape):
                    other = vals[0] if tuple(vals[0].shape) == tuple(v.shape) else v
                v = _BINARY[step[1]](v, other)
            elif kind == "const":
                v = _BINARY[step[1]](v, np.float32(step[2]))
            elif kind == "reduce" and len(v.shape) == 2:
                v = getattr(tc, step[1])(v, axis=step[2], keepdims=True)
            elif kind == "shape" and len(v.shape) == 2:
                if step[1] == "transpose":
                    v = tc.transpose(v)
                elif step[1] == "flatten_back":
                    v = tc.reshape(tc.reshape(v, (-1,)), tuple(int(d) for d in v.shape))
                elif step[1] == "softmax":
                    v = tc.softmax(v, axis=-1)
                else:
                    v = tc.swapaxes(v, 0, 1)
            vals.append(v)
        return vals[-1]
    return f


def _check_program(steps):
    x = np.random.default_rng(len(steps)).standard_normal((3, 4)).astype(np.float32)
    f = _program(steps)
    want = np.asarray(f(x), np.float64)
    got = tc.compile(f, x)(x)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5, err_msg=str(steps))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_STEP, min_size=1, max_size=6))
def test_random_graphs_compile_and_match_numpy(steps):
    _check_program(steps)


@pytest.mark.fuzz
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_STEP, min_size=1, max_size=10))
def test_random_graphs_long_campaign(steps):
    _check_program(steps)


# -- artifact bytes ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    nn.manual_seed(0)
    exe = tc.compile(nn.Linear(4, 3), tc.spec(("B", 4), "float32"))
    path = tmp_path_factory.mktemp("fuzz") / "m.tcm"
    exe.save(str(path))
    return path.read_bytes(), exe


_X = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
_MUTATION = st.lists(st.tuples(st.sampled_from(["flip", "cut", "insert", "truncate"]),
                               st.floats(0, 1), st.binary(min_size=1, max_size=8)), min_size=1, max_size=3)


def _check_artifact(data, want, mutations):
    data = bytearray(data)
    for kind, where, blob in mutations:
        if not data:
            break
        i = int(where * (len(data) - 1))
        if kind == "flip":
            data[i] ^= blob[0] or 1
        elif kind == "cut":
            del data[i:i + len(blob)]
        elif kind == "insert":
            data[i:i] = blob
        else:
            del data[i:]
    try:
        meta, vmfb, weights = tc.runtime.artifact.read_bytes(bytes(data), "fuzz.tcm")
        exe = tc.runtime.loader.from_parts(meta, vmfb, weights)
        got = exe(_X)
    except tc.TercompError:
        return
    np.testing.assert_array_equal(got, want)      # damage the digests missed changed nothing


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(_MUTATION)
def test_damaged_artifacts_are_refused_or_harmless(artifact, mutations):
    data, exe = artifact
    _check_artifact(data, exe(_X), mutations)


@pytest.mark.fuzz
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(_MUTATION)
def test_damaged_artifacts_long_campaign(artifact, mutations):
    data, exe = artifact
    _check_artifact(data, exe(_X), mutations)


# -- command-line arguments -------------------------------------------------------------
_WORDS = ["run", "info", "opt", "bench", "--input", "--dim", "--runs", "--warmup", "--pass", "simplify",
          "ternary", "-o", "--device", "local-task", "local-sync", "npu", "--threads", "0", "-3", "2",
          "B=2", "B=-1", "B", "2x4xf32=1", "2x4xi8=300", "4xf32=1,2", "x.npy", "@", "=", "--print-constants",
          "-", "\x00", "💥", "--", "--help-not", "-v", "9" * 30]


def _run_cli(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as e:          # argparse's own usage errors
            code = e.code
    assert "internal error" not in err.getvalue(), (argv, err.getvalue())
    assert code in (0, 1, 2), (argv, code)


def _argv(words, artifact_path, ir_path):
    return [artifact_path if w == "ART" else ir_path if w == "IR" else w for w in words]


_ARGV = st.lists(st.sampled_from(_WORDS + ["ART", "IR"]), min_size=1, max_size=7)


@pytest.fixture(scope="module")
def cli_files(artifact, tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "m.tcm").write_bytes(artifact[0])
    (d / "m.tern.mlir").write_text(str(tc.trace(lambda x: tc.tanh(x) + 1.0, np.ones((2, 4), np.float32))))
    return str(d / "m.tcm"), str(d / "m.tern.mlir")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(_ARGV)
def test_cli_arguments_fail_cleanly(cli_files, words):
    _run_cli(_argv(words, *cli_files))


@pytest.mark.fuzz
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                    HealthCheck.function_scoped_fixture])
@given(_ARGV)
def test_cli_arguments_long_campaign(cli_files, words):
    _run_cli(_argv(words, *cli_files))
