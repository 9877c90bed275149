"""What IREE would choke on is refused before IREE sees it, and what only IREE can judge
(flags) runs in a subprocess, so the process survives: errors, not crashes."""
import subprocess
import sys

import numpy as np
import pytest

import tercomp as tc

X = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)


def f(x):
    return tc.tanh(x) * 2.0


@pytest.mark.parametrize("flag,match", [
    ("--iree-llvmcpu-target-cpu-features=+bogus", "not a recognized feature"),
    ("--iree-input-type=bogus", "unknown custom value"),
    ("--no-such-iree-flag", "Unknown command line argument"),
])
def test_bad_flags_are_compile_errors_not_exits(flag, match):
    with pytest.raises(tc.CompileError, match=match):
        tc.compile(f, X, flags=[flag], cache=False)


def test_isolate_compiles_in_a_subprocess_with_the_same_result():
    a = tc.compile(f, X, cache=False)
    b = tc.compile(f, X, cache=False, isolate=True)
    np.testing.assert_array_equal(a(X), b(X))


@pytest.mark.parametrize("shape", [(2 ** 62, 4), (-1, 4), (2 ** 64, 4), (2 ** 30, 2 ** 30, 2 ** 30)])
def test_out_of_range_dims_are_trace_errors(shape):
    with pytest.raises(tc.TraceError, match="dim|elements"):
        tc.compile(f, tc.spec(shape))


def test_cli_isolate(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import tercomp as tc\ndef f(x):\n    return tc.tanh(x)\n")
    out = tmp_path / "m.tcm"
    r = subprocess.run([sys.executable, "-m", "tercomp.cli", "compile", f"{src}:f", "--example", "2,3:f32",
                        "--isolate", "--no-cache", "-o", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(tc.load(str(out))(X), np.tanh(X), rtol=1e-6)
