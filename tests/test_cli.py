"""The `tercomp` command line: every subcommand in a process of its own, errors in one line."""
import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import bitnet_ref as R
import box
from conftest import run_filecheck
import tercomp as tc
from tercomp import models
from tercomp.cli import main, parse_input, parse_spec
from tercomp.runtime.devices import driver_present

MODEL = textwrap.dedent("""
    import tercomp as tc
    from tercomp import nn


    def affine(x, y):
        return tc.tanh(x) * y + 1.0


    class MLP(nn.Module):
        def __init__(self):
            nn.manual_seed(0)
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(tc.relu(self.fc1(x)))


    def make_model():
        return MLP()


    class BitMLP(nn.Module):
        def __init__(self):
            nn.manual_seed(1)
            self.fc1 = nn.BitLinear(256, 256)
            self.fc2 = nn.BitLinear(256, 64)

        def forward(self, x):
            return self.fc2(tc.relu(self.fc1(x)))


    def make_error():
        raise RuntimeError("factory failed")


    not_callable = 42
""")


def tercomp(*args, stdin=None, check=True, console_script=False):
    """Run the command line in a process of its own: tercomp.cli.main in a fork of a
    process that imported tercomp (tests/box.py: no python start and import, ~1.3 s, per
    command); with `console_script` the `tercomp` script (or `python -m tercomp`) itself."""
    if console_script:
        script = shutil.which("tercomp")
        cmd = [script] if script else [sys.executable, "-m", "tercomp"]
        r = subprocess.run(cmd + [str(a) for a in args], input=stdin, capture_output=True,
                           text=True, timeout=300)
    else:
        r = subprocess.CompletedProcess(args, *box.cli(*args, stdin=stdin))
    assert "Traceback" not in r.stderr, r.stderr
    if check:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "model.py"
    path.write_text(MODEL)
    return path


@pytest.fixture(scope="module")
def model(model_file):
    spec = importlib.util.spec_from_file_location("cli_test_model", model_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def mlp_artifact(model_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "mlp.tcm"
    r = tercomp("compile", f"{model_file}:make_model", "--example", "B,8:f32", "-o", out)
    assert "wrote" in r.stderr and out.exists()
    return out


def mlp_ref(m, x):
    h = np.maximum(x @ m.fc1.weight.T + m.fc1.bias, 0)
    return h @ m.fc2.weight.T + m.fc2.bias


# -- every subcommand in a process of its own -------------------------------------------

def test_help_of_every_command(capsys):
    r = tercomp("--help", console_script=True)
    assert "usage: tercomp" in r.stdout
    for command in ("compile", "run", "info", "opt", "bench", "perplexity"):
        assert command in r.stdout
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0 and "usage: tercomp " + command in capsys.readouterr().out
    assert "usage: tercomp bench" in tercomp("bench", "--help").stdout


def test_compile_info_run_a_module_factory(mlp_artifact, model, tmp_path):
    info = tercomp("info", mlp_artifact).stdout
    assert "input:         x: [B, 8] f32" in info and "output:        out: [B, 4] f32" in info
    assert "targets:       llvm-cpu" in info and "IREE:          3.13" in info
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    r = tercomp("run", mlp_artifact, "--input", tmp_path / "x.npy", "-o", tmp_path / "y.npz")
    assert r.stdout.startswith("out: float32[3, 4]")
    np.testing.assert_allclose(np.load(tmp_path / "y.npz")["out"], mlp_ref(model.MLP(), x),
                               rtol=1e-5, atol=1e-5)


def test_compile_bitlinear_with_ternary_kernels_and_irpa_weights(model_file, model, tmp_path):
    out = tmp_path / "bit.tcm"
    tercomp("compile", f"{model_file}:BitMLP", "--example", "B,256:f32", "--ternary", "addsub",
            "--weights", "irpa", "-o", out, "--dump", tmp_path / "dump")
    stage = (tmp_path / "dump" / "01-ternary.tern.mlir").read_text()
    run_filecheck(stage, """
# CHECK: "tern.ternary_matmul"({{.*}}strategy = "addsub"
# CHECK: "tern.ternary_matmul"({{.*}}strategy = "addsub"
# CHECK-NOT: "tern.matmul"
""")
    info = tercomp("info", out).stdout
    run_filecheck(info, "# CHECK: weights.irpa: {{ *}}{{[0-9]+}} bytes")
    x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    tercomp("run", out, "--input", tmp_path / "x.npy", "-o", tmp_path / "y.npz")
    want = tc.compile(model.BitMLP(), x, ternary="addsub")(x)
    np.testing.assert_allclose(np.load(tmp_path / "y.npz")["out"], want, rtol=1e-6, atol=1e-6)
    r = tercomp("compile", f"{model_file}:BitMLP", "--example", "B,256:f32", "--ternary", "int4",
                "-o", out, check=False)
    assert r.returncode == 2 and "invalid choice: 'int4'" in r.stderr


def test_compile_a_function_and_run_iree_style_inputs(model_file, tmp_path):
    out = tmp_path / "affine.tcm"
    tercomp("compile", f"{model_file}:affine", "--example", "2,3:f32", "--example", "2,3:float32",
            "-o", out, "--dump", tmp_path / "dump")
    assert any(f.endswith("mlir.mlir") for f in os.listdir(tmp_path / "dump"))
    tercomp("run", out, "--input=2x3xf32=1,2,3,4,5,6", "--input=2x3xf32=0.5", "-o", tmp_path / "r.npz")
    x = np.arange(1, 7, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(np.load(tmp_path / "r.npz")["out"], np.tanh(x) * 0.5 + 1, rtol=1e-6)


def test_compile_for_gpus_and_inspect(model_file, tmp_path):
    out = tmp_path / "gpu.tcm"
    tercomp("compile", f"{model_file}:MLP", "--example", "B,8:f32", "--target", "vulkan",
            "--target", "cuda", "--cuda-target", "sm_86", "-o", out)
    info = tercomp("info", out).stdout
    assert "targets:       vulkan, cuda" in info and "devices:       vulkan, cuda" in info
    assert "--iree-cuda-target=sm_86" in info and "--iree-vulkan-target=vp_android_baseline_2022" in info
    import json
    meta = json.loads(tercomp("info", out, "--json").stdout)
    assert meta["targets"] == ["vulkan", "cuda"] and meta["vmfb_size"] > 0
    if driver_present("vulkan"):
        r = tercomp("run", out, "--input=1x8xf32=1", "--device", "vulkan")
        assert r.stdout.startswith("out: float32[1, 4]")
    else:
        r = tercomp("run", out, "--input=1x8xf32=1", check=False)
        assert r.returncode == 1 and "no device here runs this module" in r.stderr


def test_opt_runs_passes(tmp_path):
    import tercomp as tc
    text = str(tc.trace(lambda x: tc.exp(x) * 1.0 + tc.exp(x), tc.spec(("B", 4))))
    path = tmp_path / "in.tern.mlir"
    path.write_text(text)
    checks = """
    # CHECK-LABEL: func.func @forward(
    # CHECK:         %[[E:.*]] = "tern.exp"(%x)
    # CHECK-NOT:     "tern.exp"
    # CHECK-NOT:     "tern.mul"
    # CHECK:         "tern.add"(%[[E]], %[[E]])
    """
    run_filecheck(tercomp("opt", path, "--pass", "simplify").stdout, checks)
    run_filecheck(tercomp("opt", "-", "--pass", "simplify", stdin=text).stdout, checks)
    assert tercomp("opt", path).stdout == text                    # no passes: round trip


def test_opt_autodiff_appends_the_backward(tmp_path):
    """`--pass autodiff`: the gradient of output 0 with respect to every float input, as
    IR that the reference interpreter runs (2 x cos(x) for sum(2 sin(x)))."""
    import tercomp as tc
    from tercomp.ops import interpret, parse
    text = str(tc.trace(lambda x: tc.sum(tc.sin(x) * 2.0), tc.spec((3,))))
    out = tercomp("opt", "-", "--pass", "autodiff", stdin=text).stdout
    run_filecheck(out, """
    # CHECK-LABEL: func.func @forward(%x: tensor<3xf32>
    # CHECK:         "tern.cos"(%x)
    # CHECK:         "func.return"(%[[G:.*]]) : (tensor<3xf32>)
    """)
    x = np.array([0.0, 0.5, 2.0], np.float32)
    np.testing.assert_allclose(interpret(parse(out, "<stdin>"), x)[0], 2 * np.cos(x), rtol=1e-6)


def test_bench(mlp_artifact):
    r = tercomp("bench", mlp_artifact, "--dim", "B=4", "--runs", "3", "--threads", "1")
    assert "x[4, 8]" in r.stdout and "median" in r.stdout and "over 3 runs" in r.stdout


def test_python_dash_m_works_too(mlp_artifact):
    r = subprocess.run([sys.executable, "-m", "tercomp.cli", "info", str(mlp_artifact)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "function:      forward" in r.stdout


@pytest.fixture(scope="module")
def lm_artifact(tmp_path_factory):
    """A language model's artifact (.tcm): a one-layer model of random weights."""
    cfg = {"hidden": 256, "ff": 256, "vocab": 300, "heads": 4, "kv_heads": 2, "layers": 1,
           "eps": 1e-5, "theta": 10000.0, "ctx": 64}
    d = tmp_path_factory.mktemp("lm")
    gguf = R.write_gguf(d / "tiny.gguf", cfg, R.random_weights(cfg, seed=7))
    tc.compile_lm(models.load(str(gguf)), max_seq=16).save(d / "tiny.tcm")
    return d / "tiny.tcm"


@pytest.mark.parametrize("blocked", [True, False], ids=["blocked", "unblocked"])
def test_artifact_commands_do_not_load_the_compiler(blocked, mlp_artifact, lm_artifact):
    """`tercomp info`, `tercomp run` and `tercomp serve MODEL.tcm` (up to the server
    start) run where iree.compiler and sympy cannot be imported, and, where they can,
    leave both unimported (~110 MiB): only `compile`, `opt` and a model to compile load
    the compiler side, when they run."""
    script = textwrap.dedent(f"""
        import sys
        if {blocked}:
            sys.modules['iree.compiler'] = None
            sys.modules['sympy'] = None
        import tercomp.cli
        import tercomp.serve.http
        tercomp.cli.build_parser().format_help()
        assert tercomp.cli.main(["info", {str(mlp_artifact)!r}]) == 0
        assert tercomp.cli.main(["run", {str(mlp_artifact)!r}, "--input", "2x8xf32=1"]) == 0
        started = []
        tercomp.serve.http.serve = lambda app, engine, **kw: started.append(kw["port"])
        assert tercomp.cli.main(["serve", {str(lm_artifact)!r}, "--port", "8123"]) == 0
        assert started == [8123], started
        loaded = sorted({{'iree.compiler', 'sympy'}} & set(sys.modules))
        assert not loaded or {blocked}, loaded
        heavy = [m for m in sys.modules if m.startswith(tuple(
            f"tercomp.{{p}}" for p in ("compiler", "generate", "models", "ops", "passes", "kernels")))]
        assert not heavy, heavy
        """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "function:      forward" in r.stdout and "serving tiny (1 slots of 16 tokens)" in r.stderr


# -- errors: one line, non-zero status, never a traceback ---------------------------------

def test_errors_in_a_subprocess(mlp_artifact, tmp_path):
    bad = tmp_path / "bad.tcm"
    bad.write_bytes(open(mlp_artifact, "rb").read()[:500])
    for args, status, message in [
        ((), 2, "a command is required"),
        (("frobnicate",), 2, "invalid choice"),
        (("info", bad), 1, "not a tercomp artifact"),
        (("run", mlp_artifact, "--input=2x3xf32=1"), 1, "expected shape [B, 8]"),
    ]:
        r = tercomp(*args, check=False)
        assert r.returncode == status, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tercomp: error: ") and message in lines[0], r.stderr


@pytest.mark.parametrize("args, status, message", [
    (["compile", "nofile.py:f", "--example", "4:f32", "-o", "x.tcm"], 2, "no such file"),
    (["compile", "MODEL:affine", "--example", "4:f99", "-o", "x.tcm"], 2, "unknown dtype 'f99'"),
    (["compile", "MODEL:affine", "--example", "4+1:f32", "-o", "x.tcm"], 2, "bad dim '4+1'"),
    (["compile", "MODEL:missing", "--example", "4:f32", "-o", "x.tcm"], 2,
     "has no 'missing'; it defines BitMLP, MLP, affine, make_error, make_model (use "),
    (["compile", "MODEL:not_callable", "--example", "4:f32", "-o", "x.tcm"], 1, "not a function"),
    (["compile", "MODEL:make_error", "--example", "4:f32", "-o", "x.tcm"], 1, "factory failed"),
    (["compile", "MODEL", "--example", "4:f32", "-o", "x.tcm"], 2, "expected FILE.py:OBJECT"),
    (["compile", "MODEL:affine", "--example", "4:f32", "--example", "4:f32", "--target", "tpu",
      "-o", "x.tcm"], 1, "unknown target 'tpu'"),
    (["compile", "MODEL:affine", "--example", "4:f32", "--example", "4:f32", "--target", "cuda",
      "--cuda-target", "sm_90", "-o", "x.tcm"], 1, "cannot build CUDA code for sm_90"),
    (["compile", "MODEL:affine", "--example", "4:f32", "-o", "x.tcm"], 2, "takes 2 argument(s) (x, y)"),
    (["compile", "MODEL:MLP", "-o", "x.tcm"], 2, "takes 1 argument(s) (x) but 0"),
    (["compile", "MODEL:affine", "--example", "4:f32", "--example", "4:f32", "--flag=--iree-bogus",
      "-o", "x.tcm"], 1, "Unknown command line argument"),
    (["compile", "MODEL:affine"], 2, "required: -o/--output"),
    (["info", "missing.tcm"], 1, "no artifact at missing.tcm"),
    (["run", "ART", "--input", "nope.npy"], 2, "cannot read the input nope.npy"),
    (["run", "ART", "--input", "3x8xf32=1,2"], 2, "needs 24 values, got 2"),
    (["run", "ART", "--input", "banana"], 2, "bad --input 'banana'"),
    (["run", "ART", "--input", "1x8xf32=1", "--device", "cuda"], 1, "does not run on cuda"),
    (["run", "ART", "--input", "1x8xf32=1", "--threads", "0"], 2, "positive integer"),
    (["bench", "ART"], 2, "has the symbolic dim B: give its size with --dim NAME=INT, e.g. --dim B=8"),
    (["bench", "ART", "--dim", "B"], 2, "bad --dim 'B'"),
    (["opt", "-", "--pass", "nosuchpass"], 1, "unknown pass 'nosuchpass'"),
    (["opt", "missing.tern.mlir"], 2, "cannot read missing.tern.mlir"),
])
def test_errors_are_one_line(args, status, message, model_file, mlp_artifact, capsys, monkeypatch):
    import io
    import tercomp as tc
    monkeypatch.setattr(sys, "stdin", io.StringIO(str(tc.trace(lambda x: tc.exp(x), tc.spec((4,))))))
    args = [str(model_file) + a[5:] if a.startswith("MODEL") else str(mlp_artifact) if a == "ART" else a
            for a in args]
    assert main(args) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tercomp: error: "), err
    assert message in err[0]


def test_malformed_ir_names_line_and_column(tmp_path, capsys):
    path = tmp_path / "bad.tern.mlir"
    path.write_text("func.func @f(%x: tensor<4xf32>) -> (tensor<4xf32>) {\n  %y = $\n}\n")
    assert main(["opt", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}:2:" in err and err.count("\n") == 1


def test_spinner_only_on_a_terminal(monkeypatch, capsys):
    import pty
    import select
    import time
    from tercomp.cli import spinner
    master, slave = pty.openpty()
    shown = b""
    with os.fdopen(slave, "w") as tty:
        monkeypatch.setattr(sys, "stderr", tty)
        with spinner("compiling model"):
            # a block that lasts until the spinner has drawn (however loaded the machine)
            deadline = time.monotonic() + 60
            while b"compiling model" not in shown and time.monotonic() < deadline:
                if select.select([master], [], [], 0.1)[0]:
                    shown += os.read(master, 4096)
    try:
        while select.select([master], [], [], 0.5)[0]:  # the erase, written on exit
            shown += os.read(master, 4096)
    except OSError:                                     # EIO: the terminal's slave is closed
        pass
    os.close(master)
    assert b"compiling model" in shown and shown.endswith(b"\r\x1b[K")
    monkeypatch.undo()
    with spinner("quiet"):          # pytest's stderr is not a terminal
        time.sleep(0.6)
    assert capsys.readouterr().err == ""


def test_spec_and_input_parsing():
    assert parse_spec("B,784:f32").type.shape[1] == 784
    assert str(parse_spec("B,784:f32").type.shape[0]) == "B"
    assert parse_spec("4,8:float32").type.dtype == "f32"
    assert parse_spec(":i32").type.shape == ()
    np.testing.assert_array_equal(parse_input("2x3xf32=1,2,3,4,5,6"),
                                  np.arange(1, 7, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(parse_input("4xf32=0"), np.zeros(4, np.float32))
    assert parse_input("f32=1.5").shape == () and parse_input("2xi32=[7 8]").dtype == np.int32
    assert parse_input("3xi1=1,0,1").dtype == np.bool_
