"""tc.grad / value_and_grad / vjp / jvp / custom_vjp / stop_gradient behaviour, against
NumPy formulas and finite differences; error cases; a FileCheck of the backward graph;
and, where PyTorch is installed, a comparison with torch autograd."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import tercomp as tc
from tercomp import nn
from tercomp.ops import REGISTRY, OpDef
from tercomp.passes import run_pipeline

from conftest import run_filecheck

EPS = 1e-6


def rand(*shape, seed=0, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def value(f, *args):
    """f(*args) in the reference interpreter (keeps float64)."""
    out = tc.value_and_grad(f)(*args)[0]
    return float(out)


def fd_grad(f, x, *rest):
    """Full central-difference gradient of scalar f w.r.t. its first argument."""
    g = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[i] += EPS
        xm[i] -= EPS
        g[i] = (value(f, xp, *rest) - value(f, xm, *rest)) / (2 * EPS)
    return g


def close(expected, received, rtol=1e-5, atol=1e-7, what=""):
    expected, received = np.asarray(expected), np.asarray(received)
    assert expected.shape == received.shape, f"{what}: shape {received.shape}, expected {expected.shape}"
    assert np.allclose(received, expected, rtol=rtol, atol=atol), \
        f"{what}: expected {expected}, received {received}"


# -- argnums ----------------------------------------------------------------------------------
def test_grad_argnums_int_and_tuple():
    x, y = rand(3, 4, seed=1), rand(3, 4, seed=2)

    def f(x, y):
        return tc.sum(x * x * y + tc.tanh(x))
    gx = tc.grad(f)(x, y)
    close(2 * x * y + 1 - np.tanh(x) ** 2, gx, what="argnums=0")
    gy = tc.grad(f, argnums=1)(x, y)
    close(x * x, gy, what="argnums=1")
    both = tc.grad(f, argnums=(0, 1))(x, y)
    assert isinstance(both, tuple) and len(both) == 2
    close(gx, both[0], what="argnums=(0,1)[0]")
    close(gy, both[1], what="argnums=(0,1)[1]")
    (only_y,) = tc.grad(f, argnums=(1,))(x, y)
    close(gy, only_y, what="argnums=(1,)")


def test_value_and_grad():
    x = rand(5, seed=3)
    v, g = tc.value_and_grad(lambda x: tc.sum(tc.exp(x)))(x)
    close(np.exp(x).sum(), v, what="value")
    close(np.exp(x), g, what="grad")


def test_pytree_args_dict_and_list():
    params = {"w": rand(4, 3, seed=4), "b": [rand(3, seed=5), rand(3, seed=6)]}
    x = rand(2, 4, seed=7)

    def f(p, x):
        h = tc.matmul(x, p["w"]) + p["b"][0] * p["b"][1]
        return tc.sum(h * h)
    g = tc.grad(f)(params, x)
    assert set(g) == {"w", "b"} and isinstance(g["b"], (list, tuple)) and len(g["b"]) == 2
    h = x @ params["w"] + params["b"][0] * params["b"][1]
    close(x.T @ (2 * h), g["w"], what="d/dw")
    close((2 * h).sum(0) * params["b"][1], g["b"][0], what="d/db0")
    close((2 * h).sum(0) * params["b"][0], g["b"][1], what="d/db1")


def test_has_aux():
    x = rand(3, seed=8)

    def f(x):
        y = x * x
        return tc.sum(y), {"y": y}
    g, aux = tc.grad(f, has_aux=True)(x)
    close(2 * x, g, what="grad")
    close(x * x, aux["y"], what="aux")
    (v, aux2), g2 = tc.value_and_grad(f, has_aux=True)(x)
    close((x * x).sum(), v, what="value")
    close(x * x, aux2["y"], what="aux")
    close(2 * x, g2, what="grad")


# -- modules ----------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, d_in=4, d_hidden=8, d_out=3, dtype="float64"):
        self.fc1 = nn.Linear(d_in, d_hidden, dtype=dtype)
        self.fc2 = nn.Linear(d_hidden, d_out, dtype=dtype)

    def forward(self, x):
        return self.fc2(tc.relu(self.fc1(x)))


def mlp_loss(model, x, y):
    return tc.mean(tc.cross_entropy(model(x), y))


def _mlp_data(dtype):
    nn.manual_seed(0)
    model = MLP(dtype=dtype)
    x = rand(6, 4, seed=9, dtype=dtype)
    y = np.array([0, 2, 1, 1, 0, 2], np.int32)
    return model, x, y


def _numpy_mlp_grads(p, x, y):
    h = x @ p["fc1.weight"].T + p["fc1.bias"]
    a = np.maximum(h, 0)
    z = a @ p["fc2.weight"].T + p["fc2.bias"]
    s = np.exp(z - z.max(1, keepdims=True))
    s /= s.sum(1, keepdims=True)
    dz = (s - np.eye(3)[y]) / len(y)
    da = dz @ p["fc2.weight"]
    dh = da * (h > 0)
    return {"fc1.weight": dh.T @ x, "fc1.bias": dh.sum(0), "fc2.weight": dz.T @ a, "fc2.bias": dz.sum(0)}


def test_grad_of_module_parameters():
    model, x, y = _mlp_data("float64")
    g = tc.grad(mlp_loss)(model, x, y)
    params = model.parameters()
    assert isinstance(g, dict) and set(g) == set(params), f"grad keys {list(g)} != {list(params)}"
    expected = _numpy_mlp_grads(params, x, y)
    for k in params:
        close(expected[k], g[k], what=k)
    # the model itself is left untouched
    for k, v in model.parameters().items():
        assert isinstance(v, np.ndarray) and v is params[k]


def test_compiled_mlp_grad_matches_fd():
    model, x, y = _mlp_data("float32")
    exe = tc.compile(tc.grad(mlp_loss), model, x, y)
    g = exe(model, x, y)
    p64 = {k: v.astype(np.float64) for k, v in model.parameters().items()}
    model64, _, _ = _mlp_data("float64")
    model64.load_state_dict(p64)
    x64 = x.astype(np.float64)
    for k in p64:
        def f(w, k=k):
            return mlp_loss_with(model64, k, w, x64, y)
        fd = fd_grad(f, p64[k])
        close(fd, g[k], rtol=1e-3, atol=1e-5, what=f"compiled grad {k}")


def mlp_loss_with(model, name, w, x, y):
    saved = model.parameters()
    model._load_params({name: w})
    try:
        return mlp_loss(model, x, y)
    finally:
        model._load_params({name: saved[name]})


# -- higher order -------------------------------------------------------------------------------
def test_grad_of_grad():
    x = np.array([0.3, -1.2, 2.0])
    d2 = tc.grad(lambda x: tc.sum(tc.grad(lambda u: tc.sum(u * u * u))(x)))(x)
    close(6 * x, d2, what="d2/dx2 sum(x^3)")
    # scalar: f = tanh, f'' = -2 tanh (1 - tanh^2)
    s = np.float64(0.7)
    h = tc.grad(tc.grad(lambda u: tc.tanh(u)))(np.asarray(s))
    close(-2 * np.tanh(s) * (1 - np.tanh(s) ** 2), h, what="tanh''")


def test_hessian_vector_product():
    A = rand(4, 4, seed=10)
    A = A + A.T
    x, v = rand(4, seed=11), rand(4, seed=12)

    def f(x):  # 0.5 x^T A x + sum(x^4)/4: H = A + diag(3 x^2)
        return 0.5 * tc.sum(x * tc.matmul(A, tc.expand_dims(x, 1))[:, 0]) + 0.25 * tc.sum(x * x * x * x)
    hvp = tc.grad(lambda x: tc.sum(tc.grad(f)(x) * v))(x)
    close(A @ v + 3 * x * x * v, hvp, what="Hv")


def test_vjp_and_jvp():
    W = rand(3, 4, seed=13)
    x = rand(4, seed=14)

    def f(x):
        return tc.tanh(tc.matmul(W, tc.expand_dims(x, 1))[:, 0])
    J = (1 - np.tanh(W @ x) ** 2)[:, None] * W
    out, f_vjp = tc.vjp(f, x)
    close(np.tanh(W @ x), out, what="vjp primal out")
    ct = rand(3, seed=15)
    (gx,) = f_vjp(ct)
    close(J.T @ ct, gx, what="vjp")
    t = rand(4, seed=16)
    out2, t_out = tc.jvp(f, (x,), (t,))
    close(np.tanh(W @ x), out2, what="jvp primal out")
    close(J @ t, t_out, what="jvp")


# -- gradient control ---------------------------------------------------------------------------
def test_stop_gradient():
    x = rand(5, seed=17)
    g = tc.grad(lambda x: tc.sum(x * tc.stop_gradient(x)))(x)
    close(x, g, what="d/dx x*sg(x)")
    g0 = tc.grad(lambda x: tc.sum(tc.stop_gradient(x * x)) + tc.sum(x))(x)
    close(np.ones_like(x), g0, what="blocked branch")


def test_custom_vjp_straight_through():
    @tc.custom_vjp
    def ste_round(x):  # round half away from zero: truncate x + sign(x)/2
        return tc.astype(tc.astype(x + tc.sign(x) * 0.5, "int32"), x.dtype)

    def fwd(x):
        return ste_round.fn(x), ()

    ste_round.defvjp(fwd, lambda res, g: (g,))
    x = np.array([0.2, 0.7, -1.4, 2.6])
    w = np.array([1.0, -2.0, 3.0, 0.5])
    close(np.round(x), ste_round(x), what="forward rounds")
    g = tc.grad(lambda x: tc.sum(ste_round(x) * w))(x)
    close(w, g, what="straight-through backward")
    # compiled, float32
    exe = tc.compile(tc.grad(lambda x: tc.sum(ste_round(x) * w.astype(np.float32))), x.astype(np.float32))
    close(w, exe(x.astype(np.float32)), rtol=1e-6, what="compiled straight-through backward")


# -- errors -----------------------------------------------------------------------------------------
def test_error_grad_wrt_integer():
    with pytest.raises(tc.TercompError, match=r"only floating-point inputs can be differentiated"):
        tc.grad(lambda i: tc.sum(i))(np.arange(3, dtype=np.int32))


def test_error_grad_of_non_scalar():
    with pytest.raises(tc.TercompError, match=r"needs a scalar output.*shape") as e:
        tc.grad(lambda x: x * 2)(rand(3))
    assert "tc.sum" in str(e.value) or "reduce" in str(e.value)


def test_error_op_without_gradient_rule():
    name = "test_nograd_square"
    assert name not in REGISTRY
    REGISTRY[name] = OpDef(name, "test", lambda ts, a: [ts[0]], lambda xs, a: [xs[0] * xs[0]])
    try:
        from tercomp.tracing import apply
        x = rand(3)
        assert np.allclose(apply(name, x), x * x)
        with pytest.raises(tc.TercompError, match=rf"tern\.{name} has no gradient rule") as e:
            tc.grad(lambda x: tc.sum(apply(name, x)))(x)
        assert "stop_gradient" in str(e.value) and "custom_vjp" in str(e.value)
        # stop_gradient around it is the suggested way out, and works
        g = tc.grad(lambda x: tc.sum(apply(name, tc.stop_gradient(x)) + x))(x)
        close(np.ones(3), g, what="stop_gradient workaround")
    finally:
        del REGISTRY[name]


def test_error_argnums_out_of_range():
    with pytest.raises(tc.TercompError, match="argnums"):
        tc.grad(lambda x: tc.sum(x), argnums=2)(rand(3))


# -- FileCheck of the backward graph ----------------------------------------------------------
def test_filecheck_backward_names_and_cse():
    def f(w, x):
        h = tc.tanh(tc.matmul(x, w))
        return tc.sum(h * h)
    g = tc.trace(tc.grad(f), rand(4, 3, dtype=np.float32), rand(2, 4, dtype=np.float32))
    g = run_pipeline(g, ["simplify"])
    text = str(g)
    run_filecheck(text, r"""
CHECK-LABEL: func.func @forward(%w: tensor<4x3xf32>, %x: tensor<2x4xf32>)
CHECK: %[[H:.*]] = "tern.tanh"
CHECK-NOT: "tern.tanh"
CHECK: %[[WG:w\.grad[0-9_]*]] = "tern.matmul"
CHECK-NOT: "tern.tanh"
CHECK: "func.return"(%[[WG]])
""")
    # no duplicated subexpressions after simplify: every (op, operands, attrs) is unique
    seen = set()
    for op in g.ops:
        key = (op.opname, tuple(id(v) for v in op.operands), repr(sorted(op.attrs.items(), key=lambda kv: kv[0])))
        assert key not in seen, f"duplicated {op.opname} in\n{text}"
        seen.add(key)


# -- layering ----------------------------------------------------------------------------------
def test_layers_below_autodiff_never_import_it():
    """tercomp.autodiff sits above ops, trace and passes: it installs the VJP rules that
    need the reverse walk or the tracer (tern.custom_vjp, tern.scan, tern.checkpoint), so
    nothing below imports it, not even inside a function (ops/control.py once imported
    the transforms to run custom_vjp's bwd)."""
    pkg = pathlib.Path(tc.__file__).parent
    for layer in ("ir", "ops", "trace", "passes", "codegen"):
        for path in sorted((pkg / layer).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""] + [a.name for a in node.names]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                bad = [n for n in names if n.split(".")[-1] in ("autodiff", "transforms")
                       or n.startswith("tercomp.autodiff")]
                assert not bad, f"{path.relative_to(pkg)}:{node.lineno} imports {bad}"
    code = ("import sys, tercomp.ops, tercomp.tracing, tercomp.passes\n"
            "print(sorted(m for m in sys.modules if m.startswith('tercomp.autodiff')))\n"
            "import tercomp.autodiff\n"
            "from tercomp.ops import get\n"
            "print([n for n in ('custom_vjp', 'scan', 'checkpoint') if get(n).vjp is None])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:2] == ["[]", "[]"], r.stdout


# -- PyTorch -------------------------------------------------------------------------------------
def test_mlp_grads_match_torch():
    torch = pytest.importorskip("torch")
    model, x, y = _mlp_data("float64")
    g = tc.grad(mlp_loss)(model, x, y)
    p = {k: torch.tensor(v, requires_grad=True) for k, v in model.parameters().items()}
    h = torch.relu(torch.tensor(x) @ p["fc1.weight"].T + p["fc1.bias"])
    z = h @ p["fc2.weight"].T + p["fc2.bias"]
    torch.nn.functional.cross_entropy(z, torch.tensor(y, dtype=torch.long)).backward()
    for k in p:
        close(p[k].grad.numpy(), g[k], what=f"torch {k}")


def test_attention_grads_match_torch():
    torch = pytest.importorskip("torch")
    T, D = 5, 4
    q, k, v = rand(T, D, seed=20), rand(T, D, seed=21), rand(T, D, seed=22)
    mask = np.tril(np.ones((T, T), bool))
    wo = rand(T, D, seed=23)

    def attn(q, k, v):
        s = tc.matmul(q, k, transpose_b=True) * (1.0 / np.sqrt(D))
        s = tc.where(mask, s, np.full((T, T), -1e9))
        return tc.sum(tc.matmul(tc.softmax(s, axis=-1), v) * wo)
    g = tc.grad(attn, argnums=(0, 1, 2))(q, k, v)
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    s = (tq @ tk.T) / np.sqrt(D)
    s = s.masked_fill(~torch.tensor(mask), -1e9)
    (torch.softmax(s, -1) @ tv * torch.tensor(wo)).sum().backward()
    for name, a, b in zip("qkv", (tq, tk, tv), g):
        close(a.grad.numpy(), b, what=f"attention d/d{name}")
