"""Tracing: run user Python on Tracer values and record tern ops into a Graph.

A Tracer stands for a tern Value inside an active Trace. Operators, methods and the
NumPy-named functions of `tercomp.tracing.api` call `apply(opname, ...)`, which emits
into the innermost active trace (with the user's source line), or, when no argument is
a Tracer, evaluates the op's NumPy reference eagerly.
"""
from __future__ import annotations

import functools
import itertools
import os
import sys
import threading

import numpy as np

from ..errors import TraceError
from ..ir import Graph, SourceLoc, UNKNOWN_LOC, Value, numpy_dtype
from ..ops import GraphBuilder, get
from ..ops.registry import normalize_attrs

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_state = threading.local()


def _trace_stack() -> list:
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


def _in_package(f) -> bool:
    return _file_in_package(f.f_code.co_filename)


@functools.lru_cache(maxsize=4096)
def _file_in_package(fn: str) -> bool:
    return os.path.abspath(fn).startswith(_PKG_DIR) or fn.startswith("<frozen")


@functools.lru_cache(maxsize=4096)
def _display_path(path: str, cwd: str) -> str:
    """`path` relative to the working directory `cwd` where it lies below it."""
    try:
        rel = os.path.relpath(path, cwd)
        if not rel.startswith(".."):
            return rel
    except ValueError:
        pass
    return path


def _frame_location(f) -> SourceLoc:
    col = 0
    try:
        pos = next(itertools.islice(f.f_code.co_positions(), f.f_lasti // 2, None))
        col = (pos[2] or 0) + 1
    except (AttributeError, StopIteration):
        pass
    return SourceLoc(_display_path(f.f_code.co_filename, os.getcwd()), f.f_lineno, col)


def user_location(tb=None) -> SourceLoc:
    """The innermost stack frame outside the tercomp package: the user's line (of the
    current stack, or of traceback `tb`: where an exception was raised)."""
    if tb is not None:
        frames = []
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        user = [f for f in frames if not _in_package(f)]
        return _frame_location(user[-1]) if user else UNKNOWN_LOC
    f = sys._getframe(1)
    while f is not None:
        if not _in_package(f):
            return _frame_location(f)
        f = f.f_back
    return UNKNOWN_LOC


class Trace:
    """An active trace: a Graph being built."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.builder = GraphBuilder(graph)

    def __enter__(self):
        _trace_stack().append(self)
        return self

    def __exit__(self, *exc):
        _trace_stack().pop()

    def emit(self, opname, operands, attrs, name=None, loc=None):
        self.builder.loc = loc or user_location()
        out = self.builder.emit(opname, *operands, name=name, **attrs)
        if isinstance(out, tuple):
            return tuple(Tracer(v, self) for v in out)
        return Tracer(out, self)

    def const(self, value, like_dtype=None, name="cst", loc=None) -> Value:
        arr = np.asarray(value)
        if like_dtype is not None and (arr.dtype.kind in "iuf" or arr.dtype == np.bool_) and arr.ndim == 0 \
                and not isinstance(value, np.ndarray):
            arr = arr.astype(numpy_dtype(like_dtype))
        elif arr.dtype == np.float64 and type(value) is float:
            arr = arr.astype(np.float32)
        self.builder.loc = loc or user_location()
        return self.builder.emit("constant", name=name, value=arr)


class BodyTrace(Trace):
    """The trace of an op body (a scan step, a checkpointed function), nested in `parent`.
    A value of an enclosing trace used inside the body is captured: it becomes an input
    of the body (bodies are isolated from above), and the op that owns the body takes the
    outer value as an operand. `captured` maps id(outer Value) -> (outer, body input) in
    the order the body's inputs were added."""

    def __init__(self, graph: Graph, parent: Trace):
        super().__init__(graph)
        self.parent = parent
        self.captured: dict = {}

    def capture(self, t: "Tracer") -> Value:
        if t.trace is self:
            return t.value
        if t.trace is not self.parent:
            if not isinstance(self.parent, BodyTrace):
                raise TraceError(f"value %{t.name} comes from a trace that does not enclose this body",
                                 loc=user_location())
            t = Tracer(self.parent.capture(t), self.parent)
        hit = self.captured.get(id(t.value))
        if hit is None:
            hit = self.captured[id(t.value)] = (t.value, self.graph.add_input(t.value.name, t.value.type))
        return hit[1]


def current_trace():
    stack = _trace_stack()
    return stack[-1] if stack else None


# NumPy functions called on traced values (np.sum(x), np.exp(x), np.maximum(x, 0)) run
# tercomp's function of the same name, as JAX arrays do. The Tracer methods (x.sum(),
# x.reshape(2, -1)) and the operators made of more than one op (x ** p, x @ y, x.T, x[i])
# are functions of trace/api.py and trace/indexing.py too. Those modules sit above this
# one (they build on apply), so trace/api.py fills these tables when it is imported.
NUMPY_API: dict = {}
METHODS: dict = {}        # method name -> function(tracer, *args, **kwargs)
OPERATORS: dict = {}      # "pow", "matmul", "transpose", "getitem" -> function


def _numpy_dispatch(name: str, args, kwargs):
    fn = NUMPY_API.get(name)
    if fn is None:
        raise TraceError(f"np.{name} was called on a traced value; tercomp has no {name}",
                         loc=user_location(), hint="use the tc.* functions (tc.sum, tc.exp, tc.where, ...) "
                                                   "in traced code")
    try:
        return fn(*args, **kwargs)
    except TypeError as e:
        raise TraceError(f"np.{name} on a traced value: {e}", loc=user_location(),
                         hint=f"call tc.{name} with the arguments it takes") from None


class Tracer:
    """A traced tensor. Behaves like a NumPy array for shapes, operators and methods;
    NumPy functions applied to it run tercomp's own (np.sum(x) is tc.sum(x))."""

    __array_priority__ = 1000

    def __init__(self, value: Value, trace: Trace):
        self.value = value
        self.trace = trace

    # -- metadata ----------------------------------------------------------------------
    @property
    def shape(self):
        return self.value.type.shape

    @property
    def dtype(self):
        return self.value.type.dtype

    @property
    def ndim(self):
        return self.value.type.rank

    @property
    def name(self):
        return self.value.name

    def __repr__(self):
        return f"Tracer(%{self.value.name}: {self.value.type})"

    __hash__ = object.__hash__

    # -- Python control flow is not traceable -------------------------------------------
    def _no_concrete(self, what):
        raise TraceError(f"{what} of a traced value %{self.value.name} ({self.value.type}): "
                         "the value is not known while tracing",
                         loc=user_location(),
                         hint="use tc.where(cond, a, b) instead of if/else, tc.maximum/tc.minimum "
                              "instead of max()/min(), and keep loops over Python ints")

    def __bool__(self):
        self._no_concrete("Python control flow (if/while/and/or) on the truth value")

    def __float__(self):
        self._no_concrete("float()")

    def __int__(self):
        self._no_concrete("int()")

    def __index__(self):
        self._no_concrete("using as a Python index")

    def __array__(self, *a, **k):
        self._no_concrete("converting to a NumPy array")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if method != "__call__" or kwargs.get("out") is not None:
            raise TraceError(f"np.{ufunc.__name__}.{method} (or out=) on a traced value is not supported",
                             loc=user_location(), hint=f"call tc.{ufunc.__name__}(...) instead")
        kwargs.pop("out", None)
        return _numpy_dispatch(ufunc.__name__, inputs, kwargs)

    def __array_function__(self, func, types, args, kwargs):
        return _numpy_dispatch(func.__name__, args, kwargs)

    def __len__(self):
        d = self.shape[0] if self.shape else None
        if isinstance(d, int):
            return d
        self._no_concrete("len()")

    def __iter__(self):
        n = len(self)
        return (self[i] for i in range(n))

    # -- operators -----------------------------------------------------------------------
    def __add__(self, o): return apply("add", self, o)
    def __radd__(self, o): return apply("add", o, self)
    def __sub__(self, o): return apply("sub", self, o)
    def __rsub__(self, o): return apply("sub", o, self)
    def __mul__(self, o): return apply("mul", self, o)
    def __rmul__(self, o): return apply("mul", o, self)
    def __truediv__(self, o): return apply("div", self, o)
    def __rtruediv__(self, o): return apply("div", o, self)
    def __neg__(self): return apply("neg", self)
    def __pos__(self): return self
    def __abs__(self): return apply("abs", self)
    def __lt__(self, o): return apply("lt", self, o)
    def __le__(self, o): return apply("le", self, o)
    def __gt__(self, o): return apply("gt", self, o)
    def __ge__(self, o): return apply("ge", self, o)
    def __eq__(self, o): return apply("eq", self, o)
    def __ne__(self, o): return apply("ne", self, o)

    def __pow__(self, p): return OPERATORS["pow"](self, p)
    def __matmul__(self, o): return OPERATORS["matmul"](self, o)
    def __rmatmul__(self, o): return OPERATORS["matmul"](o, self)
    def __getitem__(self, idx): return OPERATORS["getitem"](self, idx)

    @property
    def T(self):
        return OPERATORS["transpose"](self)

    # -- methods (NumPy names) ------------------------------------------------------------
    def __getattr__(self, name):
        fn = METHODS.get(name)
        if fn is None:
            raise AttributeError(f"traced tensors have no attribute {name!r}")
        return lambda *a, **k: fn(self, *a, **k)


def _is_traced(x):
    return isinstance(x, Tracer)


def apply(opname: str, *args, name: str | None = None, **attrs):
    """Apply a registered op to Tracers, arrays or Python scalars.

    With a Tracer among the arguments the op is recorded into that trace; otherwise the
    op's NumPy reference runs eagerly and NumPy arrays come back.
    """
    tracers = [a for a in args if _is_traced(a)]
    if not tracers:
        arrs = [np.asarray(a, dtype=np.float32) if type(a) is float else np.asarray(a) for a in args]
        opdef = get(opname)
        outs = opdef.reference(arrs, normalize_attrs(opdef, attrs))
        return outs[0] if len(outs) == 1 else tuple(outs)
    trace = tracers[-1].trace
    stack = _trace_stack()
    for t in tracers:
        if t.trace not in stack:
            raise TraceError(f"a traced value %{t.name} was used after its trace ended",
                             loc=user_location(),
                             hint="do not keep traced values in globals or attributes across calls")
    # inside an op body, values of the enclosing traces are captured into the body
    lift = getattr(stack[-1], "capture", None)
    if lift is not None:
        trace = stack[-1]
    loc = user_location()
    # Python scalars take the dtype of the traced operands (not of a boolean condition)
    like = next((t.dtype for t in tracers if t.dtype != "i1"), tracers[0].dtype)
    operands = []
    for a in args:
        if _is_traced(a):
            if a.trace is not trace and lift is None:
                raise TraceError("values from two different traces were mixed", loc=loc)
            operands.append(a.value if a.trace is trace else lift(a))
        else:
            operands.append(trace.const(a, like_dtype=like, loc=loc))
    return trace.emit(opname, operands, attrs, name=name, loc=loc)
