"""tc.scan: the tern.scan op with a body region (IR text, parser, verifier), its lowering
to scf.for, and its gradient (a reverse scan) against float64 finite differences and the
same recurrence unrolled in Python, first and second order."""
import numpy as np
import pytest

import tercomp as tc
from tercomp import pytree
from conftest import run_filecheck
from tercomp.errors import ParseError, TercompError, VerifyError
from tercomp.ops import parse
from tercomp.ir.printer import print_graph
from tercomp.ops import verify

EPS = 1e-6
rng = np.random.default_rng(0)


# -- bodies --------------------------------------------------------------------------------
def gru_step(p, h, x):
    z = tc.sigmoid(x @ p["Wz"] + h @ p["Uz"])
    r = tc.sigmoid(x @ p["Wr"] + h @ p["Ur"])
    n = tc.tanh(x @ p["Wn"] + (r * h) @ p["Un"])
    return (1.0 - z) * n + z * h


def gru_params(i, h, dtype=np.float64):
    return {k: (rng.standard_normal(s) * 0.5).astype(dtype)
            for k, s in [("Wz", (i, h)), ("Uz", (h, h)), ("Wr", (i, h)), ("Ur", (h, h)),
                         ("Wn", (i, h)), ("Un", (h, h))]}


def gru_loss(p, h0, xs):
    def step(h, x):
        h = gru_step(p, h, x)
        return h, tc.sum(h * h, axis=-1)
    h, ys = tc.scan(step, h0, xs)
    return tc.sum(ys) + tc.sum(tc.tanh(h))


def gru_loss_unrolled(p, h0, xs):
    h, total = h0, 0.0
    for t in range(xs.shape[0]):
        h = gru_step(p, h, xs[t])
        total = total + tc.sum(h * h)
    return total + tc.sum(tc.tanh(h))


def ssm_loss(A_log, D, h0, seq):
    """Selective SSM (diagonal A = -exp(A_log), input-dependent delta, B, C); pytree xs."""
    A = -tc.exp(A_log)                                         # [Dm, N]

    def step(h, s):
        dA = tc.exp(tc.expand_dims(s["delta"], -1) * A)        # [Dm, N]
        dB = tc.expand_dims(s["delta"], -1) * tc.expand_dims(s["B"], 0)
        h = dA * h + dB * tc.expand_dims(s["x"], -1)
        y = tc.sum(h * tc.expand_dims(s["C"], 0), axis=-1) + D * s["x"]
        return h, y
    h, ys = tc.scan(step, h0, seq)
    return tc.sum(ys * ys) + tc.sum(h)


def pytree_loss(w, carry, xs):
    """A dict carry (a vector and a running scalar), a tuple of per-step outputs."""
    def step(c, x):
        v = tc.tanh(c["v"] * w + x)
        return {"v": v, "s": c["s"] + tc.sum(v)}, (v, tc.sum(v * x))
    c, (vs, dots) = tc.scan(step, carry, xs)
    return tc.sum(vs * vs) + tc.sum(dots) + c["s"] * c["s"]


def _problems():
    p = gru_params(3, 4)
    yield "gru", gru_loss, [p, rng.standard_normal(4), rng.standard_normal((5, 3))]
    Dm, N, T = 3, 2, 4
    seq = {"x": rng.standard_normal((T, Dm)), "delta": rng.uniform(0.1, 1.0, (T, Dm)),
           "B": rng.standard_normal((T, N)), "C": rng.standard_normal((T, N))}
    yield "ssm", ssm_loss, [rng.standard_normal((Dm, N)) * 0.3, rng.standard_normal(Dm),
                            rng.standard_normal((Dm, N)), seq]
    yield "pytree", pytree_loss, [rng.standard_normal(3), {"v": rng.standard_normal(3), "s": np.array(0.5)},
                                  rng.standard_normal((4, 3))]


PROBLEMS = list(_problems())


def _leaves(tree):
    return pytree.flatten(tree)[0]


def _perturb(args, dirs, eps):
    it = iter(dirs)
    return pytree.unflatten(pytree.flatten(args)[2],
                               [np.asarray(x + eps * next(it)) for x in _leaves(args)])


def _value(f, args):
    return float(f(*args))


# -- IR --------------------------------------------------------------------------------------
def test_scan_ir_text_and_round_trip():
    W = rng.standard_normal((4, 4)).astype(np.float32)

    def f(h0, xs):
        return tc.scan(lambda h, x: (tc.tanh(h @ W + x),) * 2, h0, xs, reverse=True)
    g = tc.trace(f, tc.spec((4,)), tc.spec(("T", 4)))
    run_filecheck(str(g), r"""
# CHECK-LABEL: func.func @forward(%h0: tensor<4xf32>, %xs: tensor<?x4xf32> {tern.dims = ["T", 4 : i64]})
# CHECK:       %[[C:.*]], %[[YS:.*]] = "tern.scan"(%h0, %xs) ({
# CHECK-NEXT:  ^bb0(%[[H:.*]]: tensor<4xf32>, %[[X:.*]]: tensor<4xf32>):
# CHECK:         %[[T:.*]] = "tern.tanh"
# CHECK:         "tern.yield"(%[[T]], %[[T]]) : (tensor<4xf32>, tensor<4xf32>) -> ()
# CHECK-NEXT:  }) {length = "T", n_carry = 1 : i64, n_xs = 1 : i64, reverse = true} : (tensor<4xf32>, tensor<?x4xf32>) -> (tensor<4xf32>, tensor<?x4xf32>)
# CHECK:       "func.return"(%[[C]], %[[YS]])
""")
    back = parse(print_graph(g, elide=False))
    assert back.structurally_equal(g)
    assert back.ops[0].attrs["body"].inputs[0].type.shape == (4,)


def test_gradient_ir_round_trips_and_nests():
    p = gru_params(3, 4)
    g = tc.trace(tc.grad(gru_loss), p, tc.spec((4,), "float64"), tc.spec(("T", 3), "float64"))
    back = parse(print_graph(g, elide=False))
    assert back.structurally_equal(g)
    verify(back)

    def nested(xs):   # a scan in a scan's body
        def outer(c, row):
            c2, _ = tc.scan(lambda a, x: (a + x * c, None), c, row)
            return c2, c2
        return tc.scan(outer, tc.sum(xs[0]) * 0.0, xs)
    g = tc.trace(nested, np.ones((3, 2), np.float32))
    assert parse(print_graph(g, elide=False)).structurally_equal(g)


def test_parser_rejects_malformed_bodies():
    g = tc.trace(lambda c, xs: tc.scan(lambda a, x: (a + x, a), c, xs), np.ones(2, np.float32),
                 np.ones((3, 2), np.float32))
    text = print_graph(g)
    bad = {
        "no yield": text.replace('"tern.yield"', '"tern.neg"'),
        "outer value in the body": text.replace('"tern.add"(%carry, %x)', '"tern.add"(%c, %x)'),
        "wrong block arity": text.replace("^bb0(%carry: tensor<2xf32>, ", "^bb0("),
        "unterminated": text[:text.index("^bb0")],
    }
    for what, t in bad.items():
        with pytest.raises(ParseError):
            parse(t)
    body = "%r = \"tern.scan\"(%c) ({\n^bb0(%a: tensor<2xf32>):\n" * 40
    with pytest.raises(ParseError, match="nested deeper"):
        parse("func.func @f(%c: tensor<2xf32>) -> (tensor<2xf32>) {\n" + body)


def test_verifier_checks_the_body():
    g = tc.trace(lambda c, xs: tc.scan(lambda a, x: (a + x, a), c, xs), np.ones(2, np.float32),
                 np.ones((3, 2), np.float32))
    body = g.ops[-1].attrs["body"]
    body.outputs = list(reversed(body.outputs)) + [body.inputs[1]]   # still [2]f32 each
    g.ops[-1].attrs["n_carry"] = 2
    with pytest.raises(VerifyError):
        verify(g)


# -- values ----------------------------------------------------------------------------------
def test_compiled_scan_matches_the_loop_for_every_length():
    p = gru_params(3, 4, np.float32)

    def f(p, h0, xs):
        return tc.scan(lambda h, x: (gru_step(p, h, x), h), h0, xs, reverse=False)
    exe = tc.compile(f, p, tc.spec((4,)), tc.spec(("T", 3)))
    for T in (1, 6):
        h0 = rng.standard_normal(4).astype(np.float32)
        xs = rng.standard_normal((T, 3)).astype(np.float32)
        h, prev = h0, []
        for t in range(T):
            prev.append(h)
            h = gru_step(p, h, xs[t])
        got_h, got_prev = exe(p, h0, xs)
        np.testing.assert_allclose(got_h, h, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_prev, np.stack(prev), rtol=1e-5, atol=1e-6)


def test_reverse_and_length_only_scan_reference():
    xs = rng.standard_normal((5, 2))
    c, ys = tc.scan(lambda a, x: (a * 0.5 + x, a), np.zeros(2), xs, reverse=True)
    a, want = np.zeros(2), [None] * 5
    for t in range(4, -1, -1):
        want[t] = a
        a = a * 0.5 + xs[t]
    np.testing.assert_allclose(c, a)
    np.testing.assert_allclose(ys, np.stack(want))
    c, ys = tc.scan(lambda a, _: (a + 1.0, a * 2.0), np.float32(0.0), None, length=3)
    assert float(c) == 3.0 and ys.tolist() == [0.0, 2.0, 4.0]


# -- gradients -------------------------------------------------------------------------------
@pytest.mark.parametrize("name,f,args", PROBLEMS, ids=[p[0] for p in PROBLEMS])
def test_grad_against_finite_differences_and_unrolled(name, f, args):
    argnums = tuple(range(len(args)))
    grads = tc.grad(f, argnums=argnums)(*args)
    g_leaves = _leaves(grads)
    dirs = [rng.standard_normal(np.shape(x)) for x in _leaves(args)]
    fd = (_value(f, _perturb(args, dirs, EPS)) - _value(f, _perturb(args, dirs, -EPS))) / (2 * EPS)
    got = sum(float(np.sum(g * d)) for g, d in zip(g_leaves, dirs))
    assert abs(got - fd) <= 1e-5 * max(1.0, abs(fd)), f"{name}: grad.d {got} vs finite difference {fd}"
    if name == "gru":   # the same recurrence unrolled in Python, differentiated op by op
        want = _leaves(tc.grad(gru_loss_unrolled, argnums=argnums)(*args))
        for w, g in zip(want, g_leaves):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name,f,args", PROBLEMS[:2], ids=[p[0] for p in PROBLEMS[:2]])
def test_grad_of_grad_through_scan(name, f, args):
    argnums = tuple(range(len(args)))
    vs = [rng.standard_normal(np.shape(x)) for x in _leaves(args)]

    def gdotv(*a):
        gs = _leaves(tc.grad(f, argnums=argnums)(*a))
        return sum(tc.sum(g * v) for g, v in zip(gs, vs))
    hvp = _leaves(tc.grad(gdotv, argnums=argnums)(*args))
    gp = _leaves(tc.grad(f, argnums=argnums)(*_perturb(args, vs, EPS)))
    gm = _leaves(tc.grad(f, argnums=argnums)(*_perturb(args, vs, -EPS)))
    for h, a, b in zip(hvp, gp, gm):
        np.testing.assert_allclose(h, (a - b) / (2 * EPS), rtol=1e-5, atol=1e-6,
                                   err_msg=f"{name}: Hessian-vector product")


def test_compiled_gradient_with_symbolic_length():
    p = gru_params(3, 4)
    exe = tc.compile(tc.grad(gru_loss, argnums=(0, 1, 2)), {k: v.astype(np.float32) for k, v in p.items()},
                     tc.spec((4,)), tc.spec(("T", 3)))
    for T in (2, 7):
        h0, xs = rng.standard_normal(4), rng.standard_normal((T, 3))
        want = _leaves(tc.grad(gru_loss, argnums=(0, 1, 2))(p, h0, xs))
        p32 = {k: v.astype(np.float32) for k, v in p.items()}
        got = _leaves(exe(p32, h0.astype(np.float32), xs.astype(np.float32)))
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=2e-5)


# -- errors ----------------------------------------------------------------------------------
def _line_of(marker):
    import inspect
    src = inspect.getsource(test_errors_name_the_users_line).splitlines()
    start = test_errors_name_the_users_line.__code__.co_firstlineno
    return start + next(i for i, s in enumerate(src) if marker in s)


def test_errors_name_the_users_line():
    x2, xs = np.ones(2, np.float32), np.ones((3, 2), np.float32)
    with pytest.raises(TercompError, match=r"carry from \[2\]f32 into \[3\]f32") as e:
        tc.trace(lambda c, s: tc.scan(lambda a, x: (tc.concatenate([a, x[:1]]), a), c, s), x2, xs)  # shape
    assert e.value.loc.line == _line_of("# shape") and e.value.loc.file.endswith("test_scan.py")
    with pytest.raises(TercompError, match=r"into \[2\]i32"):
        tc.trace(lambda c, s: tc.scan(lambda a, x: (a.astype("int32"), a), c, s), x2, xs)  # dtype
    with pytest.raises(TercompError, match="different leading dims") as e:
        tc.trace(lambda c, s, t: tc.scan(lambda a, x: (a, a), c, (s, t)), x2, xs, np.ones((4, 2), np.float32))  # lead
    assert e.value.loc.line == _line_of("# lead")
    with pytest.raises(TercompError, match="pair"):
        tc.trace(lambda c, s: tc.scan(lambda a, x: a, c, s), x2, xs)
    with pytest.raises(TercompError, match="give xs or a length"):
        tc.trace(lambda c: tc.scan(lambda a, x: (a, a), c, None), x2)


def test_dynamic_carry_with_fused_producers():
    """IREE 3.13 returned a wrong final carry for this loop (dynamic batch and length, the
    scanned xs a transpose of the input, y independent of the carry) until the lowering
    fenced the loop's operands (ops/body_ops.py, _fence)."""
    x = rng.standard_normal((2, 6, 8)).astype(np.float32)

    def f(x):
        xx = tc.transpose(x, (1, 0, 2))
        h0 = tc.broadcast_to(tc.expand_dims(tc.sum(xx, axis=0) * 0.0, -1), (xx.shape[1], 8, 4))
        return tc.scan(lambda h, s: (h * 0.5 + tc.expand_dims(s, -1), s * 1.0), h0, xx)
    exe = tc.compile(f, tc.spec(("B", "L", 8)))
    for got, want in zip(exe(x), f(x)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_jvp_through_scan():
    def f(h0, xs):
        return tc.scan(lambda h, x: (tc.tanh(h * 0.7 + x[:1] * 2.0),) * 2, h0, xs)
    h0, xs = rng.standard_normal(4), rng.standard_normal((5, 3))
    th, tx = rng.standard_normal(4), rng.standard_normal((5, 3))
    _, tangents = tc.jvp(f, (h0, xs), (th, tx))
    plus, minus = f(h0 + EPS * th, xs + EPS * tx), f(h0 - EPS * th, xs - EPS * tx)
    for t, a, b in zip(tangents, plus, minus):
        np.testing.assert_allclose(t, (a - b) / (2 * EPS), rtol=1e-6, atol=1e-8)


def _scan_text():
    def f(w, xs):
        def outer(c, row):
            c2, _ = tc.scan(lambda a, x: (tc.tanh(a * w + x), None), c, row)
            return c2, c2 * c2
        c, ys = tc.scan(outer, tc.sum(xs[0]) * 0.0, xs, reverse=True)
        return tc.sum(ys) + c
    return str(tc.trace(tc.grad(f), np.float32(0.5), np.ones((3, 2), np.float32)))


def test_mutated_scan_ir_parses_or_raises_a_tercomp_error():
    """Random edits of IR with nested bodies: a TercompError or a graph, nothing else."""
    from hypothesis import HealthCheck, given, settings, strategies as st
    text = _scan_text()
    alphabet = '%"(){}[]<>:,=x?^_.0123456789abcdefghijklmnoprstuvwxyzT@ \n'
    edit = st.tuples(st.integers(0, len(text) - 1), st.integers(0, 40),
                     st.one_of(st.text(alphabet=alphabet, max_size=8),
                               st.sampled_from(["({", "})", "^bb0:", '"tern.yield"() : () -> ()', "{" * 50])))

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(edit, min_size=1, max_size=3))
    def check(edits):
        t = text
        for pos, cut, insert in edits:
            t = t[:pos] + insert + t[pos + cut:]
        try:
            g = parse(t, "fuzz.tern.mlir")
        except TercompError:
            return
        assert str(g)
    assert parse(text).structurally_equal(parse(text))
    check()


def test_grad_through_a_scan_in_a_scan():
    def f(w, xs):
        def outer(c, row):
            c2, _ = tc.scan(lambda a, x: (tc.tanh(a * w + x), None), c, row)
            return c2, c2 * c2
        c, ys = tc.scan(outer, tc.sum(xs[0]) * 0.0, xs, reverse=True)
        return tc.sum(ys) + c
    w, xs = np.array(0.7), rng.standard_normal((3, 4))
    gw, gx = tc.grad(f, argnums=(0, 1))(w, xs)
    dx = rng.standard_normal(xs.shape)
    fd = (float(f(np.asarray(w + EPS), xs + EPS * dx)) - float(f(np.asarray(w - EPS), xs - EPS * dx))) / (2 * EPS)
    assert abs(float(gw) + float(np.sum(gx * dx)) - fd) < 1e-6 * max(1.0, abs(fd))


@pytest.mark.parametrize("reverse", [False, True])
def test_long_scans_run_in_chunks(reverse):
    """A symbolic length runs as chunks of CHUNK steps (ops/body_ops.py): lengths around and
    past the chunk size, forward and reverse, against the reference."""
    W = (rng.standard_normal((4, 4)) * 0.5).astype(np.float32)

    def f(h0, xs):
        return tc.scan(lambda h, x: (tc.tanh(h @ W + x), h * 2.0), h0, xs, reverse=reverse)
    exe = tc.compile(f, tc.spec((4,)), tc.spec(("T", 4)))
    for T in (31, 32, 33, 70):
        h0, xs = rng.standard_normal(4).astype(np.float32), rng.standard_normal((T, 4)).astype(np.float32)
        for got, want in zip(exe(h0, xs), f(h0, xs)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
