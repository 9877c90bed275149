"""Passes over tern IR, run by the pass manager."""
from .manager import PASSES, register_pass, get_pass, run_pipeline, Dumper
from . import simplify  # noqa: F401
from . import ternary  # noqa: F401
from . import check_numerics  # noqa: F401
from . import kernels  # noqa: F401

__all__ = ["PASSES", "register_pass", "get_pass", "run_pipeline", "Dumper"]
