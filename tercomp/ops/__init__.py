"""The op registry and its families. Importing this package registers every op."""
from .registry import REGISTRY, OpDef, GraphBuilder, get, register, infer_types
from . import control, elementwise

try:  # families written in parallel; each registers itself on import
    from . import shape, reduce, linalg, composite  # noqa: F401
except ImportError:  # pragma: no cover - only while a family file is missing
    pass

from .interpret import interpret  # noqa: E402

__all__ = ["REGISTRY", "OpDef", "GraphBuilder", "get", "register", "infer_types", "interpret"]
