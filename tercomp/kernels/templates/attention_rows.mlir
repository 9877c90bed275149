{# params: name, heads, kv_heads, d, s, kel, slots, groups, chunk, window, prefetch #}
{#
  The slot caches' attention read row by row: (q [T, H, D] f32, k, v [N, S, KV, D] kel,
  slots, positions: i32 [T], scale: f32, T: index) -> out [T, H, D] f32; query t reads
  rows 0..positions[t] of slot slots[t] (with `window` = W > 0 only the W most recent).

  One workgroup per (query, group of KV / `groups` consecutive KV heads and their query
  heads): for each cache row it reads the group's heads side by side, KV / groups * D
  contiguous values, so a workgroup walks its slot's rows as one forward stream (the
  hardware prefetchers follow it; a head's D values alone are a few lines out of every
  KV * D row). Per chunk of `chunk` rows, an online softmax per head: the scores of all
  the group's heads (one D-wide dot product each, rows outer), the chunk's max, exp and
  sum per head (8 scores a step; the chunk is padded to 8 with -inf), the rescale of the
  head's accumulator, then the weighted V rows (rows outer, the group's heads inner; each
  head's D-wide accumulator lives in a stack buffer). Written on 8-lane vectors with the
  D/8 lanes of a row unrolled (D % 8 == 0).
#}
%% import "lib.mlir" as lib
%% set lanes = d // 8
%% set v8 = "vector<8xf32>"
%% set vk = "vector<8x%s>" % kel
%% set qt = "memref<?x%dx%dxf32>" % (heads, d)
%% set ebytes = 4 if kel == "f32" else 2
%% set qpk = heads // kv_heads
%% set gkv = kv_heads // groups
%% set hg = gkv * qpk
%% set kt = "memref<%dx%dx%dx%dx%s>" % (slots, s, kv_heads, d, kel)
%% set st = "memref<%dx%dxf32>" % (hg, chunk)
%% set at = "memref<%dx%dxf32>" % (hg, d)
%% set ht = "memref<%dxf32>" % hg
{# rows a step of the row loops (a divisor of 8: the chunk's scores are padded to 8 with
   -inf, exp 0; rows past the last read the last row, weighted 0) #}
%% set rblock = 4
%% macro widen(dst, src)
%%   if kel == "f32"
{{ dst }} = arith.addf {{ src }}, %z8 : {{ v8 }}
%%   else
{{ dst }} = arith.extf {{ src }} : {{ vk }} to {{ v8 }}
%%   endif
%% endmacro
{# the kv head (%kv) and query head (%qh) of the group's query head %hh #}
%% macro heads_of(hh)
%%   if qpk == 1
            %kv = arith.addi %kh0, {{ hh }} : index
%%   else
            %kvo = arith.divui {{ hh }}, %cqpk : index
            %kv = arith.addi %kh0, %kvo : index
%%   endif
            %qh = arith.addi %h0, {{ hh }} : index
%% endmacro
%% call lib.executable(name, "%bq: !stream.binding, %bk: !stream.binding, %bv: !stream.binding, %bs: !stream.binding, %bp: !stream.binding, %bo: !stream.binding, %scale: f32, %m: index", times=groups)
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c7 = arith.constant 7 : index
      %c8 = arith.constant 8 : index
      %cm8 = arith.constant -8 : index
      %crb = arith.constant {{ rblock }} : index
%% for r in range(rblock)
      %cr{{ r }} = arith.constant {{ r }} : index
%% endfor
%% for i in range(lanes)
      %col{{ i }} = arith.constant {{ 8 * i }} : index
%% endfor
      %chg = arith.constant {{ hg }} : index
      %cgkv = arith.constant {{ gkv }} : index
      %cqpk = arith.constant {{ qpk }} : index
      %cgroups = arith.constant {{ groups }} : index
      %cchunk = arith.constant {{ chunk }} : index
      %cpf = arith.constant {{ prefetch }} : index
      %ninf = arith.constant 0xFF800000 : f32
      %zero = arith.constant 0.0 : f32
      %one = arith.constant 1.0 : f32
      %z8 = arith.constant dense<0.0> : {{ v8 }}
      %ninf8 = arith.constant dense<0xFF800000> : {{ v8 }}
      %q = stream.binding.subspan %bq[%c0] : !stream.binding -> {{ qt }}{%m}
      %k = stream.binding.subspan %bk[%c0] : !stream.binding -> {{ kt }}
      %v = stream.binding.subspan %bv[%c0] : !stream.binding -> {{ kt }}
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {{ qt }}{%m}
      %sl = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?xi32>{%m}
      %pos = stream.binding.subspan %bp[%c0] : !stream.binding -> memref<?xi32>{%m}
      %sc = memref.alloca() : {{ st }}
      %acc = memref.alloca() : {{ at }}
      %mst = memref.alloca() : {{ ht }}
      %lst = memref.alloca() : {{ ht }}
      %w = stream.dispatch.workgroup.id[0] : index
      %t = arith.divui %w, %cgroups : index
      %g = arith.remui %w, %cgroups : index
      %kh0 = arith.muli %g, %cgkv : index
      %h0 = arith.muli %kh0, %cqpk : index
      %slot32 = memref.load %sl[%t] : memref<?xi32>
      %slot = arith.index_cast %slot32 : i32 to index
      %last32 = memref.load %pos[%t] : memref<?xi32>
      %last = arith.index_cast %last32 : i32 to index
      %n = arith.addi %last, %c1 : index
%% if window
      %cwin = arith.constant {{ window }} : index
      %wide = arith.cmpi ugt, %n, %cwin : index
      %nw = arith.subi %n, %cwin : index
      %first = arith.select %wide, %nw, %c0 : index
%% endif
      scf.for %hh = %c0 to %chg step %c1 {
        memref.store %ninf, %mst[%hh] : {{ ht }}
        memref.store %zero, %lst[%hh] : {{ ht }}
%% for i in range(lanes)
        vector.store %z8, %acc[%hh, %col{{ i }}] : {{ at }}, {{ v8 }}
%% endfor
      }
      scf.for %cs = {{ "%first" if window else "%c0" }} to %n step %cchunk {
        %ceu = arith.addi %cs, %cchunk : index
        %ce = arith.minui %ceu, %n : index
        %len = arith.subi %ce, %cs : index
        %len7 = arith.addi %len, %c7 : index
        %len8 = arith.andi %len7, %cm8 : index
{# the scores: rows outer, the group's heads inner (one forward stream over the rows) #}
        scf.for %s = %cs to %ce step %crb {
          %j = arith.subi %s, %cs : index
%% for r in range(rblock)
          %rs{{ r }} = arith.addi %s, %cr{{ r }} : index
          %rr{{ r }} = arith.minui %rs{{ r }}, %last : index
%% endfor
%% if prefetch
%%   for c in range(0, gkv * d, 64 // ebytes)
          %pkv{{ c }} = arith.constant {{ c // d }} : index
          %pcol{{ c }} = arith.constant {{ c % d }} : index
          %pk{{ c }} = arith.addi %kh0, %pkv{{ c }} : index
%%   endfor
%%   for r in range(rblock)
          %sa{{ r }} = arith.addi %rr{{ r }}, %cpf : index
          %sp{{ r }} = arith.minui %sa{{ r }}, %last : index
%%     for c in range(0, gkv * d, 64 // ebytes)
          memref.prefetch %k[%slot, %sp{{ r }}, %pk{{ c }}, %pcol{{ c }}], read, locality<3>, data : {{ kt }}
%%     endfor
%%   endfor
%% endif
          scf.for %hh = %c0 to %chg step %c1 {
{{ heads_of("%hh") }}
%% for i in range(lanes)
            %q{{ i }} = vector.load %q[%t, %qh, %col{{ i }}] : {{ qt }}, {{ v8 }}
%% endfor
%% for r in range(rblock)
%%   for i in range(lanes)
            %k{{ r }}_{{ i }} = vector.load %k[%slot, %rr{{ r }}, %kv, %col{{ i }}] : {{ kt }}, {{ vk }}
            {{ widen("%%kf%d_%d" % (r, i), "%%k%d_%d" % (r, i)) }}
            %d{{ r }}_{{ i }} = vector.fma %q{{ i }}, %kf{{ r }}_{{ i }}, {{ "%z8" if i < 2 else "%%d%d_%d" % (r, i - 2) }} : {{ v8 }}
%%   endfor
            %dsum{{ r }} = arith.addf %d{{ r }}_{{ lanes - 1 }}, {{ "%%d%d_%d" % (r, lanes - 2) if lanes > 1 else "%z8" }} : {{ v8 }}
            %dt{{ r }} = vector.reduction <add>, %dsum{{ r }} fastmath<reassoc> : {{ v8 }} into f32
            %sd{{ r }} = arith.mulf %dt{{ r }}, %scale : f32
            %jr{{ r }} = arith.addi %j, %cr{{ r }} : index
            memref.store %sd{{ r }}, %sc[%hh, %jr{{ r }}] : {{ st }}
%% endfor
          }
        }
{# per head: pad the scores to 8 with -inf, max, exp, sum, rescale the accumulator #}
        scf.for %hh = %c0 to %chg step %c1 {
          scf.for %j = %len to %len8 step %c1 {
            memref.store %ninf, %sc[%hh, %j] : {{ st }}
          }
          %cmv = scf.for %j = %c0 to %len8 step %c8 iter_args(%mv = %ninf8) -> ({{ v8 }}) {
            %x = vector.load %sc[%hh, %j] : {{ st }}, {{ v8 }}
            %mv2 = arith.maximumf %mv, %x : {{ v8 }}
            scf.yield %mv2 : {{ v8 }}
          }
          %cm = vector.reduction <maximumf>, %cmv : {{ v8 }} into f32
          %mx = memref.load %mst[%hh] : {{ ht }}
          %mn = arith.maximumf %mx, %cm : f32
          %dm = arith.subf %mx, %mn : f32
          %corr = math.exp %dm : f32
          %mnv = vector.broadcast %mn : f32 to {{ v8 }}
          %lv = scf.for %j = %c0 to %len8 step %c8 iter_args(%ls = %z8) -> ({{ v8 }}) {
            %x = vector.load %sc[%hh, %j] : {{ st }}, {{ v8 }}
            %xd = arith.subf %x, %mnv : {{ v8 }}
            %e = math.exp %xd : {{ v8 }}
            vector.store %e, %sc[%hh, %j] : {{ st }}, {{ v8 }}
            %ls2 = arith.addf %ls, %e : {{ v8 }}
            scf.yield %ls2 : {{ v8 }}
          }
          %lc = vector.reduction <add>, %lv fastmath<reassoc> : {{ v8 }} into f32
          %l = memref.load %lst[%hh] : {{ ht }}
          %l0 = arith.mulf %l, %corr : f32
          %l1 = arith.addf %l0, %lc : f32
          memref.store %mn, %mst[%hh] : {{ ht }}
          memref.store %l1, %lst[%hh] : {{ ht }}
          %corrv = vector.broadcast %corr : f32 to {{ v8 }}
%% for i in range(lanes)
          %a{{ i }} = vector.load %acc[%hh, %col{{ i }}] : {{ at }}, {{ v8 }}
          %as{{ i }} = arith.mulf %a{{ i }}, %corrv : {{ v8 }}
          vector.store %as{{ i }}, %acc[%hh, %col{{ i }}] : {{ at }}, {{ v8 }}
%% endfor
        }
{# the weighted V rows: rows outer, the group's heads inner #}
        scf.for %s = %cs to %ce step %crb {
          %j = arith.subi %s, %cs : index
%% for r in range(rblock)
          %rs{{ r }} = arith.addi %s, %cr{{ r }} : index
          %rr{{ r }} = arith.minui %rs{{ r }}, %last : index
%% endfor
%% if prefetch
%%   for c in range(0, gkv * d, 64 // ebytes)
          %pkv{{ c }} = arith.constant {{ c // d }} : index
          %pcol{{ c }} = arith.constant {{ c % d }} : index
          %pk{{ c }} = arith.addi %kh0, %pkv{{ c }} : index
%%   endfor
%%   for r in range(rblock)
          %sa{{ r }} = arith.addi %rr{{ r }}, %cpf : index
          %sp{{ r }} = arith.minui %sa{{ r }}, %last : index
%%     for c in range(0, gkv * d, 64 // ebytes)
          memref.prefetch %v[%slot, %sp{{ r }}, %pk{{ c }}, %pcol{{ c }}], read, locality<3>, data : {{ kt }}
%%     endfor
%%   endfor
%% endif
          scf.for %hh = %c0 to %chg step %c1 {
{{ heads_of("%hh") }}
%% for i in range(lanes)
            %a{{ i }} = vector.load %acc[%hh, %col{{ i }}] : {{ at }}, {{ v8 }}
%% endfor
%% for r in range(rblock)
            %jr{{ r }} = arith.addi %j, %cr{{ r }} : index
            %e{{ r }} = memref.load %sc[%hh, %jr{{ r }}] : {{ st }}
            %eb{{ r }} = vector.broadcast %e{{ r }} : f32 to {{ v8 }}
%%   for i in range(lanes)
            %vr{{ r }}_{{ i }} = vector.load %v[%slot, %rr{{ r }}, %kv, %col{{ i }}] : {{ kt }}, {{ vk }}
            {{ widen("%%vf%d_%d" % (r, i), "%%vr%d_%d" % (r, i)) }}
            %a{{ r + 1 }}_{{ i }} = vector.fma %eb{{ r }}, %vf{{ r }}_{{ i }}, {{ ("%%a%d" % i) if r == 0 else ("%%a%d_%d" % (r, i)) }} : {{ v8 }}
%%   endfor
%% endfor
%% for i in range(lanes)
            vector.store %a{{ rblock }}_{{ i }}, %acc[%hh, %col{{ i }}] : {{ at }}, {{ v8 }}
%% endfor
          }
        }
      }
      scf.for %hh = %c0 to %chg step %c1 {
        %qh = arith.addi %h0, %hh : index
        %l = memref.load %lst[%hh] : {{ ht }}
        %inv = arith.divf %one, %l : f32
        %invv = vector.broadcast %inv : f32 to {{ v8 }}
%% for i in range(lanes)
        %f{{ i }} = vector.load %acc[%hh, %col{{ i }}] : {{ at }}, {{ v8 }}
        %r{{ i }} = arith.mulf %f{{ i }}, %invv : {{ v8 }}
        vector.store %r{{ i }}, %o[%t, %qh, %col{{ i }}] : {{ qt }}, {{ v8 }}
%% endfor
      }
%% endcall
