"""The op registry and its families. Importing this package registers every op."""
from .registry import REGISTRY, RULES, OpDef, GraphBuilder, get, register, infer_types, parse, verify
from . import control, elementwise

from . import shape, index, reduce, linalg, composite, conv, pool, im2col, ternary, kv_cache_ops, kv_slots  # noqa: F401,E402

from .interpret import interpret  # noqa: E402
from . import body_ops  # noqa: F401,E402  (op bodies are run by the interpreter)

__all__ = ["REGISTRY", "RULES", "OpDef", "GraphBuilder", "get", "register", "infer_types",
           "interpret", "parse", "verify"]
