"""The one lowering driver: tern IR (after the passes) -> an MLIR module for IREE.

It sits above the layers it calls: the op registry (tercomp/ops/: each op's generic
lowering), the kernel table (tercomp/kernels/: the rows the `kernels` pass chose) and the
MLIR-building library (tercomp/codegen/: builders, executables, parameters, targets),
none of which imports it. `driver.py` lowers functions (tc.compile); `state.py` lowers
entry points over mutable globals (tc.compile_lm's step and its KV cache).
"""
from .driver import Lowered, check_storage, to_mlir
from .state import Entry, StateVar, to_stateful_mlir

__all__ = ["Lowered", "check_storage", "to_mlir", "Entry", "StateVar", "to_stateful_mlir"]
