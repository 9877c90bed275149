"""IR text and other input text are data: parsed by grammars with limits, never run.

Each hostile case runs in a child process with a time limit, so a hang or a crash fails
the test instead of the test run."""
import ast
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import tercomp as tc
from tercomp import dimexpr
from tercomp.ops import parse

import box

PKG = pathlib.Path(tc.__file__).parent

# Calls that turn text into code or objects.
_FORBIDDEN = {"eval", "exec", "sympify", "parse_expr", "literal_eval", "__import__", "S"}
_FORBIDDEN_MODULES = {"pickle", "marshal", "shelve", "dill", "cloudpickle"}


def _forbidden_uses(path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in _FORBIDDEN:
                yield f"{path.relative_to(PKG.parent)}:{node.lineno}: call of {name}"
            for kw in node.keywords:
                if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    yield f"{path.relative_to(PKG.parent)}:{node.lineno}: allow_pickle"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for m in mods:
                if m.split(".")[0] in _FORBIDDEN_MODULES:
                    yield f"{path.relative_to(PKG.parent)}:{node.lineno}: import of {m}"


def test_no_file_of_the_package_turns_text_into_code():
    found = [u for p in sorted(PKG.rglob("*.py")) for u in _forbidden_uses(p)]
    assert found == []


def test_the_ast_check_finds_an_eval(tmp_path):
    p = PKG / "_ast_probe_tmp.py"
    try:
        p.write_text("import pickle\nx = eval('1')\nimport sympy\ny = sympy.sympify('2')\n")
        found = list(_forbidden_uses(p))
    finally:
        p.unlink()
    assert len(found) == 3


_HEADER = 'func.func @f() -> tensor<{ty}> {{\n  %c = "tern.constant"() {{value = dense<{lit}> : tensor<{ty}>}} : () -> tensor<{ty}> loc("a":1:1)\n  return %c : tensor<{ty}>\n}}\n'

# Each case must raise a ParseError, quickly, without running anything.
HOSTILE = {
    "shell": ("2xf32", "[__import__('os').system('touch PWNED'), 1]"),
    "power tower": ("1xf32", "9**9**9"),
    "list repeat": ("1xf32", "[0]*10**10"),
    "expression": ("f32", "2.-1"),
    "nested": ("2xf32", "[" * 2000 + "1" + "]" * 2000),
    "huge splat": ("100000x100000x1000xf32", "1.0"),
    "huge int": ("i64", "9" * 5000),
    "int overflow": ("i8", "300"),
    "ragged": ("2x2xf32", "[[1.0, 2.0], [3.0]]"),
    "wrong count": ("3xf32", "[1.0, 2.0]"),
    "hex too long": ("f32", "0x1FFFFFFFFF"),
    "string blob size": ("2xf32", '"0x0000"'),
    "lambda": ("f32", "(lambda: 1)()"),
    "attribute access": ("f32", "().__class__"),
}


def _run_parse(text, tmp_path):
    """Parse `text` in a child process (tests/box.py: a fork of a process that imported
    tercomp) in `tmp_path` with a 60 s limit; returns (exit code, output)."""
    src = tmp_path / "case.tern.mlir"
    src.write_text(text)
    code = ("import sys, tercomp\nfrom tercomp.ops import parse\n"
            "try:\n    parse(open(sys.argv[1]).read())\n    print('PARSED')\n"
            "except tercomp.TercompError as e:\n    print('ERROR', type(e).__name__, e)\n")
    return box.run(code, src, timeout=60, cwd=tmp_path)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_dense_literal_is_a_parse_error(case, tmp_path):
    ty, lit = HOSTILE[case]
    rc, out = _run_parse(_HEADER.format(ty=ty, lit=lit), tmp_path)
    assert rc == 0 and out.startswith("ERROR ParseError"), out
    assert not (tmp_path / "PWNED").exists()


def test_hostile_dims_are_parse_errors(tmp_path):
    for dims in ['"__import__(\'os\').system(\'touch PWNED\')"', '"B**99**99"', '"' + "(" * 100 + "B" + ")" * 100 + '"']:
        text = ('func.func @f(%x: tensor<?xf32> {tern.dims = [' + dims + ']}) -> tensor<?xf32> {\n'
                '  return %x : tensor<?xf32>\n}\n')
        rc, out = _run_parse(text, tmp_path)
        assert rc == 0 and out.startswith("ERROR ParseError"), out
    assert not (tmp_path / "PWNED").exists()


def test_hostile_reshape_dim_attribute(tmp_path):
    text = ('func.func @f(%x: tensor<?xf32> {tern.dims = ["B"]}) -> tensor<?xf32> {\n'
            '  %y = "tern.reshape"(%x) {shape = ["__import__(\'os\').system(\'touch PWNED\')"]} : '
            '(tensor<?xf32>) -> tensor<?xf32> loc("a":1:1)\n  return %y : tensor<?xf32>\n}\n')
    rc, out = _run_parse(text, tmp_path)
    assert rc == 0 and out.startswith("ERROR ParseError"), out
    assert not (tmp_path / "PWNED").exists()


def test_deeply_nested_attribute_lists_are_a_parse_error():
    text = ('func.func @f(%x: tensor<2xf32>) -> tensor<2xf32> {\n'
            '  %y = "tern.neg"(%x) {junk = ' + "[" * 3000 + "]" * 3000 + '} : (tensor<2xf32>) -> tensor<2xf32>\n'
            '  return %y : tensor<2xf32>\n}\n')
    with pytest.raises(tc.ParseError, match="nested deeper"):
        parse(text)


@pytest.mark.parametrize("ty,lit,expected", [
    ("2x2xf32", "[[1.0, -2.5e1], [3, inf]]", [[1.0, -25.0], [3.0, np.inf]]),
    ("3xi8", "[-128, 127, 255]", [-128, 127, -1]),
    ("2xi1", "[true, false]", [True, False]),
    ("2x3xi32", "7", [[7] * 3] * 2),
    ("f32", "0x7F800000", np.inf),
    ("2xf32", '"0x0000803F00000040"', [1.0, 2.0]),
])
def test_dense_literals_read_as_mlir_does(ty, lit, expected):
    g = parse(_HEADER.format(ty=ty, lit=lit))
    np.testing.assert_array_equal(g.ops[0].attrs["value"], np.array(expected))


def test_dense_nan_hex_literal():
    g = parse(_HEADER.format(ty="f32", lit="0x7FC00000"))
    assert np.isnan(g.ops[0].attrs["value"])


@pytest.mark.parametrize("text,value", [("B", 5), ("2*B + 1", 11), ("floor(T/2)", 3), ("B**2 - T", 18),
                                        ("-(B - 7)", 2), ("ceiling(T/2)*B", 20), ("B//2", 2)])
def test_dim_grammar_matches_sympy_spelling(text, value):
    tree = dimexpr.parse(text)
    assert dimexpr.evaluate(tree, {"B": 5, "T": 7}) == value
    sym = tc.ir.as_dim(text)      # the same text read into sympy, and printed back the same
    assert tc.ir.as_dim(str(sym)) == sym


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet="B T 0123456789+-*/()_.,'\"[]{}:;%!@#$^&|<>=?~`\\abcdefghijklmnopqrstuvwxyz", max_size=40))
def test_dim_grammar_never_raises_anything_but_parse_errors(text):
    try:
        tree = dimexpr.parse(text)
    except tc.ParseError:
        return
    try:
        dimexpr.evaluate(tree, {n: 3 for n in dimexpr.names(tree)})
    except tc.ParseError:
        pass


def test_tercomp_opt_refuses_a_code_carrying_literal(tmp_path):
    src = tmp_path / "evil.tern.mlir"
    src.write_text(_HEADER.format(ty="2xf32", lit="[__import__('os').system('touch PWNED'), 1]"))
    r = subprocess.run([sys.executable, "-m", "tercomp.cli", "opt", str(src), "--pass", "simplify"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode != 0
    assert "malformed dense literal" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "PWNED").exists()
