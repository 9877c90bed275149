"""Both ways of handing a module to IREE, in this process and in an iree-compile
subprocess (`isolate=True`, extra `flags=`, GPU targets by default), give the same
results for every kind of module: a gradient, a training step, a scan and its
gradient, and the LM generation step. A crash of IREE is a CompileError naming the
stage, never a dead interpreter."""
import numpy as np
import pytest

import tercomp as tc
from tercomp import models, nn
from tercomp.codegen import iree_session, targets as T
from tercomp.codegen.iree_session import compile_source

RNG = np.random.default_rng(7)
W = RNG.standard_normal((4, 3)).astype(np.float32)
X = RNG.standard_normal((2, 4)).astype(np.float32)


def both(compile_fn):
    """(in-process, subprocess) results of compile_fn(isolate) called by `run`."""
    return compile_fn(False), compile_fn(True)


def test_gradient_compiles_both_ways_alike():
    """The case of the issue: IREE crashed on the subprocess path (the module went as
    bytecode, whose matmul kept the builders' empty indexing maps)."""
    f = tc.grad(lambda w, x: tc.mean(x @ w))
    a, b = both(lambda iso: tc.compile(f, W, X, isolate=iso, cache=False)(W, X))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, np.broadcast_to(X.mean(0)[:, None] / 3, W.shape) * 1.0,
                               rtol=1e-6)


def test_extra_flags_take_the_subprocess_path_for_gradients():
    f = tc.grad(lambda w, x: tc.sum(tc.tanh(x @ w)))
    a = tc.compile(f, W, X, cache=False)(W, X)
    b = tc.compile(f, W, X, cache=False, flags=["--iree-opt-level=O2"])(W, X)
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


class Net(nn.Module):
    def __init__(self):
        self.fc = nn.BitLinear(8, 4)

    def forward(self, x):
        return self.fc(x)


def _loss(model, x, y):
    return tc.cross_entropy(model(x), y)


def test_training_step_compiles_both_ways_alike():
    x = RNG.standard_normal((6, 8)).astype(np.float32)
    y = RNG.integers(0, 4, 6).astype(np.int32)

    def run(isolate):
        net = Net()
        net.fc.weight = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
        step = tc.compile_train_step(_loss, net, tc.optim.AdamW(1e-2), x, y, clip_norm=1.0,
                                     isolate=isolate, cache=False)
        losses = [float(step(x, y)) for _ in range(3)]
        return losses, step.params()["fc.weight"]
    (la, wa), (lb, wb) = both(run)
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_array_equal(wa, wb)
    assert la[2] < la[0]


def _scan_loss(h0, xs):
    def step(h, x):
        h = tc.tanh(h * 0.5 + x)
        return h, tc.sum(h * h)
    h, ys = tc.scan(step, h0, xs)
    return tc.sum(ys) + tc.sum(h)


def test_scan_and_its_gradient_compile_both_ways_alike():
    h0 = RNG.standard_normal(3).astype(np.float32)
    xs = RNG.standard_normal((5, 3)).astype(np.float32)
    for fn in (_scan_loss, tc.grad(_scan_loss, argnums=(0, 1))):
        a, b = both(lambda iso: tc.compile(fn, h0, xs, isolate=iso, cache=False)(h0, xs))
        for u, v in zip(np.atleast_1d(a) if not isinstance(a, tuple) else a,
                        np.atleast_1d(b) if not isinstance(b, tuple) else b):
            np.testing.assert_array_equal(u, v)


@pytest.fixture(scope="module")
def tiny_lm():
    cfg = models.BitNetConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    return models.BitNetLM(cfg)


@pytest.mark.slow     # test_training_step_compiles_both_ways_alike checks the same, faster
def test_generation_compiles_both_ways_alike(tiny_lm):
    ids = np.array([1, 5, 9, 3], np.int32)

    def run(isolate):
        gen = tc.compile_lm(tiny_lm, max_seq=16, isolate=isolate, cache=False)
        return gen.prefill(ids), gen.generate(ids, max_new_tokens=4)
    (pa, ta), (pb, tb) = both(run)
    np.testing.assert_array_equal(pa, pb)
    np.testing.assert_array_equal(ta, tb)


# -- crashes ---------------------------------------------------------------------------------
def _bytecode_of_a_gradient() -> bytes:
    """A module that crashes iree-compile (SIGSEGV in MatmulTransposeAOp): a gradient's
    matmul, written as bytecode, as the subprocess path used to."""
    import io
    from tercomp.lowering import to_mlir
    from tercomp.codegen.iree_session import new_session
    graph = tc.trace(tc.grad(lambda w, x: tc.mean(x @ w)), W, X)
    _, ctx = new_session()
    module = to_mlir(graph, ctx).module
    buf = io.BytesIO()
    with ctx:
        module.operation.write_bytecode(buf)
    return buf.getvalue()


def test_a_crash_of_iree_is_a_compile_error_naming_the_stage():
    with pytest.raises(tc.CompileError, match=r"(?s)IREE crashed \(SIG\w+\) during the test stage.*"
                                              r"Stack dump"):
        compile_source(_bytecode_of_a_gradient(), T.target_flags("llvm-cpu"), stage="the test stage")


def test_gpu_targets_compile_in_a_subprocess_by_default(monkeypatch):
    """A crash class remains in IREE's GPU backends (compile_lm for cuda crashed the
    interpreter until the attention's GQA maps changed), so GPU compiles are isolated
    unless isolate=False."""
    assert not T.needs_isolation(["llvm-cpu"], T.target_flags("llvm-cpu"))
    assert T.needs_isolation(["cuda"], T.target_flags("cuda"))
    assert T.needs_isolation(["vulkan"], T.target_flags("vulkan"))
    assert not T.needs_isolation(["vulkan"], T.target_flags("vulkan"), isolate=False)
    assert T.needs_isolation(["llvm-cpu"], [], user_flags=["--iree-opt-level=O2"], isolate=False)
    seen = []
    real = iree_session.compile_source

    def spy(source, flags, stage="", timeout=3600):
        seen.append(stage)
        return real(source, flags, stage, timeout)
    monkeypatch.setattr(iree_session, "compile_source", spy)
    tc.compile(lambda x: tc.tanh(x), X, target="cuda", cache=False)
    assert seen == ["the IREE compile for cuda"]
    tc.compile(lambda x: tc.tanh(x), X, cache=False)
    assert len(seen) == 1


def test_iree_reverifies_after_each_pass_only_when_asked(monkeypatch):
    """IREE's verification of the whole module after each of its passes is off (the
    module is verified once, when parsed), on both paths, unless TERCOMP_VERIFY_IR=1;
    results are the same either way."""
    assert hasattr(iree_session._capi._dylib, "ireeCompilerInvocationSetVerifyIR"), \
        "this IREE cannot turn the per-pass verifier off in process (compiles get ~25% slower)"
    runs = []
    real_run = iree_session.subprocess.run

    def spy(cmd, **kw):
        runs.append(cmd)
        return real_run(cmd, **kw)
    monkeypatch.setattr(iree_session.subprocess, "run", spy)
    f = tc.grad(lambda w, x: tc.sum(tc.tanh(x @ w)))
    results = []
    for env in ("", "1"):
        monkeypatch.setenv("TERCOMP_VERIFY_IR", env)
        assert iree_session.verify_each_pass() == (env == "1")
        results += [tc.compile(f, W, X, cache=False, isolate=iso)(W, X) for iso in (False, True)]
    assert ["--verify=false" in cmd for cmd in runs] == [True, False]
    for r in results[1:]:
        np.testing.assert_array_equal(results[0], r)
