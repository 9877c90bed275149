{# params: name, heads, kv_heads, d, s, kel, chunk, window, prefetch, vgroup, qblock, bvgroup, blanes #}
{#
  (q [T, H, D] f32, k, v [S, KV, D] kel, scale: f32, start: index, T: index) ->
  out [T, H, D] f32 (the slot caches of the batched generator: attention_rows.mlir).
  With `window` = W > 0 (a sliding-window layer) a query reads only the W most recent
  of its rows: the chunks start at row max(0, last + 1 - W).
  One workgroup per query head; an online softmax over chunks of `chunk` cache rows,
  whose scores live in a stack buffer. Written on 8-lane vectors with the D/8 lanes of
  a row unrolled (D % 8 == 0).
  Queries go `qblock` at a time (the rest of T, and every query of a windowed layer, one
  at a time): each K and V row a block reads is loaded and widened once for all of its
  queries (`bvgroup` x 8 floats of each query a pass over a chunk's V rows, on vectors
  of `blanes` lanes). A block reads the rows of its last query; a row past an earlier
  query's own last one gets score -inf, so weight 0 (exactly: its max, exps, sums and
  accumulators are those of that query alone, chunk for chunk).
#}
%% import "lib.mlir" as lib
%% set lanes = d // 8
%% set v8 = "vector<8xf32>"
%% set vk = "vector<8x%s>" % kel
%% set qt = "memref<?x%dx%dxf32>" % (heads, d)
%% set ebytes = 4 if kel == "f32" else 2
{# the columns of a head's row that start its 64-byte lines #}
%% set lines = range(0, d, 64 // ebytes)
%% set kt = "memref<%dx%dx%dx%s>" % (s, kv_heads, d, kel)
{# prefetch(cache): the head's row `prefetch` rows ahead of %s (the last row %last at
   most): a head's D values are a few lines out of each KV * D row, so rows are strided
   by KV * D and the hardware prefetchers, which stop at a 4 KiB page, miss them #}
%% macro prefetch_row(cache)
%%   if prefetch
            %sa = arith.addi %s, %cpf : index
            %sp = arith.minui %sa, %last : index
%%     for c in lines
            memref.prefetch {{ cache }}[%sp, %kh, %col_l{{ c }}], read, locality<3>, data : {{ kt }}
%%     endfor
%%   endif
%% endmacro
%% set bindings = "%bq: !stream.binding, %bk: !stream.binding, %bv: !stream.binding, %bo: !stream.binding, %scale: f32, %p: index, %m: index"
%% set qb = 1 if window else qblock
%% set st = "memref<%dx%dxf32>" % (qb, chunk)
%% set at = "memref<%dx%dxf32>" % (qb, d)
%% macro widen(dst, src, w=8)
%%   if kel == "f32"
{{ dst }} = arith.addf {{ src }}, %z{{ w }} : vector<{{ w }}xf32>
%%   else
{{ dst }} = arith.extf {{ src }} : vector<{{ w }}x{{ kel }}> to vector<{{ w }}xf32>
%%   endif
%% endmacro
{# block(nq): the queries %t0 .. %t0 + nq - 1 (query i: %t<i>, its last row %last<i>).
   A block of several queries works on w = 16 lanes (D % 16 == 0): a 16-lane FMA chain
   is the 8-lane kernel's two interleaved chains side by side (lanes 2m and 2m + 1 of
   8), their halves added as the 8-lane kernel adds its last two, so every float is the
   same; the one-query path keeps 8 lanes. #}
%% macro block(nq)
%%   set qs = range(nq)
%%   set w = blanes if nq > 1 and d % blanes == 0 else 8
%%   set nl = d // w
%%   set vw = "vector<%dxf32>" % w
%%   set vkw = "vector<%dx%s>" % (w, kel)
%%   set vg = vgroup if nq == 1 else ([1, bvgroup * 8 // w]|max)
%%   set col = "%col" if w == 8 else "%colw"
%%   for i in qs
%%     if i
        %t{{ i }} = arith.addi %t0, %cq{{ i }} : index
%%     endif
        %last{{ i }} = arith.addi %p, %t{{ i }} : index
%%   endfor
        %last = arith.addi %last{{ nq - 1 }}, %c0 : index
%%   if nq == 1
%%     for l in range(nl)
        %q0_{{ l }} = vector.load %q[%t0, %h, {{ col }}{{ l }}] : {{ qt }}, {{ vw }}
%%     endfor
%%   endif
%%   for i in qs
%%     for l in range(nl)
        vector.store %z{{ w }}, %acc[%cq{{ i }}, {{ col }}{{ l }}] : {{ at }}, {{ vw }}
%%     endfor
%%   endfor
        %n = arith.addi %last, %c1 : index
%%   if window
        %cwin = arith.constant {{ window }} : index
        %wide = arith.cmpi ugt, %n, %cwin : index
        %nw = arith.subi %n, %cwin : index
        %first = arith.select %wide, %nw, %c0 : index
%%   endif
        %res:{{ 2 * nq }} = scf.for %cs = {{ "%first" if window else "%c0" }} to %n step %cchunk
            iter_args(<% for i in qs %>%mx{{ i }} = %ninf, <% endfor %><% for i in qs %>%l{{ i }} = %zero{{ ", " if not loop.last }}<% endfor %>) -> ({{ (["f32"] * (2 * nq))|join(", ") }}) {
          %ceu = arith.addi %cs, %cchunk : index
          %ce = arith.minui %ceu, %n : index
          %len = arith.subi %ce, %cs : index
          %cm:{{ nq }} = scf.for %s = %cs to %ce step %c1 iter_args(<% for i in qs %>%m1_{{ i }} = %ninf{{ ", " if not loop.last }}<% endfor %>) -> ({{ (["f32"] * nq)|join(", ") }}) {
{{ prefetch_row("%k") }}
            %j = arith.subi %s, %cs : index
%%   for l in range(nl)
            %k{{ l }} = vector.load %k[%s, %kh, {{ col }}{{ l }}] : {{ kt }}, {{ vkw }}
            {{ widen("%%kf%d" % l, "%%k%d" % l, w) }}
%%   endfor
%%   for i in qs
%%     for l in range(nl)
%%       if nq > 1
            %q{{ i }}_{{ l }} = vector.load %q[%t{{ i }}, %h, {{ col }}{{ l }}] : {{ qt }}, {{ vw }}
%%       endif
%%       if w == 8
            %d{{ i }}_{{ l }} = vector.fma %q{{ i }}_{{ l }}, %kf{{ l }}, {{ "%z8" if l < 2 else "%%d%d_%d" % (i, l - 2) }} : {{ v8 }}
%%       else
            %d{{ i }}_{{ l }} = vector.fma %q{{ i }}_{{ l }}, %kf{{ l }}, {{ "%z16" if l < 1 else "%%d%d_%d" % (i, l - 1) }} : {{ vw }}
%%       endif
%%     endfor
%%     if w == 8
            %dsum{{ i }} = arith.addf %d{{ i }}_{{ nl - 1 }}, {{ "%%d%d_%d" % (i, nl - 2) if nl > 1 else "%z8" }} : {{ v8 }}
%%     else
            %dlo{{ i }} = vector.shuffle %d{{ i }}_{{ nl - 1 }}, %d{{ i }}_{{ nl - 1 }} [0, 1, 2, 3, 4, 5, 6, 7] : {{ vw }}, {{ vw }}
            %dhi{{ i }} = vector.shuffle %d{{ i }}_{{ nl - 1 }}, %d{{ i }}_{{ nl - 1 }} [8, 9, 10, 11, 12, 13, 14, 15] : {{ vw }}, {{ vw }}
            %dsum{{ i }} = arith.addf %dhi{{ i }}, %dlo{{ i }} : {{ v8 }}
%%     endif
            %dt{{ i }} = vector.reduction <add>, %dsum{{ i }} fastmath<reassoc> : {{ v8 }} into f32
%%     if nq > 1
            %sd0_{{ i }} = arith.mulf %dt{{ i }}, %scale : f32
            %in{{ i }} = arith.cmpi ule, %s, %last{{ i }} : index
            %sd{{ i }} = arith.select %in{{ i }}, %sd0_{{ i }}, %ninf : f32
%%     else
            %sd{{ i }} = arith.mulf %dt{{ i }}, %scale : f32
%%     endif
            memref.store %sd{{ i }}, %sc[%cq{{ i }}, %j] : {{ st }}
            %m2_{{ i }} = arith.maximumf %m1_{{ i }}, %sd{{ i }} : f32
%%   endfor
            scf.yield <% for i in qs %>%m2_{{ i }}{{ ", " if not loop.last }}<% endfor %> : {{ (["f32"] * nq)|join(", ") }}
          }
%%   for i in qs
          %mn{{ i }} = arith.maximumf %mx{{ i }}, %cm#{{ i }} : f32
          %dm{{ i }} = arith.subf %mx{{ i }}, %mn{{ i }} : f32
          %corr{{ i }} = math.exp %dm{{ i }} : f32
          %corrv{{ i }} = vector.broadcast %corr{{ i }} : f32 to {{ vw }}
          %mnv{{ i }} = vector.broadcast %mn{{ i }} : f32 to {{ v8 }}
          scf.for %j = %c0 to %len step %c8 {
            %x = vector.load %sc[%cq{{ i }}, %j] : {{ st }}, {{ v8 }}
            %xd = arith.subf %x, %mnv{{ i }} : {{ v8 }}
            %e = math.exp %xd : {{ v8 }}
            vector.store %e, %sc[%cq{{ i }}, %j] : {{ st }}, {{ v8 }}
          }
          %lc{{ i }} = scf.for %j = %c0 to %len step %c1 iter_args(%ls = %zero) -> (f32) {
            %e = memref.load %sc[%cq{{ i }}, %j] : {{ st }}
            %ls2 = arith.addf %ls, %e : f32
            scf.yield %ls2 : f32
          }
          %l0_{{ i }} = arith.mulf %l{{ i }}, %corr{{ i }} : f32
          %l1_{{ i }} = arith.addf %l0_{{ i }}, %lc{{ i }} : f32
%%   endfor
{# the weighted sum of the chunk's V rows: rows outer, `vg` w-lane vectors of each
   query inner, one accumulator each (the FMA chains interleave instead of one chain of
   4-cycle FMAs per lane; each lane still sums its rows in order); a V row's lanes are
   loaded once for the block's queries #}
%%   for g0 in range(0, nl, vg)
%%     set gl = range(g0, [g0 + vg, nl]|min)
%%     set nacc = nq * gl|length
%%     set gtypes = ([vw] * nacc)|join(", ")
%%     for i in qs
%%       for l in gl
          %a{{ i }}_{{ l }} = vector.load %acc[%cq{{ i }}, {{ col }}{{ l }}] : {{ at }}, {{ vw }}
          %as{{ i }}_{{ l }} = arith.mulf %a{{ i }}_{{ l }}, %corrv{{ i }} : {{ vw }}
%%       endfor
%%     endfor
          %w{{ g0 }}:{{ nacc }} = scf.for %s = %cs to %ce step %c1 iter_args(<% for i in qs %><% for l in gl %>%wa{{ i }}_{{ l }} = %as{{ i }}_{{ l }}{{ ", " if not (loop.last and i == nq - 1) }}<% endfor %><% endfor %>) -> ({{ gtypes }}) {
%%     if g0 == 0
{{ prefetch_row("%v") }}
%%     endif
            %j = arith.subi %s, %cs : index
%%     for l in gl
            %vr{{ l }} = vector.load %v[%s, %kh, {{ col }}{{ l }}] : {{ kt }}, {{ vkw }}
            {{ widen("%%vf%d" % l, "%%vr%d" % l, w) }}
%%     endfor
%%     for i in qs
            %e{{ i }} = memref.load %sc[%cq{{ i }}, %j] : {{ st }}
            %eb{{ i }} = vector.broadcast %e{{ i }} : f32 to {{ vw }}
%%       for l in gl
            %wn{{ i }}_{{ l }} = vector.fma %eb{{ i }}, %vf{{ l }}, %wa{{ i }}_{{ l }} : {{ vw }}
%%       endfor
%%     endfor
            scf.yield <% for i in qs %><% for l in gl %>%wn{{ i }}_{{ l }}{{ ", " if not (loop.last and i == nq - 1) }}<% endfor %><% endfor %> : {{ gtypes }}
          }
%%     for i in qs
%%       for l in gl
          vector.store %w{{ g0 }}#{{ i * gl|length + loop.index0 }}, %acc[%cq{{ i }}, {{ col }}{{ l }}] : {{ at }}, {{ vw }}
%%       endfor
%%     endfor
%%   endfor
          scf.yield <% for i in qs %>%mn{{ i }}, <% endfor %><% for i in qs %>%l1_{{ i }}{{ ", " if not loop.last }}<% endfor %> : {{ (["f32"] * (2 * nq))|join(", ") }}
        }
%%   for i in qs
        %inv{{ i }} = arith.divf %one, %res#{{ nq + i }} : f32
        %invv{{ i }} = vector.broadcast %inv{{ i }} : f32 to {{ vw }}
%%     for l in range(nl)
        %f{{ i }}_{{ l }} = vector.load %acc[%cq{{ i }}, {{ col }}{{ l }}] : {{ at }}, {{ vw }}
        %g{{ i }}_{{ l }} = arith.mulf %f{{ i }}_{{ l }}, %invv{{ i }} : {{ vw }}
        vector.store %g{{ i }}_{{ l }}, %o[%t{{ i }}, %h, {{ col }}{{ l }}] : {{ qt }}, {{ vw }}
%%     endfor
%%   endfor
%% endmacro
%% call lib.executable(name, bindings, groups=heads)
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c8 = arith.constant 8 : index
%% for i in range(qb)
      %cq{{ i }} = arith.constant {{ i }} : index
%% endfor
%% for i in range(lanes)
      %col{{ i }} = arith.constant {{ 8 * i }} : index
%% endfor
%% for i in range(d // 16)
      %colw{{ i }} = arith.constant {{ 16 * i }} : index
%% endfor
%% for c in lines
      %col_l{{ c }} = arith.constant {{ c }} : index
%% endfor
      %cpf = arith.constant {{ prefetch }} : index
      %cchunk = arith.constant {{ chunk }} : index
      %cgroup = arith.constant {{ heads // kv_heads }} : index
      %cqb = arith.constant {{ qb }} : index
      %ninf = arith.constant 0xFF800000 : f32
      %zero = arith.constant 0.0 : f32
      %one = arith.constant 1.0 : f32
      %z8 = arith.constant dense<0.0> : {{ v8 }}
      %z16 = arith.constant dense<0.0> : vector<16xf32>
      %q = stream.binding.subspan %bq[%c0] : !stream.binding -> {{ qt }}{%m}
      %k = stream.binding.subspan %bk[%c0] : !stream.binding -> {{ kt }}
      %v = stream.binding.subspan %bv[%c0] : !stream.binding -> {{ kt }}
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {{ qt }}{%m}
      %sc = memref.alloca() : {{ st }}
      %acc = memref.alloca() : {{ at }}
      %h = stream.dispatch.workgroup.id[0] : index
      %kh = arith.divui %h, %cgroup : index
%% if qb > 1
      %mrem = arith.remui %m, %cqb : index
      %mfull = arith.subi %m, %mrem : index
      scf.for %t0 = %c0 to %mfull step %cqb {
{{ block(qb) }}
      }
%% endif
      scf.for %t0 = {{ "%mfull" if qb > 1 else "%c0" }} to %m step %c1 {
{{ block(1) }}
      }
%% endcall
