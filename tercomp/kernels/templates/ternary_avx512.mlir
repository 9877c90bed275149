{# params: name, n, kb, offset, prequantized, rows, mb, gemm_rows, tile_rows, chunk, prefetch_rows, stream_ahead, workgroups, decode_workgroups, eps, c127, lo, hi #}
{#
  The avx512 ternary matmul (see ternary/avx512.py for the why): the avx2 kernel's
  inputs and outputs (ternary_avx2.mlir) on 64-byte zmm chunks, each u8 x s8 product
  reduced into i32 lanes by vpdpbusd (4 products a lane, no i16 stage). `prequantized`
  (x as the quantize dispatch's codes): `mb` rows of x at a time through the GEMM loop,
  the remaining rows one by one through the GEMV loop (`rows` weight rows a step, one
  from each of `rows` streams); else (a decode's few rows) every row through the GEMV
  loop, quantized by the workgroup into a one-row buffer. The decode works on i32 lanes: no carry or borrow crosses a
  2-bit field, so the byte-wise arithmetic is the same done 32 bits at a time.
#}
%% import "lib.mlir" as lib
%% import "avx2_quant_lib.mlir" as quant
%% set v8, v32 = "vector<64xi8>", "vector<16xi32>"
%% set dp = 'llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"'
%% set dpt = "(%s, %s, %s) -> %s" % (v32, v8, v8, v32)
%% set kp = 4 * kb
%% set bt = "memref<1x%dxi8>" % kp
%% set wt = "memref<%dx%dxi8>" % (n, kb)
%% set ot = "memref<?x%dxf32>" % n
%% set qt = "memref<?x%dxi8>" % kp
{#
  codes: load the 64 packed bytes at column %c of weight row `base` + `step`
  (prefetching the same column `ahead` rows further on with `locality`) and define
  %q{i}_{j}, the u = w + 1 codes of plane j (64 bytes, computed on i32 lanes), planes
  1 and 3 left 4 times their codes (u & 0xC, (u >> 4) & 0xC): one shift serves all four
  planes. The bytes hold u already when `offset`, else the signed codes, remapped here.
#}
%% macro codes(i, base, step, ahead, locality)
%%   set raw = "%%raw%d" % i
{{ lib.load_row(raw ~ "b", "%%rowraw%d" % i, base, step, "%c", "%w", wt, v8, "%%preraw%d" % i, ahead, locality) }}
{{ raw }} = vector.bitcast {{ raw }}b : {{ v8 }} to {{ v32 }}
%%   set u = raw if offset else "%%u%d" % i
%%   if not offset
%lo{{ i }} = arith.andi {{ raw }}, %m55 : {{ v32 }}
%hs{{ i }} = arith.shrui {{ raw }}, %s1 : {{ v32 }}
%hi{{ i }} = arith.andi %hs{{ i }}, %m55 : {{ v32 }}
%lp{{ i }} = arith.addi %lo{{ i }}, %m55 : {{ v32 }}
%u{{ i }} = arith.subi %lp{{ i }}, %hi{{ i }} : {{ v32 }}
%%   endif
%qw{{ i }}_0 = arith.andi {{ u }}, %three : {{ v32 }}
%qw{{ i }}_1 = arith.andi {{ u }}, %twelve : {{ v32 }}
%t{{ i }} = arith.shrui {{ u }}, %s4 : {{ v32 }}
%qw{{ i }}_2 = arith.andi %t{{ i }}, %three : {{ v32 }}
%qw{{ i }}_3 = arith.andi %t{{ i }}, %twelve : {{ v32 }}
%%   for j in range(4)
%q{{ i }}_{{ j }} = vector.bitcast %qw{{ i }}_{{ j }} : {{ v32 }} to {{ v8 }}
%%   endfor
%% endmacro
{# x_planes: %x{b}_{j}, the 64 quantized x values of plane j at column %c of row `row` of `mem` (`mem_type`). #}
%% macro x_planes(b, mem, mem_type, row)
%%   for j in range(4)
%xo{{ b }}_{{ j }} = affine.apply affine_map<(d0) -> (d0 + {{ j * kb }})>(%c)
%x{{ b }}_{{ j }} = vector.load {{ mem }}[{{ row }}, %xo{{ b }}_{{ j }}] : {{ mem_type }}, {{ v8 }}
%%   endfor
%% endmacro
{#
  products: %na{tag} and %nb{tag}, the accumulators %a{tag} (planes 0 and 2) and %b{tag}
  (planes 1 and 3, 4 times their codes) after vpdpbusd of the codes %q{i}_j with x %x{b}_j.
#}
%% macro products(tag, i, b)
%pa{{ tag }} = {{ dp }}(%a{{ tag }}, %q{{ i }}_0, %x{{ b }}_0) : {{ dpt }}
%na{{ tag }} = {{ dp }}(%pa{{ tag }}, %q{{ i }}_2, %x{{ b }}_2) : {{ dpt }}
%pb{{ tag }} = {{ dp }}(%b{{ tag }}, %q{{ i }}_1, %x{{ b }}_1) : {{ dpt }}
%nb{{ tag }} = {{ dp }}(%pb{{ tag }}, %q{{ i }}_3, %x{{ b }}_3) : {{ dpt }}
%% endmacro
{#
  stores: y[m + b, r + i] (or y[m + b, rows[i]]) = (sum(u x) - sums[b]) * fms[b] for each
  (i, b) of `pairs`, sum(u x) = (sum(4 %acc#2p + %acc#2p+1)) / 4 (exact: both hold whole
  multiples).
#}
%% macro stores(pairs, sums, fms, rows=none)
%%   for i, b in pairs
%%     set p = loop.index0
%sh{{ i }}_{{ b }} = arith.shli %acc#{{ 2 * p }}, %two32 : {{ v32 }}
%all{{ i }}_{{ b }} = arith.addi %sh{{ i }}_{{ b }}, %acc#{{ 2 * p + 1 }} : {{ v32 }}
%red4_{{ i }}_{{ b }} = vector.reduction <add>, %all{{ i }}_{{ b }} : {{ v32 }} into i32
%red{{ i }}_{{ b }} = arith.shrsi %red4_{{ i }}_{{ b }}, %c2i32 : i32
%%     set row = "%%orow%d_%d" % (i, b) if rows is none else rows[i]
%%     if rows is none
{{ row }} = affine.apply affine_map<(d0) -> (d0 + {{ i }})>(%r)
%%     endif
%dif{{ i }}_{{ b }} = arith.subi %red{{ i }}_{{ b }}, {{ sums[b] }} : i32
%flt{{ i }}_{{ b }} = arith.sitofp %dif{{ i }}_{{ b }} : i32 to f32
%y{{ i }}_{{ b }} = arith.mulf %flt{{ i }}_{{ b }}, {{ fms[b] }} : f32
%ocol{{ i }}_{{ b }} = affine.apply affine_map<(d0) -> (d0 + {{ b }})>(%mrow)
memref.store %y{{ i }}_{{ b }}, %o[%ocol{{ i }}_{{ b }}, {{ row }}] : {{ ot }}
%%   endfor
%% endmacro
{# iter_args: the accumulators of `pairs` as scf.for iter_args, each starting at zero; yields: their next values. #}
%% macro iter_args(pairs)
<% for i, b in pairs %>%a{{ i }}_{{ b }} = %z32, %b{{ i }}_{{ b }} = %z32{{ ", " if not loop.last }}<% endfor %>
<%- endmacro %>
%% macro yields(pairs)
<% for i, b in pairs %>%na{{ i }}_{{ b }}, %nb{{ i }}_{{ b }}{{ ", " if not loop.last }}<% endfor %>
<%- endmacro %>
{#
  gemv_loop: one quantized row of x (row `row` of `mem`) against `rows` weight rows per
  step from `rows` streams, a quarter of the workgroup's rows each, each prefetched
  stream_ahead rows ahead into L1.
#}
%% macro gemv_loop(mem, mem_type, row, sum, fm)
%%   set streams, pairs = ["%rj"], [(0, 0)]
%%   for i in range(1, rows)
%%     do streams.append("%%rq%d" % i)
%%     do pairs.append((i, 0))
%%   endfor
%%   set t32 = ([v32] * (2 * rows))|join(", ")
        %nq = arith.subi %r1, %r0 : index
        %q = arith.divui %nq, %cr : index
%%   for i in range(1, rows)
        %qoff{{ i }} = arith.muli %q, %c{{ i }} : index
%%   endfor
        %rqend = arith.addi %r0, %q : index
        scf.for %rj = %r0 to %rqend step %c1 {
%%   for i in range(1, rows)
          %rq{{ i }} = arith.addi %rj, %qoff{{ i }} : index
%%   endfor
          %acc:{{ 2 * rows }} = scf.for %c = %c0 to %ckb step %cc iter_args({{ iter_args(pairs) }}) -> ({{ t32 }}) {
            {{ x_planes(0, mem, mem_type, row) | indent(12) }}
%%   for i in range(rows)
            {{ codes(i, streams[i], 0, stream_ahead, 3) | indent(12) }}
            {{ products("%d_0" % i, i, 0) | indent(12) }}
%%   endfor
            scf.yield {{ yields(pairs) }} : {{ t32 }}
          }
          {{ stores(pairs, [sum], [fm], rows=streams) | indent(10) }}
        }
%% endmacro
{#
  gemm_loop: the rows of x in whole blocks of mb (rows `xrows` of %xq, their statistics
  from %xs) against the workgroup's weight rows in tiles of tile_rows: each tile (a few
  KB, kept in L1 and L2) meets every block of x before the next tile is read, so the
  weights stream from memory once a call, and each weight chunk is decoded once for
  mb rows of x (gemm_rows weight rows a step).
#}
%% macro gemm_loop(xrows, sums, fms)
%%   set pairs = []
%%   for i in range(gemm_rows)
%%     for b in range(mb)
%%       do pairs.append((i, b))
%%     endfor
%%   endfor
%%   set t32 = ([v32] * (2 * pairs|length))|join(", ")
      scf.for %rt = %r0 to %r1 step %ctile {
        %rtend0 = arith.addi %rt, %ctile : index
        %rtend = arith.minui %rtend0, %r1 : index
        scf.for %mrow = %c0 to %mfull step %cmb {
%%   for b in range(mb)
          {{ xrows[b] }} = affine.apply affine_map<(d0) -> (d0 + {{ b }})>(%mrow)
{{ quant.row_stats(b, xrows[b], sums[b], fms[b]) }}
%%   endfor
          scf.for %r = %rt to %rtend step %cg {
            %acc:{{ 2 * pairs|length }} = scf.for %c = %c0 to %ckb step %cc iter_args({{ iter_args(pairs) }}) -> ({{ t32 }}) {
%%   for i in range(gemm_rows)
              {{ codes(i, "%r", i, prefetch_rows, 3) | indent(14) }}
%%   endfor
%%   for b in range(mb)
              {{ x_planes(b, "%xq", qt, xrows[b]) | indent(14) }}
%%   endfor
%%   for i, b in pairs
              {{ products("%d_%d" % (i, b), i, b) | indent(14) }}
%%   endfor
              scf.yield {{ yields(pairs) }} : {{ t32 }}
            }
            {{ stores(pairs, sums, fms) | indent(12) }}
          }
        }
      }
%% endmacro
%% set sums, fms, xrows = [], [], []
%% for b in range(mb)
%%   do sums.append("%%sx%d" % b)
%%   do fms.append("%%fm%d" % b)
%%   do xrows.append("%%xr%d" % b)
%% endfor
%% set inputs = "%bq: !stream.binding, %bs: !stream.binding, " if prequantized else "%bx: !stream.binding, "
%% call lib.executable(name, inputs ~ "%bw: !stream.binding, %bo: !stream.binding, %wscale: f32, %m: index", few=decode_workgroups, many=workgroups, m_min=mb)
{{ quant.common(kp, [mb, rows]|max, eps, c127, lo, hi) }}
      %cr = arith.constant {{ rows }} : index
      %cg = arith.constant {{ gemm_rows }} : index
      %cmb = arith.constant {{ mb }} : index
      %ctile = arith.constant {{ tile_rows }} : index
      %cc = arith.constant {{ chunk }} : index
      %ckb = arith.constant {{ kb }} : index
      %cn = arith.constant {{ n }} : index
%% if prequantized
      %xq = stream.binding.subspan %bq[%c0] : !stream.binding -> {{ qt }}{%m}
      %xs = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?x2xf32>{%m}
%% else
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> memref<?x{{ kp }}xf32>{%m}
      %buf = memref.alloca() : {{ bt }}
%% endif
      %w = stream.binding.subspan %bw[%c0] : !stream.binding -> {{ wt }}
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {{ ot }}{%m}
      %wg = stream.dispatch.workgroup.id[0] : index
      %ng = stream.dispatch.workgroup.count[0] : index
      %rpg = arith.ceildivui %cn, %ng : index
      %rpr = arith.ceildivui %rpg, %cr : index
      %rpw = arith.muli %rpr, %cr : index
      %r0u = arith.muli %wg, %rpw : index
      %r0 = arith.minui %r0u, %cn : index
      %r1u = arith.addi %r0, %rpw : index
      %r1 = arith.minui %r1u, %cn : index
      %three = arith.constant dense<50529027> : {{ v32 }}
      %twelve = arith.constant dense<202116108> : {{ v32 }}
      %m55 = arith.constant dense<1431655765> : {{ v32 }}
      %s1 = arith.constant dense<1> : {{ v32 }}
      %s4 = arith.constant dense<4> : {{ v32 }}
      %two32 = arith.constant dense<2> : {{ v32 }}
      %c2i32 = arith.constant 2 : i32
      %z32 = arith.constant dense<0> : {{ v32 }}
%% if prequantized
      %mblocks = arith.divui %m, %cmb : index
      %mfull = arith.muli %mblocks, %cmb : index
{{ gemm_loop(xrows, sums, fms) }}
      scf.for %mrow = %mfull to %m step %c1 {
{{ quant.row_stats(0, "%mrow", sums[0], fms[0]) }}
{{ gemv_loop("%xq", qt, "%mrow", sums[0], fms[0]) }}
      }
%% else
      scf.for %mrow = %c0 to %m step %c1 {
{{ quant.quantize_row(kp, 0, "%mrow", "%buf", "%c0", bt, sums[0], "%amc0") }}
          {{ fms[0] }} = arith.mulf %amc0, %wscale : f32
{{ gemv_loop("%buf", bt, "%c0", sums[0], fms[0]) }}
      }
%% endif
%% endcall
