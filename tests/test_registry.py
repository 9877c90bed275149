"""Generated from the op registry: every op is compiled with IREE and compared with its
NumPy reference. An op without an example here fails `test_every_op_has_an_example`."""
import numpy as np
import pytest

import iree.runtime as rt
from tercomp.codegen.iree_session import HOST_CPU_FLAGS, compile_module, new_session
from tercomp.lowering import to_mlir
from tercomp.ir import Graph, TensorType
from tercomp.kernels import table as kernel_table
from tercomp.ops import REGISTRY, GraphBuilder, interpret

rng = np.random.default_rng(0)


def f32(*shape, positive=False):
    x = rng.standard_normal(shape).astype(np.float32)
    return np.abs(x) + 0.5 if positive else x


def ints(hi, *shape):
    return rng.integers(0, hi, size=shape).astype(np.int32)


def _body(n_in):
    """A small op body: (c, x[, w]) -> (tanh(c * w + x), its square)."""
    g = Graph(name="body")
    b = GraphBuilder(g)
    c, x, *w = [g.add_input(n, TensorType((3,), "f32")) for n in ("c", "x", "w")[:n_in]]
    h = b.tanh(b.add(b.mul(c, w[0]) if w else c, x))
    g.set_outputs([h, b.mul(h, h)])
    return g


# op -> (operand arrays, attrs, symbolic-first-dim?)
EXAMPLES = {
    "neg": ([f32(3, 4)], {}), "exp": ([f32(3, 4)], {}), "log": ([f32(3, 4, positive=True)], {}),
    "sqrt": ([f32(3, 4, positive=True)], {}), "rsqrt": ([f32(3, 4, positive=True)], {}),
    "tanh": ([f32(3, 4)], {}), "sigmoid": ([f32(3, 4) * 5], {}), "relu": ([f32(3, 4)], {}),
    "sin": ([f32(3, 4) * 4], {}), "cos": ([f32(3, 4) * 4], {}), "exp2": ([f32(3, 4)], {}),
    "log2": ([f32(3, 4, positive=True)], {}),
    "silu": ([f32(3, 4)], {}), "gelu": ([f32(3, 4)], {}), "abs": ([f32(3, 4)], {}),
    "sign": ([f32(3, 4)], {}), "pow": ([f32(3, 4, positive=True)], {"exponent": 1.5}),
    "add": ([f32(3, 4), f32(4)], {}), "sub": ([f32(3, 4), f32(3, 1)], {}),
    "mul": ([f32(3, 4), f32(3, 4)], {}), "div": ([f32(3, 4), f32(4, positive=True)], {}),
    "maximum": ([f32(3, 4), f32(3, 4)], {}), "minimum": ([f32(3, 4), f32(4)], {}),
    "lt": ([f32(3, 4), f32(3, 4)], {}), "le": ([f32(3, 4), f32(4)], {}),
    "gt": ([f32(3, 4), f32(3, 4)], {}), "ge": ([f32(3, 4), f32(3, 4)], {}),
    "eq": ([np.array([[1, 2], [3, 3]], np.float32), np.array([1, 3], np.float32)], {}),
    "ne": ([np.array([[1, 2], [3, 3]], np.float32), np.array([1, 3], np.float32)], {}),
    "where": ([f32(3, 4) > 0, f32(3, 4), f32(4)], {}),
    "cast": ([f32(3, 4) * 10], {"dtype": "i32"}),
    "constant": ([], {"value": f32(2, 3)}),
    "stop_gradient": ([f32(3, 4)], {}),
    "custom_vjp": ([f32(3, 4), f32(3, 4)], {"rule": "test#0", "n_outputs": 1, "n_inputs": 1}),
    "sum": ([f32(3, 4, 5)], {"axes": [0, 2], "keepdims": False}),
    "mean": ([f32(3, 4, 5)], {"axes": [1], "keepdims": True}),
    "max": ([f32(3, 4)], {"axes": [1]}), "min": ([f32(3, 4)], {"axes": [0], "keepdims": True}),
    "argmax": ([f32(3, 5)], {"axis": 1}),
    "matmul": ([f32(2, 3, 4), f32(4, 5)], {}),
    "matmul_sum": ([f32(2, 3, 4), f32(2, 5, 4)], {}),
    "widening_matmul": ([f32(3, 8), np.arange(-20, 20, dtype=np.int8).reshape(5, 8)],
                        {"kernel": "generic"}),
    "reshape": ([f32(3, 4)], {"shape": [2, 6]}),
    "transpose": ([f32(2, 3, 4)], {"perm": [2, 0, 1]}),
    "broadcast_to": ([f32(3, 1)], {"shape": [2, 3, 4]}),
    "expand_dims": ([f32(3, 4)], {"axis": 1}),
    "squeeze": ([f32(3, 1, 4)], {"axes": [1]}),
    "concatenate": ([f32(3, 4), f32(2, 4)], {"axis": 0}),
    "slice": ([f32(6, 5)], {"starts": [1, 0], "stops": [5, 5], "steps": [2, 1]}),
    "unslice": ([f32(2, 5)], {"shape": [6, 5], "starts": [1, 0], "stops": [5, 5], "steps": [2, 1]}),
    "split": ([f32(3, 6)], {"axis": 1, "sizes": [2, 4]}),
    "take": ([f32(5, 3), ints(5, 4)], {"axis": 0}),
    "scatter_add": ([f32(4, 3), ints(5, 4)], {"axis": 0, "size": 5}),
    "size": ([f32(3, 4)], {"axes": [0, 1]}),
    "softmax": ([f32(3, 4)], {"axis": -1}), "log_softmax": ([f32(3, 4)], {"axis": 1}),
    "logsumexp": ([f32(3, 4)], {"axes": [1]}),
    "layer_norm": ([f32(3, 4), f32(4), f32(4)], {"eps": 1e-5}),
    "rms_norm": ([f32(3, 4), f32(4)], {"eps": 1e-6}),
    "pad": ([f32(3, 4)], {"widths": [[1, 2], [0, 1]]}),
    "one_hot": ([ints(4, 5)], {"num_classes": 4}),
    "cross_entropy": ([f32(3, 4), ints(4, 3)], {}),
    "conv": ([f32(2, 4, 6, 5), f32(6, 2, 3, 2)], {"stride": [2, 1], "padding": [[1, 0], [1, 1]],
                                                "dilation": [1, 2], "groups": 2}),
    "conv_transpose": ([f32(2, 4, 3, 5), f32(4, 3, 3, 2)],
                       {"stride": [2, 1], "padding": [[1, 0], [1, 1]], "dilation": [1, 2],
                        "groups": 2, "output_padding": [1, 0]}),
    "conv_weight_grad": ([f32(2, 4, 6, 5), f32(2, 6, 3, 5)],
                         {"stride": [2, 1], "padding": [[1, 0], [1, 1]], "dilation": [1, 2],
                          "groups": 2, "kernel": [3, 2]}),
    "im2col": ([f32(2, 3, 6, 5)], {"kernel": [3, 2], "stride": [2, 1], "padding": [[1, 0], [1, 1]],
                                   "dilation": [1, 2]}),
    "max_pool": ([f32(2, 3, 5, 4)], {"window": [2, 2], "stride": [2, 1], "padding": [[1, 0], [0, 1]]}),
    "avg_pool": ([f32(2, 3, 7)], {"window": [3], "stride": [2], "padding": [[1, 1]]}),
    "round": ([f32(3, 4) * 3], {}),
    "ternarize": ([f32(5, 6)], {}),
    "act_quant": ([f32(3, 7)], {}),
    "ternary_matmul": ([f32(3, 8), np.array([[0x45, 0x12], [0x21, 0x00], [0x09, 0x64]], np.int8)],
                       {"k": 8, "n": 3, "scale": 0.75, "strategy": "addsub", "act_quant": True}),
    "ternary_pack": ([np.array([[0.5, -0.5, 0, 0.5, 0, 0, -0.5, 0.5, -0.5, 0],
                                [0, 0, 0.5, -0.5, 0.5, 0.5, 0, 0, 0, -0.5]], np.float32)],
                     {"codes": "offset"}),
    "ternary_weight": ([np.array([[0x45, 0x12], [0x21, 0x00], [0x09, 0x64]], np.int8)],
                       {"k": 8, "scale": 0.75}),
    "arange": ([ints(3, 5), np.array(3, np.int32)], {}),
    "cache_write": ([f32(8, 2, 4), f32(3, 2, 4), np.array(2, np.int32)], {}),
    "scan": ([f32(3), f32(5, 3), f32(3)], {"body": _body(3), "n_carry": 1, "n_xs": 1, "length": 5,
                                            "reverse": True}),
    "checkpoint": ([f32(3), f32(3)], {"body": _body(2)}),
    "cached_attention": ([f32(2, 4, 4), f32(8, 2, 4), f32(8, 2, 4), np.array(3, np.int32)],
                         {"scale": 0.5}),
    "rope": ([f32(3, 2, 8), f32(3, 4), f32(3, 4)], {"style": "interleaved"}),
    "kv_scatter": ([f32(3, 8, 2, 4), f32(3, 2, 4), np.array([2, 0, 2], np.int32),
                    np.array([5, 0, 6], np.int32)], {}),
    "slot_attention": ([f32(3, 4, 4), f32(3, 8, 2, 4), f32(3, 8, 2, 4), np.array([2, 0, 2], np.int32),
                        np.array([5, 0, 6], np.int32)], {"scale": 0.5}),
}

# Ops whose examples are owned by another family's test file (still must be listed here).
SKIP_COMPILE = set()


def test_every_op_has_an_example():
    missing = sorted(set(REGISTRY) - set(EXAMPLES) - SKIP_COMPILE)
    assert not missing, f"ops without a compile test example in tests/test_registry.py: {missing}"


def test_every_op_can_be_lowered():
    """Every op has a lowering or a decomposition, or (the ternary matmul, which has no
    generic form) kernels of the kernel table for every target, one of which the passes
    settle it to."""
    emitted = [n for n in kernel_table.UNSETTLED
               if any(r.compiles_for(kernel_table.ALL_TARGETS) for r in kernel_table.rows(n))]
    bad = [n for n, d in REGISTRY.items() if d.lower is None and d.decompose is None
           and n not in SKIP_COMPILE and n not in emitted]
    assert not bad, f"ops with neither a lowering nor a decomposition: {bad}"


def _graph(name):
    arrays, attrs = EXAMPLES[name]
    g = Graph(name=f"op_{name}")
    b = GraphBuilder(g)
    ins = [g.add_input(f"a{i}", TensorType(a.shape, a.dtype)) for i, a in enumerate(arrays)]
    out = b.emit(name, *ins, **attrs)
    outs = list(out) if isinstance(out, tuple) else [out]
    g.set_outputs(outs)
    return g, arrays


@pytest.fixture(scope="module")
def compiled_all():
    """All examples as functions of one module: one IREE compile for the whole table."""
    names = sorted(n for n in EXAMPLES if n in REGISTRY)
    graphs = {n: _graph(n) for n in names}
    session, ctx = new_session()
    module = to_mlir([g for g, _ in graphs.values()], ctx).module
    vmfb = compile_module(session, module, HOST_CPU_FLAGS)
    config = rt.Config("local-task")
    sysctx = rt.SystemContext(config=config)
    sysctx.add_vm_module(rt.VmModule.copy_buffer(sysctx.instance, vmfb))
    return graphs, sysctx.modules.module


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_op_matches_reference(name, compiled_all):
    graphs, mod = compiled_all
    if name not in graphs:
        pytest.fail(f"{name} is in the example table but not in the registry")
    g, arrays = graphs[name]
    want = interpret(g, *arrays)
    got = mod[g.name](*arrays)
    got = list(got) if isinstance(got, (list, tuple)) else [got]
    for w, h in zip(want, got):
        h = np.asarray(h.to_host() if hasattr(h, "to_host") else h)
        if w.dtype == np.bool_:
            h = h.astype(bool)
        assert h.shape == w.shape, f"{name}: shape {h.shape} != reference {w.shape}"
        np.testing.assert_allclose(h, w, rtol=1e-5, atol=1e-6, err_msg=f"tern.{name} vs its reference")


def test_elementwise_ops_have_their_tc_function():
    # generated from the registry (trace/api.py): a new elementwise op needs no API edit
    import tercomp as tc
    from tercomp.ops.registry import REQUIRED
    from tercomp.tracing.api import NUMPY_NAMES
    for name, d in REGISTRY.items():
        if d.family == "elementwise" and d.num_operands in (1, 2) and \
                not any(v is REQUIRED for v in d.attrs.values()):
            for alias in NUMPY_NAMES.get(name, (name,)):
                fn = getattr(tc, alias)
                x = np.full((2,), 0.5, np.float32)
                got = fn(*[x] * d.num_operands)
                want = d.reference([x] * d.num_operands, dict(d.attrs))[0]
                np.testing.assert_array_equal(got, want, err_msg=alias)


def test_registry_ops_with_a_method_form_have_their_method():
    # generated from OpDef.method (trace/api.py): an op's method needs no API edit
    import tercomp as tc
    from tercomp.tracing.tracer import METHODS
    methods = {d.method: name for name, d in REGISTRY.items() if d.method is not None}
    assert {"sum", "mean", "reshape", "transpose", "astype", "exp"} <= set(methods)
    args = {"reshape": (6,), "astype": ("int32",)}
    for method, opname in methods.items():
        assert method in METHODS, f"tern.{opname} declares the method .{method}(), which traced tensors lack"
        g = tc.trace(lambda x: getattr(x, method)(*args.get(method, ())),
                     np.full((2, 1, 3), 0.5, np.float32))
        assert [op.opname for op in g.ops] == [opname], f"x.{method}() traced to {[op.opname for op in g.ops]}"
