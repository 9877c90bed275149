"""The one kernel table (tercomp/kernels/table.py): every kernel an op can take is
a row of it, with where it fits and how it is emitted; the `kernels` pass settles each
op from it, the lowering emits what the op's kernel attribute names and checks nothing
again, and the compile cache key of tc.compile_lm follows it."""
import dataclasses
import inspect
import pathlib
import re

import numpy as np
import pytest

import tercomp as tc
from conftest import run_filecheck
from tercomp.codegen.iree_session import new_session
from tercomp.lowering import to_mlir
from tercomp.errors import TraceError
from tercomp.kernels import table as kt
from tercomp.kernels.ternary import strategies as ternary_strategies
from tercomp.ir import TensorType
from tercomp.ops import get
from tercomp.ops.registry import REGISTRY
from tercomp.passes import run_pipeline
from tercomp.ternary_pack import pack_ternary
from tercomp.tracing.tracer import apply

F32 = "float32"


def test_every_row_is_a_kernel_of_a_registered_op():
    for r in kt.TABLE:
        attr = kt.attr_name(r.op)
        assert get(r.op).attrs[attr] == kt.UNSETTLED.get(r.op, kt.GENERIC), r
        assert r.kernel in kt.kernel_names(r.op) and r.targets and r.why
        assert callable(r.fits) and callable(r.emit) and r.fits.__doc__
        assert r.describe().startswith(f"{r.op} kernel {r.kernel!r}")
    assert kt.ops() == ("ternary_matmul", "widening_matmul", "matmul", "matmul_sum", "rms_norm",
                        "rope", "cached_attention", "slot_attention", "kv_scatter")
    assert ternary_strategies.TABLE == kt.rows("ternary_matmul")
    assert ternary_strategies.CHOICES == ("auto", *kt.kernel_names("ternary_matmul"), "off")


@pytest.mark.parametrize("targets", [["vulkan"], ["llvm-cpu-generic"], ["llvm-cpu", "cuda"]])
def test_host_only_rows_are_never_chosen_for_other_targets(targets):
    types = {"ternary_matmul": kt.ternary_types(1, 4096, 4096),
             "widening_matmul": [TensorType((1, 64), "f32"), TensorType((8, 64), "f16")],
             "matmul": [TensorType((64, 576), "f32"), TensorType((32, 576, 1024), "f32")],
             "matmul_sum": [TensorType((32, 64, 1024), "f32"), TensorType((32, 576, 1024), "f32")],
             "rms_norm": [TensorType((1, 64), "f32"), TensorType((64,), "f32")],
             "rope": [TensorType((1, 2, 64), "f32")] + [TensorType((1, 32), "f32")] * 2,
             "cached_attention": [TensorType((1, 2, 64), "f32"), TensorType((8, 2, 64), "f32")],
             "slot_attention": [TensorType((1, 2, 64), "f32"), TensorType((2, 8, 2, 64), "f32")],
             "kv_scatter": [TensorType((2, 8, 2, 64), "f16"), TensorType((1, 2, 64), "f16")]}
    attrs = {"k": 4096, "n": 4096, "style": "neox", "transpose_b": False}
    for op in kt.ops():
        found = kt.choose(op, types[op], attrs, targets, features=("avx2",))
        assert found is None or found.compiles_for(targets)
    for op in kt.ops()[4:]:
        assert kt.choose(op, types[op], attrs, ["llvm-cpu"], features=()).kernel == "cpu"
    for op in ("matmul", "matmul_sum"):
        assert kt.choose(op, types[op], {}, ["llvm-cpu"], features=("avx2",)) is None
        assert kt.choose(op, types[op], {}, ["llvm-cpu"], features=("avx512f",)).kernel == "avx512-f32"
    wm = types["widening_matmul"]
    assert kt.choose("widening_matmul", wm, {}, ["llvm-cpu"], features=()) is None
    assert kt.choose("widening_matmul", wm, {}, ["llvm-cpu"], features=("avx2",)).kernel == "avx2"


def test_the_kernels_pass_settles_ternary_matmuls_from_the_table():
    """A ternary_matmul left at "auto" in the IR is settled by the kernels pass, by the
    same rule the ternary pass uses for the ones it creates."""
    packed = np.zeros((8, 16), np.int8)

    def f(x):
        return apply("ternary_matmul", x, packed, k=64, n=8, scale=1.0)
    g = tc.trace(f, tc.spec((1, 64)))
    out = str(run_pipeline(g, [("kernels", {"targets": ["vulkan"]})]))
    run_filecheck(out, """
CHECK: "tern.ternary_matmul"{{.*}}strategy = "addsub"
""")


def test_the_compile_cache_key_follows_the_table(monkeypatch):
    before = kt.table_key(["llvm-cpu"])
    extra = kt.KernelRow("rms_norm", "cpu2", kt.HOST, None, lambda types, attrs: True,
                         lambda ctx, op, xs: None, "why")
    monkeypatch.setattr(kt, "TABLE", kt.TABLE + (extra,))
    assert kt.table_key(["llvm-cpu"]) != before
    assert kt.table_key(["vulkan"]) == kt.table_key(["vulkan"])


def test_the_compile_cache_key_follows_the_features_kernels_choose_code_by(monkeypatch):
    """The avx512 ternary GEMM decodes with gf2p8affineqb only where the host has GFNI:
    hosts with and without it (the same table rows) get different keys."""
    with_gfni = frozenset({"avx2", "avx512f", "avx512_vnni", "gfni"})
    monkeypatch.setattr(kt, "host_cpu_features", lambda: with_gfni)
    key = kt.table_key(["llvm-cpu"])
    monkeypatch.setattr(kt, "host_cpu_features", lambda: with_gfni - {"gfni"})
    assert kt.table_key(["llvm-cpu"]) != key
    assert kt.table_key(["vulkan"]) == kt.table_key(["vulkan"])


# ------------------------------------------------------------------ the table decides alone
def _packed(k, n):
    return pack_ternary(np.zeros((n, k), np.int8)).view(np.int8)


def _ternary(m, k, n, act_quant=True):
    p = _packed(k, n)
    return (lambda x, kernel: apply("ternary_matmul", x, p, k=k, n=n, scale=0.5,
                                    act_quant=act_quant, strategy=kernel),
            [tc.spec((m, k))])


def _widening(w_dtype, k, scaled):
    w = np.ones((12, k), w_dtype)
    s = (np.ones(12, np.float32),) if scaled else ()
    return (lambda x, kernel: apply("widening_matmul", x, w, *s, kernel=kernel),
            [tc.spec(("B", k))])


def _rms_norm(shape, dtype=F32):
    w = np.ones(shape[-1], dtype)
    return lambda x, kernel: apply("rms_norm", x, w, kernel=kernel), [tc.spec(shape, dtype)]


def _rope(lead, d, style="neox", dtype=F32):
    return (lambda x, c, s, kernel: apply("rope", x, c, s, style=style, kernel=kernel),
            [tc.spec((*lead, "T", 3, d), dtype), tc.spec(("T", d // 2), dtype),
             tc.spec(("T", d // 2), dtype)])


def _attention(d, cache_dtype):
    return (lambda q, k, v, start, kernel: apply("cached_attention", q, k, v, start, scale=0.5,
                                                 kernel=kernel),
            [tc.spec(("T", 4, d)), tc.spec((32, 2, d), cache_dtype),
             tc.spec((32, 2, d), cache_dtype), tc.spec((), "int32")])


def _slots(d, cache_dtype):
    return (lambda q, k, v, slots, pos, kernel: apply("slot_attention", q, k, v, slots, pos,
                                                      scale=0.5, kernel=kernel),
            [tc.spec(("T", 4, d)), tc.spec((3, 32, 2, d), cache_dtype),
             tc.spec((3, 32, 2, d), cache_dtype), tc.spec(("T",), "int32"),
             tc.spec(("T",), "int32")])


def _kv_scatter(kv, d, cache_dtype, t="T"):
    return (lambda cache, rows, slots, pos, kernel: apply("kv_scatter", cache, rows, slots, pos,
                                                          kernel=kernel),
            [tc.spec((3, 32, kv, d), cache_dtype), tc.spec((t, kv, d), cache_dtype),
             tc.spec((t,), "int32"), tc.spec((t,), "int32")])


def _matmul(a_shape, x_shape, transpose_b=False, dtype=F32):
    return (lambda a, x, kernel: apply("matmul", a, x, transpose_b=transpose_b, kernel=kernel),
            [tc.spec(a_shape, dtype), tc.spec(x_shape, dtype)])


def _matmul_sum(a_shape, x_shape):
    return (lambda a, x, kernel: apply("matmul_sum", a, x, kernel=kernel),
            [tc.spec(a_shape), tc.spec(x_shape)])


#: op -> ops of it whose shapes and attributes each row of the op fits, or not
SAMPLES = {
    "ternary_matmul": [_ternary(m, k, n, aq) for m in ("B", 1, 6) for k, n in
                       ((256, 8), (128, 8), (100, 8), (256, 7)) for aq in (True, False)],
    "widening_matmul": [_widening(np.float16, 48, False), _widening(np.int8, 48, True),
                        _widening(np.int8, 64, True), _widening(np.float16, 64, False),
                        _widening(np.int8, 48, False), _widening(np.float16, 40, False),
                        _widening(np.float32, 48, False)],
    "rms_norm": [_rms_norm(("R", 64)), _rms_norm((2, "T", 64)), _rms_norm(("R", 60)),
                 _rms_norm(("R", 64), "float16")],
    "rope": [_rope((), 32), _rope((1,), 32), _rope((2,), 32), _rope((), 24),
             _rope((), 32, "interleaved"), _rope((), 32, dtype="float16")],
    "cached_attention": [_attention(16, "float16"), _attention(16, F32), _attention(12, F32),
                         _attention(520, "float16")],
    "slot_attention": [_slots(16, "float16"), _slots(12, F32)],
    # rows of 64 bytes and more, f16 and f32, a static T; then rows of 48 bytes, i32 caches
    "kv_scatter": [_kv_scatter(2, 16, "float16"), _kv_scatter(2, 16, F32), _kv_scatter(4, 32, "float16", 5),
                   _kv_scatter(2, 12, "float16"), _kv_scatter(2, 16, "int32")],
    "matmul": [_matmul((64, 72), (16, 72, 256)), _matmul((24, 72), (16, 72, 256)), _matmul((24, 72), (64, 72, 256)),
               _matmul((64, 72), (16, 72, 48)), _matmul((64, 72), (16, 72, 40)),
               _matmul((8, 8), (2, 8, 16)), _matmul((64, 72), (16, 256, 72), True),
               _matmul((16, 64, 72), (16, 72, 256)), _matmul((64, 72), ("B", 72, 256)),
               _matmul((64, 72), (16, 72, 256), dtype="float16"), _matmul((256, 256), (256, 256)),
               _matmul((256, 256), (256, 256), True), _matmul((8, 8), (8, 16)),
               _matmul((256, 72), (72, 40))],
    "matmul_sum": [_matmul_sum((16, 64, 256), (16, 72, 256)), _matmul_sum((32, 64, 256), (32, 72, 256)),
                   _matmul_sum((16, 40, 256), (16, 72, 256)),
                   _matmul_sum((2, 16, 8), (2, 8, 8)), _matmul_sum((16, 64, 256), (16, 71, 256))],
}


def _emitted(monkeypatch, graph) -> list:
    """The (op, kernel) of every row whose emit lowering `graph` called, in order."""
    called = []

    def spy(r):
        def emit(ctx, op, xs):
            called.append((r.op, r.kernel))
            return r.emit(ctx, op, xs)
        return dataclasses.replace(r, emit=emit)
    monkeypatch.setattr(kt, "TABLE", tuple(spy(r) for r in kt.TABLE))
    _, ctx = new_session()
    to_mlir(graph, ctx)
    monkeypatch.undo()
    return called


def _the_op(graph, opname):
    (op,) = [o for o in graph.ops if o.opname == opname]
    return [v.type for v in op.operands], op.attrs


@pytest.mark.parametrize("opname", list(SAMPLES))
def test_a_row_emits_an_op_exactly_where_its_fits_says(opname, monkeypatch):
    """For sampled shapes and attributes of every op of the table: asked for by name, a
    row either fits (the op is traced, and lowered with the row's emit and nothing else)
    or is refused when the op is made (never a silent fallback); left to the `kernels`
    pass (every CPU feature present), the op gets the first row that fits and that "auto"
    picks, and is lowered with that row's emit, or with its own lowering when none does."""
    unsettled = kt.UNSETTLED.get(opname, kt.GENERIC)
    for fn, specs in SAMPLES[opname]:
        auto = tc.trace(lambda *xs: fn(*xs, unsettled), *specs)
        types, attrs = _the_op(auto, opname)
        for r in kt.rows(opname):
            if not r.fits(types, attrs):
                with pytest.raises(TraceError, match=f"{r.kernel!r} cannot emit {opname}"):
                    tc.trace(lambda *xs: fn(*xs, r.kernel), *specs)
                continue
            named = tc.trace(lambda *xs: fn(*xs, r.kernel), *specs)
            assert _emitted(monkeypatch, named) == [(opname, r.kernel)], (r.kernel, types)
        monkeypatch.setattr(kt, "target_features", lambda targets: frozenset({kt.AVX2, kt.VNNI, kt.AVX512F}))
        settled = run_pipeline(auto, [("kernels", {"targets": ["llvm-cpu"]})])
        monkeypatch.undo()
        want = next((r for r in kt.rows(opname) if r.auto(types, attrs)), None)
        assert _the_op(settled, opname)[1][kt.attr_name(opname)] == (want.kernel if want
                                                                     else unsettled)
        assert _emitted(monkeypatch, settled) == ([(opname, want.kernel)] if want else [])


def test_no_lowering_but_the_tables_reads_a_kernel_attribute():
    """An op's own `lower` is its generic lowering: the lowering driver emits the row its
    kernel attribute names (kernel_table.row_of), and no op looks at it again."""
    for name, opdef in REGISTRY.items():
        if opdef.lower is None:
            continue
        source = inspect.getsource(opdef.lower)
        for attr in ("kernel", "strategy"):
            assert f'"{attr}"' not in source and f"'{attr}'" not in source, (name, attr)


def test_only_the_table_and_the_pass_that_chooses_read_kernel_attributes():
    root = pathlib.Path(tc.__file__).parent
    allowed = {root / "kernels" / "table.py", root / "passes" / "kernels.py"}
    reads = re.compile(r"""\[["'](kernel|strategy)["']\]|\.get\(["'](kernel|strategy)["']""")
    found = [str(p.relative_to(root)) for p in root.rglob("*.py")
             if p not in allowed and reads.search(p.read_text())]
    assert not found, f"kernel attributes read outside the kernel table: {found}"


@pytest.mark.skipif(kt.AVX2 not in kt.host_cpu_features(), reason="host CPU lacks AVX2")
def test_a_named_kernel_that_does_not_fit_is_refused_at_the_users_line():
    class Odd(tc.nn.Module):
        def __init__(self):
            tc.nn.manual_seed(0)
            self.fc = tc.nn.BitLinear(256, 7)

        def forward(self, x):
            return self.fc(x)
    with pytest.raises(tc.TercompError, match="ternary strategy 'avx2' cannot emit") as e:
        tc.compile(Odd(), tc.spec(("B", 256)), ternary="avx2", cache=False)
    assert "test_kernel_table.py" in str(e.value.loc) and "addsub" in e.value.hint
