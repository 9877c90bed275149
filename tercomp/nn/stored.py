"""Frozen layers over one narrow table: an embedding and an output layer that read the
same [vocab, hidden] weights stored in float16, or int8 with a scale per row, widened in
registers (`tern.widening_matmul`).

A language model's output layer is the largest read of a decode step (with a tied
embedding, one table serves both lookups): tc.compile_lm stores it narrow
(`output_dtype`), and models.load keeps a GGUF's f16 token embedding and output table
as these layers (the file's bytes, never widened: an 8B model's two tables are 2 GiB in
f16, 4 GiB in f32). Both layers keep the table in a private attribute, so the module
tree has one copy however many layers read it, and it is no parameter (`trainable()`
gives the float32 layer to train).

    >>> table = nn.StoredTable.from_weight(lm.embed_tokens.weight, "int8")
    >>> emb, head = nn.StoredEmbedding(table), nn.StoredLinear(table)
"""
from __future__ import annotations

import numpy as np

from ..tracing import api as _t
from ..tracing.tracer import apply
from .layers import Embedding, Linear
from .module import Module

#: how a stored table may keep its weights
TABLE_DTYPES = ("float16", "int8")


def quantize_rows(w) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [N, K], scale f32 [N]) with w ~= q * scale[:, None]: each row scaled by its
    largest magnitude / 127, rounded to nearest (llama.cpp's Q8_0 does the same per 32
    weights; one scale a row keeps the kernel's inner loop free of scales)."""
    w = np.asarray(w)
    q = np.empty(w.shape, np.int8)
    scale = np.empty(w.shape[0], np.float32)
    # _ROWS rows at a time: the float32 temporaries stay in cache (~2.5x faster on a
    # 32000 x 1536 table than whole-table passes)
    for lo in range(0, w.shape[0], _ROWS):
        blk = np.asarray(w[lo:lo + _ROWS], np.float32)
        top = np.maximum(blk.max(axis=1), -blk.min(axis=1))        # no |w| temporary
        s = np.where(top > 0, top / 127.0, 1.0).astype(np.float32)
        blk = blk / s[:, None]
        np.rint(blk, out=blk)
        np.clip(blk, -127, 127, out=blk)
        q[lo:lo + _ROWS] = blk
        scale[lo:lo + _ROWS] = s
    return q, scale


_ROWS = 64


class StoredTable:
    """A [rows, dim] table kept as float16, or int8 with a float32 scale per row."""

    def __init__(self, values: np.ndarray, scale: np.ndarray | None = None):
        self.values, self.scale = values, scale

    @classmethod
    def from_weight(cls, w, dtype: str = "float16") -> "StoredTable":
        if dtype == "float16":
            w = np.asarray(w)
            return cls(w if w.dtype == np.float16 else w.astype(np.float32).astype(np.float16))
        if dtype == "int8":
            return cls(*quantize_rows(w))
        raise ValueError(f"a stored table is one of {TABLE_DTYPES}, got {dtype!r}")

    @property
    def dtype(self) -> str:
        """"float16" or "int8": how the values are kept."""
        return "int8" if self.scale is not None else str(self.values.dtype)

    @property
    def shape(self) -> tuple:
        return self.values.shape

    def weight(self) -> np.ndarray:
        """The table as an array: the float16 values themselves (no copy), or an int8
        table's values times their row scales in float32."""
        if self.scale is None:
            return self.values
        return self.values.astype(np.float32) * self.scale[:, None]

    def widened(self) -> np.ndarray:
        """A float32 copy of the table (a row block at a time: no float64 temporaries)."""
        out = np.empty(self.values.shape, np.float32)
        for lo in range(0, len(out), 4096):
            out[lo:lo + 4096] = self.values[lo:lo + 4096]
            if self.scale is not None:
                out[lo:lo + 4096] *= self.scale[lo:lo + 4096, None]
        return out


#: tables smaller than this (elements) stay float16 under "auto": their read is a small
#: share of a step, and the int8 rounding would move a small model's logits for nothing
AUTO_INT8_MIN = 1 << 23
#: hidden states the "auto" choice checks top-1 agreement on
AUTO_PROBES = 32


def choose_table(w, norm_weight=None, *, probes: int = AUTO_PROBES, seed: int = 0
                 ) -> tuple[str, "StoredTable", str]:
    """("int8" or "float16", the StoredTable, why) for output table `w` [vocab, dim]: int8
    (half the bytes of a decode step's largest read) where the table is large
    (>= AUTO_INT8_MIN elements) and gives the top-1 token of the model's own float32
    table on every one of `probes` hidden states (unit Gaussian vectors times the final
    norm's weight `norm_weight`, as the output layer sees them), both with the hidden
    state in float32 (the widening kernel) and quantized to int8 a row at a time (the
    avx512-vnni kernel, kernels/dense/vnni_avx512.py); float16 otherwise.

    >>> dtype, table, why = choose_table(lm.embed_tokens.weight, lm.norm.weight)
    """
    w = np.asarray(w)           # float16 from a GGUF: widened a slice at a time below
    if w.size < AUTO_INT8_MIN:
        return "float16", StoredTable.from_weight(w, "float16"), \
            f"a table of {w.size} < {AUTO_INT8_MIN} elements stays float16"
    i8 = StoredTable.from_weight(w, "int8")
    h = np.random.default_rng(seed).standard_normal((probes, w.shape[1])).astype(np.float32)
    if norm_weight is not None:
        h *= np.asarray(norm_weight, np.float32)
    ref = np.empty((probes, w.shape[0]), np.float32)
    for lo in range(0, w.shape[0], 4096):        # a slice of rows at a time: bounded memory
        ref[:, lo:lo + 4096] = h @ w[lo:lo + 4096].astype(np.float32).T
    top = ref.argmax(axis=1)
    # Each int8 weight is within half its row's step of the float one, so an int8 logit
    # is within |h|_1 * step / 2 of the float32 one (0.52: room for float rounding); with
    # h in int8 too (step s_h) add |W_row|_1 * s_h / 2 + K * step * s_h / 4. Only rows
    # whose bound reaches the top row's can be int8's top-1, and only theirs are computed
    # in int8 (the same argmax, first index on ties, as over every row).
    from ..ternary_pack import act_quant
    hq, inv = act_quant(h)                      # the kernel's rounding, bit for bit
    s_h = 1.0 / inv[:, 0]
    w_l1 = np.empty(w.shape[0], np.float64)     # |W_row|_1 bounded through the int8 codes
    for lo in range(0, w.shape[0], 4096):
        w_l1[lo:lo + 4096] = np.abs(i8.values[lo:lo + 4096].astype(np.int16)).sum(axis=1)
    w_l1 = (w_l1 + 0.5 * w.shape[1]) * i8.scale
    bound_f = np.abs(h).sum(axis=1)[:, None] * (0.52 * i8.scale)[None, :]
    bound_q = bound_f + 0.52 * s_h[:, None] * w_l1[None, :] \
        + 0.26 * w.shape[1] * s_h[:, None] * i8.scale[None, :]
    for p in range(probes):
        t = top[p]
        for bound, x, sx, kind in ((bound_f, h[p], 1.0, "float32"),
                                   (bound_q, hq[p], s_h[p], "int8")):
            rows = np.flatnonzero(ref[p] + bound[p] >= ref[p, t] - bound[p, t])
            logits = (i8.values[rows].astype(np.float32) @ x) * (i8.scale[rows] * sx)
            if rows[logits.argmax()] != t:      # the first miss decides: float16
                return "float16", StoredTable.from_weight(w, "float16"), \
                    (f"int8 changes the top-1 token on probe hidden state {p + 1} of "
                     f"{probes} ({kind})")
    return "int8", i8, (f"int8 keeps the float32 table's top-1 token on {probes}/{probes} "
                        f"probe hidden states (float32 and int8 ones)")


class StoredEmbedding(Module):
    """Rows of a StoredTable, widened to float32: ids [...] -> [..., dim]."""

    def __init__(self, table: StoredTable):
        self._table = table

    @property
    def table(self) -> StoredTable:
        return self._table

    @property
    def weight(self) -> np.ndarray:
        """The table [rows, dim] as stored (StoredTable.weight: float16 values, no copy);
        read-only: `trainable()` gives a layer whose float32 weight is a parameter."""
        return self._table.weight()

    def trainable(self) -> Module:
        """An nn.Embedding over a float32 copy of the table (a parameter)."""
        emb = Embedding.__new__(Embedding)
        emb.weight = self._table.widened()
        return emb

    def forward(self, ids):
        rows = _t.take(self._table.values, ids, axis=0).astype("float32")
        if self._table.scale is None:
            return rows
        return rows * _t.expand_dims(_t.take(self._table.scale, ids, axis=0), -1)


class StoredLinear(Module):
    """x [..., dim] -> x @ table.T [..., rows], the table widened in registers."""

    def __init__(self, table: StoredTable):
        self._table = table

    table = StoredEmbedding.table
    weight = StoredEmbedding.weight

    @property
    def in_features(self) -> int:
        return self._table.shape[1]

    @property
    def out_features(self) -> int:
        return self._table.shape[0]

    def trainable(self) -> Module:
        """An nn.Linear (no bias) over a float32 copy of the table (a parameter)."""
        lin = Linear.__new__(Linear)
        lin.in_features, lin.out_features = self.in_features, self.out_features
        lin.weight, lin.bias = self._table.widened(), None
        return lin

    def forward(self, h):
        scale = () if self._table.scale is None else (self._table.scale,)
        lead = h.shape[:-1]
        y = apply("widening_matmul", h.reshape(-1, h.shape[-1]), self._table.values, *scale)
        return y if len(lead) == 1 else y.reshape(*lead, y.shape[-1])
