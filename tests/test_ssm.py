"""nn.SelectiveSSM / nn.MambaBlock against a float64 NumPy recurrence, their gradients
against finite differences, the SSM seed document's backward formulas against our
exact gradients (where the seed approximates, the test shows by how much), and
compile_train_step(accumulate_calls=k) with clipping against the seed's accumulator."""
import numpy as np
import pytest

import tercomp as tc
from tercomp import nn
from tercomp import ternary_pack as tp

rng = np.random.default_rng(3)


def ssm_reference(m, x):
    """Mamba S6 in float64 NumPy, a plain loop over time."""
    P = {k: np.asarray(v, np.float64) for k, v in m.parameters().items()}
    x = x.astype(np.float64)
    r, n = m.dt_rank, m.d_state
    proj = x @ P["x_proj.weight"].T
    delta = np.log1p(np.exp(proj[..., :r] @ P["dt_proj.weight"].T + P["dt_proj.bias"]))
    Bm, Cm, A = proj[..., r:r + n], proj[..., r + n:], -np.exp(P["A_log"])
    h, ys = np.zeros((x.shape[0], m.d_inner, n)), []
    for t in range(x.shape[1]):
        dt = delta[:, t, :, None]
        h = np.exp(dt * A) * h + dt * Bm[:, t, None, :] * x[:, t, :, None]
        ys.append((h * Cm[:, t, None, :]).sum(-1) + P["D"] * x[:, t])
    return np.stack(ys, 1)


@pytest.fixture(scope="module")
def ssm():
    nn.manual_seed(0)
    return nn.SelectiveSSM(8, d_state=4)


@pytest.mark.parametrize("mode", ["scan", "associative"])
def test_selective_ssm_matches_the_loop(ssm, mode):
    ssm.mode = mode
    x = rng.standard_normal((2, 7, 8)).astype(np.float32)
    try:
        np.testing.assert_allclose(ssm(x), ssm_reference(ssm, x), rtol=1e-5, atol=1e-5)
    finally:
        ssm.mode = "auto"
    ops = {op.opname for op in tc.trace(ssm, x).ops}           # auto: static length -> associative
    assert "scan" not in ops and "scan" in {op.opname for op in tc.trace(ssm, tc.spec((2, "L", 8))).ops}


def test_compiled_ssm_serves_every_batch_and_length(ssm):
    exe = tc.compile(ssm, tc.spec(("B", "L", 8)))
    for shape in [(2, 6, 8), (3, 1, 8), (1, 9, 8)]:
        x = rng.standard_normal(shape).astype(np.float32)
        np.testing.assert_allclose(exe(x), ssm_reference(ssm, x), rtol=1e-4, atol=1e-5)


def test_ssm_gradients_both_modes_and_finite_differences():
    nn.manual_seed(1)
    m = nn.SelectiveSSM(4, d_state=3, mode="scan", dtype="float64")
    x, w = rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 4))

    def loss(m, x):
        return tc.sum(m(x) * w)
    g_scan = tc.grad(loss, argnums=(0, 1))(m, x)
    m.mode = "associative"
    g_assoc = tc.grad(loss, argnums=(0, 1))(m, x)
    m.mode = "scan"                     # the finite differences below check the scan form
    for a, b in zip(tc.pytree.flatten(g_scan)[0], tc.pytree.flatten(g_assoc)[0]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    params = m.state_dict()
    dirs = {k: rng.standard_normal(v.shape) for k, v in params.items()}
    dx, eps = rng.standard_normal(x.shape), 1e-6

    def at(s):
        m.load_state_dict({k: params[k] + s * dirs[k] for k in params})
        return float(loss(m, x + s * dx))
    fd = (at(eps) - at(-eps)) / (2 * eps)
    m.load_state_dict(params)
    got = sum(float(np.sum(g_scan[0][k] * dirs[k])) for k in params) + float(np.sum(g_scan[1] * dx))
    assert abs(got - fd) < 1e-6 * max(1.0, abs(fd)), (got, fd)


def test_mamba_block_compiles_and_trains_through_bitlinear():
    nn.manual_seed(2)
    blk = nn.MambaBlock(8, d_state=4)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    exe = tc.compile(blk, tc.spec(("B", "L", 8)), ternary="off")
    np.testing.assert_allclose(exe(x), blk(x), rtol=1e-4, atol=1e-4)
    g = tc.grad(lambda m, x: tc.sum(m(x) ** 2))(blk, x)
    assert set(g) == set(blk.parameters()) and all(np.isfinite(v).all() for v in g.values())
    assert np.abs(g["in_proj.weight"]).sum() > 0     # straight-through through the ternary weights


def mamba_block_reference(blk, x):
    """The published Mamba block (mamba_simple.Mamba.forward, pre-norm and residual as
    its Block) in float64 NumPy, with BitLinear's ternary projections:
    x + out_proj(ssm(silu(causal depthwise conv1d(xi))) * silu(z))."""
    P = {k: np.asarray(v, np.float64) for k, v in blk.parameters().items()}
    x64 = x.astype(np.float64)

    def bitlinear(layer, h):
        t, s = layer.ternary()
        q, sx = tp.act_quant(h.astype(np.float32))
        return (q.astype(np.float64) / sx) @ (t.astype(np.float64).T * s)

    h = x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + 1e-6) * P["norm.weight"]
    u = bitlinear(blk.in_proj, h)
    xi, z = u[..., :blk.d_inner], u[..., blk.d_inner:]
    w, k = P["conv1d.weight"][:, 0, :], P["conv1d.weight"].shape[-1]
    xc = np.zeros_like(xi) + P["conv1d.bias"]
    for t in range(x.shape[1]):
        for j in range(k):                     # tap j sees time t - (k - 1) + j
            if t - (k - 1) + j >= 0:
                xc[:, t] += w[:, j] * xi[:, t - (k - 1) + j]

    def silu(v):
        return v / (1 + np.exp(-v))
    y = ssm_reference(blk.ssm, silu(xc)) * silu(z)
    return x64 + bitlinear(blk.out_proj, y)


def test_mamba_block_matches_the_published_block():
    nn.manual_seed(5)
    blk = nn.MambaBlock(8, d_state=4)
    blk.conv1d.weight = rng.standard_normal(blk.conv1d.weight.shape).astype(np.float32)
    assert blk.conv1d.weight.shape == (16, 1, 4) and blk.conv1d.bias.shape == (16,)
    x = rng.standard_normal((2, 6, 8)).astype(np.float32)
    want = mamba_block_reference(blk, x)
    np.testing.assert_allclose(blk(x), want, rtol=2e-4, atol=2e-4)
    # causal: changing the last step changes no earlier output
    x2 = x.copy()
    x2[:, -1] += 1.0
    np.testing.assert_allclose(blk(x2)[:, :-1], blk(x)[:, :-1], rtol=1e-6, atol=1e-6)
    exe = tc.compile(blk, tc.spec(("B", "L", 8)), ternary="off")
    np.testing.assert_allclose(exe(x[:, :4]), mamba_block_reference(blk, x[:, :4]), rtol=2e-4, atol=2e-4)


# -- the seed's formulas (../shared/seeds/003: SsmBackward, layer backward functions) ------------
def seed_model(a_bar, b_bar, c, x, dy):
    """The seed's SSM: h_t = a_bar_t * h_{t-1} + b_bar_t * x_t (x_t a scalar), y_t = C . h_t."""
    def step(h, s):
        h = s["a"] * h + s["b"] * s["x"]
        return h, tc.sum(c * h)
    _, ys = tc.scan(step, np.zeros(c.shape), {"a": a_bar, "b": b_bar, "x": x})
    return tc.sum(ys * dy)


def seed_reverse(a_bar, b_bar, c, x, dy):
    """The seed's forward states h_0..h_T and its reverse recurrence
    dh_t = C dy_t + a_bar_{t+1} dh_{t+1}."""
    T = len(x)
    h = [np.zeros(c.shape)]
    for t in range(T):
        h.append(a_bar[t] * h[-1] + b_bar[t] * x[t])
    dh = np.zeros((T,) + c.shape)
    for t in range(T - 1, -1, -1):
        dh[t] = c * dy[t] + (a_bar[t + 1] * dh[t + 1] if t + 1 < T else 0.0)
    return np.stack(h), dh


def test_seed_ssm_backward_formulas():
    T, N = 6, 3
    a_bar, b_bar = rng.uniform(0.3, 0.9, (T, N)), rng.standard_normal((T, N))
    c, x, dy = rng.standard_normal(N), rng.standard_normal(T), rng.standard_normal(T)
    da, db, dc, dx = tc.grad(seed_model, argnums=(0, 1, 2, 3))(a_bar, b_bar, c, x, dy)
    # the seed's reverse scan (input_dim = output_dim = 1, where it is meant to be exact)
    h, dh = seed_reverse(a_bar, b_bar, c, x, dy)
    np.testing.assert_allclose(da, dh * h[:-1], rtol=1e-12)                  # da[t] = dh_t h_{t-1}
    np.testing.assert_allclose(db, dh * x[:, None], rtol=1e-12)              # db[t] = dh_t x_t
    np.testing.assert_allclose(dc, np.sum(h[1:] * dy[:, None], 0), rtol=1e-12)   # dc = sum h_t dy_t
    # dx: the seed takes mean(b_bar_t) * mean(dh_t); the gradient is sum_n b_bar_tn dh_tn
    np.testing.assert_allclose(dx, np.sum(b_bar * dh, 1), rtol=1e-10)
    seed_dx = b_bar.mean(1) * dh.mean(1)
    assert np.max(np.abs(seed_dx - dx)) > 0.1 * np.max(np.abs(dx)), "the seed's dx is an approximation"


def test_seed_step_size_gradient_is_an_approximation():
    """a_bar = exp(delta A): d/d delta_t = dh_t * A * a_bar_t * h_{t-1}; the seed's
    delta_grad[t] = dh_t * h_t * a_bar_t drops A and uses h_t instead of h_{t-1}."""
    T, N = 5, 3
    A, delta = -rng.uniform(0.5, 2.0, N), rng.uniform(0.1, 0.5, (T, N))
    b_bar, c, x, dy = rng.standard_normal((T, N)), rng.standard_normal(N), rng.standard_normal(T), rng.standard_normal(T)
    g = tc.grad(lambda d: seed_model(tc.exp(d * A), b_bar, c, x, dy))(delta)
    a_bar = np.exp(delta * A)
    h, dh = seed_reverse(a_bar, b_bar, c, x, dy)
    np.testing.assert_allclose(g, dh * A * a_bar * h[:-1], rtol=1e-10, atol=1e-14)   # exact
    seed = dh * h[1:] * a_bar
    assert np.max(np.abs(seed - g)) > 0.1 * np.max(np.abs(g)), "the seed's delta_grad is an approximation"


def test_seed_layer_backward_functions():
    n = 5
    x, dy, w, b = (rng.standard_normal(n) for _ in range(4))
    W = rng.standard_normal((n, 3))
    gx, gW, gb = tc.grad(lambda v, m, c: tc.sum((v @ m + c) * dy[:3]), argnums=(0, 1, 2))(x, W, b[:3])
    np.testing.assert_allclose(gx, W @ dy[:3], rtol=1e-12)                       # linear_backward
    np.testing.assert_allclose(gW, np.outer(x, dy[:3]), rtol=1e-12)
    np.testing.assert_allclose(gb, dy[:3], rtol=1e-12)
    sig = 1 / (1 + np.exp(-x))
    np.testing.assert_allclose(tc.grad(lambda v: tc.sum(tc.silu(v) * dy))(x),
                               dy * sig * (1 + x * (1 - sig)), rtol=1e-12)        # silu_backward
    y = np.exp(x) / np.exp(x).sum()
    np.testing.assert_allclose(tc.grad(lambda v: tc.sum(tc.softmax(v) * dy))(x),
                               y * (dy - np.dot(y, dy)), rtol=1e-10)             # softmax_backward
    mean, var = x.mean(), x.var()
    xh = (x - mean) / np.sqrt(var + 1e-5)
    gx, gw, gb = tc.grad(lambda v, s, t: tc.sum(tc.layer_norm(v, s, t) * dy), argnums=(0, 1, 2))(x, w, b)
    # layer_norm_backward: the seed takes dx = scale / std * (dy - mean(dy) - x_hat mean(dy x_hat)),
    # exact only for a uniform scale; the exact dx has g = scale * dy inside the means
    seed_dx = w / np.sqrt(var + 1e-5) * (dy - dy.mean() - xh * (dy * xh).mean())
    g = w * dy
    np.testing.assert_allclose(gx, (g - g.mean() - xh * (g * xh).mean()) / np.sqrt(var + 1e-5), rtol=1e-8)
    assert np.max(np.abs(seed_dx - gx)) > 0.1 * np.max(np.abs(gx)), "the seed's layer-norm dx is approximate"
    u = np.full(n, 1.7)                                                         # ... but exact for a uniform scale
    np.testing.assert_allclose(tc.grad(lambda v: tc.sum(tc.layer_norm(v, u, b) * dy))(x),
                               u / np.sqrt(var + 1e-5) * (dy - dy.mean() - xh * (dy * xh).mean()), rtol=1e-8)
    np.testing.assert_allclose(gw, dy * xh, rtol=1e-8)
    np.testing.assert_allclose(gb, dy, rtol=1e-12)


def test_accumulate_calls_matches_the_seed_accumulator():
    """k calls, one update with the mean of their gradients clipped to a global norm
    (the seed's GradAccumulator: accumulate, normalize by the count, apply_clip)."""
    nn.manual_seed(0)
    model = nn.Linear(4, 3)
    x, y = rng.standard_normal((6, 4)).astype(np.float32), rng.integers(0, 3, 6).astype(np.int32)
    p0 = model.state_dict()

    def lossp(p, x, y):
        return tc.cross_entropy(x @ p["weight"].T + p["bias"], y)
    p64 = {k: v.astype(np.float64) for k, v in p0.items()}
    grads = [tc.grad(lossp)(p64, x[2 * i:2 * i + 2].astype(np.float64), y[2 * i:2 * i + 2]) for i in range(3)]
    mean = {k: sum(g[k] for g in grads) / 3 for k in p0}
    norm = np.sqrt(sum(np.sum(v ** 2) for v in mean.values()))
    want = {k: p0[k] - 0.5 * (0.1 / max(norm, 0.1)) * mean[k] for k in p0}
    step = tc.compile_train_step(lambda m, x, y: tc.cross_entropy(m(x), y), model, tc.optim.SGD(0.5),
                                 x[:2], y[:2], accumulate_calls=3, clip_norm=0.1)
    for i in range(3):
        step(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2])
        if i < 2:
            assert step.steps == 0 and all(np.array_equal(step.params()[k], p0[k]) for k in p0)
    assert step.steps == 1 and abs(step.grad_norm - norm) < 1e-5
    for k in p0:
        np.testing.assert_allclose(step.params()[k], want[k], rtol=1e-5, atol=1e-6)
    assert float(step.opt_state()["accum"]["calls"]) == 0.0
