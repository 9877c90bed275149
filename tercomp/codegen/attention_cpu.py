"""The attention of a language model on a CPU: `cached_attention` over a KV cache as one
hand-written dispatch (vector code compiled by IREE like `ternary_avx2`), for any number
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
"""
from __future__ import annotations

from iree.compiler import ir
from iree.compiler.dialects import arith

from .executables import dispatch, ensure_executable
from .executables import executable_text as wrap_executable

CHUNK = 256


def fits(head_dim: int, kv_dtype: str) -> bool:
    return kv_dtype in ("f16", "f32") and head_dim % 8 == 0 and head_dim <= 512


def executable_text(name: str, heads: int, kv_heads: int, d: int, s: int, kel: str,
                    slots: int = 0) -> str:
    """`stream.executable @name`: (q [T, H, D] f32, k, v [S, KV, D] kel, scale: f32,
    start: index, T: index) -> out [T, H, D] f32; with `slots` = N > 0 (the batched
    cache of ops/kv_slots.py) the caches are [N, S, KV, D] and `start` is replaced by
    two i32 [T] bindings: query t reads rows 0..positions[t] of slot slots[t].

    Written on 8-lane vectors with the D/8 lanes of a row unrolled here (IREE's codegen
    of one D-wide vector spilled it lane by lane): q's row stays in registers for the
    dot products; exp runs 8 scores at a time over the chunk buffer; the weighted sum of
    V rows keeps one 8-lane accumulator per pass over the chunk's rows."""
    lanes = d // 8
    v8, vk = "vector<8xf32>", f"vector<8x{kel}>"
    qt, kt = f"memref<?x{heads}x{d}xf32>", f"memref<{s}x{kv_heads}x{d}x{kel}>"
    row = "%s"                   # the cache row of position %s: [%s] or [%slot, %s]
    if slots:
        kt, row = f"memref<{slots}x{s}x{kv_heads}x{d}x{kel}>", "%slot, %s"
    st, at = f"memref<{CHUNK}xf32>", f"memref<{d}xf32>"

    def widen(dst, src):
        if kel == "f32":
            return f"{dst} = arith.addf {src}, %z8 : {v8}"
        return f"{dst} = arith.extf {src} : {vk} to {v8}"

    def col(i):
        return f"%col{i}"
    cols = "\n".join(f"      {col(i)} = arith.constant {8 * i} : index" for i in range(lanes))
    qload = "\n".join(f"        %q{i} = vector.load %q[%t, %h, {col(i)}] : {qt}, {v8}"
                       for i in range(lanes))
    dot = []
    for i in range(lanes):
        acc = "%z8" if i < 2 else f"%d{i - 2}"
        dot += [f"            %k{i} = vector.load %k[{row}, %kh, {col(i)}] : {kt}, {vk}",
                f"            {widen(f'%kf{i}', f'%k{i}')}",
                f"            %d{i} = vector.fma %q{i}, %kf{i}, {acc} : {v8}"]
    last2 = [f"%d{lanes - 1}"] + ([f"%d{lanes - 2}"] if lanes > 1 else [])
    if len(last2) == 2:
        dot.append(f"            %dsum = arith.addf {last2[0]}, {last2[1]} : {v8}")
    else:
        dot.append(f"            %dsum = arith.addf {last2[0]}, %z8 : {v8}")
    dot = "\n".join(dot)
    zero_acc = "\n".join(f"        vector.store %z8, %acc[{col(i)}] : {at}, {v8}"
                          for i in range(lanes))
    weigh = []
    for i in range(lanes):
        weigh.append(f"""
          %a{i} = vector.load %acc[{col(i)}] : {at}, {v8}
          %as{i} = arith.mulf %a{i}, %corrv : {v8}
          %w{i} = scf.for %s = %cs to %ce step %c1 iter_args(%wa = %as{i}) -> ({v8}) {{
            %j = arith.subi %s, %cs : index
            %e = memref.load %sc[%j] : {st}
            %eb = vector.broadcast %e : f32 to {v8}
            %vr = vector.load %v[{row}, %kh, {col(i)}] : {kt}, {vk}
            {widen("%vf", "%vr")}
            %wn = vector.fma %eb, %vf, %wa : {v8}
            scf.yield %wn : {v8}
          }}
          vector.store %w{i}, %acc[{col(i)}] : {at}, {v8}""")
    weigh = "".join(weigh)
    store = "\n".join(f"""        %f{i} = vector.load %acc[{col(i)}] : {at}, {v8}
        %g{i} = arith.mulf %f{i}, %invv : {v8}
        vector.store %g{i}, %o[%t, %h, {col(i)}] : {qt}, {v8}""" for i in range(lanes))
    if slots:
        last = """        %slot32 = memref.load %sl[%t] : memref<?xi32>
        %slot = arith.index_cast %slot32 : i32 to index
        %last32 = memref.load %pos[%t] : memref<?xi32>
        %last = arith.index_cast %last32 : i32 to index"""
        bind = """
      %sl = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?xi32>{%m}
      %pos = stream.binding.subspan %bp[%c0] : !stream.binding -> memref<?xi32>{%m}"""
        # bindings in the order of the dispatch's tensors: q, k, v, slots, positions, out
        args = ("%bq: !stream.binding, %bk: !stream.binding, %bv: !stream.binding, "
                "%bs: !stream.binding, %bp: !stream.binding, %bo: !stream.binding, "
                "%scale: f32, %m: index")
    else:
        last, bind = "        %last = arith.addi %p, %t : index", ""
        args = ("%bq: !stream.binding, %bk: !stream.binding, %bv: !stream.binding, "
                "%bo: !stream.binding, %scale: f32, %p: index, %m: index")
    body = f"""      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c8 = arith.constant 8 : index
{cols}
      %cchunk = arith.constant {CHUNK} : index
      %cgroup = arith.constant {heads // kv_heads} : index
      %ninf = arith.constant 0xFF800000 : f32
      %zero = arith.constant 0.0 : f32
      %one = arith.constant 1.0 : f32
      %z8 = arith.constant dense<0.0> : {v8}
      %q = stream.binding.subspan %bq[%c0] : !stream.binding -> {qt}{{%m}}
      %k = stream.binding.subspan %bk[%c0] : !stream.binding -> {kt}
      %v = stream.binding.subspan %bv[%c0] : !stream.binding -> {kt}
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {qt}{{%m}}{bind}
      %sc = memref.alloca() : {st}
      %acc = memref.alloca() : {at}
      %h = stream.dispatch.workgroup.id[0] : index
      %kh = arith.divui %h, %cgroup : index
      scf.for %t = %c0 to %m step %c1 {{
{qload}
{zero_acc}
{last}
        %n = arith.addi %last, %c1 : index
        %res:2 = scf.for %cs = %c0 to %n step %cchunk
            iter_args(%mx = %ninf, %l = %zero) -> (f32, f32) {{
          %ceu = arith.addi %cs, %cchunk : index
          %ce = arith.minui %ceu, %n : index
          %len = arith.subi %ce, %cs : index
          %cm = scf.for %s = %cs to %ce step %c1 iter_args(%m1 = %ninf) -> (f32) {{
{dot}
            %dt = vector.reduction <add>, %dsum fastmath<reassoc> : {v8} into f32
            %sd = arith.mulf %dt, %scale : f32
            %j = arith.subi %s, %cs : index
            memref.store %sd, %sc[%j] : {st}
            %m2 = arith.maximumf %m1, %sd : f32
            scf.yield %m2 : f32
          }}
          %mn = arith.maximumf %mx, %cm : f32
          %dm = arith.subf %mx, %mn : f32
          %corr = math.exp %dm : f32
          %corrv = vector.broadcast %corr : f32 to {v8}
          %mnv = vector.broadcast %mn : f32 to {v8}
          scf.for %j = %c0 to %len step %c8 {{
            %x = vector.load %sc[%j] : {st}, {v8}
            %xd = arith.subf %x, %mnv : {v8}
            %e = math.exp %xd : {v8}
            vector.store %e, %sc[%j] : {st}, {v8}
          }}
          %lc = scf.for %j = %c0 to %len step %c1 iter_args(%ls = %zero) -> (f32) {{
            %e = memref.load %sc[%j] : {st}
            %ls2 = arith.addf %ls, %e : f32
            scf.yield %ls2 : f32
          }}
          %l0 = arith.mulf %l, %corr : f32
          %l1 = arith.addf %l0, %lc : f32{weigh}
          scf.yield %mn, %l1 : f32, f32
        }}
        %inv = arith.divf %one, %res#1 : f32
        %invv = vector.broadcast %inv : f32 to {v8}
{store}
      }}"""
    return wrap_executable(name, heads, args, body)


def emit(q: ir.Value, k: ir.Value, v: ir.Value, start: ir.Value, t: ir.Value,
         scale: float) -> ir.Value:
    """out [T, H, D] f32 for q tensor<? x H x D x f32> (T = the index value `t`), the caches
    k, v tensor<S x KV x D x f16|f32> and the index value `start`."""
    qt, kt = ir.RankedTensorType(q.type), ir.RankedTensorType(k.type)
    heads, d = qt.get_dim_size(1), qt.get_dim_size(2)
    s, kv_heads = kt.get_dim_size(0), kt.get_dim_size(1)
    kel = str(kt.element_type)
    name = f"tern_attention_{heads}x{kv_heads}x{d}x{s}_{kel}"
    ensure_executable(name, lambda: executable_text(name, heads, kv_heads, d, s, kel))
    dynamic = qt.is_dynamic_dim(0)
    dims = [t] if dynamic else []
    scale_v = arith.constant(ir.F32Type.get(), float(scale))
    return dispatch(name, name, [t], [q, k, v, scale_v, start, t], dims, q.type, dims)


def emit_slots(q: ir.Value, k: ir.Value, v: ir.Value, slots: ir.Value, positions: ir.Value,
               t: ir.Value, scale: float) -> ir.Value:
    """out [T, H, D] f32 for q tensor<? x H x D x f32>, the slot caches k, v
    tensor<N x S x KV x D x f16|f32> and the i32 [T] tensors `slots` and `positions`
    (ops/kv_slots.py's slot_attention)."""
    qt, kt = ir.RankedTensorType(q.type), ir.RankedTensorType(k.type)
    heads, d = qt.get_dim_size(1), qt.get_dim_size(2)
    n, s, kv_heads = kt.get_dim_size(0), kt.get_dim_size(1), kt.get_dim_size(2)
    kel = str(kt.element_type)
    name = f"tern_slot_attention_{heads}x{kv_heads}x{d}x{n}x{s}_{kel}"
    ensure_executable(name, lambda: executable_text(name, heads, kv_heads, d, s, kel, slots=n))
    dims = [t] if qt.is_dynamic_dim(0) else []
    idx_dims = [t] if ir.RankedTensorType(slots.type).is_dynamic_dim(0) else []
    scale_v = arith.constant(ir.F32Type.get(), float(scale))
    return dispatch(name, name, [t], [q, k, v, slots, positions, scale_v, t],
                    dims + idx_dims + idx_dims, q.type, dims)
