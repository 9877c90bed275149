{# params: name, n, k, mb, rows, groups, rows_per_group, stream_ahead, prefetch_rows, eps, c127, lo, hi #}
{#
  (x [M, K] f32, w [N, K] i8, scale [N] f32, M: index) -> y [M, N] f32 with x quantized
  to int8 a row at a time (act_quant: roundeven(x * 127 / max(amax, eps)), clipped to
  +-127) and y[m, r] = scale[r] * amc_m / 127 * sum_k xq[m, k] w[r, k], the sums
  exact in i32 by vpdpbusd on (w xor 0x80) = w + 128 as u8 and xq as s8, less
  128 * sum_k xq[m, k]. `groups` workgroups of `rows_per_group` weight rows; each
  quantizes `mb` rows of x at a time into a stack buffer, then multiplies them with its
  rows, `rows` weight rows a step (one from each of `rows` streams, prefetched
  `stream_ahead` rows ahead), in pairs of streams for blocks of `mb` rows of x (2 x mb
  accumulators), all at once for the rows of x left over; then its remaining weight
  rows one by one (prefetched `prefetch_rows` ahead).
#}
%% import "lib.mlir" as lib
%% import "avx2_quant_lib.mlir" as quant
%% set v8, v32 = "vector<64xi8>", "vector<16xi32>"
%% set dp = 'llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"'
%% set dpt = "(%s, %s, %s) -> %s" % (v32, v8, v8, v32)
%% set xt = "memref<?x%dxf32>" % k
%% set wt = "memref<%dx%dxi8>" % (n, k)
%% set ot = "memref<?x%dxf32>" % n
%% set qt = "memref<%dx%dxi8>" % (mb, k)
{#
  quantize_rows: rows m0 .. m0 + count - 1 of x into rows 0 .. count - 1 of %xq, each
  row's 128 * (sum of its codes) into %xcorr and amc / 127 into %xfm.
#}
%% macro quantize_rows(tag, m0, count)
          scf.for %qj = %c0 to {{ count }} step %c1 {
            %qrow = arith.addi {{ m0 }}, %qj : index
{{ quant.quantize_row(k, tag, "%qrow", "%xq", "%qj", qt, "%qsum" ~ tag, "%qamc" ~ tag) }}
            %qcorr{{ tag }} = arith.muli %qsum{{ tag }}, %c128i : i32
            memref.store %qcorr{{ tag }}, %xcorr[%qj] : memref<{{ mb }}xi32>
            %qfm{{ tag }} = arith.divf %qamc{{ tag }}, %c127 : f32
            memref.store %qfm{{ tag }}, %xfm[%qj] : memref<{{ mb }}xf32>
          }
%% endmacro
{#
  row_block: y[m0 + j, wrows[i]] for the weight rows `wrows` (SSA index names) and the
  rows j < nx of the quantized buffer (x row m0 + j): one K loop of len(wrows) x nx
  accumulators; each weight vector loaded (its row `ahead` rows on prefetched) and
  offset once for all nx rows. `jvar`: nx is 1 and the buffer row is this index.
#}
%% macro row_block(tag, wrows, nx, m0, ahead, locality, jvar=none, guard=none)
%%   set pairs = []
%%   for i in range(wrows|length)
%%     for j in range(nx)
%%       do pairs.append((i, j))
%%     endfor
%%   endfor
%%   set types = ([v32] * pairs|length)|join(", ")
          %acc{{ tag }}:{{ pairs|length }} = scf.for %c = %c0 to %ck step %c64 iter_args(<% for i, j in pairs %>%a{{ i }}_{{ j }} = %zi{{ ", " if not loop.last }}<% endfor %>) -> ({{ types }}) {
%%   for j in range(nx)
            %xv{{ j }} = vector.load %xq[{{ jvar if jvar is not none else "%%cj%d" % j }}, %c] : {{ qt }}, {{ v8 }}
%%   endfor
%%   for i in range(wrows|length)
            {{ lib.load_row("%%wv%d" % i, "%%wr%d" % i, wrows[i], 0, "%c", "%w", wt, v8, "%%wp%d" % i, ahead, locality) | indent(12) }}
            %wu{{ i }} = arith.xori %wv{{ i }}, %flip : {{ v8 }}
%%     for j in range(nx)
            %n{{ i }}_{{ j }} = {{ dp }}(%a{{ i }}_{{ j }}, %wu{{ i }}, %xv{{ j }}) : {{ dpt }}
%%     endfor
%%   endfor
            scf.yield <% for i, j in pairs %>%n{{ i }}_{{ j }}{{ ", " if not loop.last }}<% endfor %> : {{ types }}
          }
%%   for j in range(nx)
%%     set jr = jvar if jvar is not none else "%%cj%d" % j
          %cr{{ tag }}_{{ j }} = memref.load %xcorr[{{ jr }}] : memref<{{ mb }}xi32>
          %fm{{ tag }}_{{ j }} = memref.load %xfm[{{ jr }}] : memref<{{ mb }}xf32>
          %ym{{ tag }}_{{ j }} = arith.addi {{ m0 }}, {{ jr }} : index
%%   endfor
%%   for i in range(wrows|length)
          %ws{{ tag }}_{{ i }} = memref.load %wsc[{{ wrows[i] }}] : memref<?xf32>
%%     for j in range(nx)
          %rd{{ tag }}_{{ i }}_{{ j }} = vector.reduction <add>, %acc{{ tag }}#{{ i * nx + j }} : {{ v32 }} into i32
          %df{{ tag }}_{{ i }}_{{ j }} = arith.subi %rd{{ tag }}_{{ i }}_{{ j }}, %cr{{ tag }}_{{ j }} : i32
          %ff{{ tag }}_{{ i }}_{{ j }} = arith.sitofp %df{{ tag }}_{{ i }}_{{ j }} : i32 to f32
          %fx{{ tag }}_{{ i }}_{{ j }} = arith.mulf %ff{{ tag }}_{{ i }}_{{ j }}, %fm{{ tag }}_{{ j }} : f32
          %y{{ tag }}_{{ i }}_{{ j }} = arith.mulf %fx{{ tag }}_{{ i }}_{{ j }}, %ws{{ tag }}_{{ i }} : f32
%%       if guard is not none and j > 0
          %gd{{ tag }}_{{ i }}_{{ j }} = arith.cmpi ult, %cj{{ j }}, {{ guard }} : index
          scf.if %gd{{ tag }}_{{ i }}_{{ j }} {
            memref.store %y{{ tag }}_{{ i }}_{{ j }}, %o[%ym{{ tag }}_{{ j }}, {{ wrows[i] }}] : {{ ot }}
          }
%%       else
          memref.store %y{{ tag }}_{{ i }}_{{ j }}, %o[%ym{{ tag }}_{{ j }}, {{ wrows[i] }}] : {{ ot }}
%%       endif
%%     endfor
%%   endfor
%% endmacro
{#
  weight_rows: every weight row of the workgroup against the nx rows of x in the buffer
  (x rows m0 ..): the streams `rows` at a time (in pairs when nx > 1), then the rest
  one by one. `jvar` as in row_block.
#}
%% macro weight_rows(tag, nx, m0, jvar=none, guard=none)
          scf.for %rb = %r0 to %rq step %c1 {
%%   for i in range(rows)
            %rs{{ i }} = affine.apply affine_map<(d0)[s0] -> (d0 + s0 * {{ i }})>(%rb)[%groups]
%%   endfor
%%   set streams = []
%%   for i in range(rows)
%%     do streams.append("%%rs%d" % i)
%%   endfor
%%   if nx > 1
%%     for p in range(0, rows, 2)
{{ row_block(tag ~ "p" ~ p, streams[p:p + 2], nx, m0, stream_ahead, 3, jvar, guard) }}
%%     endfor
%%   else
{{ row_block(tag ~ "s", streams, nx, m0, stream_ahead, 3, jvar, guard) }}
%%   endif
          }
          scf.for %rt = %rg to %r1 step %c1 {
{{ row_block(tag ~ "t", ["%rt"], nx, m0, prefetch_rows, 0, jvar, guard) }}
          }
%% endmacro
%% set bindings = "%bx: !stream.binding, %bw: !stream.binding, %bs: !stream.binding, %bo: !stream.binding, %m: index"
%% call lib.executable(name, bindings, groups=groups)
{{ quant.common(k, 2, eps, c127, lo, hi) }}
%% for j in range(mb)
      %cj{{ j }} = arith.constant {{ j }} : index
%% endfor
      %cmb = arith.constant {{ mb }} : index
      %cr4 = arith.constant {{ rows }} : index
      %ck = arith.constant {{ k }} : index
      %c64 = arith.constant 64 : index
      %cn = arith.constant {{ n }} : index
      %rpw = arith.constant {{ rows_per_group }} : index
      %c128i = arith.constant 128 : i32
      %zi = arith.constant dense<0> : {{ v32 }}
      %flip = arith.constant dense<-128> : {{ v8 }}
      %zb = arith.constant dense<0> : {{ v8 }}
      %c0i = arith.constant 0 : i32
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> {{ xt }}{%m}
      %w = stream.binding.subspan %bw[%c0] : !stream.binding -> {{ wt }}
      %wsc = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?xf32>{%cn}
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {{ ot }}{%m}
      %xq = memref.alloca() : {{ qt }}
      %xcorr = memref.alloca() : memref<{{ mb }}xi32>
      %xfm = memref.alloca() : memref<{{ mb }}xf32>
      %wg = stream.dispatch.workgroup.id[0] : index
      %r0 = arith.muli %wg, %rpw : index
      %r1u = arith.addi %r0, %rpw : index
      %r1 = arith.minui %r1u, %cn : index
      %span = arith.subi %r1, %r0 : index
      %groups = arith.divui %span, %cr4 : index
      %whole = arith.muli %groups, %cr4 : index
      %rg = arith.addi %r0, %whole : index
      %rq = arith.addi %r0, %groups : index
      %mblocks = arith.divui %m, %cmb : index
      %mwhole = arith.muli %mblocks, %cmb : index
      %mrest = arith.subi %m, %mwhole : index
      scf.for %mi = %c0 to %mwhole step %cmb {
{{ quantize_rows("b", "%mi", "%cmb") }}
{{ weight_rows("b", mb, "%mi") }}
      }
%% if mb > 1
      %one = arith.cmpi eq, %mrest, %c1 : index
      %some = arith.cmpi ugt, %mrest, %c1 : index
      scf.if %one {
{{ quantize_rows("r", "%mwhole", "%c1") }}
{{ weight_rows("r", 1, "%mwhole", "%c0") }}
      }
{# 2 .. mb - 1 rows left: a block of mb, its last rows zero codes, their outputs not stored #}
      scf.if %some {
{{ quantize_rows("p", "%mwhole", "%mrest") }}
        scf.for %zj = %mrest to %cmb step %c1 {
          scf.for %zk = %c0 to %ck step %c64 {
            vector.store %zb, %xq[%zj, %zk] : {{ qt }}, {{ v8 }}
          }
          memref.store %c0i, %xcorr[%zj] : memref<{{ mb }}xi32>
        }
{{ weight_rows("p", mb, "%mwhole", none, "%mrest") }}
      }
%% endif
%% endcall
