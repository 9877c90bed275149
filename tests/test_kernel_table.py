"""The one kernel table (tercomp/kernels/table.py): every kernel an op can take is
a row of it, the `kernels` pass settles each op from it, and the compile cache key of
tc.compile_lm follows it."""
import numpy as np
import pytest

import tercomp as tc
from conftest import run_filecheck
from tercomp.kernels import table as kt
from tercomp.kernels.ternary import strategies as ternary_strategies
from tercomp.ir import TensorType
from tercomp.ops import get
from tercomp.passes import run_pipeline
from tercomp.trace.tracer import apply


def test_every_row_is_a_kernel_of_a_registered_op():
    for r in kt.TABLE:
        attr = kt.attr_name(r.op)
        assert get(r.op).attrs[attr] == kt.UNSETTLED.get(r.op, kt.GENERIC), r
        assert r.kernel in kt.kernel_names(r.op) and r.targets and r.why
        assert r.describe().startswith(f"{r.op} kernel {r.kernel!r}")
    assert kt.ops() == ("ternary_matmul", "widening_matmul", "rms_norm", "rope",
                        "cached_attention", "slot_attention")
    assert ternary_strategies.TABLE == kt.rows("ternary_matmul")
    assert ternary_strategies.CHOICES == ("auto", *kt.kernel_names("ternary_matmul"), "off")


@pytest.mark.parametrize("targets", [["vulkan"], ["llvm-cpu-generic"], ["llvm-cpu", "cuda"]])
def test_host_only_rows_are_never_chosen_for_other_targets(targets):
    x = TensorType((1, 64), "f32")
    for op in kt.ops():
        found = kt.choose(op, [x], {"k": 4096, "n": 4096}, targets, features=("avx2",))
        assert found is None or found.compiles_for(targets)
    assert kt.choose("rms_norm", [x], {}, ["llvm-cpu"], features=()).kernel == "cpu"
    assert kt.choose("widening_matmul", [x], {}, ["llvm-cpu"], features=()) is None
    assert kt.choose("widening_matmul", [x], {}, ["llvm-cpu"], features=("avx2",)).kernel == "avx2"


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
    extra = kt.KernelRow("rms_norm", "cpu2", kt.HOST, None, lambda types, attrs: True, "why")
    monkeypatch.setattr(kt, "TABLE", kt.TABLE + (extra,))
    assert kt.table_key(["llvm-cpu"]) != before
    assert kt.table_key(["vulkan"]) == kt.table_key(["vulkan"])
