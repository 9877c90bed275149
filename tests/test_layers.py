"""tercomp's packages import one way (STYLE.md §11, §15; DESIGN.md): every import in
tercomp/, at the top of a file or inside a function, goes to the same or a lower layer,
and no two packages import each other, directly or through others."""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "tercomp"

#: lowest first. A unit is a top-level module or package of tercomp.
LAYERS = [
    # leaves: no tercomp imports but each other
    {"_version", "errors", "dtypes", "dimexpr", "pytree", "ternary_pack", "sympy_walk",
     "distributed"},
    {"ir", "runtime"},          # the IR; the runtime (a deployed artifact needs only it)
    {"codegen"},                # the MLIR-building library: builders, executables, params
    {"kernels"},                # the kernel table and the hand-written kernels
    {"ops"},                    # the op registry: rules, references, VJPs, generic lowerings
    {"tracing", "passes", "lowering"},  # tracing; the passes; the one lowering driver
    {"autodiff", "nn", "optim"},
    {"models", "serve"},        # the LM families and formats; the server of a saved model
    {"build"},                  # a traced program -> a CompiledModule (Pipeline)
    {"compiler", "generate", "embed"},   # tc.compile, tc.compile_lm, tc.compile_embed
    {"training"},
    {"cli", "__main__", ""},  # "": __init__
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def _unit(module: str) -> str:
    """'tercomp.ops.linalg' -> 'ops'; 'tercomp' -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports():
    """(importing module, imported module, line) for every tercomp import in tercomp/."""
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG.parent).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        package = module if rel.name == "__init__" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [f"{target}.{a.name}" for a in node.names] if node.module is None \
                    else [target]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name == "tercomp" or name.startswith("tercomp."):
                    yield module, name, f"{path.relative_to(PKG.parent)}:{node.lineno}"


def test_every_unit_has_a_layer():
    units = {_unit(m) for m, _, _ in _imports()} | {_unit(t) for _, t, _ in _imports()}
    assert sorted(units - set(RANK)) == []


def test_no_import_runs_up_a_layer():
    up = [f"{where}: {src} imports {dst}" for src, dst, where in _imports()
          if RANK.get(_unit(dst), -1) > RANK.get(_unit(src), len(LAYERS))]
    assert up == [], "\n".join(up)


def test_no_two_packages_import_each_other():
    graph = {}
    for src, dst, _ in _imports():
        a, b = _unit(src), _unit(dst)
        if a != b and "" not in (a, b):
            graph.setdefault(a, set()).add(b)
    state = {}

    def visit(u, path):
        state[u] = "open"
        for v in sorted(graph.get(u, ())):
            if state.get(v) == "open":
                pytest.fail("import cycle: " + " -> ".join(path + [u, v]))
            if v not in state:
                visit(v, path + [u])
        state[u] = "done"
    for u in sorted(graph):
        if u not in state:
            visit(u, [])


def test_the_checker_sees_relative_and_function_level_imports():
    """The walk finds function-level and relative imports (what the tests above rely on)."""
    found = {(s, d) for s, d, _ in _imports()}
    assert ("tercomp.lowering.driver", "tercomp.ops") in found           # relative, top
    assert ("tercomp.cli.compile", "tercomp") in found                   # inside a function
