"""Reverse-mode autodiff over tern IR, and the function transforms built on it.

The core is `backward`: it walks a region of ops in reverse and asks each op's registry
entry for its VJP, written in tern ops, so the backward graph is ordinary IR: it is
simplified, lowered and compiled like any other code, and can be differentiated again.
Composite ops without a VJP rule are differentiated through their decomposition.
Backward values are named after their primals (`%fc1.weight.grad`).

The transforms (grad, value_and_grad, vjp, jvp, custom_vjp) compose with each other and
with tc.trace / tc.compile. Called on traced values they record the forward ops into the
current trace and append the backward (`_cotangents`: seeds -> backward -> zeros for
unreachable inputs -> the primals' pytrees); called on NumPy arrays they trace
themselves and run the reference interpreter, returning NumPy arrays (handy for checks
and finite differences).

tern.custom_vjp's VJP calls the user's bwd on traced values, so it is installed into
the registry from here, where the tracer is at hand; ops never import autodiff.
"""
from __future__ import annotations

import functools
import itertools
import json

import numpy as np

from .. import pytree
from ..errors import (TraceError, VerifyError, ConfigError, InputError, UnsupportedError,
                      InternalError)
from ..ir import Graph, Value, numpy_dtype
from ..ir.types import is_float
from ..ops import GraphBuilder, get, interpret
from ..passes.manager import register_pass
from ..tracing import trace
from ..tracing.api import multiply
from ..tracing.tracer import Trace, Tracer, apply, current_trace, user_location


# -- the reverse walk ------------------------------------------------------------------------
def zeros_like(b: GraphBuilder, v: Value) -> Value:
    z = b.scalar(0.0, v.dtype)
    if v.type.rank == 0:
        return z
    return b.emit("broadcast_to", z, shape=[d if isinstance(d, int) else str(d) for d in v.shape])


def _propagates(op, active) -> bool:
    """Whether gradients flow from an active operand of `op` to its results. Not through
    operands the op declares non-differentiable (`size`'s, `stop_gradient`'s), so ops
    downstream of them need no gradient rule and get no backward code."""
    opdef = get(op.opname)
    if not opdef.differentiable:
        return False
    return any(id(v) in active for i, v in enumerate(op.operands) if i not in opdef.nondiff_operands)


def backward(b: GraphBuilder, ops: list, seeds: dict, wrt: list) -> list:
    """Cotangents of `wrt` given `seeds` {output Value: cotangent Value}, through `ops`
    (in topological order). Returns one Value (or None if unreachable) per `wrt`."""
    graph = b.graph
    start = len(graph.ops)
    active = {id(v) for v in wrt}
    region = []
    for op in ops:
        if _propagates(op, active):
            region.append(op)
            for r in op.results:
                if is_float(r.dtype):
                    active.add(id(r))
    ct: dict = {}
    for v, g in seeds.items():
        if id(v) in active:
            ct[id(v)] = g
    finalized = []
    for op in reversed(region):
        cts = [ct.get(id(r)) for r in op.results]
        if all(c is None for c in cts):
            continue
        for r, c in zip(op.results, cts):
            if c is not None:
                finalized.append((c, r.name))
        opdef = get(op.opname)
        b.loc = op.loc
        cts = [c if c is not None else zeros_like(b, r) for r, c in zip(op.results, cts)]
        # a rule may decline a case it does not cover (None): the decomposition's then
        grads = opdef.vjp(b, op, cts) if opdef.vjp is not None else None
        if grads is None:
            grads = _decomposition_vjp(b, op, cts)
        for i, (v, g) in enumerate(zip(op.operands, grads)):
            if g is None or id(v) not in active or i in opdef.nondiff_operands:
                continue
            if g.type.shape != v.type.shape and g.type != v.type:
                raise InternalError(f"internal: the VJP of tern.{op.opname} gave operand {i} a cotangent of "
                                    f"type {g.type}, expected {v.type}", loc=op.loc)
            ct[id(v)] = g if id(v) not in ct else b.add(ct[id(v)], g)
    results = [ct.get(id(v)) for v in wrt]
    _name_cotangents(graph, start, [(g, v.name) for g, v in zip(results, wrt) if g is not None] + finalized)
    return results


def _decomposition_vjp(b: GraphBuilder, op, cts) -> list:
    """The cotangents of op's operands through its decomposition (a composite op without
    a rule of its own, or one whose rule declined)."""
    opdef = get(op.opname)
    if opdef.decompose is None:
        raise UnsupportedError(f"tern.{op.opname} has no gradient rule", loc=op.loc,
                               hint="wrap the computation in tc.stop_gradient(...) or define a "
                                    "rule with tc.custom_vjp")
    start = len(b.graph.ops)
    outs = opdef.decompose(b, list(op.operands), op.attrs)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    return backward(b, b.graph.ops[start:], dict(zip(outs, cts)), list(op.operands))


def _name_cotangents(graph: Graph, start: int, pairs):
    created = {id(r) for op in graph.ops[start:] for r in op.results}
    done = set()
    for g, primal in pairs:
        if id(g) in created and id(g) not in done:
            g.name = graph.fresh_name(f"{primal}.grad")
            g.grad_of = primal
            done.add(id(g))


def saved_for_backward(fwd_ops, bwd_ops) -> list:
    """The values a backward reads from its forward (activations, stacked scan residuals),
    constants aside: [[name, shape with symbolic dims as text, dtype]], JSON-able so a
    compiled module can report them (CompiledModule.memory_report)."""
    made = {id(r) for op in fwd_ops if op.opname != "constant" for r in op.results}
    out, seen = [], set()
    for op in bwd_ops:
        for v in op.operands:
            if id(v) in made and id(v) not in seen:
                seen.add(id(v))
                out.append([v.name, [d if isinstance(d, int) else str(d) for d in v.shape], v.dtype])
    return out


def seed_for(b: GraphBuilder, out: Value, what: str, loc=None) -> Value:
    if out.type.rank != 0:
        raise TraceError(f"{what} needs a scalar output, but the function returns "
                         f"%{out.name} of shape {out.type}", loc=loc,
                         hint="reduce it first (tc.sum / tc.mean), or use tc.vjp with a cotangent")
    if not is_float(out.dtype):
        raise TraceError(f"{what}: the output %{out.name} is {out.dtype}, not floating point", loc=loc)
    return b.scalar(1.0, out.dtype)


def check_differentiable(values, what, loc=None):
    for v in values:
        if not is_float(v.dtype):
            raise TraceError(f"{what}: input %{v.name} is {v.dtype}; only floating-point inputs "
                             "can be differentiated", loc=loc,
                             hint="leave integer inputs (labels, ids) out of argnums")


# -- the glue between traced functions and the reverse walk ---------------------------------
def _eager(fn, *args):
    """Run `fn(*args)` by tracing it and interpreting the graph (no tracer among args)."""
    g = trace(fn, *args, name="eager")
    leaves, _, _ = pytree.flatten(tuple(args))
    outs = interpret(g, *[np.asarray(x) for x in leaves])
    return pytree.unflatten(g.meta["out_tree"], outs)


def _active_trace(args):
    leaves, _, _ = pytree.flatten(args)
    ts = [x for x in leaves if isinstance(x, Tracer)]
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


def _cotangents(tr, fwd_ops, seeds: dict, trees: list) -> list:
    """Append the backward of `fwd_ops` from `seeds` {output Value: cotangent Value} to
    trace `tr`. `trees` are the flattened primals (pytree.flatten results); returns their
    cotangents as pytrees of the same structure, zeros where no gradient reaches."""
    b = tr.builder
    wrt = [t for leaves, _, _ in trees for t in leaves]
    grads = backward(b, fwd_ops, seeds, [t.value for t in wrt])
    it = iter([Tracer(g if g is not None else zeros_like(b, t.value), tr) for g, t in zip(grads, wrt)])
    return [pytree.unflatten(treedef, [next(it) for _ in leaves]) for leaves, _, treedef in trees]


@register_pass("autodiff")
def autodiff(graph: Graph, wrt: list | None = None, return_value: bool = False,
             has_aux: bool = False) -> Graph:
    """The pass form of tc.grad over IR (`tercomp opt --pass autodiff`): append the
    backward of output 0 (a float scalar) with respect to the inputs at indices `wrt`
    (default: every float input). Outputs become [value?, aux?, *grads]."""
    wrt = [i for i, v in enumerate(graph.inputs) if is_float(v.dtype)] if wrt is None else wrt
    out = graph.outputs[0]
    loc = out.producer.loc if out.producer is not None else None
    primals = [graph.inputs[i] for i in wrt]
    check_differentiable(primals, "grad", loc)
    b = GraphBuilder(graph, loc) if loc is not None else GraphBuilder(graph)
    grads = backward(b, list(graph.ops), {out: seed_for(b, out, "grad", loc)}, primals)
    grads = [g if g is not None else zeros_like(b, v) for g, v in zip(grads, primals)]
    keep = ([0] if return_value else []) + (list(range(1, len(graph.outputs))) if has_aux else [])
    graph.set_outputs([graph.outputs[i] for i in keep] + grads,
                      [graph.output_names[i] for i in keep] + [f"{v.name}.grad" for v in primals])
    return graph


# -- grad, value_and_grad, vjp, jvp ----------------------------------------------------------
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
                raise ConfigError(f"{what}: argnums {self.argnums} is out of range for "
                                  f"{len(args)} arguments", loc=loc)
        args = list(args)
        for i in nums:
            args[i] = _as_tracers(tr, args[i])
        wrt_trees = [pytree.flatten(args[i]) for i in nums]
        check_differentiable([t.value for leaves, _, _ in wrt_trees for t in leaves], what, loc)
        start = len(tr.graph.ops)
        result = self.fn(*args)
        if self.has_aux:
            if not (isinstance(result, (tuple, list)) and len(result) == 2):
                raise TraceError(f"{what}(has_aux=True): the function must return (value, aux)", loc=loc)
            out, aux = result
        else:
            out, aux = result, None
        if not isinstance(out, Tracer):
            raise TraceError(f"{what}: the function's output does not depend on its inputs", loc=loc)
        tr.builder.loc = loc
        seed = seed_for(tr.builder, out.value, what, loc)
        mid = len(tr.graph.ops)
        trees = _cotangents(tr, tr.graph.ops[start:], {out.value: seed}, wrt_trees)
        tr.graph.meta.setdefault("saved_for_backward", []).extend(
            saved_for_backward(tr.graph.ops[start:mid], tr.graph.ops[mid:]))
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
            raise InputError(f"vjp: the cotangent has {len(ct_leaves)} leaves, the output {len(out_leaves)}",
                             loc=loc)
        cts = [c if isinstance(c, Tracer) else Tracer(tr.const(np.asarray(c), name="ct"), tr)
               for c, o in zip(ct_leaves, out_leaves)]
        for c, o in zip(cts, out_leaves):
            if tuple(c.shape) != tuple(o.shape):
                raise InputError(f"vjp: cotangent shape {list(c.shape)} does not match output shape "
                                 f"{list(o.shape)}", loc=loc)
        tr.builder.loc = loc
        seeds = {o.value: c.value for o, c in zip(out_leaves, cts) if isinstance(o, Tracer)}
        return tuple(_cotangents(tr, fwd_ops, seeds, trees))
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
    dummy = pytree.unflatten(tree, [multiply(x, 0.0) for x in leaves])
    _, g_vjp = vjp(lambda u: f_vjp(u), dummy)
    (t_out,) = g_vjp(tangents)
    return out, t_out


# -- custom_vjp ------------------------------------------------------------------------------
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
            raise TraceError(f"custom_vjp {self.rule}: call defvjp(fwd, bwd) before using it",
                             loc=user_location())
        args = [_as_tracers(tr, a) for a in args]
        out, res = self.fwd(*args)
        arg_leaves = [t for a in args for t in pytree.flatten(a)[0]]
        res_leaves = [r if isinstance(r, Tracer) else Tracer(tr.const(np.asarray(r), name="res"), tr)
                      for r in pytree.flatten(res)[0]]
        out_leaves, _, out_tree = pytree.flatten(out)
        results = apply("custom_vjp", *out_leaves, *arg_leaves, *res_leaves, rule=self.rule,
                        n_outputs=len(out_leaves), n_inputs=len(arg_leaves),
                        res_tree=json.dumps(pytree.jsonable(pytree.flatten(res)[2])))
        results = results if isinstance(results, tuple) else (results,)
        return pytree.unflatten(out_tree, list(results))


def _custom_vjp_rule(b, op, cts):
    """VJP of tern.custom_vjp: call the user's bwd on traced values."""
    rule = _CUSTOM_RULES.get(op.attrs["rule"])
    if rule is None:
        raise TraceError(f"custom_vjp rule {op.attrs['rule']!r} is not defined in this process",
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
            raise VerifyError(f"custom_vjp {rule.rule}: malformed res_tree attribute", loc=op.loc) from None
        res_vals = pytree.unflatten(res_tree, [Tracer(v, tr) for v in res])
        g = [Tracer(c, tr) for c in cts]
        grads = rule.bwd(res_vals, g[0] if len(g) == 1 else tuple(g))
    grads = grads if isinstance(grads, (tuple, list)) else (grads,)
    if len(grads) != n_in:
        raise TraceError(f"custom_vjp {rule.rule}: bwd returned {len(grads)} gradients for {n_in} inputs",
                         loc=op.loc)
    out = [None] * n_out
    for x, gr in zip(ins, grads):
        if gr is None:
            out.append(None)
        elif isinstance(gr, Tracer):
            out.append(gr.value)
        else:
            if not x.type.is_static:
                raise TraceError(f"custom_vjp {rule.rule}: bwd must return traced values for inputs "
                                 "with symbolic shapes", loc=op.loc)
            out.append(b.constant(np.broadcast_to(np.asarray(gr, dtype=numpy_dtype(x.dtype)),
                                                  [int(d) for d in x.shape]).copy()))
    return out + [None] * len(res)


get("custom_vjp").vjp = _custom_vjp_rule
