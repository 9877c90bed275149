"""Targets, devices, device-resident results and the compile cache.

Every target is compiled; CPU builds run and match NumPy; Vulkan and CUDA builds run
only where the device is present (Vulkan runs on Mesa's lavapipe, a CPU driver:
`apt-get install mesa-vulkan-drivers`).
"""
import os
import platform

import numpy as np
import pytest

import tercomp as tc
import box
import mlp as mlp_sample  # samples/ is on sys.path (tests/conftest.py)
from tercomp import nn
from tercomp.codegen import targets as T
from tercomp.runtime.devices import driver_present

HAS_VULKAN = driver_present("vulkan")
HAS_CUDA = driver_present("cuda")
needs_vulkan = pytest.mark.skipif(not HAS_VULKAN, reason="no Vulkan device (apt-get install mesa-vulkan-drivers)")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")

B = tc.spec(("B", 8), "float32")


def fn(x, y):
    return tc.tanh(x) * y + 1.0


def fn_ref(x, y):
    return np.tanh(x) * y + 1.0


def MLP():
    """The sample MLP, small."""
    return mlp_sample.MLP(8, 16, 4)


mlp_ref = mlp_sample.reference


@pytest.fixture(scope="module")
def xy():
    rng = np.random.default_rng(0)
    return rng.standard_normal((5, 8)).astype(np.float32), rng.standard_normal((5, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def mlp():
    nn.manual_seed(0)
    return MLP()


@pytest.fixture
def no_iree(monkeypatch):
    """Fail the test if IREE's compiler is reached (names must be checked before)."""
    import tercomp.build as compiler

    def boom(*a, **k):
        raise AssertionError("IREE was called")
    monkeypatch.setattr(compiler, "compile_vmfb", boom)


# -- flags ------------------------------------------------------------------------------

def test_flags_of_each_target():
    assert T.target_flags("llvm-cpu") == [
        "--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
        "--iree-llvmcpu-target-cpu=host"]
    assert T.target_flags("llvm-cpu-generic") == [
        "--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
        "--iree-llvmcpu-target-cpu=generic", "--iree-llvmcpu-target-triple=x86_64-unknown-linux-gnu"]
    assert T.target_flags("vulkan") == ["--iree-hal-target-device=vulkan",
                                        "--iree-vulkan-target=vp_android_baseline_2022"]
    assert T.target_flags("vulkan-spirv", vulkan_target="rdna3") == [
        "--iree-hal-target-device=vulkan", "--iree-vulkan-target=rdna3"]
    assert T.target_flags("cuda") == ["--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80"]
    assert T.target_flags("cuda", cuda_target="sm_86")[1] == "--iree-cuda-target=sm_86"


def test_several_targets_are_one_device_that_selects():
    flags = T.target_flags(["llvm-cpu", "vulkan", "cuda", "vulkan"])
    assert flags[:2] == ["--iree-hal-target-device=local,vulkan,cuda", T.UNLINKED]
    assert sum(f.startswith("--iree-hal-target-device") for f in flags) == 1
    assert "--iree-vulkan-target=vp_android_baseline_2022" in flags
    assert "--iree-cuda-target=sm_80" in flags


@pytest.mark.parametrize("target, options, match", [
    ("tpu", {}, "unknown target 'tpu'"),
    ("", {}, "unknown target ''"),
    ([], {}, "target must be a name or a list"),
    (3, {}, "target must be a name or a list"),
    (["llvm-cpu", "llvm-cpu-generic"], {}, "cannot share one artifact"),
    ("vulkan", {"vulkan_target": "bogus"}, "unknown Vulkan target 'bogus'"),
    ("vulkan", {"vulkan_target": "h100"}, "unknown Vulkan target"),
    ("cuda", {"cuda_target": "sm_90"}, "IREE 3.13 cannot build CUDA code for sm_90"),
    ("cuda", {"cuda_target": "hopper"}, "cannot build CUDA code"),
    ("cuda", {"cuda_target": "sm_bogus"}, "unknown CUDA target"),
    ("llvm-cpu", {"vulkan_target": "rdna3"}, "add 'vulkan' to target="),
    ("vulkan", {"cuda_target": "sm_80"}, "add 'cuda' to target="),
])
def test_bad_targets_fail_before_iree(no_iree, target, options, match):
    # Each of these names crashes the interpreter or fails obscurely inside IREE.
    with pytest.raises(tc.TercompError, match=match):
        tc.compile(fn, B, B, target=target, **options)


@pytest.mark.parametrize("flag", ["--iree-hal-target-device=bogus", "--iree-vulkan-target=bogus",
                                  "--iree-llvmcpu-target-cpu=bogus", "--iree-hal-target-backends=x",
                                  "--iree-vulkan-target-features=bogus", "not-a-flag"])
def test_extra_flags_cannot_pick_targets(no_iree, flag):
    with pytest.raises(tc.TercompError):
        tc.compile(fn, B, B, flags=[flag])


# -- compile and run every target --------------------------------------------------------

def test_llvm_cpu_runs_and_matches_numpy(xy, mlp):
    exe = tc.compile(fn, B, B)
    assert exe.targets == ["llvm-cpu"] and exe.device == "local-task"
    np.testing.assert_allclose(exe(*xy), fn_ref(*xy), rtol=1e-5, atol=1e-6)
    m = tc.compile(mlp, B)
    for batch in (1, 5):
        np.testing.assert_allclose(m(xy[0][:batch]), mlp_ref(mlp, xy[0][:batch]), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="generic is x86-64 code")
def test_llvm_cpu_generic_runs_and_matches_numpy(xy, mlp):
    exe = tc.compile(mlp, B, target="llvm-cpu-generic")
    assert "--iree-llvmcpu-target-cpu=generic" in exe.meta["flags"]
    np.testing.assert_allclose(exe(xy[0]), mlp_ref(mlp, xy[0]), rtol=1e-5, atol=1e-5)


def test_vulkan_and_cuda_builds(mlp):
    vk = tc.compile(mlp, B, target="vulkan")
    assert vk.targets == ["vulkan"] and vk.vmfb_size > 0
    cu = tc.compile(mlp, B, target="cuda", cuda_target="ampere")
    assert cu.targets == ["cuda"] and "--iree-cuda-target=ampere" in cu.meta["flags"]
    assert vk.device == ("vulkan" if HAS_VULKAN else None)
    assert cu.device == ("cuda" if HAS_CUDA else None)


@needs_vulkan
def test_vulkan_runs_and_matches_numpy(xy, mlp):
    exe = tc.compile(mlp, B, target="vulkan")
    np.testing.assert_allclose(exe(xy[0]), mlp_ref(mlp, xy[0]), rtol=1e-5, atol=1e-5)
    ints = tc.compile(lambda a, b: a * b - a, tc.spec(("B", 16), "int32"), tc.spec(("B", 16), "int32"),
                      target="vulkan")
    a = np.arange(-32, 32, dtype=np.int32).reshape(4, 16)
    np.testing.assert_array_equal(ints(a, a[::-1]), a * a[::-1] - a)


@needs_vulkan
def test_a_gpu_device_is_shared_and_closes_with_its_last_module(xy):
    # iree.runtime's get_device keeps a device for the life of the process, and an open
    # lavapipe device polls from two threads: a process that once ran on Vulkan burned two
    # cores while idle. tercomp's modules share the device and close it with the last one.
    import gc
    from tercomp.runtime import devices
    tasks = lambda: len(os.listdir("/proc/self/task"))
    gc.collect()
    before = tasks()
    a = tc.compile(fn, B, B, target="vulkan")
    b = tc.compile(lambda x, y: x - y, B, B, target="vulkan")
    np.testing.assert_allclose(b(a(*xy), xy[1]), fn_ref(*xy) - xy[1], rtol=1e-5, atol=1e-5)
    assert a._held is b._held and devices._held.get("vulkan") is a._held
    assert tasks() > before                   # the driver's threads
    del a, b
    gc.collect()
    assert "vulkan" not in devices._held
    assert tasks() <= before
    again = tc.compile(fn, B, B, target="vulkan")
    np.testing.assert_allclose(again(*xy), fn_ref(*xy), rtol=1e-5, atol=1e-5)


@needs_cuda
def test_cuda_runs_and_matches_numpy(xy, mlp):
    exe = tc.compile(mlp, B, target="cuda")
    np.testing.assert_allclose(exe(xy[0]), mlp_ref(mlp, xy[0]), rtol=1e-4, atol=1e-4)


def test_one_artifact_for_cpu_and_vulkan(xy, mlp):
    exe = tc.compile(mlp, B, target=["llvm-cpu", "vulkan"])
    assert exe.targets == ["llvm-cpu", "vulkan"] and exe.device == "local-task"
    devices = ["local-task", "local-sync"] + (["vulkan"] if HAS_VULKAN else [])
    for device in devices:
        out = _on(exe, device)
        np.testing.assert_allclose(out(xy[0]), mlp_ref(mlp, xy[0]), rtol=1e-5, atol=1e-5)


def _on(exe, device):
    return tc.CompiledModule(exe.vmfb, exe.signature, device=device, targets=exe.targets, meta=exe.meta)


# -- devices ----------------------------------------------------------------------------

def test_missing_device_names_the_available_drivers(xy, no_iree):
    with pytest.raises(tc.DeviceUnavailable, match="unknown device 'tpu'") as e:
        tc.compile(fn, B, B, device="tpu")
    assert "local-task" in str(e.value)
    with pytest.raises(tc.DeviceUnavailable, match="does not run on cuda"):
        tc.compile(fn, B, B, device="cuda")
    with pytest.raises(tc.DeviceUnavailable, match="threads= applies to the local-task"):
        tc.compile(fn, B, B, device="local-sync", threads=2)
    with pytest.raises(tc.DeviceUnavailable, match="threads= applies to the local-task"):
        tc.compile(fn, B, B, target="cuda", threads=2)
    with pytest.raises(tc.DeviceUnavailable, match="unknown option"):
        tc.compile(fn, B, B, device="local-task?cores=2")


@pytest.mark.skipif(HAS_CUDA, reason="a CUDA device is present")
def test_cuda_module_without_a_cuda_device(xy):
    exe = tc.compile(fn, B, B, target="cuda")
    assert exe.device is None
    with pytest.raises(tc.DeviceUnavailable, match="needs cuda") as e:
        exe(*xy)
    assert "available drivers: local-task" in str(e.value)


def test_local_sync_device(xy):
    exe = tc.compile(fn, B, B, device="local-sync")
    np.testing.assert_allclose(exe(*xy), fn_ref(*xy), rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_threads_size_the_local_task_pool(tmp_path):
    # The pool is sized once per process, so each count runs in a process of its own.
    script = (
        "import os, sys, numpy as np, tercomp as tc\n"
        "n = lambda: len(os.listdir('/proc/self/task'))\n"
        "exe = tc.compile(lambda x: tc.exp(x), tc.spec((4,)), device=sys.argv[1], "
        "threads=int(sys.argv[2]) if len(sys.argv) > 2 else None)\n"
        "before = n(); exe(np.zeros(4, np.float32)); print(n() - before)\n"
        "try:\n    tc.compile(lambda x: tc.exp(x), tc.spec((4,)), threads=7)(np.zeros(4, np.float32))\n"
        "except tc.TercompError as e:\n    print('refused' if 'once per process' in str(e) else e)\n")
    counts = {}
    for args in (["local-task", "1"], ["local-task?threads=3"]):
        # a fork of a process that imported tercomp and made no device (tests/box.py)
        rc, out = box.run(script, *args, env={"TERCOMP_CACHE_DIR": tmp_path}, timeout=120)
        assert rc == 0, out
        lines = out.split()
        counts[args[-1]] = int(lines[0])
        assert lines[1] == "refused"
    # one worker per thread, plus one device thread
    assert counts["1"] == 2 and counts["local-task?threads=3"] == 4


# -- results that stay on the device -----------------------------------------------------

@pytest.mark.parametrize("device", ["local-task", pytest.param("vulkan", marks=needs_vulkan)])
def test_keep_on_device_round_trip(xy, device):
    target = "vulkan" if device == "vulkan" else "llvm-cpu"
    exe = tc.compile(fn, B, B, target=target, device=device)
    x, y = xy
    h = exe(x, y, keep_on_device=True)
    assert isinstance(h, tc.DeviceArray) and h.shape == (5, 8) and h.dtype == np.float32
    assert h.device == device
    np.testing.assert_allclose(np.asarray(h), fn_ref(x, y), rtol=1e-5, atol=1e-6)
    h2 = exe(h, y, keep_on_device=True)                 # device array back in
    np.testing.assert_allclose(h2.to_host(), fn_ref(fn_ref(x, y), y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(exe(h2, h), fn_ref(fn_ref(fn_ref(x, y), y), fn_ref(x, y)),
                               rtol=1e-5, atol=1e-5)
    other = tc.compile(fn, B, B, device="local-sync")   # another device: copied, still right
    np.testing.assert_allclose(other(h, y), fn_ref(fn_ref(x, y), y), rtol=1e-5, atol=1e-6)
    with pytest.raises(tc.InputError, match=r"dim 0 \(B\) is 2 but B = 5"):
        exe(h, y[:2])


def test_wrong_inputs_are_checked_before_iree(xy):
    exe = tc.compile(fn, B, B)
    x, y = xy
    with pytest.raises(tc.InputError, match="takes 2 arguments, got 1"):
        exe(x)
    with pytest.raises(tc.InputError, match="expected dtype f32, got f64"):
        exe(x.astype(np.float64), y)
    with pytest.raises(tc.InputError, match="dim 1 must be 8"):
        exe(x[:, :4], y[:, :4])
    with pytest.raises(tc.InputError, match="B"):
        exe(x, y[:3])


# -- compile cache ----------------------------------------------------------------------

def test_compile_cache_hit_skips_iree(tmp_path, monkeypatch, xy):
    monkeypatch.setenv("TERCOMP_CACHE_DIR", str(tmp_path))
    first = tc.compile(fn, B, B)
    assert first.meta["cache_hit"] is False
    assert os.listdir(tmp_path) == [first.meta["cache_key"] + ".tcm"]     # no temp files left
    import tercomp.build as compiler
    monkeypatch.setattr(compiler, "compile_vmfb", lambda *a, **k: pytest.fail("IREE ran"))
    second = tc.compile(fn, B, B)
    assert second.meta["cache_hit"] is True and second.vmfb == first.vmfb
    np.testing.assert_allclose(second(*xy), fn_ref(*xy), rtol=1e-5, atol=1e-6)


def test_compile_cache_key_and_opt_out(tmp_path, monkeypatch):
    monkeypatch.setenv("TERCOMP_CACHE_DIR", str(tmp_path))
    a = tc.compile(fn, B, B)
    b = tc.compile(fn, B, B, flags=["--iree-opt-level=O1"])                 # other flags
    c = tc.compile(lambda x, y: tc.tanh(x) * y + 2.0, B, B)                 # other constant
    assert len({a.meta["cache_key"], b.meta["cache_key"], c.meta["cache_key"]}) == 3
    assert not b.meta["cache_hit"] and not c.meta["cache_hit"]
    n = len(os.listdir(tmp_path))
    d = tc.compile(fn, B, B, cache=False)
    assert d.meta["cache_hit"] is False and "cache_key" not in d.meta
    assert len(os.listdir(tmp_path)) == n


def test_compile_cache_damaged_entry_is_a_miss(tmp_path, monkeypatch, xy):
    monkeypatch.setenv("TERCOMP_CACHE_DIR", str(tmp_path))
    first = tc.compile(fn, B, B)
    path = tmp_path / (first.meta["cache_key"] + ".tcm")
    path.write_bytes(path.read_bytes()[:100])
    again = tc.compile(fn, B, B)
    assert again.meta["cache_hit"] is False
    np.testing.assert_allclose(again(*xy), fn_ref(*xy), rtol=1e-5, atol=1e-6)
    assert tc.compile(fn, B, B).meta["cache_hit"] is True                   # rewritten
