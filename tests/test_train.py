"""tc.optim and tc.compile_train_step against NumPy references; errors; checkpoints; the
digits sample end to end."""
import math
import os
import sys
import warnings

import numpy as np
import pytest

import tercomp as tc
from tercomp import nn
from tercomp.training.packing import Packing

from conftest import run_filecheck

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "samples"))

N, IN, OUT = 16, 5, 3


# -- a model whose gradients are easy to write in NumPy ---------------------------------
class Affine(nn.Module):
    def __init__(self):
        self.lin = nn.Linear(IN, OUT)

    def forward(self, x):
        return self.lin(x)


def mse(model, x, t):
    r = model(x) - t
    return tc.mean(r * r)


def log_mse(model, x, t):
    # Not linear in the per-example terms: the mean of micro-batch gradients differs
    # from the whole-batch gradient, so accumulation is really checked.
    r = model(x) - t
    return tc.log(tc.mean(r * r))


def np_grads(p, x, t, log=False):
    """(loss, grads) in float64 of mse / log_mse for params {lin.weight, lin.bias}."""
    w, b = p["lin.weight"].astype(np.float64), p["lin.bias"].astype(np.float64)
    r = x @ w.T + b - t
    m = np.mean(r * r)
    d = 2 * r / r.size
    if log:
        d, m = d / m, np.log(m)
    return m, {"lin.weight": d.T @ x, "lin.bias": d.sum(0)}


def make(seed=0):
    nn.manual_seed(seed)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, IN)).astype(np.float32)
    t = rng.standard_normal((N, OUT)).astype(np.float32)
    return Affine(), x, t


def assert_tree_close(got, want, rtol=1e-5, atol=1e-7):
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k], np.float64), want[k], rtol=rtol, atol=atol,
                                   err_msg=f"parameter {k}")


# -- NumPy reference optimizers ---------------------------------------------------------
def np_cosine(t, peak, total, warmup, final=0.0):
    if t < warmup:
        return peak * (t + 1) / warmup
    u = min(1.0, (t - warmup) / (total - warmup))
    return final + (peak - final) * 0.5 * (1 + math.cos(math.pi * u))


def np_adamw(p, grads_fn, steps, lr_fn, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
    p = {k: v.astype(np.float64) for k, v in p.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t in range(1, steps + 1):
        lr = lr_fn(t - 1)
        g = grads_fn(p)
        for k in p:
            p[k] = p[k] * (1 - lr * wd)
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            mhat, vhat = m[k] / (1 - b1 ** t), v[k] / (1 - b2 ** t)
            p[k] = p[k] - lr * mhat / (np.sqrt(vhat) + eps)
    return p, m, v


def np_sgd(p, grads_fn, steps, lr, momentum=0.0, nesterov=False, wd=0.0):
    p = {k: v.astype(np.float64) for k, v in p.items()}
    buf = {k: np.zeros_like(v) for k, v in p.items()}
    for _ in range(steps):
        g = grads_fn(p)
        for k in p:
            gk = g[k] + wd * p[k]
            if momentum:
                buf[k] = momentum * buf[k] + gk
                gk = gk + momentum * buf[k] if nesterov else buf[k]
            p[k] = p[k] - lr * gk
    return p


# -- optimizer steps, compiled, against NumPy ---------------------------------------------
def test_adamw_compiled_step_matches_numpy():
    model, x, t = make(1)
    p0 = model.state_dict()
    sched = tc.optim.cosine(0.05, total_steps=6, warmup_steps=2, final_lr=0.001)
    opt = tc.optim.AdamW(lr=sched, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    step = tc.compile_train_step(mse, model, opt, x, t)
    losses = [step(x, t) for _ in range(4)]
    want, m, v = np_adamw(p0, lambda p: np_grads(p, x, t)[1], 4,
                          lambda s: np_cosine(s, 0.05, 6, 2, 0.001), wd=0.1)
    assert_tree_close(step.params(), want)
    state = step.opt_state()
    assert float(state["step"]) == 4.0 and np.shape(state["step"]) == ()
    assert_tree_close(state["mu"], m, atol=1e-6)
    assert_tree_close(state["nu"], v, atol=1e-7)
    assert losses[0] == pytest.approx(np_grads(p0, x, t)[0], rel=1e-5)
    assert losses[-1] < losses[0]
    # The model itself is untouched until sync_to.
    assert_tree_close(model.state_dict(), {k: v.astype(np.float64) for k, v in p0.items()}, atol=0)
    step.sync_to(model)
    assert_tree_close(model.state_dict(), want)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_compiled_step_matches_numpy(nesterov):
    model, x, t = make(2)
    p0 = model.state_dict()
    opt = tc.optim.SGD(lr=0.1, momentum=0.9, nesterov=nesterov, weight_decay=0.01)
    step = tc.compile_train_step(mse, model, opt, x, t)
    for _ in range(3):
        step(x, t)
    want = np_sgd(p0, lambda p: np_grads(p, x, t)[1], 3, 0.1, 0.9, nesterov, 0.01)
    assert_tree_close(step.params(), want)


def test_clip_norm_compiled_matches_numpy():
    model, x, t = make(3)
    p0 = model.state_dict()
    step = tc.compile_train_step(mse, model, tc.optim.SGD(lr=0.5), x, t, clip_norm=0.1)
    step(x, t)
    _, g = np_grads(p0, x, t)
    norm = math.sqrt(sum(float(np.sum(v * v)) for v in g.values()))
    assert norm > 0.1                                  # the clip is active
    assert step.grad_norm == pytest.approx(norm, rel=1e-5)
    want = {k: p0[k] - 0.5 * g[k] * (0.1 / norm) for k in p0}
    assert_tree_close(step.params(), want)


def test_clip_by_global_norm_eager():
    rng = np.random.default_rng(0)
    g = {"a": rng.standard_normal((3, 4)).astype(np.float32),
         "b": [rng.standard_normal(5).astype(np.float32)]}
    norm = math.sqrt(float(np.sum(g["a"].astype(np.float64) ** 2) + np.sum(g["b"][0].astype(np.float64) ** 2)))
    clipped, got_norm = tc.optim.clip_by_global_norm(g, 1.0)
    assert float(got_norm) == pytest.approx(norm, rel=1e-6)
    np.testing.assert_allclose(clipped["a"], g["a"] / norm, rtol=1e-5)
    np.testing.assert_allclose(clipped["b"][0], g["b"][0] / norm, rtol=1e-5)
    same, _ = tc.optim.clip_by_global_norm(g, 10 * norm)      # under the limit: unchanged
    np.testing.assert_allclose(same["a"], g["a"], rtol=1e-6)


def test_accumulate_compiled_matches_numpy():
    model, x, t = make(4)
    p0 = model.state_dict()
    k = 4
    step = tc.compile_train_step(log_mse, model, tc.optim.SGD(lr=0.1), x, t, accumulate=k)
    loss = step(x, t)
    m = N // k
    parts = [np_grads(p0, x[i * m:(i + 1) * m], t[i * m:(i + 1) * m], log=True) for i in range(k)]
    g = {key: sum(pg[key] for _, pg in parts) / k for key in p0}
    assert loss == pytest.approx(sum(lv for lv, _ in parts) / k, rel=1e-5)
    # Not the whole-batch gradient: accumulation really split the batch.
    full = np_grads(p0, x, t, log=True)[1]
    assert not np.allclose(full["lin.bias"], g["lin.bias"], rtol=1e-3)
    assert_tree_close(step.params(), {key: p0[key] - 0.1 * g[key] for key in p0})


class _Mlp(nn.Module):
    def __init__(self):
        self.a, self.b = nn.Linear(IN, 64), nn.Linear(64, OUT)

    def forward(self, x):
        return self.b(tc.relu(self.a(x)))


def test_step_keeps_its_transient_storage(monkeypatch):
    """A static-shape step on CPU takes IREE's transient buffers from one storage the
    module allocated once (lowering.lower_graph's `transients`): calls that reuse it give
    the numbers of a step that takes them from the device's pool, bit for bit."""
    from tercomp.training import compile as train_compile

    def steps(own):
        monkeypatch.setattr(train_compile, "_own_transients", lambda graph, opts: own)
        nn.manual_seed(7)
        rng = np.random.default_rng(7)
        x = rng.standard_normal((32, IN)).astype(np.float32)
        t = rng.standard_normal((32, OUT)).astype(np.float32)
        step = tc.compile_train_step(mse, _Mlp(), tc.optim.AdamW(1e-2), x, t)
        losses = [step(x, t) for _ in range(3)]
        return step, losses, step.params()

    kept, losses, params = steps(True)
    pooled, want_losses, want = steps(False)
    assert "iree.abi.transients" in kept.exe.ir("mlir")
    assert "iree.abi.transients" not in pooled.exe.ir("mlir")
    storage, refl = kept.exe._transients, kept.exe._fn.vm_function.reflection
    assert storage is not None and pooled.exe._transients is None
    assert int(refl["iree.abi.transients.size.constant"]) > 32 * 64 * 4   # the hidden layer, at least
    assert losses == want_losses and losses[-1] < losses[0]
    for k in want:
        np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(want[k]), err_msg=k)


def test_symbolic_batch_step_grows_its_transient_storage():
    """With a symbolic batch IREE's size query tells the transient bytes of each batch
    size: the storage grows for a larger batch, is kept for a smaller one, and every
    call trains as the NumPy reference does."""
    model, x, t = make(8)
    step = tc.compile_train_step(mse, model, tc.optim.SGD(lr=0.1), tc.spec(("B", IN)),
                                 tc.spec(("B", OUT)))
    assert "iree.abi.transients" in step.exe.ir("mlir")
    p = {k: v.astype(np.float64) for k, v in model.state_dict().items()}
    sizes = []
    for n in (4, 16, 8):
        step(x[:n], t[:n])
        _, g = np_grads(p, x[:n], t[:n])
        p = {k: p[k] - 0.1 * g[k] for k in p}
        sizes.append(step.exe._transients.size)
    assert_tree_close(step.params(), p)
    assert sizes[0] < sizes[1] == sizes[2], sizes
    asked = sorted(step.exe._transients.sizes.values())      # one query per batch size
    assert len(asked) == 3 and asked[-1] == sizes[1] and asked[0] < asked[1] < asked[2]


def test_cosine_schedule_eager_and_traced():
    sched = tc.optim.cosine(1.0, total_steps=20, warmup_steps=5, final_lr=0.1)
    steps = np.arange(0, 25, dtype=np.float32)
    want = np.array([np_cosine(s, 1.0, 20, 5, 0.1) for s in range(25)])
    eager = np.array([float(sched(np.float32(s))) for s in range(25)])
    np.testing.assert_allclose(eager, want, rtol=1e-6, atol=1e-7)
    exe = tc.compile(lambda s: sched(s), steps)
    np.testing.assert_allclose(exe(steps), want, rtol=1e-6, atol=1e-7)
    assert tc.optim.constant(0.3)(7.0) == 0.3


def test_metrics_and_device_resident_state():
    from tercomp.runtime.module import DeviceArray
    model, x, t = make(5)

    def loss_with_metrics(m, x, t):
        loss = mse(m, x, t)
        return loss, {"twice": loss * 2.0}

    step = tc.compile_train_step(loss_with_metrics, model, tc.optim.AdamW(1e-2), x, t)
    copied = []
    orig = DeviceArray.to_host
    DeviceArray.to_host = lambda self: (copied.append(self.shape), orig(self))[1]
    try:
        loss, metrics = step(x, t)
        passed_in = [type(v) for v in step._params.values()]
        loss2, _ = step(x, t)
    finally:
        DeviceArray.to_host = orig
    assert isinstance(loss, float) and metrics["twice"] == pytest.approx(2 * loss, rel=1e-6)
    assert loss2 < loss
    # The second call got the first call's device arrays, and nothing but scalars (loss,
    # grad norm, metrics) crossed to the host.
    assert passed_in == [DeviceArray] * len(passed_in)
    assert copied and all(s == () for s in copied), copied


# -- errors ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_step():
    model, x, t = make(6)
    return tc.compile_train_step(mse, model, tc.optim.SGD(lr=0.1), x, t), x, t


def test_wrong_batch_raises_before_iree(small_step):
    step, x, t = small_step
    with pytest.raises(tc.TercompError, match="shape"):
        step(x[:, :4], t)
    with pytest.raises(tc.TercompError, match="dtype"):
        step(x.astype(np.float64), t)
    with pytest.raises(tc.TercompError, match="2 arrays"):
        step(x)
    assert step.steps == 0


@pytest.mark.parametrize("lr", ["0.1", None, [0.1], float("nan"), -1.0, True])
def test_non_numeric_lr_raises(lr):
    with pytest.raises(tc.TercompError, match="lr|learning rate"):
        tc.optim.SGD(lr=lr)
    with pytest.raises(tc.TercompError, match="lr|learning rate"):
        tc.optim.AdamW(lr=lr)


def test_bad_hyper_parameters_raise():
    with pytest.raises(tc.TercompError, match="momentum"):
        tc.optim.SGD(0.1, momentum="0.9")
    with pytest.raises(tc.TercompError, match="nesterov"):
        tc.optim.SGD(0.1, nesterov=True)
    with pytest.raises(tc.TercompError, match="betas"):
        tc.optim.AdamW(1e-3, betas=("a", 0.99))
    with pytest.raises(tc.TercompError, match="eps"):
        tc.optim.AdamW(1e-3, eps=0.0)
    with pytest.raises(tc.TercompError, match="total_steps"):
        tc.optim.cosine(1e-3, total_steps="100")
    model, x, t = make(0)
    with pytest.raises(tc.TercompError, match="on_nan"):
        tc.compile_train_step(mse, model, tc.optim.SGD(0.1), x, t, on_nan="ignore")
    with pytest.raises(tc.TercompError, match="accumulate"):
        tc.compile_train_step(mse, model, tc.optim.SGD(0.1), x, t, accumulate=0)
    with pytest.raises(tc.TercompError, match="divisible"):
        tc.compile_train_step(mse, model, tc.optim.SGD(0.1), x, t, accumulate=3)


@pytest.mark.parametrize("on_nan", ["raise", "stop"])
def test_nan_loss(on_nan):
    model, x, t = make(7)
    step = tc.compile_train_step(mse, model, tc.optim.SGD(lr=0.1), x, t, on_nan=on_nan)
    step(x, t)
    before = step.params()
    bad = x.copy()
    bad[3, 1] = np.nan
    if on_nan == "raise":
        with pytest.raises(tc.TercompError, match="NaN|nan"):
            step(bad, t)
        assert not step.stopped
    else:
        with pytest.warns(RuntimeWarning, match="stopped"):
            loss = step(bad, t)
        assert math.isnan(loss) and step.stopped
        assert math.isnan(step(x, t))              # later calls do not run
    # The non-finite update was skipped inside the compiled step.
    assert_tree_close(step.params(), {k: v.astype(np.float64) for k, v in before.items()}, atol=0)
    assert step.steps == 1


# -- checkpoints -----------------------------------------------------------------------
def test_checkpoint_round_trip(tmp_path):
    model, x, t = make(8)
    opt = tc.optim.AdamW(lr=1e-2)
    step = tc.compile_train_step(mse, model, opt, x, t)
    step(x, t), step(x, t)
    path = str(tmp_path / "ckpt.safetensors")
    tc.save_checkpoint(path, step)

    fresh, _, _ = make(9)
    opt_state = tc.load_checkpoint(path, fresh)
    assert_tree_close(fresh.state_dict(), {k: v.astype(np.float64) for k, v in step.params().items()}, atol=0)
    assert float(opt_state["step"]) == 2.0
    # Resuming from the checkpoint continues exactly where the first run was.
    resumed = tc.compile_train_step(mse, fresh, opt, x, t, opt_state=opt_state)
    step(x, t), resumed(x, t)
    assert_tree_close(resumed.params(), {k: v.astype(np.float64) for k, v in step.params().items()}, atol=0)

    tc.save_checkpoint(path, model)                     # a module without optimizer state
    assert tc.load_checkpoint(path, fresh) is None
    with pytest.raises(tc.TercompError, match="no such file"):
        tc.load_checkpoint(str(tmp_path / "missing.safetensors"), fresh)
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(tc.TercompError):
        tc.load_checkpoint(str(tmp_path / "junk.safetensors"), fresh)
    with pytest.raises(tc.TercompError, match="shape|missing"):
        tc.load_checkpoint(path, nn.Linear(2, 2))


# -- the digits sample -----------------------------------------------------------------
def test_digits_sample_reaches_93_percent():
    import train_digits
    acc = train_digits.main(["--epochs", "12", "--hidden", "128", "--quiet"])
    assert acc >= 0.93, acc


@pytest.mark.slow
def test_digits_sample_long(tmp_path):
    import train_digits
    png = tmp_path / "loss.png"
    acc = train_digits.main(["--epochs", "60", "--quiet", "--plot", str(png)])
    assert acc >= 0.95, acc
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- packed parameters ----------------------------------------------------------------
class TwoLayers(nn.Module):
    def __init__(self):
        self.a = nn.Linear(IN, 7)
        self.b = nn.Linear(7, OUT)

    def forward(self, x):
        return self.b(tc.tanh(self.a(x)))


def test_an_elementwise_optimizer_updates_every_parameter_in_one_pass():
    """AdamW's update runs on the parameters packed in one vector (training.packing): the
    traced step concatenates the gradients once, takes one norm and one square root of
    the moments for all four parameters; the user still sees per-parameter trees."""
    nn.manual_seed(3)
    model = TwoLayers()
    x, t = make(3)[1:]
    step = tc.compile_train_step(mse, model, tc.optim.AdamW(1e-2), x, t, clip_norm=1.0)
    assert step.packing is not None
    # a matrix [N, K] starts at a multiple of K, the length is a multiple of each K
    assert step.packing.offsets == [0, 10, 45, 49] and step.packing.size == 70
    run_filecheck(step.exe.stages["simplify"], """
        CHECK: tern.slice
        CHECK-SAME: runtime_offsets = true
        CHECK: tern.concatenate
        CHECK-NOT: tern.concatenate
        CHECK-COUNT-2: tern.sqrt
        CHECK-NOT: tern.sqrt
    """)
    # each parameter is read at an offset IREE cannot see, so the same code at another
    # offset is the same executable; a matrix as rows of a [size / K, K] view (no copy)
    run_filecheck(step.exe.stages["mlir"], """
        CHECK: [[VIEW:%.+]] = tensor.expand_shape %arg0 {{\\[}}[0, 1]] output_shape [14, 5]
        CHECK: [[ROW:%.+]] = util.optimization_barrier %c2 : index
        CHECK: tensor.extract_slice [[VIEW]]{{\\[}}[[ROW]], 0] [7, 5] [1, 1]
    """)
    step(x, t)
    assert set(step.params()) == set(model.state_dict())
    state = step.opt_state()
    assert set(state["mu"]) == set(model.state_dict())
    assert all(state["mu"][k].shape == v.shape for k, v in model.state_dict().items())


class PerTensorSGD(tc.optim.Optimizer):
    """An update that looks at whole tensors (each scaled to a step of norm lr): it must
    not run on packed parameters."""

    def __init__(self, lr):
        self.lr = tc.optim.constant(lr)

    def init(self, params):
        return {"step": np.float32(0.0)}

    def update(self, grads, state, params):
        new = {k: p - self.lr(0) * grads[k] / tc.sqrt(tc.sum(grads[k] * grads[k]))
               for k, p in params.items()}
        return new, {"step": state["step"] + 1.0}


def test_an_optimizer_that_looks_at_whole_tensors_keeps_them_apart():
    model, x, t = make(4)
    p0 = model.state_dict()
    step = tc.compile_train_step(mse, model, PerTensorSGD(0.1), x, t)
    assert step.packing is None
    step(x, t)
    g = np_grads(p0, x, t)[1]
    want = {k: p0[k] - 0.1 * g[k] / np.linalg.norm(g[k]) for k in p0}
    assert_tree_close(step.params(), want)


def test_parameters_beyond_an_int32_count_stay_apart():
    big = {f"w{i}": np.broadcast_to(np.float32(0), (40000, 20000)) for i in range(3)}  # no memory
    assert Packing.of(big, tc.optim.AdamW(1e-3)) is None
    assert Packing.of({"w": big["w0"]}, tc.optim.AdamW(1e-3)).size == 40000 * 20000
    assert Packing.of({"w": big["w0"]}, PerTensorSGD(0.1)) is None
