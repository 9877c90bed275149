{# params: name, n, kb, offset, prequantized, rows, mb, gemm_rows, chunk, i16_chunks, gemv_i16_chunks, prefetch_rows, stream_ahead, workgroups, decode_workgroups, eps, c127, lo, hi #}
{#
  The avx2 ternary matmul (see ternary_avx2.py for the why): for x [M, 4 KB] f32 (or,
  `prequantized`, its codes q [M, 4 KB] i8 and stats [M, 2] from ternary_avx2_quant.mlir),
  w [N, KB] i8 (the offset codes w + 1 when `offset`, else the signed ones) and `wscale`,
  out [M, N] f32 = dequant(act_quant(x) @ T^T): `mb` rows of x at a time through the GEMM
  loop (`gemm_rows` weight rows a step), the remaining rows one by one through the GEMV
  loop (`rows` weight rows a step, one from each of `rows` streams).
#}
%% import "lib.mlir" as lib
%% import "avx2_quant_lib.mlir" as quant
%% set v8, v16, v32 = "vector<32xi8>", "vector<16xi16>", "vector<8xi32>"
%% set mad = 'llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"'
%% set madw = 'llvm.call_intrinsic "llvm.x86.avx2.pmadd.wd"'
%% set kp = 4 * kb
%% set bt = "memref<%dx%dxi8>" % (mb, kp)
%% set wt = "memref<%dx%dxi8>" % (n, kb)
%% set ot = "memref<?x%dxf32>" % n
%% set qt = "memref<?x%dxi8>" % kp
{#
  codes: load 32 packed bytes of weight row %r + i (or of row `base`, a row of its own
  stream, prefetched stream_ahead rows ahead into L1) at column %c (prefetching the row
  prefetch_rows ahead) and define %q{i}_{j}, its u = w + 1 codes of plane j. The bytes
  hold u already when `offset`, else the signed codes, remapped here. `scaled`: planes
  1 and 3 are left 4 times their codes (u & 0xC and (u >> 4) & 0xC), which saves two
  shifts: one shift serves planes 2 and 3, none is needed for 0 and 1.
#}
%% macro codes(i, scaled=false, base=none)
%%   set tag = "%d_%d" % (i, i if base is none else 0)
%%   set raw = "%raw" ~ tag
%%   if base is none
{{ lib.load_row(raw, "%rowraw" ~ tag, "%r", i, "%c", "%w", wt, v8, "%preraw" ~ tag, prefetch_rows, 0) }}
%%   else
{{ lib.load_row(raw, "%rowraw" ~ tag, base, 0, "%c", "%w", wt, v8, "%preraw" ~ tag, stream_ahead, 3) }}
%%   endif
%%   set u = raw if offset else "%%u%d" % i
%%   if not offset
%lo{{ i }} = arith.andi {{ raw }}, %m55 : {{ v8 }}
%hs{{ i }} = arith.shrui {{ raw }}, %s1 : {{ v8 }}
%hi{{ i }} = arith.andi %hs{{ i }}, %m55 : {{ v8 }}
%lp{{ i }} = arith.addi %lo{{ i }}, %m55 : {{ v8 }}
%u{{ i }} = arith.subi %lp{{ i }}, %hi{{ i }} : {{ v8 }}
%%   endif
%%   if scaled
%q{{ i }}_0 = arith.andi {{ u }}, %three : {{ v8 }}
%q{{ i }}_1 = arith.andi {{ u }}, %twelve : {{ v8 }}
%t{{ i }}_2 = arith.shrui {{ u }}, %s4 : {{ v8 }}
%q{{ i }}_2 = arith.andi %t{{ i }}_2, %three : {{ v8 }}
%q{{ i }}_3 = arith.andi %t{{ i }}_2, %twelve : {{ v8 }}
%%   else
%q{{ i }}_0 = arith.andi {{ u }}, %three : {{ v8 }}
%t{{ i }}_1 = arith.shrui {{ u }}, %s2 : {{ v8 }}
%q{{ i }}_1 = arith.andi %t{{ i }}_1, %three : {{ v8 }}
%t{{ i }}_2 = arith.shrui {{ u }}, %s4 : {{ v8 }}
%q{{ i }}_2 = arith.andi %t{{ i }}_2, %three : {{ v8 }}
%q{{ i }}_3 = arith.shrui {{ u }}, %s6 : {{ v8 }}
%%   endif
%% endmacro
{# x_planes: %x{b}_{j}, the 32 quantized x values of plane j at column %c of row `row` of `mem` (`mem_type`). #}
%% macro x_planes(b, mem, mem_type, row)
%%   for j in range(4)
%xo{{ b }}_{{ j }} = affine.apply affine_map<(d0) -> (d0 + {{ j * kb }})>(%c)
%x{{ b }}_{{ j }} = vector.load {{ mem }}[{{ row }}, %xo{{ b }}_{{ j }}] : {{ mem_type }}, {{ v8 }}
%%   endfor
%% endmacro
{# products: %e{tag}_j, vpmaddubsw of the codes %{cs}_j with the quantized x %{x}_j (the i16 pair sums of one chunk). #}
%% macro products(tag, cs, x)
%%   for j in range(4)
%e{{ tag }}_{{ j }} = {{ mad }}(%{{ cs }}_{{ j }}, %{{ x }}_{{ j }}) : ({{ v8 }}, {{ v8 }}) -> {{ v16 }}
%%   endfor
%% endmacro
{#
  stores: y[m + b, r + i] (or y[m + b, rows[i]]) = (sum(acc) - sums[b]) * fms[b] for each
  (i, b) of `pairs`; the accumulators are %acc#0, #1, ... in that order (`quarter`: they
  hold 4 times the sum, exactly).
#}
%% macro stores(pairs, sums, fms, quarter=false, rows=none)
%%   for i, b in pairs
%%     if quarter
%red4{{ i }}_{{ b }} = vector.reduction <add>, %acc#{{ loop.index0 }} : {{ v32 }} into i32
%red{{ i }}_{{ b }} = arith.shrsi %red4{{ i }}_{{ b }}, %c2i32 : i32
%%     else
%red{{ i }}_{{ b }} = vector.reduction <add>, %acc#{{ loop.index0 }} : {{ v32 }} into i32
%%     endif
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
{#
  gemv_loop: one quantized row of x (row `row` of `mem`) against `rows` weight rows per
  step from `rows` streams, a quarter of the workgroup's rows each. The codes are decoded
  with one shift (codes(scaled=true)) into two i16 sums per row, planes 0 + 2 and
  4 x (planes 1 + 3), each over up to gemv_i16_chunks chunks before one vpmaddwd (by 4
  and by 1) moves them, times 4, to the row's i32 accumulator.
#}
%% macro gemv_loop(mem, mem_type, row, sum, fm)
%%   set streams = ["%rj"]
%%   for i in range(1, rows)
%%     do streams.append("%%rq%d" % i)
%%   endfor
%%   set t16 = ([v16] * (2 * rows))|join(", ")
%%   set t32 = ([v32] * rows)|join(", ")
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
          %acc:{{ rows }} = scf.for %c16 = %c0 to %ckb step %cvblk iter_args(<% for i in range(rows) %>%a{{ i }} = %z32{{ ", " if not loop.last }}<% endfor %>) -> ({{ t32 }}) {
            %cend0 = arith.addi %c16, %cvblk : index
            %cend = arith.minui %cend0, %ckb : index
            %part:{{ 2 * rows }} = scf.for %c = %c16 to %cend step %cc iter_args(<% for i in range(rows) %>%pl{{ i }} = %z16, %ph{{ i }} = %z16{{ ", " if not loop.last }}<% endfor %>) -> ({{ t16 }}) {
              {{ x_planes(0, mem, mem_type, row) | indent(14) }}
%%   for i in range(rows)
              {{ codes(i, scaled=true, base=streams[i]) | indent(14) }}
              {{ products(i, "q%d" % i, "x0") | indent(14) }}
              %f{{ i }}a = arith.addi %e{{ i }}_0, %e{{ i }}_2 : {{ v16 }}
              %l{{ i }} = arith.addi %pl{{ i }}, %f{{ i }}a : {{ v16 }}
              %f{{ i }}b = arith.addi %e{{ i }}_1, %e{{ i }}_3 : {{ v16 }}
              %h{{ i }} = arith.addi %ph{{ i }}, %f{{ i }}b : {{ v16 }}
%%   endfor
              scf.yield <% for i in range(rows) %>%l{{ i }}, %h{{ i }}{{ ", " if not loop.last }}<% endfor %> : {{ t16 }}
            }
%%   for i in range(rows)
            %wl{{ i }} = {{ madw }}(%part#{{ 2 * i }}, %fours16) : ({{ v16 }}, {{ v16 }}) -> {{ v32 }}
            %wh{{ i }} = {{ madw }}(%part#{{ 2 * i + 1 }}, %ones16) : ({{ v16 }}, {{ v16 }}) -> {{ v32 }}
            %ws{{ i }} = arith.addi %wl{{ i }}, %wh{{ i }} : {{ v32 }}
            %na{{ i }} = arith.addi %a{{ i }}, %ws{{ i }} : {{ v32 }}
%%   endfor
            scf.yield <% for i in range(rows) %>%na{{ i }}{{ ", " if not loop.last }}<% endfor %> : {{ t32 }}
          }
%%   set pairs = []
%%   for i in range(rows)
%%     do pairs.append((i, 0))
%%   endfor
          {{ stores(pairs, [sum], [fm], quarter=true, rows=streams) | indent(10) }}
        }
%% endmacro
{#
  gemm_loop: mb quantized rows of x (rows `xrows` of `mem`) against gemm_rows weight rows
  per step: each weight chunk is decoded once for mb rows of x. The i16 pair sums of a
  (row, x row) pair run over up to i16_chunks chunks (|sum| <= 4 planes * 2 * 2 * 127 a
  chunk) before one vpmaddwd moves them to the i32 accumulator.
#}
%% macro gemm_loop(mem, mem_type, xrows, sums, fms)
%%   set pairs = []
%%   for i in range(gemm_rows)
%%     for b in range(mb)
%%       do pairs.append((i, b))
%%     endfor
%%   endfor
%%   set t16 = ([v16] * pairs|length)|join(", ")
%%   set t32 = ([v32] * pairs|length)|join(", ")
        scf.for %r = %r0 to %r1 step %cg {
          %acc:{{ pairs|length }} = scf.for %c16 = %c0 to %ckb step %cblk iter_args(<% for i, b in pairs %>%a{{ i }}_{{ b }} = %z32{{ ", " if not loop.last }}<% endfor %>) -> ({{ t32 }}) {
            %cend0 = arith.addi %c16, %cblk : index
            %cend = arith.minui %cend0, %ckb : index
            %part:{{ pairs|length }} = scf.for %c = %c16 to %cend step %cc iter_args(<% for i, b in pairs %>%s{{ i }}_{{ b }} = %z16{{ ", " if not loop.last }}<% endfor %>) -> ({{ t16 }}) {
%%   for i in range(gemm_rows)
              {{ codes(i) | indent(14) }}
%%   endfor
%%   for b in range(mb)
              {{ x_planes(b, mem, mem_type, xrows[b]) | indent(14) }}
%%   endfor
%%   for i, b in pairs
%%     set tag = "%d_%d" % (i, b)
              {{ products(tag, "q%d" % i, "x%d" % b) | indent(14) }}
              %f{{ tag }}a = arith.addi %e{{ tag }}_0, %e{{ tag }}_1 : {{ v16 }}
              %f{{ tag }}b = arith.addi %e{{ tag }}_2, %e{{ tag }}_3 : {{ v16 }}
              %g{{ tag }} = arith.addi %f{{ tag }}a, %f{{ tag }}b : {{ v16 }}
              %n{{ tag }} = arith.addi %s{{ tag }}, %g{{ tag }} : {{ v16 }}
%%   endfor
              scf.yield <% for i, b in pairs %>%n{{ i }}_{{ b }}{{ ", " if not loop.last }}<% endfor %> : {{ t16 }}
            }
%%   for i, b in pairs
            %h{{ i }}_{{ b }} = {{ madw }}(%part#{{ loop.index0 }}, %ones16) : ({{ v16 }}, {{ v16 }}) -> {{ v32 }}
            %na{{ i }}_{{ b }} = arith.addi %a{{ i }}_{{ b }}, %h{{ i }}_{{ b }} : {{ v32 }}
%%   endfor
            scf.yield <% for i, b in pairs %>%na{{ i }}_{{ b }}{{ ", " if not loop.last }}<% endfor %> : {{ t32 }}
          }
          {{ stores(pairs, sums, fms) | indent(10) }}
        }
%% endmacro
%% set sums, fms, xrows, cb = [], [], [], []
%% for b in range(mb)
%%   do sums.append("%%sx%d" % b)
%%   do fms.append("%%fm%d" % b)
%%   do xrows.append("%%xr%d" % b)
%%   do cb.append("%%c%d" % b)
%% endfor
%% set inputs = "%bq: !stream.binding, %bs: !stream.binding, " if prequantized else "%bx: !stream.binding, "
%% call lib.executable(name, inputs ~ "%bw: !stream.binding, %bo: !stream.binding, %wscale: f32, %m: index", few=decode_workgroups, many=workgroups, m_min=mb)
{{ quant.common(kp, mb, eps, c127, lo, hi) }}
      %cr = arith.constant {{ rows }} : index
      %cg = arith.constant {{ gemm_rows }} : index
      %cmb = arith.constant {{ mb }} : index
      %cc = arith.constant {{ chunk }} : index
      %cblk = arith.constant {{ i16_chunks * chunk }} : index
      %cvblk = arith.constant {{ gemv_i16_chunks * chunk }} : index
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
      %three = arith.constant dense<3> : {{ v8 }}
      %m55 = arith.constant dense<85> : {{ v8 }}
      %s1 = arith.constant dense<1> : {{ v8 }}
      %s2 = arith.constant dense<2> : {{ v8 }}
      %s4 = arith.constant dense<4> : {{ v8 }}
      %s6 = arith.constant dense<6> : {{ v8 }}
      %ones16 = arith.constant dense<1> : {{ v16 }}
      %fours16 = arith.constant dense<4> : {{ v16 }}
      %twelve = arith.constant dense<12> : {{ v8 }}
      %c2i32 = arith.constant 2 : i32
      %z16 = arith.constant dense<0> : {{ v16 }}
      %z32 = arith.constant dense<0> : {{ v32 }}
      %mblocks = arith.divui %m, %cmb : index
      %mfull = arith.muli %mblocks, %cmb : index
      scf.for %mrow = %c0 to %mfull step %cmb {
%% for b in range(mb)
          %xr{{ b }} = affine.apply affine_map<(d0) -> (d0 + {{ b }})>(%mrow)
%% endfor
%% for b in range(mb)
%%   if prequantized
{{ quant.row_stats(b, xrows[b], sums[b], fms[b]) }}
%%   else
{{ quant.quantize_row(kp, b, xrows[b], "%buf", cb[b], bt, sums[b], "%%amc%d" % b) }}
          {{ fms[b] }} = arith.mulf %amc{{ b }}, %wscale : f32
%%   endif
%% endfor
%% if prequantized
{{ gemm_loop("%xq", qt, xrows, sums, fms) }}
%% else
{{ gemm_loop("%buf", bt, cb, sums, fms) }}
%% endif
      }
      scf.for %mrow = %mfull to %m step %c1 {
%% if prequantized
{{ quant.row_stats(0, "%mrow", sums[0], fms[0]) }}
{{ gemv_loop("%xq", qt, "%mrow", sums[0], fms[0]) }}
%% else
{{ quant.quantize_row(kp, 0, "%mrow", "%buf", "%c0", bt, sums[0], "%amc0") }}
          {{ fms[0] }} = arith.mulf %amc0, %wscale : f32
{{ gemv_loop("%buf", bt, "%c0", sums[0], fms[0]) }}
%% endif
      }
%% endcall
