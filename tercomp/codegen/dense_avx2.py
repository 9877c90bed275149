"""The output-layer kernel of a language model on an AVX2 host: y[M, N] = x[M, K] @ W^T
with W [N, K] stored in f16 and widened in registers (`vcvtph2ps`), so a decode step
reads 2 bytes per weight; or stored in int8 with a per-row f32 scale (y[m, r] = scale[r]
* sum_k x[m, k] f32(W[r, k]), widened by `vpmovsxbd` + `vcvtdq2ps`): 1 byte per weight. A hand-written dispatch like `ternary_avx2` (same reasons:
IREE's data tiling re-lays out a widening matmul's weights on every call, 146 ms a
token at the 700M shape, and without data tiling its generic GEMV ran at ~5 GB/s):

    for 4 rows at a time, one from each quarter of the workgroup's rows (then the
    remaining rows one by one):
        for each row m of x:
            acc_r += f32(W[r, k:k+16]) * x[m, k:k+16]      16 lanes, 2 FMA chains a row
            (each row's bytes prefetched two rows of its quarter ahead)
        y[m, r] = sum(acc_r)

The rows are split into about 32 workgroups. M may be anything (a prefill that wants
every position's logits re-reads each row group from L1 per row of x).
"""
from __future__ import annotations

from iree.compiler import ir

from .executables import dispatch, ensure_executable, load_row, split_rows
from .kernel_table import host_cpu_features
from .executables import executable_text as wrap_executable

ROWS = 4
LANES = 16
PREFETCH_ROWS = 8
#: The 4 rows of a step come from 4 streams, a quarter of the workgroup's rows each,
#: prefetched into L1 this many rows ahead: far-apart streams keep more DRAM reads in
#: flight than adjacent rows (see `ternary_avx2.STREAM_AHEAD`).
STREAM_AHEAD = 2
WORKGROUPS = 32


def m_block() -> int:
    """Rows of x that share each widened weight vector (a batched decode's rows): ROWS x
    m_block accumulators of LANES floats stay in registers, 16 zmm of AVX-512's 32 for
    4 (the hot loop has no spill: checked in the dumped assembly). AVX2 has 16 ymm,
    which 4 x 1 pairs of accumulators and the loads already use: one row at a time
    there. On the 2-core Xeon with AVX-512 VNNI, 32002 x 1536 f16, 2 threads, one x row
    at a time cost 4.3 / 9.6 / 19.5 / 42.7 ms at M = 1 / 4 / 8 / 16 (the weights
    widened again for every row); 4 at a time 3.9 ms at M = 4 (a loaded machine)."""
    return 4 if "avx512f" in host_cpu_features() else 1


def fits(k: int) -> bool:
    return k % LANES == 0


#: the weight element types and how a vector of them is widened to f32
WIDEN = {"f16": "arith.extf", "i8": "arith.sitofp"}


def _row_block(rows: int, k: int, xt: str, wt: str, ot: str, tag: str, el: str,
               bases=None, mb: int = 1, m_range=("%c0", "%m")) -> str:
    """The loop nest for `rows` rows starting at %r{tag}, or for the rows `bases` (one
    per stream, each prefetched STREAM_AHEAD rows ahead into L1), over the rows of x in
    `m_range`, `mb` of them at a time: each weight vector is loaded and widened once for
    all `mb` (rows x mb accumulators)."""
    vf, vh = f"vector<{LANES}xf32>", f"vector<{LANES}x{el}>"
    r = f"%r{tag}"
    xs = [f"%xm{j} = affine.apply affine_map<(d0) -> (d0 + {j})>(%mi)" for j in range(mb)]
    loads = [f"%xv{j} = vector.load %x[%xm{j}, %c] : {xt}, {vf}" for j in range(mb)]
    for i in range(rows):
        loads += (load_row("wh", i, r, "%c", "%w", wt, vh, PREFETCH_ROWS) if bases is None else
                  load_row("wh", i, bases[i], "%c", "%w", wt, vh, STREAM_AHEAD, locality=3,
                           offset=0)) + [f"%wf{i} = {WIDEN[el]} %wh{i} : {vh} to {vf}"]
        loads += [f"%n{i}_{j} = vector.fma %wf{i}, %xv{j}, %a{i}_{j} : {vf}" for j in range(mb)]
    pairs = [(i, j) for i in range(rows) for j in range(mb)]
    accs = ", ".join(f"%a{i}_{j} = %zf" for i, j in pairs)
    types = ", ".join([vf] * len(pairs))
    stores = []
    for i in range(rows):
        row = f"%orow{i}" if bases is None else bases[i]
        if bases is None:
            stores.append(f"{row} = affine.apply affine_map<(d0) -> (d0 + {i})>({r})")
        if el == "i8":
            stores.append(f"%s{i} = memref.load %sc[{row}] : memref<?xf32>")
        for j in range(mb):
            y = f"%y{i}_{j}"
            stores.append(f"{y} = vector.reduction <add>, %acc#{i * mb + j} : {vf} into f32")
            if el == "i8":
                stores += [f"%ys{i}_{j} = arith.mulf {y}, %s{i} : f32"]
                y = f"%ys{i}_{j}"
            stores.append(f"memref.store {y}, %o[%xm{j}, {row}] : {ot}")
    nl = "\n"
    return f"""
          scf.for %mi = {m_range[0]} to {m_range[1]} step %c{mb} {{
            {nl.join(xs)}
            %acc:{len(pairs)} = scf.for %c = %c0 to %ck step %cl iter_args({accs}) -> ({types}) {{
              {nl.join(loads)}
              scf.yield {", ".join(f"%n{i}_{j}" for i, j in pairs)} : {types}
            }}
            {nl.join(stores)}
          }}"""


def executable_text(name: str, n: int, k: int, el: str = "f16", mb: int = 1) -> str:
    """`stream.executable @name` whose export `@name` maps x [M, K] f32 and w [N, K] `el`
    (and for i8, scale [N] f32) to x @ f32(w)^T (* scale) [M, N] f32; `mb` rows of x
    share each widened weight vector (M_BLOCK)."""
    rpw, groups = split_rows(n, WORKGROUPS, ROWS)
    bases = [f"%rs{i}" for i in range(ROWS)]
    mb_const = f"\n      %c{mb} = arith.constant {mb} : index" if mb > 1 else ""
    # stream i reads rows r0 + i * groups + j, j = 0 .. groups - 1
    streams = "\n        ".join(
        f"%rs{i} = affine.apply affine_map<(d0)[s0] -> (d0 + s0 * {i})>(%rb)[%groups]"
        for i in range(ROWS))
    xt, wt, ot = f"memref<?x{k}xf32>", f"memref<{n}x{k}x{el}>", f"memref<?x{n}xf32>"
    scale = f"""
      %sc = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?xf32>{{%cn}}""" \
        if el == "i8" else ""
    body = f"""      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index{mb_const}
      %cr = arith.constant {ROWS} : index
      %ck = arith.constant {k} : index
      %cl = arith.constant {LANES} : index
      %cn = arith.constant {n} : index
      %rpw = arith.constant {rpw} : index
      %zf = arith.constant dense<0.0> : vector<{LANES}xf32>
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> {xt}{{%m}}
      %w = stream.binding.subspan %bw[%c0] : !stream.binding -> {wt}
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {ot}{{%m}}{scale}
      %wg = stream.dispatch.workgroup.id[0] : index
      %r0 = arith.muli %wg, %rpw : index
      %r1u = arith.addi %r0, %rpw : index
      %r1 = arith.minui %r1u, %cn : index
      %span = arith.subi %r1, %r0 : index
      %groups = arith.divui %span, %cr : index
      %whole = arith.muli %groups, %cr : index
      %rg = arith.addi %r0, %whole : index
      %rq = arith.addi %r0, %groups : index
      %mblocks = arith.divui %m, %c{mb} : index
      %mwhole = arith.muli %mblocks, %c{mb} : index
      scf.for %rb = %r0 to %rq step %c1 {{
        {streams}{_row_block(ROWS, k, xt, wt, ot, "b", el, bases, mb, ("%c0", "%mwhole"))}
        {_row_block(ROWS, k, xt, wt, ot, "b", el, bases, 1, ("%mwhole", "%m")) if mb > 1 else ""}
      }}
      scf.for %rt = %rg to %r1 step %c1 {{{_row_block(1, k, xt, wt, ot, "t", el)}
      }}"""
    bindings = "%bx: !stream.binding, %bw: !stream.binding, " + \
        ("%bs: !stream.binding, " if el == "i8" else "") + "%bo: !stream.binding, %m: index"
    return wrap_executable(name, groups, bindings, body)


def emit(x: ir.Value, w: ir.Value, m_dim: ir.Value, n: int, k: int,
         scale: ir.Value | None = None) -> ir.Value:
    """y [M, N] f32 for x tensor<M x K x f32> (M static or dynamic; `m_dim` its index
    value) and w tensor<N x K x f16>, or w tensor<N x K x i8> with scale tensor<N x f32>,
    at the current insertion point."""
    el = "i8" if scale is not None else "f16"
    mb = m_block()
    name = f"tern_avx2_{el}_gemv_{n}x{k}" + (f"_m{mb}" if mb > 1 else "")
    ensure_executable(name, lambda: executable_text(name, n, k, el, mb))
    x_t = ir.RankedTensorType(x.type)
    dynamic = x_t.is_dynamic_dim(0)
    dims = [m_dim] if dynamic else []
    out_t = ir.RankedTensorType.get([x_t.get_dim_size(0) if not dynamic
                                     else ir.ShapedType.get_dynamic_size(), n], ir.F32Type.get())
    args = [x, w] + ([scale] if scale is not None else []) + [m_dim]
    return dispatch(name, name, [m_dim], args, dims, out_t, dims)
