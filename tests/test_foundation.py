"""The walking skeleton: trace -> tern IR -> simplify -> linalg -> IREE -> run."""
import os
import subprocess
import sys

import numpy as np
import pytest

import tercomp as tc
from tercomp import nn
from tercomp.ops import parse
from tercomp.passes import run_pipeline
from tercomp.tracing import trace
from tests.conftest import ROOT, run_filecheck

sys.path.insert(0, os.path.join(ROOT, "samples"))
import mlp as mlp_sample  # noqa: E402
import transformer_block as tb_sample  # noqa: E402


@pytest.fixture(scope="module")
def mlp():
    nn.manual_seed(0)
    model = mlp_sample.MLP(32, 16, 10)
    return model, tc.compile(model, tc.spec(("B", 32), "float32"))


def test_mlp_one_module_serves_every_batch(mlp):
    model, exe = mlp
    rng = np.random.default_rng(1)
    for batch in (1, 7, 64):
        x = rng.standard_normal((batch, 32)).astype(np.float32)
        np.testing.assert_allclose(exe(x), mlp_sample.reference(model, x), rtol=1e-5, atol=1e-5)


def test_transformer_block_matches_numpy():
    nn.manual_seed(0)
    block = tb_sample.Block(dim=32, heads=2, seq=8, hidden=64)
    exe = tc.compile(block, tc.spec(("B", 8, 32), "float32"))
    x = np.random.default_rng(2).standard_normal((3, 8, 32)).astype(np.float32)
    np.testing.assert_allclose(exe(x), tb_sample.reference(block, x), rtol=1e-4, atol=1e-4)


def _sample_graphs():
    nn.manual_seed(0)
    yield "mlp", tc.trace(mlp_sample.MLP(32, 16, 10), tc.spec(("B", 32)))
    block = tb_sample.Block(dim=32, heads=2, seq=8, hidden=64)
    yield "transformer_block", tc.trace(block, tc.spec(("B", 8, 32)))
    yield "mlp_grad", tc.trace(tc.grad(lambda m, x, y: tc.cross_entropy(m(x), y)),
                               mlp_sample.MLP(32, 16, 10), np.ones((4, 32), np.float32),
                               np.zeros(4, np.int32))


@pytest.mark.parametrize("name,graph", list(_sample_graphs()), ids=lambda v: v if isinstance(v, str) else "")
def test_print_parse_round_trip(name, graph):
    from tercomp.ir.printer import print_graph
    text = print_graph(graph, elide=False)
    back = parse(text, f"{name}.tern.mlir")
    assert back.structurally_equal(graph)
    assert str(back) == str(graph)


@pytest.mark.parametrize("name,graph", list(_sample_graphs()), ids=lambda v: v if isinstance(v, str) else "")
def test_printed_ir_verifies_with_irdl(name, graph, tmp_path):
    path = tmp_path / f"{name}.tern.mlir"
    path.write_text(str(graph))
    iree_opt = os.path.join(os.path.dirname(sys.executable), "iree-opt")
    r = subprocess.run([iree_opt if os.path.exists(iree_opt) else "iree-opt",
                        f"--irdl-file={ROOT}/dialects/tern.irdl.mlir", str(path)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_irdl_file_is_in_sync_with_the_registry():
    from tercomp.ops.irdl import generate
    with open(os.path.join(ROOT, "dialects", "tern.irdl.mlir")) as f:
        assert f.read() == generate(), "regenerate: python -m tercomp.ops.irdl > dialects/tern.irdl.mlir"


def test_traced_ir_filecheck():
    def f(x, w):
        h = tc.matmul(x, w, transpose_b=True)
        return tc.sum(tc.relu(h), axis=1)
    g = tc.trace(f, tc.spec(("B", 8)), np.ones((4, 8), np.float32))
    run_filecheck(str(g), """
# CHECK-LABEL: func.func @forward(%x: tensor<?x8xf32> {tern.dims = ["B", 8 : i64]}, %w: tensor<4x8xf32>)
# CHECK: %[[H:.*]] = "tern.matmul"(%x, %w) {kernel = "generic", transpose_b = true} : (tensor<?x8xf32>, tensor<4x8xf32>) -> tensor<?x4xf32> loc("{{.*}}test_foundation.py":[[L:[0-9]+]]:{{[0-9]+}})
# CHECK: %[[R:.*]] = "tern.relu"(%[[H]])
# CHECK: %[[S:.*]] = "tern.sum"(%[[R]]) {axes = [1 : i64], keepdims = false}
# CHECK: "func.return"(%[[S]])
""")


def test_simplify_filecheck():
    text = """
func.func @f(%x: tensor<4x3xf32>) -> (tensor<4x3xf32>, tensor<4x3xf32>) attributes {tern.output_names = ["a", "b"]} {
  %one = "tern.constant"() {value = dense<1.0> : tensor<f32>} : () -> tensor<f32>
  %zero = "tern.constant"() {value = dense<0.0> : tensor<f32>} : () -> tensor<f32>
  %m = "tern.mul"(%x, %one) : (tensor<4x3xf32>, tensor<f32>) -> tensor<4x3xf32>
  %a = "tern.add"(%m, %zero) : (tensor<4x3xf32>, tensor<f32>) -> tensor<4x3xf32>
  %t = "tern.transpose"(%a) {perm = [1 : i64, 0 : i64]} : (tensor<4x3xf32>) -> tensor<3x4xf32>
  %tt = "tern.transpose"(%t) {perm = [1 : i64, 0 : i64]} : (tensor<3x4xf32>) -> tensor<4x3xf32>
  %e1 = "tern.exp"(%tt) : (tensor<4x3xf32>) -> tensor<4x3xf32>
  %e2 = "tern.exp"(%x) : (tensor<4x3xf32>) -> tensor<4x3xf32>
  %c = "tern.constant"() {value = dense<2.0> : tensor<f32>} : () -> tensor<f32>
  %c2 = "tern.mul"(%c, %c) : (tensor<f32>, tensor<f32>) -> tensor<f32>
  %s = "tern.mul"(%e2, %c2) : (tensor<4x3xf32>, tensor<f32>) -> tensor<4x3xf32>
  "func.return"(%e1, %s) : (tensor<4x3xf32>, tensor<4x3xf32>) -> ()
}
"""
    g = run_pipeline(parse(text), ["simplify"])
    run_filecheck(str(g), """
# CHECK-LABEL: func.func @f(
# CHECK-NOT: "tern.transpose"
# CHECK-NOT: "tern.add"
# CHECK: %[[E:.*]] = "tern.exp"(%x)
# CHECK-NOT: "tern.exp"
# CHECK: %[[C:.*]] = "tern.constant"() {value = dense<4.0> : tensor<f32>}
# CHECK: %[[S:.*]] = "tern.mul"(%[[E]], %[[C]])
# CHECK: "func.return"(%[[E]], %[[S]])
""")


def test_cse_merges_equal_large_constants_and_only_those():
    """CSE keys a large constant by a sample of its bytes and compares the arrays before
    merging: two equal copies become one constant; an array that differs only where the
    sample does not look stays its own."""
    a = np.random.default_rng(0).standard_normal((256, 128)).astype(np.float32)
    b = a.copy()
    b.reshape(-1)[4097] += 1.0          # past the first 16 KiB, off the sample's stride of 8
    x = tc.spec((2, 256), "float32")
    same = run_pipeline(trace(lambda x: x @ a + x @ a.copy(), x), ["simplify"])
    run_filecheck(str(same), """
# CHECK:     %[[W:.*]] = "tern.constant"(){{.*}} -> tensor<256x128xf32>
# CHECK-NOT: "tern.constant"
# CHECK:     "tern.matmul"(%x, %[[W]])
# CHECK-NOT: "tern.matmul"
""")
    differ = run_pipeline(trace(lambda x: x @ a + x @ b, x), ["simplify"])
    run_filecheck(str(differ), """
# CHECK:     %[[A:.*]] = "tern.constant"(){{.*}} -> tensor<256x128xf32>
# CHECK:     "tern.matmul"(%x, %[[A]])
# CHECK:     %[[B:.*]] = "tern.constant"(){{.*}} -> tensor<256x128xf32>
# CHECK:     "tern.matmul"(%x, %[[B]])
""")
    exe = tc.compile(lambda x: x @ a + x @ b, x)
    xv = np.ones((2, 256), np.float32)
    np.testing.assert_allclose(exe(xv), xv @ a + xv @ b, rtol=1e-5, atol=1e-4)


def test_linalg_lowering_of_matmul_and_reduction_filecheck():
    exe = tc.compile(lambda x, w: tc.sum(x @ w, axis=1), tc.spec(("B", 8)), np.ones((8, 4), np.float32))
    run_filecheck(exe.ir("mlir"), """
# CHECK-LABEL: func.func @forward(%arg0: tensor<?x8xf32>, %arg1: tensor<8x4xf32>) -> tensor<?xf32>
# CHECK: %[[D:.*]] = tensor.dim %arg0, %{{.*}} : tensor<?x8xf32>
# CHECK: %[[MM:.*]] = linalg.matmul ins(%arg0, %arg1 : tensor<?x8xf32>, tensor<8x4xf32>)
# CHECK: linalg.generic {{.*}}iterator_types = ["parallel", "reduction"]{{.*}} ins(%[[MM]] : tensor<?x4xf32>)
# CHECK: arith.addf
# CHECK-NOT: tern.
""")


# -- errors ---------------------------------------------------------------------------
def test_shape_mismatch_names_both_shapes_and_the_user_line():
    def bad(x, y):
        return x + y   # the line the error must point at
    with pytest.raises(tc.TraceError) as e:
        tc.trace(bad, np.ones((3, 4), np.float32), np.ones((5,), np.float32))
    msg = str(e.value)
    assert "[3, 4]" in msg and "[5]" in msg
    assert e.value.loc.file.endswith("test_foundation.py")
    assert e.value.loc.line == bad.__code__.co_firstlineno + 1


def test_python_control_flow_on_a_traced_value_says_what_to_do():
    def f(x):
        if tc.sum(x) > 0:
            return x
        return -x
    with pytest.raises(tc.TraceError, match="tc.where"):
        tc.trace(f, np.ones(3, np.float32))


def test_malformed_ir_gives_line_and_column():
    text = 'func.func @f(%x: tensor<3xf32>) -> (tensor<3xf32>) {\n  %y = "tern.exp"(%x) : (tensor<3xf32>) -> tensor<3xf32>\n  %z = "tern.exp"(%q) : (tensor<3xf32>) -> tensor<3xf32>\n}'
    with pytest.raises(tc.ParseError) as e:
        parse(text, "bad.tern.mlir")
    assert e.value.loc.line == 3 and e.value.loc.col == 19
    assert "undefined value %q" in str(e.value)
    with pytest.raises(tc.ParseError, match="line 1"):
        parse("func.func @f(%x: tensor<3xq7>) -> () {}")


def test_parse_errors_keep_their_hint_and_location():
    # an op rule's hint (here exp's: cast to float) reaches the ParseError, at the op's line
    text = 'func.func @f(%x: tensor<3xi32>) -> (tensor<3xi32>) {\n  %y = "tern.exp"(%x) : (tensor<3xi32>) -> tensor<3xi32>\n  "func.return"(%y) : (tensor<3xi32>) -> ()\n}'
    with pytest.raises(tc.ParseError) as e:
        parse(text, "m.tern.mlir")
    assert (e.value.loc.file, e.value.loc.line, e.value.loc.col) == ("m.tern.mlir", 2, 8)
    assert e.value.hint == "cast the operand to float32 first"
    assert "hint" not in e.value.message
    assert str(e.value).splitlines() == [
        "m.tern.mlir:2: tern.exp: exp needs a floating-point operand, got i32 (line 2, column 8)",
        "  hint: cast the operand to float32 first"]
    with pytest.raises(tc.ParseError) as e:
        parse("func.func @f(%x: tensor<3xq7>) -> () {}")
    assert e.value.hint.startswith("use one of ['f16', 'f32'") and "\n  hint: use one of" in str(e.value)


def test_bad_shapes_and_dtypes_are_tercomp_errors_at_the_user_line():
    from tercomp.errors import TypeSpecError
    x = np.ones((2, 3), np.float32)
    for fn, what in [(lambda x: x.astype("float99"), "unsupported dtype 'float99'"),
                     (lambda x: tc.broadcast_to(x, (2 ** 41, 2, 3)), "a dim must be from 0 to 2..40")]:
        with pytest.raises(TypeSpecError, match=what) as e:
            tc.trace(fn, x)
        # a TercompError with the user's line, and still the ValueError NumPy would raise
        assert isinstance(e.value, tc.TercompError) and isinstance(e.value, ValueError)
        assert e.value.loc.file.endswith("test_foundation.py")


def test_an_op_defined_twice_is_a_tercomp_error():
    from tercomp.ops import REGISTRY, register
    with pytest.raises(tc.TercompError, match="'exp' registered twice") as e:
        register(REGISTRY["exp"])
    assert "family file" in e.value.hint


def test_parsed_ir_with_wrong_types_is_rejected():
    text = 'func.func @f(%x: tensor<3xf32>) -> (tensor<4xf32>) {\n  %y = "tern.exp"(%x) : (tensor<3xf32>) -> tensor<4xf32>\n  "func.return"(%y) : (tensor<4xf32>) -> ()\n}'
    with pytest.raises(tc.ParseError, match="tensor<3xf32>"):
        parse(text)


def test_wrong_inputs_to_a_compiled_module_are_caught_before_iree(mlp):
    _, exe = mlp
    with pytest.raises(tc.InputError, match="dim 1 must be 32"):
        exe(np.ones((2, 31), np.float32))
    with pytest.raises(tc.InputError, match="dtype f32"):
        exe(np.ones((2, 32), np.float64))
    with pytest.raises(tc.InputError, match="takes 1 argument, got 2"):
        exe(np.ones((2, 32), np.float32), np.ones(3, np.float32))


def test_verifier_names_op_rule_and_location():
    from tercomp.ops import verify
    g = tc.trace(lambda x: tc.exp(x), np.ones(3, np.float32))
    op = g.ops[0]
    op.results[0].type = op.results[0].type.with_shape((4,))
    with pytest.raises(tc.VerifyError, match=r"tern.exp.*shape rule.*result types"):
        verify(g, "a test")


def test_ir_layer_takes_the_op_rules_explicitly():
    """tercomp.ir knows no ops: its parser and verifier check op types only with the
    registry's rules passed in (tercomp.ops.parse / verify do), and importing it does not
    import the registry (no hidden ir <-> ops cycle)."""
    import subprocess
    import sys
    from tercomp import ir, ops
    from tercomp.ir.verifier import verify as bare_verify
    code = "import sys, tercomp.ir.parser, tercomp.ir.verifier; print('tercomp.ops' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    wrong = """func.func @forward(%x: tensor<3xf32>) -> (tensor<4xf32>) {
  %e = "tern.exp"(%x) : (tensor<3xf32>) -> tensor<4xf32>
  "func.return"(%e) : (tensor<4xf32>) -> ()
}"""                                                                # exp's result retyped
    g = ir.parse(wrong)                                             # syntax and names only
    bare_verify(g)
    with pytest.raises(tc.ParseError):
        ops.parse(wrong)
    with pytest.raises(tc.VerifyError):
        ops.verify(g)


def test_trace_does_not_import_nn():
    """nn sits above trace (its layers call the traced API); tc.trace recognises modules
    through the pytree registration, so tracing loads no nn module."""
    code = ("import sys, numpy; from tercomp.tracing import trace; trace(lambda x: x * 2, numpy.ones(2)); "
            "print(sorted(m for m in sys.modules if m.startswith('tercomp.nn')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_output_names_follow_the_result_structure():
    x = np.ones(3, np.float32)

    def names(fn, *args):
        return tc.trace(fn, *args).output_names
    assert names(lambda x: x * 2, x) == ["out"]
    assert names(lambda x: (x * 2, {"a": x, "b": [x]}), x) == ["out0", "out1_a", "out1_b_0"]
    # keys name results, even keys that begin with "out" (once mistaken for positions)
    assert names(lambda x: {"loss": x * 2, "outer.w": x + 1}, x) == ["loss", "outer.w"]
    # positional gradients keep the name autodiff gives them, keyed ones their key
    loss = lambda w, b: tc.sum(w * b)  # noqa: E731
    assert names(tc.grad(loss, argnums=(0, 1)), x, x) == ["w.grad", "b.grad"]
    assert names(tc.value_and_grad(loss), x, x) == ["out0", "w.grad"]
    assert names(lambda w: {"g": tc.grad(lambda v: tc.sum(v * v))(w)}, x) == ["g"]


_EDITABLE_INSTALL = """
import importlib.util, sys
from importlib.machinery import PathFinder
PKG = {pkg!r}
class Editable:     # what setuptools' editable install puts after the path search
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "tercomp":
            return importlib.util.spec_from_file_location(name, PKG + "/__init__.py")
        if name.startswith("tercomp.") and name.count(".") == 1:
            return PathFinder.find_spec(name, [PKG])
        return None
sys.meta_path.insert(sys.meta_path.index(PathFinder) + 1, Editable)
sys.path.insert(0, {here!r})     # the script's folder, first, as `python script.py` does
"""


def test_a_tercomp_folder_beside_the_script_is_named(tmp_path):
    """An empty `tercomp/` folder next to a script shadows an editable install (the path
    search finds the folder as a namespace package before setuptools' finder runs); the
    first tercomp module that loads says so. A plain `import tercomp` runs no tercomp
    code at all: nothing can detect it there."""
    (tmp_path / "tercomp").mkdir()
    boot = _EDITABLE_INSTALL.format(pkg=os.path.join(ROOT, "tercomp"), here=str(tmp_path))
    (tmp_path / "script.py").write_text(boot + "from tercomp import nn\nprint('imported')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert f"ImportError: 'tercomp' was imported from the folder {tmp_path / 'tercomp'}, " in out.stderr
    assert "Rename or remove that folder" in out.stderr
    (tmp_path / "tercomp").rmdir()                  # without the folder the same script runs
    out = subprocess.run([sys.executable, "script.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "imported", out.stderr[-2000:]


def test_dump_dir_writes_numbered_stages(tmp_path):
    exe = tc.compile(lambda x: tc.tanh(x) * 2.0, tc.spec(("B", 4)), dump_dir=str(tmp_path))
    files = sorted(os.listdir(tmp_path))
    assert files[:4] == ["00-tern.tern.mlir", "01-ternary.tern.mlir", "02-simplify.tern.mlir", "03-mlir.mlir"]
    assert os.path.isdir(tmp_path / "iree")
    run_filecheck(exe.ir("flow"), "# CHECK: flow.executable\n# CHECK: flow.dispatch")
    assert exe.ir("tern") == (tmp_path / "00-tern.tern.mlir").read_text()


def test_big_constants_are_elided_in_dumps():
    w = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    exe = tc.compile(lambda x: x @ w, tc.spec(("B", 64)))
    run_filecheck(exe.ir("tern"), """
# CHECK: "tern.constant"() {value = dense_resource<__elided__> : tensor<64x64xf32>}
""")
    assert len(exe.ir("mlir")) < 4000
