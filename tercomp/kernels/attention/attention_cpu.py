"""The attention of a language model on a CPU: `cached_attention` over a KV cache as one
hand-written dispatch (vector code compiled by IREE like `kernels.ternary.avx2`), for any number
of queries T. IREE's codegen of the linalg form (a dot product with dynamic sizes per
head, then the softmax passes, each its own dispatch, behind an `scf.if` on T) cost
~0.65 ms a layer of a decode step at position ~160 of the 700M shape, about 40% of the
step; this kernel costs ~0.05 ms there, and a 128-token prefill is ~12% faster with it.

One workgroup per query head h (reading K/V head h // group), for each query t (it sees
cache rows 0..start+t), over chunks of CHUNK rows with a running max (the online
softmax of flash attention, rescaled once per chunk):

    scores[j] = scale * (q[t, h] . f32(k[c0 + j, kh]))          one D-wide dot per row
    m' = max(m, max_j scores);  acc *= exp(m - m');  l *= exp(m - m')
    acc += exp(scores[j] - m') * f32(v[c0 + j, kh]);  l += exp(scores[j] - m')
    out[t, h] = acc / l

The scores of a chunk live in a CHUNK-float stack buffer, so the cache length does not
bound the stack. Only rows 0..start+T-1 are read: a step's cost grows with the position.
A prefill's queries go QBLOCK at a time: the block's rows (those of its last query) are
loaded and widened from f16 once for all its queries, each query's scores and sums as
above, a row past an earlier query's own last one at score -inf (weight 0, so every
float is the one-query kernel's); the rest of T, a decode step's single query and a
sliding-window layer's queries go one at a time.

`slot_attention` (the batched generator's caches [N, S, KV, D], one query a sequence)
has a kernel of its own, `rows_text` (templates/attention_rows.mlir): one workgroup per
(query, group of KV / row_groups(KV) KV heads), which reads each cache row's group of
heads side by side (contiguous) instead of one head's D values out of every KV * D row.
The per-head kernel's rows are KV * D apart (3 KiB at the 700M shape), past what the
hardware prefetchers follow, so each row's lines waited on memory: a batched step of 8
sequences spent 8.3x a single sequence's attention time on it, at ~12 GB/s. Rows are
taken 4 at a time (K: one q load per 4 dot products; V: one accumulator load and store
per 4 rows); the chunk's scores are padded to 8 with -inf, so rows past a query's
position read its last row with weight 0.
"""
from __future__ import annotations

from iree.compiler import ir
from iree.compiler.dialects import arith

from ...codegen.builders import index_const, scalar_index, value_dim
from ...codegen.executables import dispatch, ensure_executable
from ...ir import is_static
from ..template import render

CHUNK = 256
#: Rows ahead whose K and V lines a query's loops prefetch (0: none). A head's D values
#: are 3 lines (f16, D = 96) out of every KV * D row, so its rows are strided by a few
#: KiB and the hardware prefetchers (which stop at a 4 KiB page) miss nearly every one:
#: the loops waited on DRAM row by row. Measured at the 700M shape, position 130, 2
#: threads (bench/timeline.py, bench/RESULTS.md 2026-11-27): the attention of a batched
#: step of 8 slots 136 -> 57 ms, of a decode step 13.5 -> 3.3 ms (medians, a loaded
#: machine); a 128-token prefill (its rows in cache) unchanged.
PREFETCH = 8
#: Lanes (8 floats each) of the V accumulator that one pass over a chunk's rows keeps
#: in registers: 8 independent FMA chains, 8 + 2 vector registers (AVX2 has 16). One
#: lane a pass (1) was a chain of dependent 4-cycle FMAs per lane: measured at the 700M
#: shape, 2 threads, the attention of a 128-token prefill 308 -> 227 ms (medians, all 24
#: layers, a loaded machine: bench/RESULTS.md 2026-11-27); the sums are unchanged (each
#: lane still adds its rows in order).
VGROUP = 8
#: Rows ahead whose lines the slot caches' kernel (attention_rows.mlir, rows read whole)
#: prefetches (0: none). Measured at the 700M shape (bench/RESULTS.md 2026-11-27 20:00):
#: 8 rows ahead 0.63-0.70x the per-head kernel's time (median of paired calls), none
#: 0.84-1.07x.
ROW_PREFETCH = 8
#: Queries of one head a block of the per-head kernel takes together (1: one at a time;
#: the rest of T, and a sliding-window layer's queries, go one at a time): each K and V
#: row the block reads is loaded and widened once for all of them, and a block keeps
#: QBLOCK x BLOCK_VGROUP x 8 floats of accumulators in registers over a chunk's V rows.
#: Measured at the 8B shape (32 / 8 heads, D 128, f16 cache), T = 512 from position 0,
#: CPU-time medians on the loaded 2-core VM (bench/RESULTS.md 2026-11-28): QBLOCK 1 -> 8
#: 1.54-1.68x on 8-lane vectors, 1.65-1.86x on 16; on 8 lanes QBLOCK 4 1.43-1.48x, 16
#: 1.33x; on 16 lanes QBLOCK 4, 12 and 16 and BLOCK_VGROUP 8 within 5% of 8 x 4. The
#: outputs are bit for bit those of one query at a time.
QBLOCK = 8
BLOCK_VGROUP = 4
#: Lanes of a block's vectors (8, or 16 where D is a multiple): a 16-lane dot product's
#: FMA chain is the 8-lane one's two interleaved chains side by side (the floats are the
#: same) with half the instructions: 1.2-1.25x the 8-lane block at T = 128 and 512.
BLOCK_LANES = 16


def fits(head_dim: int, kv_dtype: str) -> bool:
    return kv_dtype in ("f16", "f32") and head_dim % 8 == 0 and head_dim <= 512


def executable_text(name: str, heads: int, kv_heads: int, d: int, s: int, kel: str,
                    window: int = 0) -> str:
    """`stream.executable @name` (templates/attention.mlir): (q [T, H, D] f32, k, v
    [S, KV, D] kel, scale: f32, start: index, T: index) -> out [T, H, D] f32; with
    `window` = W > 0 a query reads only the W most recent of its rows (a sliding-window
    layer: the rows before are never loaded). The slot caches of the batched generator
    have their own kernel (`rows_text`).

    Written on 8-lane vectors with the D/8 lanes of a row unrolled (IREE's codegen of
    one D-wide vector spilled it lane by lane): q's row stays in registers for the dot
    products; exp runs 8 scores at a time over the chunk buffer; the weighted sum of V
    rows keeps VGROUP 8-lane accumulators per pass over the chunk's rows; each row's K
    and V lines are prefetched PREFETCH rows ahead."""
    return render("attention", name=name, heads=heads, kv_heads=kv_heads, d=d, s=s, kel=kel,
                  chunk=CHUNK, window=int(window or 0),
                  prefetch=PREFETCH, vgroup=VGROUP, qblock=QBLOCK,
                  bvgroup=BLOCK_VGROUP, blanes=BLOCK_LANES)


#: Stack bytes a workgroup of the row-wise slot kernel gives its chunk's scores (the
#: chunk length follows from it and the heads of a group).
SCORE_BYTES = 16384


def row_groups(kv_heads: int) -> int:
    """Workgroups a query of the row-wise slot kernel splits its KV heads into: the
    smallest divisor of kv_heads above 1 (two threads' work for one query), or 1."""
    return next((g for g in range(2, kv_heads + 1) if kv_heads % g == 0), 1)


def rows_text(name: str, heads: int, kv_heads: int, d: int, s: int, kel: str, slots: int,
              window: int = 0) -> str:
    """`stream.executable @name` (templates/attention_rows.mlir): the slot caches'
    attention with one workgroup per (query, group of KV heads), reading each cache row's
    group of heads as one contiguous run: (q [T, H, D] f32, k, v [N, S, KV, D] kel,
    slots, positions: i32 [T], scale: f32, T: index) -> out [T, H, D] f32."""
    groups = row_groups(kv_heads)
    hg = heads // groups
    chunk = max(8, min(CHUNK, SCORE_BYTES // 4 // hg // 8 * 8))
    return render("attention_rows", name=name, heads=heads, kv_heads=kv_heads, d=d, s=s,
                  kel=kel, slots=slots, groups=groups, chunk=chunk, window=int(window or 0),
                  prefetch=ROW_PREFETCH)


def _suffix(window) -> str:
    return f"_w{int(window)}" if window else ""


def emit(q: ir.Value, k: ir.Value, v: ir.Value, start: ir.Value, t: ir.Value,
         scale: float, window: int | None = None) -> ir.Value:
    """out [T, H, D] f32 for q tensor<? x H x D x f32> (T = the index value `t`), the caches
    k, v tensor<S x KV x D x f16|f32> and the index value `start` (`window`: the rows a
    query sees, None for all)."""
    qt, kt = ir.RankedTensorType(q.type), ir.RankedTensorType(k.type)
    heads, d = qt.get_dim_size(1), qt.get_dim_size(2)
    s, kv_heads = kt.get_dim_size(0), kt.get_dim_size(1)
    kel = str(kt.element_type)
    name = f"tern_attention_{heads}x{kv_heads}x{d}x{s}_{kel}{_suffix(window)}"
    ensure_executable(name, lambda: executable_text(name, heads, kv_heads, d, s, kel,
                                                    window=window))
    dynamic = qt.is_dynamic_dim(0)
    dims = [t] if dynamic else []
    scale_v = arith.constant(ir.F32Type.get(), float(scale))
    return dispatch(name, name, [t], [q, k, v, scale_v, start, t], dims, q.type, dims)


def emit_slots(q: ir.Value, k: ir.Value, v: ir.Value, slots: ir.Value, positions: ir.Value,
               t: ir.Value, scale: float, window: int | None = None) -> ir.Value:
    """out [T, H, D] f32 for q tensor<? x H x D x f32>, the slot caches k, v
    tensor<N x S x KV x D x f16|f32> and the i32 [T] tensors `slots` and `positions`
    (ops/kv_slots.py's slot_attention)."""
    qt, kt = ir.RankedTensorType(q.type), ir.RankedTensorType(k.type)
    heads, d = qt.get_dim_size(1), qt.get_dim_size(2)
    n, s, kv_heads = kt.get_dim_size(0), kt.get_dim_size(1), kt.get_dim_size(2)
    kel = str(kt.element_type)
    name = f"tern_slot_attention_rows_{heads}x{kv_heads}x{d}x{n}x{s}_{kel}{_suffix(window)}"
    ensure_executable(name, lambda: rows_text(name, heads, kv_heads, d, s, kel, n, window))
    dims = [t] if qt.is_dynamic_dim(0) else []
    idx_dims = [t] if ir.RankedTensorType(slots.type).is_dynamic_dim(0) else []
    scale_v = arith.constant(ir.F32Type.get(), float(scale))
    return dispatch(name, name, [t], [q, k, v, slots, positions, scale_v, t],
                    dims + idx_dims + idx_dims, q.type, dims)


def emit_cached(ctx, op, xs) -> list:
    """The kernel table's cached_attention "cpu" row: the dispatch above for every T (an
    scf.if on T splits the step's command buffer at every layer, ~0.17 ms a layer of a
    decode step, and the kernel is also the faster prefill at 128 tokens)."""
    q, k, v, start = xs
    t0 = op.operands[0].type.shape[0]
    t = None if is_static(t0) else value_dim(q, 0)
    p = scalar_index(start)
    t = index_const(int(t0)) if t is None else t
    return [emit(q, k, v, p, t, float(op.attrs["scale"]), op.attrs.get("window"))]


def emit_slot(ctx, op, xs) -> list:
    """The kernel table's slot_attention "cpu" row: `emit_slots`."""
    q, k, v, slots, positions = xs
    return [emit_slots(q, k, v, slots, positions, value_dim(q, 0), float(op.attrs["scale"]),
                       op.attrs.get("window"))]
