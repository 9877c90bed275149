{# params: name, n, k, el, mb, rows, lanes, groups, rows_per_group, prefetch_rows, stream_ahead #}
{#
  (x [M, K] f32, w [N, K] el (and for el = i8, scale [N] f32), M: index) ->
  x @ f32(w)^T (* scale) [M, N] f32: `groups` workgroups of `rows_per_group` rows; in each,
  `rows` rows a step, one from each of `rows` streams (a part of the workgroup's rows each,
  prefetched `stream_ahead` rows ahead into L1), then the remaining rows one by one
  (prefetched `prefetch_rows` ahead); `mb` rows of x share each widened weight vector.
#}
%% import "lib.mlir" as lib
%% set vf = "vector<%dxf32>" % lanes
%% set vh = "vector<%dx%s>" % (lanes, el)
%% set xt = "memref<?x%dxf32>" % k
%% set wt = "memref<%dx%dx%s>" % (n, k, el)
%% set ot = "memref<?x%dxf32>" % n
%% set widen = {"f16": "arith.extf", "i8": "arith.sitofp"}[el]
{#
  row_block: the loop nest for `nrows` rows starting at `r`, or for the rows `bases` (one
  per stream), over the rows of x from `m0` to `m1`, `mblock` of them at a time: each
  weight vector is loaded and widened once for all `mblock` (nrows x mblock accumulators).
#}
%% macro row_block(nrows, r, bases, mblock, m0, m1)
%%   set pairs = []
%%   for i in range(nrows)
%%     for j in range(mblock)
%%       do pairs.append((i, j))
%%     endfor
%%   endfor
%%   set types = ([vf] * pairs|length)|join(", ")
          scf.for %mi = {{ m0 }} to {{ m1 }} step %c{{ mblock }} {
%%   for j in range(mblock)
            %xm{{ j }} = affine.apply affine_map<(d0) -> (d0 + {{ j }})>(%mi)
%%   endfor
            %acc:{{ pairs|length }} = scf.for %c = %c0 to %ck step %cl iter_args(<% for i, j in pairs %>%a{{ i }}_{{ j }} = %zf{{ ", " if not loop.last }}<% endfor %>) -> ({{ types }}) {
%%   for j in range(mblock)
              %xv{{ j }} = vector.load %x[%xm{{ j }}, %c] : {{ xt }}, {{ vf }}
%%   endfor
%%   for i in range(nrows)
%%     if bases is none
              {{ lib.load_row("%%wh%d" % i, "%%rowwh%d" % i, r, i, "%c", "%w", wt, vh, "%%prewh%d" % i, prefetch_rows, 0) | indent(14) }}
%%     else
              {{ lib.load_row("%%wh%d" % i, "%%rowwh%d" % i, bases[i], 0, "%c", "%w", wt, vh, "%%prewh%d" % i, stream_ahead, 3) | indent(14) }}
%%     endif
              %wf{{ i }} = {{ widen }} %wh{{ i }} : {{ vh }} to {{ vf }}
%%     for j in range(mblock)
              %n{{ i }}_{{ j }} = vector.fma %wf{{ i }}, %xv{{ j }}, %a{{ i }}_{{ j }} : {{ vf }}
%%     endfor
%%   endfor
              scf.yield <% for i, j in pairs %>%n{{ i }}_{{ j }}{{ ", " if not loop.last }}<% endfor %> : {{ types }}
            }
%%   for i in range(nrows)
%%     set orow = "%%orow%d" % i if bases is none else bases[i]
%%     if bases is none
            {{ orow }} = affine.apply affine_map<(d0) -> (d0 + {{ i }})>({{ r }})
%%     endif
%%     if el == "i8"
            %s{{ i }} = memref.load %sc[{{ orow }}] : memref<?xf32>
%%     endif
%%     for j in range(mblock)
            %y{{ i }}_{{ j }} = vector.reduction <add>, %acc#{{ i * mblock + j }} fastmath<reassoc> : {{ vf }} into f32
%%       if el == "i8"
            %ys{{ i }}_{{ j }} = arith.mulf %y{{ i }}_{{ j }}, %s{{ i }} : f32
            memref.store %ys{{ i }}_{{ j }}, %o[%xm{{ j }}, {{ orow }}] : {{ ot }}
%%       else
            memref.store %y{{ i }}_{{ j }}, %o[%xm{{ j }}, {{ orow }}] : {{ ot }}
%%       endif
%%     endfor
%%   endfor
          }
%% endmacro
%% set bases = []
%% for i in range(rows)
%%   do bases.append("%%rs%d" % i)
%% endfor
%% set bindings = "%bx: !stream.binding, %bw: !stream.binding, " ~ ("%bs: !stream.binding, " if el == "i8" else "") ~ "%bo: !stream.binding, %m: index"
%% call lib.executable(name, bindings, groups=groups)
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
%% if mb > 1
      %c{{ mb }} = arith.constant {{ mb }} : index
%% endif
      %cr = arith.constant {{ rows }} : index
      %ck = arith.constant {{ k }} : index
      %cl = arith.constant {{ lanes }} : index
      %cn = arith.constant {{ n }} : index
      %rpw = arith.constant {{ rows_per_group }} : index
      %zf = arith.constant dense<0.0> : {{ vf }}
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> {{ xt }}{%m}
      %w = stream.binding.subspan %bw[%c0] : !stream.binding -> {{ wt }}
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {{ ot }}{%m}
%% if el == "i8"
      %sc = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?xf32>{%cn}
%% endif
      %wg = stream.dispatch.workgroup.id[0] : index
      %r0 = arith.muli %wg, %rpw : index
      %r1u = arith.addi %r0, %rpw : index
      %r1 = arith.minui %r1u, %cn : index
      %span = arith.subi %r1, %r0 : index
      %groups = arith.divui %span, %cr : index
      %whole = arith.muli %groups, %cr : index
      %rg = arith.addi %r0, %whole : index
      %rq = arith.addi %r0, %groups : index
      %mblocks = arith.divui %m, %c{{ mb }} : index
      %mwhole = arith.muli %mblocks, %c{{ mb }} : index
      scf.for %rb = %r0 to %rq step %c1 {
{# stream i reads rows r0 + i * groups + j, j = 0 .. groups - 1 #}
%% for i in range(rows)
        %rs{{ i }} = affine.apply affine_map<(d0)[s0] -> (d0 + s0 * {{ i }})>(%rb)[%groups]
%% endfor
{{ row_block(rows, none, bases, mb, "%c0", "%mwhole") }}
%% if mb > 1
{{ row_block(rows, none, bases, 1, "%mwhole", "%m") }}
%% endif
      }
      scf.for %rt = %rg to %r1 step %c1 {
{{ row_block(1, "%rt", none, 1, "%c0", "%m") }}
      }
%% endcall
