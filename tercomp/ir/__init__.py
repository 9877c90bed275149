"""tern IR: types, values, ops, graphs, and their text form."""
from .types import TensorType, Dim, dtype_name, numpy_dtype, is_static, as_dim, concrete_shape
from .graph import Graph, Op, Value, SourceLoc, UNKNOWN_LOC
from .printer import print_graph, print_op
from .parser import parse

__all__ = ["TensorType", "Dim", "dtype_name", "numpy_dtype", "is_static", "as_dim",
           "concrete_shape", "Graph", "Op", "Value", "SourceLoc", "UNKNOWN_LOC",
           "print_graph", "print_op", "parse"]
