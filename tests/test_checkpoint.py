"""tc.checkpoint: the same gradients as without it, fewer bytes kept for the backward
(exe.memory_report), and the scan of a checkpointed step keeps only its carries."""
import numpy as np
import pytest

import tercomp as tc
from conftest import run_filecheck

rng = np.random.default_rng(1)
H = 8


def step(W, h, x):
    a = tc.tanh(h @ W + x)
    b = tc.sigmoid(a * x)
    h = a * b + h * 0.5
    return h, tc.sum(h * h)


def make_loss(checkpointed):
    def loss(W, h0, xs):
        f = (lambda h, x: step(W, h, x))
        h, ys = tc.scan(tc.checkpoint(f) if checkpointed else f, h0, xs)
        return tc.sum(ys) + tc.sum(h)
    return loss


def args(dtype):
    return [(rng.standard_normal((H, H)) * 0.3).astype(dtype), rng.standard_normal(H).astype(dtype),
            rng.standard_normal((5, H)).astype(dtype)]


def test_checkpointed_scan_has_the_same_gradients():
    a = args(np.float64)
    want = tc.grad(make_loss(False), argnums=(0, 1, 2))(*a)
    got = tc.grad(make_loss(True), argnums=(0, 1, 2))(*a)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)


def test_checkpointed_scan_saves_only_the_carry():
    a = args(np.float32)
    reports = {}
    for ck in (False, True):
        exe = tc.compile(tc.grad(make_loss(ck), argnums=(0, 1, 2)), a[0], a[1], tc.spec(("T", H)))
        ref = tc.grad(make_loss(ck), argnums=(0, 1, 2))(*[x.astype(np.float64) for x in a])
        for w, g in zip(ref, exe(*a)):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
        reports[ck] = exe.memory_report(T=1024)
    assert [r["name"] for r in reports[True]["saved"]] == ["carry.saved_1"]
    assert reports[True]["saved_bytes"] == 1024 * H * 4                 # the stacked carries
    assert reports[False]["saved_bytes"] > 5 * reports[True]["saved_bytes"]
    assert exe.memory_report()["saved_bytes"] is None                    # T unbound


def test_checkpoint_outside_a_scan_recomputes_in_the_backward():
    W, h, x = args(np.float64)[0], rng.standard_normal(H), rng.standard_normal(H)
    f = lambda W, h, x: tc.sum(step(W, h, x)[0] ** 2)                    # noqa: E731
    g = lambda W, h, x: tc.sum(tc.checkpoint(lambda *a: step(*a)[0])(W, h, x) ** 2)   # noqa: E731
    for w, c in zip(tc.grad(f, argnums=(0, 1, 2))(W, h, x), tc.grad(g, argnums=(0, 1, 2))(W, h, x)):
        np.testing.assert_allclose(c, w, rtol=1e-12)
    text = str(tc.trace(tc.grad(g, argnums=(0, 1, 2)), W, h, x))
    # the forward runs inside the checkpoint body; the backward recomputes tanh outside it
    run_filecheck(text, r"""
# CHECK:     "tern.checkpoint"(%W, %h, %x) ({
# CHECK:       "tern.tanh"
# CHECK:       "tern.yield"
# CHECK:     })
# CHECK:     "tern.tanh"
# CHECK:     "func.return"
""")
