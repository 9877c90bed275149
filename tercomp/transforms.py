"""Function transforms: grad, value_and_grad, vjp, jvp, custom_vjp.

They compose with each other and with tc.trace / tc.compile. Called on traced values
they record the forward ops into the current trace and append the backward built by
`passes.autodiff.backward`; called on NumPy arrays they trace themselves and run the
reference interpreter, returning NumPy arrays (handy for checks and finite differences).
"""
from __future__ import annotations

import functools
import itertools
import json

import numpy as np

from .errors import TercompError
from .passes.autodiff import backward, check_differentiable, saved_for_backward, seed_for
from . import pytree
from .trace.tracer import Trace, Tracer, current_trace, user_location


def _tracers(tree):
    leaves, _, _ = pytree.flatten(tree)
    return [x for x in leaves if isinstance(x, Tracer)]


def _eager(fn, *args):
    """Run `fn(*args)` by tracing it and interpreting the graph (no tracer among args)."""
    from .ops import interpret
    from .trace import trace
    g = trace(fn, *args, name="eager")
    leaves, _, _ = pytree.flatten(tuple(args))
    outs = interpret(g, *[np.asarray(x) for x in leaves])
    return pytree.unflatten(g.meta["out_tree"], outs)


def _active_trace(args):
    ts = _tracers(args)
    if not ts:
        return None
    # inside an op body (a scan step) the body's trace records, capturing outer values
    cur = current_trace()
    return cur if getattr(cur, "capture", None) is not None else ts[0].trace


def _as_tracers(tr, tree):
    """Arrays inside `tree` become constants of trace `tr` (so they can be differentiated);
    traced values of an enclosing trace are captured into `tr` when it is an op body."""
    leaves, _, treedef = pytree.flatten(tree)
    lift = getattr(tr, "capture", None)
    conv = [(Tracer(lift(x), tr) if lift is not None and x.trace is not tr else x) if isinstance(x, Tracer)
            else Tracer(tr.const(np.asarray(x), name="arg"), tr) for x in leaves]
    return pytree.unflatten(treedef, conv, on_module=lambda m, vals: (m._load_params(vals), m)[1])


class _Transform:
    def __init__(self, fn):
        self.fn = fn
        functools.update_wrapper(self, fn, updated=())


class GradFn(_Transform):
    """The function returned by tc.grad / tc.value_and_grad."""

    def __init__(self, fn, argnums=0, has_aux=False, return_value=False):
        super().__init__(fn)
        self.argnums = argnums
        self.has_aux = has_aux
        self.return_value = return_value

    def __call__(self, *args):
        tr = _active_trace(args)
        if tr is None:
            return _eager(self, *args)
        what = "tc.value_and_grad" if self.return_value else "tc.grad"
        loc = user_location()
        nums = (self.argnums,) if isinstance(self.argnums, int) else tuple(self.argnums)
        for i in nums:
            if not -len(args) <= i < len(args):
                raise TercompError(f"{what}: argnums {self.argnums} is out of range for "
                                   f"{len(args)} arguments", loc=loc)
        args = list(args)
        for i in nums:
            args[i] = _as_tracers(tr, args[i])
        wrt_trees = [pytree.flatten(args[i]) for i in nums]
        wrt = [t for leaves, _, _ in wrt_trees for t in leaves]
        check_differentiable([t.value for t in wrt], what, loc)
        start = len(tr.graph.ops)
        result = self.fn(*args)
        if self.has_aux:
            if not (isinstance(result, (tuple, list)) and len(result) == 2):
                raise TercompError(f"{what}(has_aux=True): the function must return (value, aux)", loc=loc)
            out, aux = result
        else:
            out, aux = result, None
        if not isinstance(out, Tracer):
            raise TercompError(f"{what}: the function's output does not depend on its inputs", loc=loc)
        b = tr.builder
        b.loc = loc
        seed = seed_for(b, out.value, what, loc)
        mid = len(tr.graph.ops)
        grads = backward(b, tr.graph.ops[start:], {out.value: seed}, [t.value for t in wrt])
        tr.graph.meta.setdefault("saved_for_backward", []).extend(
            saved_for_backward(tr.graph.ops[start:mid], tr.graph.ops[mid:]))
        from .passes.autodiff import zeros_like
        grads = [Tracer(g if g is not None else zeros_like(b, t.value), tr) for g, t in zip(grads, wrt)]
        it = iter(grads)
        trees = [pytree.unflatten(treedef, [next(it) for _ in leaves]) for leaves, _, treedef in wrt_trees]
        g = trees[0] if isinstance(self.argnums, int) else tuple(trees)
        if self.return_value:
            return ((out, aux) if self.has_aux else out), g
        return (g, aux) if self.has_aux else g


def grad(fn, argnums=0, has_aux=False):
    """Gradient of a scalar function, as in JAX: `tc.grad(f)(x)`; argnums int or tuple.
    Grads with respect to an nn.Module come back as a dict under the parameter names.

    >>> dloss = tc.grad(loss)            # loss(params, x, y) -> scalar
    >>> exe = tc.compile(dloss, params, x, y)
    """
    return GradFn(fn, argnums, has_aux, return_value=False)


def value_and_grad(fn, argnums=0, has_aux=False):
    """Like grad, returning (value, grads) (or ((value, aux), grads) with has_aux)."""
    return GradFn(fn, argnums, has_aux, return_value=True)


def vjp(fn, *primals):
    """(out, vjp_fn) with vjp_fn(cotangent) -> tuple of cotangents, one per primal."""
    tr = _active_trace(primals)
    if tr is None:
        out = _eager(fn, *primals)

        def vjp_fn_eager(ct):
            return _eager(lambda p, c: vjp(fn, *p)[1](c), tuple(primals), ct)
        return out, vjp_fn_eager
    primals = [_as_tracers(tr, p) for p in primals]
    trees = [pytree.flatten(p) for p in primals]
    start = len(tr.graph.ops)
    out = fn(*primals)
    fwd_ops = tr.graph.ops[start:]
    out_leaves, _, out_tree = pytree.flatten(out)

    def vjp_fn(ct):
        loc = user_location()
        ct_leaves, _, ct_tree = pytree.flatten(ct)
        if len(ct_leaves) != len(out_leaves):
            raise TercompError(f"vjp: the cotangent has {len(ct_leaves)} leaves, the output {len(out_leaves)}",
                               loc=loc)
        cts = [c if isinstance(c, Tracer) else Tracer(tr.const(np.asarray(c), name="ct"), tr)
               for c, o in zip(ct_leaves, out_leaves)]
        for c, o in zip(cts, out_leaves):
            if tuple(c.shape) != tuple(o.shape):
                raise TercompError(f"vjp: cotangent shape {list(c.shape)} does not match output shape "
                                   f"{list(o.shape)}", loc=loc)
        tr.builder.loc = loc
        wrt = [t for leaves, _, _ in trees for t in leaves]
        seeds = {o.value: c.value for o, c in zip(out_leaves, cts) if isinstance(o, Tracer)}
        gs = backward(tr.builder, fwd_ops, seeds, [t.value for t in wrt])
        from .passes.autodiff import zeros_like
        gs = [Tracer(g if g is not None else zeros_like(tr.builder, t.value), tr) for g, t in zip(gs, wrt)]
        it = iter(gs)
        return tuple(pytree.unflatten(treedef, [next(it) for _ in leaves]) for leaves, _, treedef in trees)
    return out, vjp_fn


def jvp(fn, primals, tangents):
    """(out, tangent_out): forward-mode derivative, computed by transposing the VJP
    (the VJP is linear in its cotangent, so its own VJP applies the Jacobian)."""
    primals, tangents = tuple(primals), tuple(tangents)
    tr = _active_trace((primals, tangents))
    if tr is None:
        return _eager(lambda p, t: jvp(fn, p, t), primals, tangents)
    out, f_vjp = vjp(fn, *primals)
    leaves, _, tree = pytree.flatten(out)
    from .trace.api import multiply
    dummy = pytree.unflatten(tree, [multiply(x, 0.0) for x in leaves])
    _, g_vjp = vjp(lambda u: f_vjp(u), dummy)
    (t_out,) = g_vjp(tangents)
    return out, t_out


_CUSTOM_RULES: dict = {}
_rule_ids = itertools.count()


class custom_vjp(_Transform):
    """A function with a user-defined backward, as jax.custom_vjp:

    >>> @tc.custom_vjp
    ... def ste_round(x): return tc.round(x)
    >>> ste_round.defvjp(lambda x: (ste_round.fn(x), ()), lambda res, g: (g,))
    """

    def __init__(self, fn):
        super().__init__(fn)
        self.fwd = None
        self.bwd = None
        self.rule = f"{getattr(fn, '__name__', 'custom')}#{next(_rule_ids)}"
        _CUSTOM_RULES[self.rule] = self

    def defvjp(self, fwd, bwd):
        """fwd(*args) -> (out, residuals); bwd(residuals, g) -> tuple of grads per arg."""
        self.fwd, self.bwd = fwd, bwd
        return self

    def __call__(self, *args):
        tr = _active_trace(args)
        if tr is None:
            return _eager(self, *args)
        if self.fwd is None:
            raise TercompError(f"custom_vjp {self.rule}: call defvjp(fwd, bwd) before using it",
                               loc=user_location())
        args = [_as_tracers(tr, a) for a in args]
        out, res = self.fwd(*args)
        arg_leaves = [t for a in args for t in pytree.flatten(a)[0]]
        res_leaves = [r if isinstance(r, Tracer) else Tracer(tr.const(np.asarray(r), name="res"), tr)
                      for r in pytree.flatten(res)[0]]
        out_leaves, _, out_tree = pytree.flatten(out)
        from .trace.tracer import apply
        results = apply("custom_vjp", *out_leaves, *arg_leaves, *res_leaves, rule=self.rule,
                        n_outputs=len(out_leaves), n_inputs=len(arg_leaves),
                        res_tree=json.dumps(pytree.jsonable(pytree.flatten(res)[2])))
        results = results if isinstance(results, tuple) else (results,)
        return pytree.unflatten(out_tree, list(results))


def run_custom_bwd(b, op, cts):
    """VJP of tern.custom_vjp: call the user's bwd on traced values."""
    rule = _CUSTOM_RULES.get(op.attrs["rule"])
    if rule is None:
        raise TercompError(f"custom_vjp rule {op.attrs['rule']!r} is not defined in this process",
                           loc=op.loc)
    n_out, n_in = op.attrs["n_outputs"], op.attrs["n_inputs"]
    ins = op.operands[n_out:n_out + n_in]
    res = op.operands[n_out + n_in:]
    tr = Trace(b.graph)
    tr.builder = b
    with tr:
        try:
            res_tree = json.loads(op.attrs["res_tree"])
        except (ValueError, RecursionError):
            raise TercompError(f"custom_vjp {rule.rule}: malformed res_tree attribute", loc=op.loc) from None
        res_vals = pytree.unflatten(res_tree, [Tracer(v, tr) for v in res])
        g = [Tracer(c, tr) for c in cts]
        grads = rule.bwd(res_vals, g[0] if len(g) == 1 else tuple(g))
    grads = grads if isinstance(grads, (tuple, list)) else (grads,)
    if len(grads) != n_in:
        raise TercompError(f"custom_vjp {rule.rule}: bwd returned {len(grads)} gradients for {n_in} inputs",
                           loc=op.loc)
    out = [None] * n_out
    for x, gr in zip(ins, grads):
        if gr is None:
            out.append(None)
        elif isinstance(gr, Tracer):
            out.append(gr.value)
        else:
            from .ir import numpy_dtype
            if not x.type.is_static:
                raise TercompError(f"custom_vjp {rule.rule}: bwd must return traced values for inputs "
                                   "with symbolic shapes", loc=op.loc)
            out.append(b.constant(np.broadcast_to(np.asarray(gr, dtype=numpy_dtype(x.dtype)),
                                                  [int(d) for d in x.shape]).copy()))
    return out + [None] * len(res)
