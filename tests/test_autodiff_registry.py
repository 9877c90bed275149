"""Gradient tests generated from the op registry (STYLE.md section 5).

Every op with `differentiable=True` needs an entry in CASES below; the test fails
otherwise, so a new op cannot land without a gradient test. For each op and case:

  (a) first order: grad . d against a central finite difference, per float operand,
      in float64 with the reference interpreter;
  (b) second order: a Hessian-vector product (grad of grad . v) against central
      differences of the gradient;
  (c) the compiled gradient (IREE, float32) against the float64 reference gradient.

Outputs are reduced to a scalar with a fixed random weighting, sum(out * w).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

import tercomp as tc
from tercomp.ops import REGISTRY
from tercomp.runtime.devices import driver_present
from tercomp.tracing import apply

# no operands to vary / tested in test_autodiff.py / ops with a body, tested in test_scan.py
SKIP = {"constant", "custom_vjp", "scan", "checkpoint"}

EPS = 1e-6
FD_RTOL, FD_ATOL = 1e-5, 1e-7
HVP_RTOL, HVP_ATOL = 1e-5, 1e-6
COMPILED_RTOL, COMPILED_ATOL = 1e-4, 1e-5


# -- operand specs -------------------------------------------------------------------------
@dataclass
class A:
    """One operand: shape and value domain.

    domain: normal | pos (0.5..2) | away (|x| in 0.5..1.5, no kink at 0) |
            distinct (values spaced 0.1 apart: no ties for max/min) |
            int (0..hi-1) | bool
    """
    shape: tuple
    domain: str = "normal"
    hi: int = 0

    @property
    def is_float(self):
        return self.domain not in ("int", "bool")

    def sample(self, rng, dtype):
        n = int(np.prod(self.shape, dtype=np.int64))
        if self.domain == "normal":
            x = rng.standard_normal(self.shape)
        elif self.domain == "pos":
            x = rng.uniform(0.5, 2.0, self.shape)
        elif self.domain == "away":
            x = rng.choice([-1.0, 1.0], self.shape) * rng.uniform(0.5, 1.5, self.shape)
        elif self.domain == "distinct":
            x = (rng.permutation(n) * 0.1 - 0.05 * n).reshape(self.shape) + rng.uniform(-0.01, 0.01, self.shape)
        elif self.domain == "int":
            return rng.integers(0, self.hi, self.shape).astype(np.int32)
        elif self.domain == "bool":
            return rng.random(self.shape) < 0.5
        else:
            raise ValueError(self.domain)
        return np.asarray(x, dtype=dtype)


@dataclass
class Case:
    operands: list
    attrs: dict = field(default_factory=dict)
    zero_grad: bool = False     # the op blocks gradients (stop_gradient): expect exact zeros
    straight_through: bool = False  # quantizer with an identity (STE) gradient: expect grad = w
    pair: str = ""              # binary op whose operands must not tie: "distinct" second operand


def unary(domain="normal", shape=(3, 4), **attrs):
    return [Case([A(shape, domain)], attrs)]


def binary(dom0="normal", dom1="normal", pair=""):
    return [Case([A((3, 4), dom0), A((3, 4), dom1)], pair=pair),
            Case([A((3, 4), dom0), A((4,), dom1)], pair=pair)]  # broadcasting: unbroadcast in the VJP


CASES: dict[str, list] = {
    # elementwise
    "abs": unary("away"),
    "neg": unary(),
    "exp": unary(),
    "log": unary("pos"),
    "sqrt": unary("pos"),
    "rsqrt": unary("pos"),
    "tanh": unary(),
    "sin": unary(),
    "cos": unary(),
    "exp2": unary(),
    "log2": unary("pos"),
    "sigmoid": unary(),
    "gelu": unary(),
    "silu": unary(),
    "relu": unary("away"),
    "pow": unary("pos", exponent=2.5) + unary("pos", exponent=-1.5),
    "cast": [Case([A((3, 4))], {"dtype": "same"})],  # same-dtype cast; f64->f32 would ruin FD
    "add": binary(),
    "sub": binary(),
    "mul": binary(),
    "div": binary("normal", "pos"),
    "maximum": binary(pair="distinct"),
    "minimum": binary(pair="distinct"),
    "where": [Case([A((3, 4), "bool"), A((3, 4)), A((3, 4))])],
    # control
    "stop_gradient": [Case([A((3, 4))], zero_grad=True)],
    # reduce
    "sum": unary(axes=[1]) + unary(shape=(2, 3, 4), axes=[0, 2], keepdims=True) + unary(),
    "mean": unary(axes=[0]) + unary(shape=(2, 3, 4), axes=[1], keepdims=True) + unary(),
    "max": unary("distinct", axes=[1]) + unary("distinct", keepdims=True),
    "min": unary("distinct", axes=[0]) + unary("distinct", shape=(2, 3, 4), axes=[2], keepdims=True),
    # linalg
    "matmul": [Case([A((3, 4)), A((4, 5))]),
               Case([A((3, 4)), A((5, 4))], {"transpose_b": True}),
               Case([A((2, 3, 4)), A((4, 5))])],
    "matmul_sum": [Case([A((2, 3, 4)), A((2, 5, 4))])],
    # shape
    "broadcast_to": [Case([A((3, 1))], {"shape": [2, 3, 4]})],
    "concatenate": [Case([A((2, 3)), A((4, 3))], {"axis": 0}),
                    Case([A((2, 3)), A((2, 1)), A((2, 2))], {"axis": 1})],
    "expand_dims": unary(axis=1),
    "reshape": [Case([A((3, 4))], {"shape": [2, 6]})],
    "scatter_add": [Case([A((5, 3)), A((5,), "int", hi=4)], {"axis": 0, "size": 4})],
    "size": [Case([A((3, 4))], {"axes": [1]})],
    "slice": [Case([A((5, 6))], {"starts": [1, 0], "stops": [4, 6], "steps": [1, 2]})],
    "split": [Case([A((5, 3))], {"axis": 0, "sizes": [2, 3]})],
    "squeeze": [Case([A((3, 1, 4))], {"axes": [1]})],
    "take": [Case([A((5, 3)), A((4,), "int", hi=5)], {"axis": 0}),
             Case([A((3, 5)), A((2, 3), "int", hi=5)], {"axis": 1})],
    "transpose": [Case([A((2, 3, 4))], {"perm": [2, 0, 1]})],
    "unslice": [Case([A((3, 3))], {"shape": [5, 6], "starts": [1, 0], "stops": [4, 6], "steps": [1, 2]})],
    # composite
    "softmax": unary(shape=(3, 5), axis=-1) + unary(shape=(3, 5), axis=0),
    "log_softmax": unary(shape=(3, 5), axis=-1),
    "logsumexp": unary(shape=(3, 5), axes=[1]) + unary(shape=(3, 5)),
    "layer_norm": [Case([A((3, 5)), A((5,)), A((5,))])],
    "rms_norm": [Case([A((3, 5)), A((5,))])],
    "rope": [Case([A((3, 2, 4)), A((3, 2)), A((3, 2))], {"style": "neox"}),
             Case([A((2, 3, 2, 4)), A((3, 2)), A((3, 2))], {"style": "interleaved"})],
    "pad": [Case([A((3, 4))], {"widths": [[1, 0], [2, 1]]})],
    "cross_entropy": [Case([A((4, 5)), A((4,), "int", hi=5)])],
    # conv
    "conv": [Case([A((2, 4, 5)), A((6, 2, 3))], {"stride": [2], "padding": [[1, 0]], "dilation": [1],
                                                 "groups": 2}),
             Case([A((1, 2, 4, 4)), A((3, 2, 2, 2))], {"stride": [1, 2], "padding": [[1, 1], [0, 1]],
                                                       "dilation": [2, 1], "groups": 1})],
    "conv_transpose": [Case([A((2, 4, 3)), A((4, 3, 3))],
                            {"stride": [2], "padding": [[1, 0]], "dilation": [1], "groups": 2,
                             "output_padding": [1]})],
    "conv_weight_grad": [Case([A((2, 4, 5)), A((2, 6, 2))],
                              {"stride": [2], "padding": [[1, 0]], "dilation": [1], "groups": 2,
                               "kernel": [3]})],
    "im2col": [Case([A((2, 2, 5, 4))], {"kernel": [3, 2], "stride": [2, 1], "padding": [[1, 0], [0, 1]],
                                         "dilation": [1, 2]})],
    "max_pool": [Case([A((2, 2, 5, 4), "distinct")], {"window": [2, 2], "stride": [2, 1],
                                                      "padding": [[1, 0], [0, 1]]}),
                 Case([A((1, 2, 6), "distinct")], {"window": [3], "stride": [2], "padding": [[0, 0]]})],
    "avg_pool": [Case([A((2, 3, 7))], {"window": [3], "stride": [2], "padding": [[1, 1]]})],
    # ternary (fake quantization; straight-through gradients, so FD does not apply)
    "ternarize": [Case([A((3, 4))], straight_through=True)],
    "act_quant": [Case([A((3, 4))], straight_through=True)],
}

# Known bugs in op family files (which this suite does not edit): op -> reason.
XFAIL: dict[str, str] = {}

DIFF_OPS = sorted(n for n, d in REGISTRY.items() if d.differentiable and n not in SKIP)


def _dtype_name(dtype):
    return {np.float64: "f64", np.float32: "f32"}[np.dtype(dtype).type]


# -- building the scalar function ----------------------------------------------------------
class Problem:
    """One op + case at one float dtype: the operands (float ones are the function's
    arguments, the others fixed constants) and f(*floats) = sum_i sum(out_i * w_i)."""

    def __init__(self, opname, case: Case, dtype, seed=0):
        rng = np.random.default_rng(seed)
        self.opname, self.case, self.dtype = opname, case, dtype
        vals = [a.sample(rng, dtype) for a in case.operands]
        if case.pair == "distinct":  # operand 0 = operand 1 (broadcast) shifted by 0.3..1 either way
            gap = rng.choice([-1.0, 1.0], vals[0].shape) * rng.uniform(0.3, 1.0, vals[0].shape)
            vals[0] = np.asarray(np.broadcast_to(vals[1], vals[0].shape) + gap, dtype)
        self.values = vals
        self.float_idx = [i for i, a in enumerate(case.operands) if a.is_float]
        self.attrs = {k: (_dtype_name(dtype) if v == "same" else v) for k, v in case.attrs.items()}
        outs = apply(opname, *vals, **self.attrs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        self.weights = [rng.standard_normal(np.shape(o)).astype(dtype) for o in outs]

    @property
    def args(self):
        return [self.values[i] for i in self.float_idx]

    def f(self, *xs):
        operands = list(self.values)
        for i, x in zip(self.float_idx, xs):
            operands[i] = x
        outs = apply(self.opname, *operands, **self.attrs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        total = None
        for o, w in zip(outs, self.weights):
            s = tc.sum(o * w)
            total = s if total is None else total + s
        return total

    def value(self, *xs):
        """f(*xs) in the reference interpreter (traced, so float64 stays float64)."""
        from tercomp.ops import interpret
        (out,) = interpret(tc.trace(self.f, *xs), *xs)
        return float(out)

    @property
    def argnums(self):
        return tuple(range(len(self.float_idx)))

    def grad(self, *xs):
        return tc.grad(self.f, argnums=self.argnums)(*xs)


def _where(opname, operand, what):
    return f"tern.{opname}, operand {operand} ({what})"


def _check_close(expected, received, rtol, atol, where):
    expected, received = np.asarray(expected), np.asarray(received)
    if expected.shape != received.shape or not np.allclose(received, expected, rtol=rtol, atol=atol):
        err = np.max(np.abs(received - expected)) if expected.shape == received.shape else "shape mismatch"
        pytest.fail(f"{where}: expected {expected!r}, received {received!r} "
                    f"(max abs error {err}, rtol={rtol}, atol={atol})", pytrace=False)


# -- table completeness -------------------------------------------------------------------
def test_every_differentiable_op_has_a_case_and_a_rule():
    missing = [n for n in DIFF_OPS if n not in CASES]
    assert not missing, (f"differentiable ops without a gradient test case: {missing}; "
                         "add them to CASES in tests/test_autodiff_registry.py")
    no_rule = [n for n in DIFF_OPS if REGISTRY[n].vjp is None and REGISTRY[n].decompose is None]
    assert not no_rule, f"differentiable ops with neither a vjp nor a decompose rule: {no_rule}"
    stale = sorted(set(CASES) - set(DIFF_OPS))
    assert not stale, f"CASES lists ops that are not differentiable registry ops: {stale}"


# The compiled gradient of these ops runs under -m slow only: their VJPs are one or two
# elementwise or data-movement ops, whose lowering the forward tests (test_registry,
# test_op_families) and the compiled gradients of the ops left in compile already; their
# float64 gradients (test_grad_reference_fd) run for every op.
COMPILED_SLOW = {"abs", "cos", "exp", "exp2", "log", "log2", "neg", "relu", "rsqrt",
                 "sigmoid", "sin", "sqrt", "add", "sub", "mul", "maximum", "minimum",
                 "expand_dims", "squeeze", "reshape", "broadcast_to", "size", "stop_gradient",
                 "cast", "split", "transpose", "min", "mean"}


def _params(slow=frozenset()):
    out = []
    for name in DIFF_OPS:
        marks = [pytest.mark.xfail(strict=True, reason=XFAIL[name])] if name in XFAIL else []
        if name in slow:
            marks.append(pytest.mark.slow)
        out.append(pytest.param(name, id=name, marks=marks))
    return out


def _cases(opname):
    if opname not in CASES:
        pytest.fail(f"tern.{opname} is differentiable but has no entry in CASES", pytrace=False)
    return CASES[opname]


# -- (a) + (b): float64 reference -----------------------------------------------------------
@pytest.mark.parametrize("opname", _params())
def test_grad_reference_fd(opname):
    for k, case in enumerate(_cases(opname)):
        p = Problem(opname, case, np.float64, seed=k)
        rng = np.random.default_rng(100 + k)
        xs = p.args
        grads = p.grad(*xs)
        assert len(grads) == len(xs)
        dirs = [rng.standard_normal(np.shape(x)) for x in xs]
        label = f"case {k} {case.attrs}"
        # (a) first order, per operand
        for j, (x, d, g) in enumerate(zip(xs, dirs, grads)):
            where = _where(opname, p.float_idx[j], f"first order, {label}")
            assert np.shape(g) == np.shape(x), f"{where}: gradient shape {np.shape(g)}, operand {np.shape(x)}"
            assert np.asarray(g).dtype == np.float64, f"{where}: gradient dtype {np.asarray(g).dtype}"
            if case.zero_grad:
                _check_close(np.zeros_like(x), g, 0, 0, where)
                continue
            if case.straight_through:
                _check_close(p.weights[0], g, 1e-12, 0, where)
                continue
            plus = [xi + EPS * d if i == j else xi for i, xi in enumerate(xs)]
            minus = [xi - EPS * d if i == j else xi for i, xi in enumerate(xs)]
            fd = (p.value(*plus) - p.value(*minus)) / (2 * EPS)
            _check_close(fd, float(np.sum(g * d)), FD_RTOL, FD_ATOL, where)
        # (b) second order: H v = grad_x (grad f(x) . v) against FD of the gradient
        vs = [rng.standard_normal(np.shape(x)) for x in xs]

        def gdotv(*ys):
            gs = tc.grad(p.f, argnums=p.argnums)(*ys)
            total = None
            for gi, vi in zip(gs, vs):
                s = tc.sum(gi * vi)
                total = s if total is None else total + s
            return total

        hvp = tc.grad(gdotv, argnums=p.argnums)(*xs)
        gp = p.grad(*[x + EPS * v for x, v in zip(xs, vs)])
        gm = p.grad(*[x - EPS * v for x, v in zip(xs, vs)])
        for j, (h, a, b) in enumerate(zip(hvp, gp, gm)):
            where = _where(opname, p.float_idx[j], f"Hessian-vector product, {label}")
            flat = case.zero_grad or case.straight_through
            expected = np.zeros_like(xs[j]) if flat else (a - b) / (2 * EPS)
            _check_close(expected, h, HVP_RTOL, HVP_ATOL, where)


# -- (c) compiled float32 gradient against the float64 reference ----------------------------
@pytest.mark.parametrize("opname", _params(COMPILED_SLOW))
def test_grad_compiled(opname):
    for k, case in enumerate(_cases(opname)):
        p32 = Problem(opname, case, np.float32, seed=k)
        p64 = Problem(opname, case, np.float64, seed=k)
        # the same values, so both see the same (float32-rounded) point
        p64.values = [v.astype(np.float64) if a.is_float else v for v, a in zip(p32.values, case.operands)]
        p64.weights = [w.astype(np.float64) for w in p32.weights]
        expected = p64.grad(*p64.args)
        exe = tc.compile(tc.grad(p32.f, argnums=p32.argnums), *p32.args)
        got = exe(*p32.args)
        got = got if isinstance(got, (tuple, list)) else (got,)
        assert len(got) == len(expected)
        for j, (e, g) in enumerate(zip(expected, got)):
            where = _where(opname, p32.float_idx[j], f"compiled gradient, case {k} {case.attrs}")
            assert np.asarray(g).dtype == np.float32, f"{where}: dtype {np.asarray(g).dtype}"
            _check_close(e, g, COMPILED_RTOL, COMPILED_ATOL, where)


# -- (d) the compiled gradient on Vulkan (lavapipe) against the CPU's -------------------------
# Under -m slow: lavapipe's compiles and runs cost the 2-core CI ~6 s an op, and its
# threads poll while a device is open; a training step on Vulkan runs in the default
# suite (test_readme's Targets section).


def _vulkan_params():
    out = []
    for name in DIFF_OPS:
        marks = [pytest.mark.slow]
        if name in XFAIL:
            marks.append(pytest.mark.xfail(strict=True, reason=XFAIL[name]))
        out.append(pytest.param(name, id=name, marks=marks))
    return out


def test_compiled_slow_names_registry_ops():
    assert COMPILED_SLOW <= set(DIFF_OPS), sorted(COMPILED_SLOW - set(DIFF_OPS))


@pytest.mark.skipif(not driver_present("vulkan"),
                    reason="no Vulkan device (apt-get install mesa-vulkan-drivers)")
@pytest.mark.parametrize("opname", _vulkan_params())
def test_grad_compiled_vulkan(opname):
    for k, case in enumerate(_cases(opname)):
        p = Problem(opname, case, np.float32, seed=k)
        g = tc.grad(p.f, argnums=p.argnums)
        cpu = tc.compile(g, *p.args)(*p.args)
        gpu = tc.compile(g, *p.args, target="vulkan")(*p.args)
        cpu = cpu if isinstance(cpu, (tuple, list)) else (cpu,)
        gpu = gpu if isinstance(gpu, (tuple, list)) else (gpu,)
        assert len(gpu) == len(cpu)
        for j, (c, v) in enumerate(zip(cpu, gpu)):
            where = _where(opname, p.float_idx[j], f"Vulkan gradient, case {k} {case.attrs}")
            _check_close(c, v, COMPILED_RTOL, COMPILED_ATOL, where)
