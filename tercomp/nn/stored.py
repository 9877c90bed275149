"""Frozen layers over one narrow table: an embedding and an output layer that read the
same [vocab, hidden] weights stored in float16, or int8 with a scale per row, widened in
registers (`tern.widening_matmul`).

A language model's output layer is the largest read of a decode step (with a tied
embedding, one table serves both lookups): tc.compile_lm stores it narrow
(`output_dtype`). Both layers keep the table in a private attribute, so the module tree
has one copy however many layers read it.

    >>> table = nn.StoredTable.from_weight(lm.embed_tokens.weight, "int8")
    >>> emb, head = nn.StoredEmbedding(table), nn.StoredLinear(table)
"""
from __future__ import annotations

import numpy as np

from ..trace import api as _t
from ..trace.tracer import apply
from .module import Module

#: how a stored table may keep its weights
TABLE_DTYPES = ("float16", "int8")


def quantize_rows(w) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [N, K], scale f32 [N]) with w ~= q * scale[:, None]: each row scaled by its
    largest magnitude / 127, rounded to nearest (llama.cpp's Q8_0 does the same per 32
    weights; one scale a row keeps the kernel's inner loop free of scales)."""
    w = np.asarray(w, np.float32)
    top = np.abs(w).max(axis=1)
    scale = np.where(top > 0, top / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


class StoredTable:
    """A [rows, dim] table kept as float16, or int8 with a float32 scale per row."""

    def __init__(self, values: np.ndarray, scale: np.ndarray | None = None):
        self.values, self.scale = values, scale

    @classmethod
    def from_weight(cls, w, dtype: str = "float16") -> "StoredTable":
        if dtype == "float16":
            return cls(np.asarray(w, np.float32).astype(np.float16))
        if dtype == "int8":
            return cls(*quantize_rows(w))
        raise ValueError(f"a stored table is one of {TABLE_DTYPES}, got {dtype!r}")


class StoredEmbedding(Module):
    """Rows of a StoredTable, widened to float32: ids [...] -> [..., dim]."""

    def __init__(self, table: StoredTable):
        self._table = table

    def forward(self, ids):
        rows = _t.take(self._table.values, ids, axis=0).astype("float32")
        if self._table.scale is None:
            return rows
        return rows * _t.expand_dims(_t.take(self._table.scale, ids, axis=0), -1)


class StoredLinear(Module):
    """x [..., dim] -> x @ table.T [..., rows], the table widened in registers."""

    def __init__(self, table: StoredTable):
        self._table = table

    def forward(self, h):
        scale = () if self._table.scale is None else (self._table.scale,)
        lead = h.shape[:-1]
        y = apply("widening_matmul", h.reshape(-1, h.shape[-1]), self._table.values, *scale)
        return y if len(lead) == 1 else y.reshape(*lead, y.shape[-1])
