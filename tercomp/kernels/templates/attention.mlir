{# params: name, heads, kv_heads, d, s, kel, chunk, window, prefetch, vgroup #}
{#
  (q [T, H, D] f32, k, v [S, KV, D] kel, scale: f32, start: index, T: index) ->
  out [T, H, D] f32 (the slot caches of the batched generator: attention_rows.mlir).
  With `window` = W > 0 (a sliding-window layer) a query reads only the W most recent
  of its rows: the chunks start at row max(0, last + 1 - W).
  One workgroup per query head; an online softmax over chunks of `chunk` cache rows,
  whose scores live in a stack buffer. Written on 8-lane vectors with the D/8 lanes of
  a row unrolled (D % 8 == 0).
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
%% set st = "memref<%dxf32>" % chunk
%% set at = "memref<%dxf32>" % d
%% macro widen(dst, src)
%%   if kel == "f32"
{{ dst }} = arith.addf {{ src }}, %z8 : {{ v8 }}
%%   else
{{ dst }} = arith.extf {{ src }} : {{ vk }} to {{ v8 }}
%%   endif
%% endmacro
%% call lib.executable(name, bindings, groups=heads)
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c8 = arith.constant 8 : index
%% for i in range(lanes)
      %col{{ i }} = arith.constant {{ 8 * i }} : index
%% endfor
%% for c in lines
      %col_l{{ c }} = arith.constant {{ c }} : index
%% endfor
      %cpf = arith.constant {{ prefetch }} : index
      %cchunk = arith.constant {{ chunk }} : index
      %cgroup = arith.constant {{ heads // kv_heads }} : index
      %ninf = arith.constant 0xFF800000 : f32
      %zero = arith.constant 0.0 : f32
      %one = arith.constant 1.0 : f32
      %z8 = arith.constant dense<0.0> : {{ v8 }}
      %q = stream.binding.subspan %bq[%c0] : !stream.binding -> {{ qt }}{%m}
      %k = stream.binding.subspan %bk[%c0] : !stream.binding -> {{ kt }}
      %v = stream.binding.subspan %bv[%c0] : !stream.binding -> {{ kt }}
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {{ qt }}{%m}
      %sc = memref.alloca() : {{ st }}
      %acc = memref.alloca() : {{ at }}
      %h = stream.dispatch.workgroup.id[0] : index
      %kh = arith.divui %h, %cgroup : index
      scf.for %t = %c0 to %m step %c1 {
%% for i in range(lanes)
        %q{{ i }} = vector.load %q[%t, %h, %col{{ i }}] : {{ qt }}, {{ v8 }}
%% endfor
%% for i in range(lanes)
        vector.store %z8, %acc[%col{{ i }}] : {{ at }}, {{ v8 }}
%% endfor
        %last = arith.addi %p, %t : index
        %n = arith.addi %last, %c1 : index
%% if window
        %cwin = arith.constant {{ window }} : index
        %wide = arith.cmpi ugt, %n, %cwin : index
        %nw = arith.subi %n, %cwin : index
        %first = arith.select %wide, %nw, %c0 : index
%% endif
        %res:2 = scf.for %cs = {{ "%first" if window else "%c0" }} to %n step %cchunk
            iter_args(%mx = %ninf, %l = %zero) -> (f32, f32) {
          %ceu = arith.addi %cs, %cchunk : index
          %ce = arith.minui %ceu, %n : index
          %len = arith.subi %ce, %cs : index
          %cm = scf.for %s = %cs to %ce step %c1 iter_args(%m1 = %ninf) -> (f32) {
{{ prefetch_row("%k") }}
%% for i in range(lanes)
            %k{{ i }} = vector.load %k[%s, %kh, %col{{ i }}] : {{ kt }}, {{ vk }}
            {{ widen("%%kf%d" % i, "%%k%d" % i) }}
            %d{{ i }} = vector.fma %q{{ i }}, %kf{{ i }}, {{ "%z8" if i < 2 else "%%d%d" % (i - 2) }} : {{ v8 }}
%% endfor
            %dsum = arith.addf %d{{ lanes - 1 }}, {{ "%%d%d" % (lanes - 2) if lanes > 1 else "%z8" }} : {{ v8 }}
            %dt = vector.reduction <add>, %dsum fastmath<reassoc> : {{ v8 }} into f32
            %sd = arith.mulf %dt, %scale : f32
            %j = arith.subi %s, %cs : index
            memref.store %sd, %sc[%j] : {{ st }}
            %m2 = arith.maximumf %m1, %sd : f32
            scf.yield %m2 : f32
          }
          %mn = arith.maximumf %mx, %cm : f32
          %dm = arith.subf %mx, %mn : f32
          %corr = math.exp %dm : f32
          %corrv = vector.broadcast %corr : f32 to {{ v8 }}
          %mnv = vector.broadcast %mn : f32 to {{ v8 }}
          scf.for %j = %c0 to %len step %c8 {
            %x = vector.load %sc[%j] : {{ st }}, {{ v8 }}
            %xd = arith.subf %x, %mnv : {{ v8 }}
            %e = math.exp %xd : {{ v8 }}
            vector.store %e, %sc[%j] : {{ st }}, {{ v8 }}
          }
          %lc = scf.for %j = %c0 to %len step %c1 iter_args(%ls = %zero) -> (f32) {
            %e = memref.load %sc[%j] : {{ st }}
            %ls2 = arith.addf %ls, %e : f32
            scf.yield %ls2 : f32
          }
          %l0 = arith.mulf %l, %corr : f32
          %l1 = arith.addf %l0, %lc : f32
{# the weighted sum of the chunk's V rows: rows outer, `vgroup` lanes inner, one
   accumulator each (the lanes' FMA chains interleave instead of one chain of 4-cycle
   FMAs per lane; each lane still sums its rows in order) #}
%% for g0 in range(0, lanes, vgroup)
%%   set gl = range(g0, [g0 + vgroup, lanes]|min)
%%   set gtypes = ([v8] * gl|length)|join(", ")
%%   for i in gl
          %a{{ i }} = vector.load %acc[%col{{ i }}] : {{ at }}, {{ v8 }}
          %as{{ i }} = arith.mulf %a{{ i }}, %corrv : {{ v8 }}
%%   endfor
          %w{{ g0 }}:{{ gl|length }} = scf.for %s = %cs to %ce step %c1 iter_args(<% for i in gl %>%wa{{ i }} = %as{{ i }}{{ ", " if not loop.last }}<% endfor %>) -> ({{ gtypes }}) {
%%   if g0 == 0
{{ prefetch_row("%v") }}
%%   endif
            %j = arith.subi %s, %cs : index
            %e = memref.load %sc[%j] : {{ st }}
            %eb = vector.broadcast %e : f32 to {{ v8 }}
%%   for i in gl
            %vr{{ i }} = vector.load %v[%s, %kh, %col{{ i }}] : {{ kt }}, {{ vk }}
            {{ widen("%%vf%d" % i, "%%vr%d" % i) }}
            %wn{{ i }} = vector.fma %eb, %vf{{ i }}, %wa{{ i }} : {{ v8 }}
%%   endfor
            scf.yield <% for i in gl %>%wn{{ i }}{{ ", " if not loop.last }}<% endfor %> : {{ gtypes }}
          }
%%   for i in gl
          vector.store %w{{ g0 }}#{{ loop.index0 }}, %acc[%col{{ i }}] : {{ at }}, {{ v8 }}
%%   endfor
%% endfor
          scf.yield %mn, %l1 : f32, f32
        }
        %inv = arith.divf %one, %res#1 : f32
        %invv = vector.broadcast %inv : f32 to {{ v8 }}
%% for i in range(lanes)
        %f{{ i }} = vector.load %acc[%col{{ i }}] : {{ at }}, {{ v8 }}
        %g{{ i }} = arith.mulf %f{{ i }}, %invv : {{ v8 }}
        vector.store %g{{ i }}, %o[%t, %h, %col{{ i }}] : {{ qt }}, {{ v8 }}
%% endfor
      }
%% endcall
