"""The shape, reduce, linalg and composite op families.

For every op: its NumPy reference against an independent NumPy computation, its shape
rule (symbolic dims included) and error messages, the print -> parse round trip, its
VJP against central finite differences in float64 (first and second order), and its
MLIR lowering compiled by IREE against the reference. All compiled cases share one
module (one IREE compile), static and dynamic (`?`) dims alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import sympy

import tercomp.ops  # noqa: F401  (registers every family)
import tercomp.ops.composite  # noqa: F401
import tercomp.ops.elementwise  # noqa: F401
import tercomp.ops.linalg  # noqa: F401
import tercomp.ops.reduce  # noqa: F401
import tercomp.ops.shape  # noqa: F401
from tercomp.errors import TraceError
from tercomp.ir import Graph, TensorType, as_dim
from tercomp.ops import parse
from tercomp.ops.interpret import interpret
from tercomp.ops.registry import REGISTRY, GraphBuilder
from tercomp.ops.shape import unbroadcast
from tercomp.ops.shape_util import SLICE_END, attr_to_dim, bind_symbols, dim_to_attr

B, C = as_dim("B"), as_dim("C")
RNG = np.random.default_rng(0)


def rand(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def ints(lo, hi, *shape, dtype=np.int32):
    return RNG.integers(lo, hi, size=shape).astype(dtype)


def types_of(arrays, sym=None):
    """Tensor types of `arrays`; sym[i] (a tuple with names like 'B') overrides a shape."""
    out = []
    for i, a in enumerate(arrays):
        shape = sym[i] if sym and sym[i] is not None else a.shape
        out.append(TensorType(tuple(shape), a.dtype))
    return out


def bindings(types, arrays):
    out = {}
    for t, a in zip(types, arrays):
        for d, n in zip(t.shape, a.shape):
            if isinstance(d, sympy.Symbol):
                out[d] = n
    return out


def graph_of(opname, types, attrs, name="f"):
    g = Graph(name=name)
    ins = [g.add_input(f"x{i}", t) for i, t in enumerate(types)]
    out = GraphBuilder(g).emit(opname, *ins, **attrs)
    g.set_outputs(list(out) if isinstance(out, tuple) else [out])
    return g


def result_types(opname, types, attrs):
    return [v.type for v in graph_of(opname, types, attrs).outputs]


# -- the cases: (op, inputs, attrs, independent NumPy expectation, symbolic shapes) ------
@dataclass
class Case:
    id: str
    op: str
    inputs: list
    attrs: dict
    expect: object                     # inputs -> list of arrays
    sym: list | None = None            # per-input symbolic shapes for a dynamic variant
    compile: bool = True
    diff: tuple = (0,)                 # inputs checked by finite differences

    @property
    def sym_only(self) -> bool:
        """Attributes naming a symbolic dim only make sense with the symbolic shapes."""
        def named(v):
            return isinstance(v, str) or (isinstance(v, list) and any(named(x) for x in v))
        return any(named(v) for v in self.attrs.values())

    def variants(self):
        """The input-shape variants to compile and round-trip: static and/or symbolic."""
        return ([] if self.sym_only else [None]) + ([self.sym] if self.sym else [])


def _np_softmax(x, ax):
    e = np.exp(x.astype(np.float64))
    return e / e.sum(axis=ax, keepdims=True)


def _np_lse(x, axes, keepdims=False):
    with np.errstate(divide="ignore"):
        return np.log(np.exp(x.astype(np.float64)).sum(axis=axes, keepdims=keepdims))


def _np_take(x, idx, axis):
    n = x.shape[axis]
    idx = np.array([[min(max(int(i) + n if i < 0 else int(i), 0), n - 1)] for i in idx.reshape(-1)])
    return np.take(x, idx.reshape(-1), axis=axis)


_X3 = rand(2, 3, 4)
_TIES = np.array([[1.0, 3.0, 3.0, -1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 5.0, 1.0, 5.0]], np.float32)
_IDX = np.array([3, -1, 0, 9, 3], np.int32)
_LABELS = np.array([0, 4, 2, 1], np.int32)

CASES = [
    # shape
    Case("reshape", "reshape", [_X3], {"shape": [4, -1]}, lambda x: [x.reshape(4, 6)]),
    Case("reshape_dyn", "reshape", [_X3], {"shape": ["B", 12]}, lambda x: [x.reshape(2, 12)],
         sym=[("B", 3, 4)]),
    Case("reshape_split", "reshape", [rand(6, 4)], {"shape": [2, 3, 2, 2]},
         lambda x: [x.reshape(2, 3, 2, 2)]),
    Case("reshape_regroup", "reshape", [rand(4, 6)], {"shape": [8, 3]}, lambda x: [x.reshape(8, 3)]),
    Case("reshape_regroup_dyn", "reshape", [rand(2, 4, 6)], {"shape": ["B", 8, 3]},
         lambda x: [x.reshape(2, 8, 3)], sym=[("B", 4, 6)]),
    Case("reshape_scalar", "reshape", [rand(1, 1)], {"shape": []}, lambda x: [x.reshape(())]),
    Case("transpose", "transpose", [_X3], {"perm": [2, 0, 1]}, lambda x: [x.transpose(2, 0, 1)],
         sym=[("B", 3, 4)]),
    Case("broadcast_to", "broadcast_to", [rand(3, 1)], {"shape": [2, 3, 4]},
         lambda x: [np.broadcast_to(x, (2, 3, 4))]),
    Case("broadcast_to_dyn", "broadcast_to", [rand(2, 1)], {"shape": ["B", 5]},
         lambda x: [np.broadcast_to(x, (2, 5))], sym=[("B", 1)]),
    Case("expand_dims", "expand_dims", [rand(3, 4)], {"axis": 1}, lambda x: [x[:, None, :]],
         sym=[("B", 4)]),
    Case("expand_dims_last", "expand_dims", [rand(3, 4)], {"axis": -1}, lambda x: [x[..., None]]),
    Case("squeeze", "squeeze", [rand(3, 1, 4, 1)], {"axes": [1, 3]}, lambda x: [x[:, 0, :, 0]],
         sym=[("B", 1, 4, 1)]),
    Case("squeeze_all", "squeeze", [rand(1, 1)], {}, lambda x: [x[0, 0]]),
    Case("concatenate", "concatenate", [rand(2, 3), rand(2, 5)], {"axis": 1},
         lambda a, b: [np.hstack([a, b])], sym=[("B", 3), ("B", 5)], diff=(0, 1)),
    Case("concatenate_rows", "concatenate", [rand(2, 3), rand(4, 3), rand(1, 3)], {"axis": 0},
         lambda a, b, c: [np.vstack([a, b, c])], sym=[("B", 3), ("C", 3), (1, 3)], diff=(0, 1, 2)),
    Case("split", "split", [rand(2, 8)], {"axis": 1, "sizes": [3, 5]},
         lambda x: [x[:, :3], x[:, 3:]], sym=[("B", 8)]),
    Case("slice", "slice", [rand(5, 6)], {"starts": [1, -5], "stops": [SLICE_END, 6], "steps": [2, 3]},
         lambda x: [x[1::2, 1::3]]),
    Case("slice_dyn", "slice", [rand(3, 6)], {"starts": [0, 1], "stops": ["B", 5], "steps": [1, 2]},
         lambda x: [x[:, 1:5:2]], sym=[("B", 6)]),
    Case("unslice", "unslice", [rand(2, 2)],
         {"shape": [5, 6], "starts": [1, 1], "stops": [SLICE_END, 6], "steps": [2, 3]},
         lambda g: [_np_unslice(g, (5, 6), np.s_[1::2, 1::3])]),
    Case("unslice_dyn", "unslice", [rand(3, 2)],
         {"shape": ["B", 6], "starts": [0, 1], "stops": [SLICE_END, 5], "steps": [1, 2]},
         lambda g: [_np_unslice(g, (3, 6), np.s_[:, 1:5:2])], sym=[("B", 2)]),
    Case("take", "take", [rand(4, 3), _IDX], {"axis": 0}, lambda x, i: [_np_take(x, i, 0)],
         sym=[None, ("B",)]),
    Case("take_axis1", "take", [rand(2, 4, 3), np.array([[1, 0], [3, 3]], np.int64)], {"axis": 1},
         lambda x, i: [x[:, [[1, 0], [3, 3]], :]]),
    Case("scatter_add", "scatter_add", [rand(5, 3), _IDX], {"axis": 0, "size": 4},
         lambda g, i: [_np_scatter(g, i, 4)], sym=[("B", 3), ("B",)]),
    Case("scatter_add_inner", "scatter_add", [rand(2, 2, 2, 3), np.array([[1, 0], [1, 1]], np.int32)],
         {"axis": 1, "size": 3}, lambda g, i: [_np_scatter_inner(g, i, 3)]),
    Case("size", "size", [_X3], {"axes": [0, 2]}, lambda x: [np.float32(8)], sym=[("B", 3, 4)], diff=()),
    Case("size_all", "size", [_X3], {}, lambda x: [np.float32(24)], sym=[("B", 3, "C")], diff=()),
    # reduce
    Case("sum", "sum", [_X3], {"axes": [0, 2]}, lambda x: [x.sum(axis=(0, 2))], sym=[("B", 3, 4)]),
    Case("sum_keepdims", "sum", [_X3], {"axes": [1], "keepdims": True},
         lambda x: [x.sum(axis=1, keepdims=True)], sym=[("B", 3, 4)]),
    Case("sum_all", "sum", [_X3], {}, lambda x: [np.float32(x.sum())]),
    Case("sum_int", "sum", [ints(-5, 5, 3, 4)], {"axes": [1]}, lambda x: [x.sum(axis=1).astype(np.int32)], diff=()),
    Case("max", "max", [_X3], {"axes": [2]}, lambda x: [x.max(axis=2)], sym=[("B", 3, 4)]),
    Case("max_keepdims", "max", [_X3], {"axes": [0, 1], "keepdims": True},
         lambda x: [x.max(axis=(0, 1), keepdims=True)]),
    Case("max_int", "max", [ints(-9, 9, 3, 4)], {"axes": [0]}, lambda x: [x.max(axis=0)], diff=()),
    Case("min", "min", [_X3], {"axes": [1]}, lambda x: [x.min(axis=1)], sym=[("B", 3, 4)]),
    Case("argmax", "argmax", [_TIES], {"axis": 1}, lambda x: [np.array([1, 0, 1], np.int32)],
         sym=[("B", 4)], diff=()),
    Case("argmax_nan", "argmax", [np.array([[1.0, np.nan, 3.0, np.nan], [-np.inf] * 4], np.float32)],
         {"axis": 1}, lambda x: [np.array([1, 0], np.int32)], diff=()),
    Case("argmax_keepdims", "argmax", [_X3], {"axis": 0, "keepdims": True},
         lambda x: [np.argmax(x, axis=0)[None].astype(np.int32)], diff=()),
    Case("mean", "mean", [_X3], {"axes": [1]}, lambda x: [x.mean(axis=1)]),
    Case("mean_dyn", "mean", [rand(3, 4)], {"axes": [0], "keepdims": True},
         lambda x: [x.mean(axis=0, keepdims=True)], sym=[("B", 4)]),
    # linalg
    Case("matmul", "matmul", [rand(3, 4), rand(4, 5)], {}, lambda a, b: [a @ b],
         sym=[("B", 4), None], diff=(0, 1)),
    Case("matmul_tb", "matmul", [rand(3, 4), rand(5, 4)], {"transpose_b": True},
         lambda a, b: [a @ b.T], sym=[("B", 4), None], diff=(0, 1)),
    Case("matmul_batch", "matmul", [rand(2, 1, 3, 4), rand(3, 4, 5)], {},
         lambda a, b: [np.einsum("xymk,ykn->xymn", np.broadcast_to(a, (2, 3, 3, 4)), b)], diff=(0, 1)),
    Case("matmul_batch_dyn", "matmul", [rand(2, 3, 4), rand(2, 5, 4)], {"transpose_b": True},
         lambda a, b: [np.einsum("bmk,bnk->bmn", a, b)], sym=[("B", "S", 4), ("B", 5, 4)], diff=(0, 1)),
    Case("matmul_int", "matmul", [ints(-3, 3, 2, 3), ints(-3, 3, 2, 3, 4)], {},
         lambda a, b: [np.stack([a @ b[0], a @ b[1]]).astype(np.int32)], diff=()),
    Case("matmul_sum", "matmul_sum", [rand(3, 4, 5), rand(3, 2, 5)], {},
         lambda a, x: [np.einsum("bmn,bkn->mk", a, x)], diff=(0, 1)),
    Case("widening_matmul_f16", "widening_matmul", [rand(3, 16), rand(5, 16).astype(np.float16)],
         {"kernel": "generic"}, lambda x, w: [x @ w.astype(np.float32).T], sym=[("B", 16), None],
         diff=()),
    Case("widening_matmul_i8", "widening_matmul",
         [rand(3, 8), np.arange(-20, 20, dtype=np.int8).reshape(5, 8)], {"kernel": "generic"},
         lambda x, w: [x @ w.astype(np.float32).T], diff=()),
    # composite
    Case("softmax", "softmax", [rand(3, 5) * 4], {"axis": -1}, lambda x: [_np_softmax(x, -1)],
         sym=[("B", 5)]),
    Case("softmax_axis0", "softmax", [rand(3, 5)], {"axis": 0}, lambda x: [_np_softmax(x, 0)]),
    Case("log_softmax", "log_softmax", [rand(3, 5) * 4], {"axis": 1},
         lambda x: [x - _np_lse(x, 1, True)], sym=[("B", 5)]),
    Case("logsumexp", "logsumexp", [rand(2, 3, 4)], {"axes": [0, 2]}, lambda x: [_np_lse(x, (0, 2))],
         sym=[("B", 3, 4)]),
    Case("logsumexp_keepdims", "logsumexp", [np.array([[1.0, 2.0], [-np.inf, -np.inf]], np.float32)],
         {"axes": [1], "keepdims": True}, lambda x: [_np_lse(x, 1, True)], diff=()),
    Case("logsumexp_large", "logsumexp", [np.array([1000.0, 1000.0], np.float32)], {},
         lambda x: [np.float64(1000.0 + np.log(2.0))], diff=()),
    Case("layer_norm", "layer_norm", [rand(3, 6), rand(6), rand(6)], {},
         lambda x, w, b: [(x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w + b],
         sym=[("B", 6), None, None], diff=(0, 1, 2)),
    Case("rms_norm", "rms_norm", [rand(2, 3, 4), rand(4)], {"eps": 1e-3},
         lambda x, w: [x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-3) * w],
         sym=[("B", 3, 4), None], diff=(0, 1)),
    Case("pad", "pad", [rand(2, 3)], {"widths": [[1, 0], [2, 3]]},
         lambda x: [np.pad(x, [(1, 0), (2, 3)])]),
    Case("pad_dyn", "pad", [rand(2, 3)], {"widths": [[0, 0], [0, 2]]},
         lambda x: [np.pad(x, [(0, 0), (0, 2)])], sym=[("B", 3)]),
    Case("one_hot", "one_hot", [np.array([0, 4, -1, 7, 2], np.int32)], {"num_classes": 5},
         lambda i: [np.eye(6, dtype=np.float32)[np.where((i >= 0) & (i < 5), i, 5)][:, :5]],
         sym=[("B",)], diff=()),
    Case("cross_entropy", "cross_entropy", [rand(4, 5) * 3, _LABELS], {},
         lambda z, y: [_np_lse(z, 1) - z[np.arange(4), y]], sym=[("B", 5), ("B",)]),
]


def _np_unslice(g, shape, index):
    out = np.zeros(shape, g.dtype)
    out[index] = g
    return out


def _np_scatter(g, idx, size):
    out = np.zeros((size,) + g.shape[1:], g.dtype)
    for row, i in zip(g, idx):
        i = min(max(i + size if i < 0 else i, 0), size - 1)
        out[i] += row
    return out


def _np_scatter_inner(g, idx, size):
    out = np.zeros((g.shape[0], size, g.shape[3]), g.dtype)
    for a in range(idx.shape[0]):
        for b in range(idx.shape[1]):
            out[:, idx[a, b], :] += g[:, a, b, :]
    return out


def _opdef(name):
    return REGISTRY[name]


MY_FAMILIES = {"shape", "reduce", "linalg", "composite"}


def test_every_op_of_these_families_has_a_case():
    mine = {n for n, d in REGISTRY.items() if d.family in MY_FAMILIES}
    assert mine == {c.op for c in CASES}
    for n in mine:
        d = REGISTRY[n]
        # an op may have both: a lowering of its own (a kernel for some cases) that
        # declines (returns None) for the rest, which take the decomposition
        assert d.lower is not None or d.decompose is not None, n
        assert d.vjp is not None or d.decompose is not None or not d.differentiable, n


# -- (a) references against independent NumPy --------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference(case):
    got = _opdef(case.op).reference([np.array(x) for x in case.inputs], _attrs(case))
    want = case.expect(*case.inputs)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == np.asarray(case.inputs[0]).dtype or case.op in ("argmax", "one_hot", "size"), \
            f"{case.id}: dtype {g.dtype}"
        np.testing.assert_allclose(g, np.asarray(w), rtol=1e-5, atol=1e-6, err_msg=case.id)


def test_reference_keeps_float64():
    x = rand(3, 5, dtype=np.float64)
    for op, attrs in [("softmax", {"axis": -1}), ("mean", {"axes": [0]}), ("size", {}),
                      ("logsumexp", {"axes": [1]}), ("sum", {})]:
        (y,) = _opdef(op).reference([x], _normalized(op, attrs))
        assert y.dtype == np.float64, op


def _normalized(op, attrs):
    from tercomp.ops.registry import normalize_attrs
    return normalize_attrs(REGISTRY[op], attrs)


def _attrs(case):
    return _normalized(case.op, case.attrs)


# -- (b) shape rules with symbolic dims, and errors ---------------------------------------
@pytest.mark.parametrize("op,shapes,attrs,want", [
    ("reshape", [(B, 4, 8)], {"shape": [-1, 32]}, [(B, 32)]),
    ("reshape", [(B, 4, 8)], {"shape": ["B", 2, -1]}, [(B, 2, 16)]),
    ("reshape", [(B, C, 6)], {"shape": [-1, 3]}, [(2 * B * C, 3)]),
    ("reshape", [(B, 6)], {"shape": ["2*B", 3]}, [(2 * B, 3)]),
    ("concatenate", [(B, 3), (B, 5)], {"axis": 1}, [(B, 8)]),
    ("concatenate", [(B, 3), (C, 3)], {"axis": 0}, [(B + C, 3)]),
    ("split", [(B + C, 3)], {"axis": 0, "sizes": ["B", "C"]}, [(B, 3), (C, 3)]),
    ("transpose", [(B, 3, C)], {"perm": [2, 0, 1]}, [(C, B, 3)]),
    ("broadcast_to", [(1, 3)], {"shape": ["B", 3]}, [(B, 3)]),
    ("expand_dims", [(B, 3)], {"axis": 0}, [(1, B, 3)]),
    ("squeeze", [(B, 1, 3)], {"axes": [1]}, [(B, 3)]),
    ("slice", [(B, 10)], {"starts": [0, 2], "stops": [SLICE_END, -1], "steps": [1, 3]}, [(B, 3)]),
    ("slice", [(B, 10)], {"starts": [0, 8], "stops": ["B", 2], "steps": [1, 1]}, [(B, 0)]),
    ("unslice", [(B, 3)], {"shape": ["B", 10], "starts": [0, 2], "stops": [SLICE_END, -1],
                           "steps": [1, 3]}, [(B, 10)]),
    ("take", [(100, 16), ("B", "S")], {"axis": 0}, [(B, as_dim("S"), 16)]),
    ("scatter_add", [(B, 16), ("B",)], {"axis": 0, "size": 100}, [(100, 16)]),
    ("size", [(B, 3)], {}, [()]),
    ("sum", [(B, 3, 4)], {"axes": [0, 2]}, [(3,)]),
    ("sum", [(B, 3, 4)], {"axes": [-1], "keepdims": True}, [(B, 3, 1)]),
    ("max", [(B, 3)], {}, [()]),
    ("argmax", [(B, 3)], {"axis": 1}, [(B,)]),
    ("mean", [(B, 3)], {"axes": [0], "keepdims": True}, [(1, 3)]),
    ("matmul", [(B, 4), (4, 5)], {}, [(B, 5)]),
    ("matmul", [(B, 1, 3, 4), (C, 5, 4)], {"transpose_b": True}, [(B, C, 3, 5)]),
    ("softmax", [(B, 5)], {"axis": -1}, [(B, 5)]),
    ("logsumexp", [(B, 5)], {"axes": [1]}, [(B,)]),
    ("layer_norm", [(B, 5), (5,), (5,)], {}, [(B, 5)]),
    ("rms_norm", [(B, 5), (5,)], {}, [(B, 5)]),
    ("pad", [(B, 5)], {"widths": [[0, 0], [2, 1]]}, [(B, 8)]),
    ("cross_entropy", [(B, 5), ("B",)], {}, [(B,)]),
    ("one_hot", [("B",)], {"num_classes": 7}, [(B, 7)]),
])
def test_shape_rule(op, shapes, attrs, want):
    int_ops = {("take", 1), ("scatter_add", 1), ("cross_entropy", 1), ("one_hot", 0)}
    types = [TensorType(s, "i32" if (op, i) in int_ops else "f32") for i, s in enumerate(shapes)]
    got = [t.shape for t in result_types(op, types, attrs)]
    assert got == [tuple(as_dim(d) for d in w) for w in want]


@pytest.mark.parametrize("op,shapes,attrs,pattern", [
    ("reshape", [(B, 4, 8)], {"shape": [-1, 3]}, r"\[B, 4, 8\].*\[-1, 3\]"),
    ("reshape", [(2, 4)], {"shape": [3, 3]}, r"\[2, 4\].*\[3, 3\]"),
    ("reshape", [(2, 4)], {"shape": [-1, -1]}, r"only one dim may be -1"),
    ("transpose", [(2, 3)], {"perm": [0, 0]}, r"\[0, 0\].*\[2, 3\]"),
    ("broadcast_to", [(2, 3)], {"shape": [4, 3]}, r"\[2, 3\].*\[4, 3\]"),
    ("expand_dims", [(2, 3)], {"axis": 3}, r"axis 3.*\[2, 3\]"),
    ("squeeze", [(2, 3)], {"axes": [1]}, r"axis 1 of \[2, 3\] has size 3"),
    ("concatenate", [(B, 3), (C, 4)], {"axis": 1}, r"\[B, 3\], \[C, 4\] differ in dim 0"),
    ("concatenate", [(2, 3), (2,)], {"axis": 0}, r"\[2, 3\], \[2\] must have the same rank"),
    ("split", [(2, 8)], {"axis": 1, "sizes": [3, 4]}, r"\[3, 4\].*\[2, 8\]"),
    ("slice", [(B, 4)], {"starts": [1, 0], "stops": [SLICE_END, 4], "steps": [1, 1]},
     r"symbolic size B.*taken whole"),
    ("slice", [(5, 4)], {"starts": [0, 0], "stops": [5, 4], "steps": [1, -1]}, r"step -1.*positive"),
    ("take", [(5, 4), (3,)], {"axis": 0}, r"indices must be integers"),
    ("scatter_add", [(5, 4), (3,)], {"axis": 0, "size": 4}, r"indices \[3\] must match.*\[5, 4\]"),
    ("sum", [(2, 3)], {"axes": [2]}, r"axis 2 is out of range for shape \[2, 3\]"),
    ("sum", [(2, 3)], {"axes": [1, -1]}, r"repeated axis"),
    ("argmax", [(2, 3)], {"axis": 5}, r"axis 5.*\[2, 3\]"),
    ("matmul", [(2, 3), (4, 5)], {}, r"\[2, 3\] and \[4, 5\].*3 vs 4"),
    ("matmul", [(2, 3), (5, 4)], {"transpose_b": True}, r"\[2, 3\] and \[5, 4\]"),
    ("matmul", [(3,), (3, 4)], {}, r"\[3\] and \[3, 4\] must both have rank >= 2"),
    ("matmul", [(2, 2, 3), (3, 3, 4)], {}, r"batch dims of \[2, 2, 3\] and \[3, 3, 4\]"),
    ("layer_norm", [(B, 5), (4,), (5,)], {}, r"weight \[4\].*\[B, 5\]"),
    ("cross_entropy", [(B, 5), (B, 5)], {}, r"labels \[B, 5\].*logits \[B, 5\]"),
    ("softmax", [(3, 4)], {"axis": 2}, r"axis 2.*\[3, 4\]"),
])
def test_shape_errors(op, shapes, attrs, pattern):
    int_ops = {("scatter_add", 1), ("cross_entropy", 1)}
    types = [TensorType(s, "i32" if (op, i) in int_ops else "f32") for i, s in enumerate(shapes)]
    with pytest.raises(TraceError, match=pattern):
        result_types(op, types, attrs)


def test_dim_attrs_round_trip():
    for d in [3, B, B + C, 2 * B * C]:
        assert sympy.simplify(sympy.sympify(attr_to_dim(dim_to_attr(d))) - d) == 0


def test_reference_needs_bindings_only_when_undeducible():
    ref = _opdef("broadcast_to").reference
    with pytest.raises(TraceError, match="bind_symbols"):
        ref([np.ones((1, 3))], {"shape": ["B", 3]})
    with bind_symbols({"B": 4}):
        assert ref([np.ones((1, 3))], {"shape": ["B", 3]})[0].shape == (4, 3)
    assert ref([np.ones((2, 1))], {"shape": ["B", 3]})[0].shape == (2, 3)   # B read off x
    assert _opdef("reshape").reference([np.ones((6, 4))], {"shape": ["B", 2, 2]})[0].shape == (6, 2, 2)


def test_unbroadcast():
    g = Graph()
    b = GraphBuilder(g)
    v = g.add_input("v", TensorType((B, 3, 4), "f32"))
    assert unbroadcast(b, v, v.type) is v
    assert unbroadcast(b, v, TensorType((3, 1), "f32")).type.shape == (3, 1)
    assert unbroadcast(b, v, TensorType((4,), "f32")).type.shape == (4,)
    assert unbroadcast(b, v, TensorType((B, 1, 4), "f32")).type.shape == (B, 1, 4)
    x = rand(2, 3, 4)
    g.set_outputs([unbroadcast(b, v, TensorType((3, 1), "f32"))])
    np.testing.assert_allclose(interpret(g, x)[0], x.sum(axis=(0, 2))[:, None], rtol=1e-5)


# -- (c) print -> parse round trip ---------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_print_parse_round_trip(case):
    for sym in case.variants():
        g = graph_of(case.op, types_of(case.inputs, sym), case.attrs)
        back = parse(str(g))
        assert back.structurally_equal(g), str(g)
        assert [v.type for v in back.outputs] == [v.type for v in g.outputs]


# -- VJPs: central differences in float64, first and second order ---------------------------
class Derivatives:
    """One graph computing, for y = op(x): L = sum_k <y_k, W_k>, its gradient G w.r.t.
    the inputs `diff`, D = sum_j <G_j, V_j>, and D's gradient H (a Hessian-vector
    product). W and V are random inputs of the graph, so symbolic shapes work."""

    def __init__(self, op, types, attrs, diff, seed_ones=False):
        from tercomp.autodiff import backward
        g = Graph()
        b = GraphBuilder(g)
        ins = [g.add_input(f"x{i}", t) for i, t in enumerate(types)]
        outs = b.emit(op, *ins, **attrs)
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        self.ws = [g.add_input(f"w{k}", o.type) for k, o in enumerate(outs)]
        loss = self._dot(b, outs, self.ws)
        wrt = [ins[i] for i in diff]
        grads = backward(b, list(g.ops), {loss: b.scalar(1.0, loss.dtype)}, wrt)
        self.vs = [g.add_input(f"v{j}", t) for j, t in enumerate(types[i] for i in diff)]
        live = [(gr, v) for gr, v in zip(grads, self.vs) if gr is not None]
        dots = self._dot(b, [gr for gr, _ in live], [v for _, v in live]) if live else None
        hvp = backward(b, list(g.ops), {dots: b.scalar(1.0, loss.dtype)}, wrt) if dots is not None \
            else [None] * len(wrt)
        values = [loss, *grads, dots, *hvp]
        self.present = [v is not None for v in values]
        g.set_outputs([v for v in values if v is not None])
        self.graph, self.types, self.diff, self.seed_ones = g, types, diff, seed_ones
        self.n = len(wrt)

    @staticmethod
    def _dot(b, xs, ws):
        acc = None
        for x, w in zip(xs, ws):
            t = b.sum(b.mul(x, w))
            acc = t if acc is None else b.add(acc, t)
        return acc

    def __call__(self, *xs):
        """(L, [G], D, [H]) at xs; a missing gradient is zeros."""
        binding = bindings(self.types, xs)
        rng = np.random.default_rng(7)

        def concrete(t):
            return tuple(int(sympy.sympify(d).subs(binding)) for d in t.shape)
        ws = [np.ones(concrete(w.type)) if self.seed_ones else rng.standard_normal(concrete(w.type))
              for w in self.ws]
        vs = [rng.standard_normal(concrete(v.type)) for v in self.vs]
        with bind_symbols(binding):
            got = iter(interpret(self.graph, *xs, *ws, *vs))
        vals = [next(got) if p else None for p in self.present]
        zeros = [np.zeros(np.shape(xs[i])) for i in self.diff]
        n = self.n
        grads = [gr if gr is not None else z for gr, z in zip(vals[1:1 + n], zeros)]
        hvp = [h if h is not None else z for h, z in zip(vals[2 + n:], zeros)]
        return float(vals[0]), grads, float(vals[1 + n] if vals[1 + n] is not None else 0.0), hvp


def _fd_check(case, sym, order):
    inputs = [x.astype(np.float64) if x.dtype.kind == "f" else x for x in case.inputs]
    if case.op in ("softmax", "log_softmax", "cross_entropy"):
        inputs[0] = inputs[0] / 4   # keep second derivatives well scaled
    types = types_of(inputs, sym)
    der = Derivatives(case.op, types, _attrs(case), case.diff)
    rng = np.random.default_rng(1)
    dirs = [rng.standard_normal(inputs[i].shape) for i in case.diff]
    eps = 1e-6

    def at(t):
        xs = list(inputs)
        for i, d in zip(case.diff, dirs):
            xs[i] = inputs[i] + t * d
        loss, _, dots, _ = der(*xs)
        return loss if order == 1 else dots

    fd = (at(eps) - at(-eps)) / (2 * eps)
    _, grads, _, hvp = der(*inputs)
    analytic = sum(float(np.sum(gr * d)) for gr, d in zip(grads if order == 1 else hvp, dirs))
    assert np.isclose(analytic, fd, rtol=1e-5, atol=1e-6), \
        f"{case.id} order {order}: analytic {analytic}, finite differences {fd}"


# Every differentiable case, with static and with symbolic shapes (the VJPs of the
# symbolic variants emit shape attributes such as broadcast_to ["B", 3]).
DIFF_CASES = [(c, sym) for c in CASES if c.diff and np.all(np.isfinite(c.inputs[0]))
              for sym in c.variants()]
DIFF_IDS = [c.id + ("_dynamic" if sym else "") for c, sym in DIFF_CASES]


@pytest.mark.parametrize("case,sym", DIFF_CASES, ids=DIFF_IDS)
def test_vjp_first_order(case, sym):
    _fd_check(case, sym, 1)


@pytest.mark.parametrize("case,sym", DIFF_CASES, ids=DIFF_IDS)
def test_vjp_second_order(case, sym):
    _fd_check(case, sym, 2)


def test_max_gradient_is_shared_among_ties():
    x = _TIES.astype(np.float64)
    der = Derivatives("max", types_of([x]), _normalized("max", {"axes": [1]}), (0,), seed_ones=True)
    _, (gx,), _, _ = der(x)
    want = np.array([[0, .5, .5, 0], [.25, .25, .25, .25], [0, .5, 0, .5]])
    np.testing.assert_allclose(gx, want)


# -- lowering: everything compiled into one IREE module ---------------------------------------
COMPILED = [(c, sym) for c in CASES if c.compile for sym in c.variants()]


def _compile_id(case, sym):
    return case.id + ("_dynamic" if sym else "")


@pytest.fixture(scope="module")
def compiled():
    from iree import runtime as rt
    from tercomp.codegen.iree_session import HOST_CPU_FLAGS, compile_module, new_session
    from tercomp.lowering import to_mlir
    graphs = [graph_of(c.op, types_of(c.inputs, sym), c.attrs, name=_compile_id(c, sym))
              for c, sym in COMPILED]
    session, ctx = new_session()
    module = to_mlir(graphs, ctx).module
    vmfb = compile_module(session, module, HOST_CPU_FLAGS)
    return rt.load_vm_flatbuffer(vmfb, driver="local-task")


@pytest.mark.parametrize("case,sym", COMPILED, ids=[_compile_id(c, s) for c, s in COMPILED])
def test_lowering_matches_reference(compiled, case, sym):
    types = types_of(case.inputs, sym)
    g = graph_of(case.op, types, case.attrs)
    with bind_symbols(bindings(types, case.inputs)):
        want = interpret(g, *case.inputs)
    got = compiled[_compile_id(case, sym)](*case.inputs)
    got = list(got) if isinstance(got, (tuple, list)) else [got]
    assert len(got) == len(want)
    for r, w in zip(got, want):
        r = r.to_host() if hasattr(r, "to_host") else np.asarray(r)
        assert r.shape == w.shape and r.dtype == w.dtype, (r.shape, w.shape, r.dtype, w.dtype)
        np.testing.assert_allclose(r, w, rtol=1e-5, atol=1e-6, err_msg=_compile_id(case, sym))


def test_tc_pad_takes_numpys_pad_widths_and_refuses_the_rest():
    import tercomp as tc
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for pw in (1, (1, 2), [(0, 1), (2, 0)]):
        exe = tc.compile(lambda v, pw=pw: tc.pad(v, pw), tc.spec((2, 3)), cache=False)
        np.testing.assert_array_equal(exe(x), np.pad(x, pw))
    with pytest.raises(tc.TercompError, match="pads with zeros only"):
        tc.trace(lambda v: tc.pad(v, 1, mode="edge"), tc.spec((2, 3)))
    with pytest.raises(tc.TercompError, match="symbolic size B and cannot be padded"):
        tc.trace(lambda v: tc.pad(v, 1), tc.spec(("B", 3)))
    with pytest.raises(tc.TercompError, match="is not an int, a \\(before, after\\) pair or 2"):
        tc.trace(lambda v: tc.pad(v, [1, 2, 3]), tc.spec((2, 3)))
    with pytest.raises(tc.TercompError, match="pairs \\(before, after\\) of non-negative ints"):
        tc.trace(lambda v: tc.pad(v, [(0, 0), (-1, 2)]), tc.spec((2, 3)))
