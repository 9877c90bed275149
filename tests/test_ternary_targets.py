"""Ternary kernels on every target: "auto" never gives a GPU a CPU-only kernel, ternary
modules compile for Vulkan and CUDA at a static and a symbolic batch (IREE compiles
them without a device), and the Vulkan build runs on lavapipe where a Vulkan driver is
installed (`apt-get install mesa-vulkan-drivers`; skipped otherwise)."""
import numpy as np
import pytest

import tercomp as tc
from conftest import run_filecheck
from tercomp import nn
from tercomp import ternary_pack as tp
from tercomp.runtime.devices import driver_present

K, N = 256, 96
needs_vulkan = pytest.mark.skipif(not driver_present("vulkan"),
                                  reason="no Vulkan driver (apt-get install mesa-vulkan-drivers)")
SPECS = {"static": tc.spec((1, K), "float32"), "symbolic": tc.spec(("B", K), "float32")}


@pytest.fixture
def no_iree(monkeypatch):
    """Fail the test if IREE's compiler is reached (the strategy must be refused first)."""
    import tercomp.build as compiler

    def boom(*a, **k):
        raise AssertionError("IREE was called")
    monkeypatch.setattr(compiler, "compile_vmfb", boom)


def _layer():
    nn.manual_seed(3)
    return nn.BitLinear(K, N)


def _reference(layer, x):
    t, scale = tp.absmean_ternarize(np.asarray(layer.weight))
    return tp.ternary_matmul_reference(x, tp.pack_ternary(t), K, scale, act_quant=True)


@pytest.mark.parametrize("batch", ["static", "symbolic"])
@pytest.mark.parametrize("target", ["vulkan", "cuda"])
def test_ternary_module_compiles_for_gpus(target, batch):
    exe = tc.compile(_layer(), SPECS[batch], target=target, weights="inline", cache=False)
    assert exe.targets == [target] and exe.vmfb_size > 0
    run_filecheck(exe.ir("ternary"), r"""
# CHECK: "tern.ternary_matmul"(%x, %{{.*}}) {{{.*}}strategy = "addsub"}
""")
    # nothing CPU-only reaches the GPU pipeline, and the weights stay one 2-bit constant
    run_filecheck(exe.ir("mlir"), r"""
# CHECK-NOT: iree_cpu
# CHECK:     arith.constant dense_resource<__elided__> : tensor<96x64xi8>
# CHECK-NOT: iree_cpu
# CHECK-NOT: arith.constant dense_resource
""")


@pytest.mark.parametrize("strategy", ["vnni", "blocked", "dispatch", "dispatch-vnni", "avx2"])
@pytest.mark.parametrize("target", ["vulkan", "cuda", ["llvm-cpu", "vulkan"]])
def test_cpu_only_strategy_for_a_gpu_fails_before_iree(no_iree, target, strategy):
    with pytest.raises(tc.TercompError, match=f"{strategy!r} does not compile for") as e:
        tc.compile(_layer(), SPECS["symbolic"], target=target, ternary=strategy, cache=False)
    assert "addsub" in e.value.hint


def test_cli_lists_the_strategy_table():
    from tercomp.cli import build_parser
    from tercomp.kernels.ternary.strategies import CHOICES
    compile_cmd = build_parser()._subparsers._group_actions[0].choices["compile"]
    ternary = next(a for a in compile_cmd._actions if a.dest == "ternary")
    assert tuple(ternary.choices) == CHOICES


def test_cpu_and_vulkan_artifact_gets_a_portable_kernel():
    exe = tc.compile(_layer(), SPECS["symbolic"], target=["llvm-cpu", "vulkan"], cache=False)
    run_filecheck(exe.ir("ternary"), r"""
# CHECK: "tern.ternary_matmul"(%x, %{{.*}}) {{{.*}}strategy = "addsub"}
""")
    x = np.random.default_rng(0).standard_normal((3, K)).astype(np.float32)
    np.testing.assert_allclose(exe(x), _reference(_layer(), x), rtol=1e-5, atol=1e-6)


@needs_vulkan
@pytest.mark.parametrize("batch", ["static", "symbolic"])
def test_vulkan_ternary_runs_on_lavapipe(batch):
    layer = _layer()
    exe = tc.compile(layer, SPECS[batch], target="vulkan", weights="inline", cache=False)
    assert exe.device == "vulkan"
    rng = np.random.default_rng(1)
    for b in ([1] if batch == "static" else [1, 7]):
        x = rng.standard_normal((b, K)).astype(np.float32)
        np.testing.assert_allclose(exe(x), _reference(layer, x), rtol=1e-5, atol=1e-6)


def test_the_lowering_reports_the_flags_of_its_kernels():
    """tc.compile takes the IREE flags of the ternary kernels from the lowering: each
    kernel's flags, in the strategy table's order (not the ops'), each kernel checked
    against the targets before IREE runs."""
    from tercomp.codegen.iree_session import new_session
    from tercomp.lowering import to_mlir
    from tercomp.kernels.ternary.strategies import flags_for, strategy_flags
    from tercomp.passes import run_pipeline

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            nn.manual_seed(3)
            self.a, self.b = nn.BitLinear(K, K), nn.BitLinear(K, N)

        def __call__(self, x):
            return self.b(self.a(x))

    g = run_pipeline(tc.trace(Two(), SPECS["symbolic"]),
                     [("ternary", {"strategy": "addsub", "targets": ["llvm-cpu"]})])
    first, second = [op for op in g.ops if op.opname == "ternary_matmul"]
    first.attrs["strategy"], second.attrs["strategy"] = "dispatch", "avx2"
    lowered = to_mlir(g, new_session()[1], targets=["llvm-cpu"])
    assert lowered.kernels == ["avx2", "dispatch"]
    assert lowered.flags == strategy_flags("avx2") + strategy_flags("dispatch") \
        == flags_for({"dispatch", "avx2"}, ["llvm-cpu"])
    with pytest.raises(tc.TercompError, match="'avx2' does not compile for vulkan"):
        to_mlir(g, new_session()[1], targets=["vulkan"])
    first.attrs["strategy"] = second.attrs["strategy"] = "addsub"
    assert to_mlir(g, new_session()[1], targets=["vulkan"]).flags == []


def test_compile_passes_the_kernels_flags_on():
    from tercomp.codegen.targets import target_flags
    from tercomp.kernels.ternary.strategies import strategy_flags
    exe = tc.compile(_layer(), SPECS["symbolic"], ternary="int8", weights="inline", cache=False)
    assert exe.meta["ternary"] == ["int8"]
    assert exe.meta["flags"] == target_flags("llvm-cpu") + strategy_flags("int8")
