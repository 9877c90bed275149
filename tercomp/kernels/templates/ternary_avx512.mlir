{# params: name, n, kb, offset, prequantized, rows, blocks, gfni, tile_rows, kchunk, chunk, prefetch_rows, stream_ahead, workgroups, decode_workgroups, eps, c127, lo, hi, amx, amx_kc, amx_rows, amx_group, amx_super, amx_pad #}
{#
  The avx512 ternary matmul (see ternary/avx512.py for the why): the avx2 kernel's
  inputs and outputs (ternary_avx2.mlir) on 64-byte zmm chunks, each u8 x s8 product
  reduced into i32 lanes by vpdpbusd (4 products a lane, no i16 stage). `prequantized`
  (x as the quantize dispatch's codes): the rows of x through the GEMM loop in blocks
  of each size of `blocks` in turn ((rows of x, weight rows a step, accumulators a
  pair), largest first), the rows left over one by one through the GEMV loop (`rows`
  weight rows a step, one from each of `rows` streams); else (a decode's few rows)
  every row through the GEMV loop, quantized by the workgroup into a one-row buffer.
  The shift decode works on i32 lanes: no carry or borrow crosses a 2-bit field, so
  the byte-wise arithmetic is the same done 32 bits at a time.
#}
%% import "lib.mlir" as lib
%% import "avx2_quant_lib.mlir" as quant
%% import "amx_lib.mlir" as amx_lib
%% set v8, v32, vf = "vector<64xi8>", "vector<16xi32>", "vector<16xf32>"
%% set dp = 'llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"'
%% set dpt = "(%s, %s, %s) -> %s" % (v32, v8, v8, v32)
%% set kp = 4 * kb
%% set bt = "memref<1x%dxi8>" % kp
%% set wt = "memref<%dx%dxi8>" % (n, kb)
%% set ot = "memref<?x%dxf32>" % n
%% set qt = "memref<?x%dxi8>" % kp
%% set kacct = "memref<%dx16xi32>" % (tile_rows // blocks|map(attribute=1)|min)
{#
  codes: load the 64 packed bytes at column %c of weight row `base` + `step`
  (prefetching the same column `ahead` rows further on with `locality`) and define
  %q{i}_{j}, the u = w + 1 codes of plane j (64 bytes). The bytes hold u already when
  `offset`, else the signed codes, remapped here. `scaled` (the GEMV loop): planes 1
  and 3 are left 4 times their codes (u & 0xC, (u >> 4) & 0xC: one shift serves all
  four planes); else each plane is its codes: one gf2p8affineqb a plane with `gfni`
  (its bit matrix %gfa{j} moves bits 2j and 2j + 1 of every byte to bits 0 and 1 and
  clears the rest), else (u >> 2j) & 3.
#}
%% macro codes(i, base, step, ahead, locality, scaled)
%%   set raw = "%%raw%d" % i
%%   set u = raw if offset else "%%u%d" % i
{{ lib.load_row(raw ~ "b", "%%rowraw%d" % i, base, step, "%c", "%w", wt, v8, "%%preraw%d" % i, ahead, locality) }}
%%   if offset and gfni and not scaled
%%     for j in range(4)
%q{{ i }}_{{ j }} = llvm.call_intrinsic "llvm.x86.vgf2p8affineqb.512"({{ raw }}b, %gfa{{ j }}, %gfb) : ({{ v8 }}, {{ v8 }}, i8) -> {{ v8 }}
%%     endfor
%%   else
{{ raw }} = vector.bitcast {{ raw }}b : {{ v8 }} to {{ v32 }}
%%     if not offset
%lo{{ i }} = arith.andi {{ raw }}, %m55 : {{ v32 }}
%hs{{ i }} = arith.shrui {{ raw }}, %s1 : {{ v32 }}
%hi{{ i }} = arith.andi %hs{{ i }}, %m55 : {{ v32 }}
%lp{{ i }} = arith.addi %lo{{ i }}, %m55 : {{ v32 }}
%u{{ i }} = arith.subi %lp{{ i }}, %hi{{ i }} : {{ v32 }}
%%     endif
%%     if scaled
%qw{{ i }}_0 = arith.andi {{ u }}, %three : {{ v32 }}
%qw{{ i }}_1 = arith.andi {{ u }}, %twelve : {{ v32 }}
%t{{ i }} = arith.shrui {{ u }}, %s4 : {{ v32 }}
%qw{{ i }}_2 = arith.andi %t{{ i }}, %three : {{ v32 }}
%qw{{ i }}_3 = arith.andi %t{{ i }}, %twelve : {{ v32 }}
%%     else
%qw{{ i }}_0 = arith.andi {{ u }}, %three : {{ v32 }}
%%       for j in range(1, 4)
%t{{ i }}_{{ j }} = arith.shrui {{ u }}, %s{{ 2 * j }} : {{ v32 }}
%qw{{ i }}_{{ j }} = arith.andi %t{{ i }}_{{ j }}, %three : {{ v32 }}
%%       endfor
%%     endif
%%     for j in range(4)
%q{{ i }}_{{ j }} = vector.bitcast %qw{{ i }}_{{ j }} : {{ v32 }} to {{ v8 }}
%%     endfor
%%   endif
%% endmacro
{# x_planes: %x{b}_{j}, the 64 quantized x values of plane j at column %c of row `row` of `mem` (`mem_type`). #}
%% macro x_planes(b, mem, mem_type, row)
%%   for j in range(4)
%xo{{ b }}_{{ j }} = affine.apply affine_map<(d0) -> (d0 + {{ j * kb }})>(%c)
%x{{ b }}_{{ j }} = vector.load {{ mem }}[{{ row }}, %xo{{ b }}_{{ j }}] : {{ mem_type }}, {{ v8 }}
%%   endfor
%% endmacro
{#
  products: the accumulators of `tag` after vpdpbusd of the codes %q{i}_j with x %x{b}_j:
  with `n_acc` 2, %na{tag} (planes 0 and 2) and %nb{tag} (planes 1 and 3), each a chain
  of two; with 1, %na{tag}, a chain of four.
#}
%% macro products(tag, i, b, n_acc)
%%   if n_acc == 2
%pa{{ tag }} = {{ dp }}(%a{{ tag }}, %q{{ i }}_0, %x{{ b }}_0) : {{ dpt }}
%na{{ tag }} = {{ dp }}(%pa{{ tag }}, %q{{ i }}_2, %x{{ b }}_2) : {{ dpt }}
%pb{{ tag }} = {{ dp }}(%b{{ tag }}, %q{{ i }}_1, %x{{ b }}_1) : {{ dpt }}
%nb{{ tag }} = {{ dp }}(%pb{{ tag }}, %q{{ i }}_3, %x{{ b }}_3) : {{ dpt }}
%%   else
%pa{{ tag }} = {{ dp }}(%a{{ tag }}, %q{{ i }}_0, %x{{ b }}_0) : {{ dpt }}
%pb{{ tag }} = {{ dp }}(%pa{{ tag }}, %q{{ i }}_1, %x{{ b }}_1) : {{ dpt }}
%pc{{ tag }} = {{ dp }}(%pb{{ tag }}, %q{{ i }}_2, %x{{ b }}_2) : {{ dpt }}
%na{{ tag }} = {{ dp }}(%pc{{ tag }}, %q{{ i }}_3, %x{{ b }}_3) : {{ dpt }}
%%   endif
%% endmacro
{#
  stores: y[m, rows[i]] = (sum(u x) - sum) * fm for each weight row i of the GEMV loop,
  sum(u x) = (sum(4 %acc#2i + %acc#2i+1)) / 4 (exact: both hold whole multiples).
#}
%% macro stores(rows_, sum, fm)
%%   for row in rows_
%%     set i = loop.index0
%sh{{ i }} = arith.shli %acc#{{ 2 * i }}, %two32 : {{ v32 }}
%all{{ i }} = arith.addi %sh{{ i }}, %acc#{{ 2 * i + 1 }} : {{ v32 }}
%red4_{{ i }} = vector.reduction <add>, %all{{ i }} : {{ v32 }} into i32
%red{{ i }} = arith.shrsi %red4_{{ i }}, %c2i32 : i32
%dif{{ i }} = arith.subi %red{{ i }}, {{ sum }} : i32
%flt{{ i }} = arith.sitofp %dif{{ i }} : i32 to f32
%y{{ i }} = arith.mulf %flt{{ i }}, {{ fm }} : f32
memref.store %y{{ i }}, %o[%mrow, {{ row }}] : {{ ot }}
%%   endfor
%% endmacro
{#
  reduce16: %{tag}r3_0, a vector<16xi32> whose lane p is the sum of the 16 lanes of
  vector p of `vs` (2, 4, 8 or 16 of them; the lanes from len(vs) on hold other sums):
  pairs of vectors interleaved by 32-bit lanes and added, then by 64-bit lanes (each
  128-bit block now holds a partial sum of 4 vectors), then by 128-bit blocks twice (a
  vector paired with itself when it has no partner); 2 shuffles and an add a pair,
  45 instructions for 16 sums against about 12 for each sum reduced alone.
#}
%% macro reduce16(tag, vs)
%%   set ns = namespace(lvl=vs)
%%   set masks = [
       ([0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29],
        [2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31]),
       ([0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29],
        [2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31]),
       ([0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27],
        [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31]),
       ([0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27],
        [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31])]
%%   for lo, hi in masks
%%     set step = loop.index0
%%     set nxt = []
%%     for k in range(0, [ns.lvl|length, 2]|max, 2)
%%       set a = ns.lvl[k]
%%       set b = ns.lvl[k + 1] if k + 1 < ns.lvl|length else ns.lvl[k]
%%       set r = "%%%sr%d_%d" % (tag, step, k // 2)
{{ r }}l = vector.shuffle {{ a }}, {{ b }} {{ lo }} : {{ v32 }}, {{ v32 }}
{{ r }}h = vector.shuffle {{ a }}, {{ b }} {{ hi }} : {{ v32 }}, {{ v32 }}
{{ r }} = arith.addi {{ r }}l, {{ r }}h : {{ v32 }}
%%       do nxt.append(r)
%%     endfor
%%     set ns.lvl = nxt
%%   endfor
%% endmacro
{#
  gemv_loop: one quantized row of x (row `row` of `mem`) against `rows` weight rows per
  step from `rows` streams, a quarter of the workgroup's rows each, each prefetched
  stream_ahead rows ahead into L1.
#}
%% macro gemv_loop(mem, mem_type, row, sum, fm)
%%   set streams = ["%rj"]
%%   for i in range(1, rows)
%%     do streams.append("%%rq%d" % i)
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
          %acc:{{ 2 * rows }} = scf.for %c = %c0 to %ckb step %cc iter_args(<% for i in range(rows) %>%a{{ i }}_0 = %z32, %b{{ i }}_0 = %z32{{ ", " if not loop.last }}<% endfor %>) -> ({{ t32 }}) {
            {{ x_planes(0, mem, mem_type, row) | indent(12) }}
%%   for i in range(rows)
            {{ codes(i, streams[i], 0, stream_ahead, 3, true) | indent(12) }}
            {{ products("%d_0" % i, i, 0, 2) | indent(12) }}
%%   endfor
            scf.yield <% for i in range(rows) %>%na{{ i }}_0, %nb{{ i }}_0{{ ", " if not loop.last }}<% endfor %> : {{ t32 }}
          }
          {{ stores(streams, sum, fm) | indent(10) }}
        }
%% endmacro
{#
  gemm_block: the rows of x from `m_lo` to `m_hi` (whole blocks of mb rows) against the
  tile's weight rows, g a step, each (weight row, row of x) pair summed in `n_acc`
  accumulators: each weight chunk is decoded once for the mb rows of x. The mb x g sums
  of a step are reduced together (reduce16) into one vector, dequantized together and
  stored g at a time (y[m + b, r : r + g]). With `kchunk` (packed bytes, below kb) the
  K columns go in chunks of kchunk (the last one shorter where kchunk does not divide
  kb): each chunk of the block's rows of x (mb x 4 x kchunk bytes) meets every weight row
  of the tile before the next chunk is read, so it stays in L1 where the whole rows (mb x
  4 x kb bytes) would not; each step's 16 sums are reduced after each chunk and added
  into %kacc[step of the tile] (memory), dequantized after the last chunk.
#}
%% macro gemm_block(tag, m_lo, m_hi, mb, g, n_acc)
%%   set sums, fms, xrows, pairs = [], [], [], []
%%   for b in range(mb)
%%     do sums.append("%%sx%d" % b)
%%     do fms.append("%%fm%d" % b)
%%     do xrows.append("%%xr%d" % b)
%%     for i in range(g)
%%       do pairs.append((i, b))
%%     endfor
%%   endfor
%%   set lanes_s, lanes_f = [], []
%%   for i, b in pairs
%%     do lanes_s.append(sums[b])
%%     do lanes_f.append(fms[b])
%%   endfor
%%   for p in range(pairs|length, 16)
%%     do lanes_s.append("%c0i32")
%%     do lanes_f.append("%f0")
%%   endfor
%%   set t32 = ([v32] * (n_acc * pairs|length))|join(", ")
%%   set chunked = kchunk and kchunk < kb
        scf.for %mrow = {{ m_lo }} to {{ m_hi }} step %cmb{{ tag }} {
%%   for b in range(mb)
          {{ xrows[b] }} = affine.apply affine_map<(d0) -> (d0 + {{ b }})>(%mrow)
{{ quant.row_stats(b, xrows[b], sums[b], fms[b]) }}
%%   endfor
          %sumv = vector.from_elements {{ lanes_s|join(", ") }} : {{ v32 }}
          %fmv = vector.from_elements {{ lanes_f|join(", ") }} : {{ vf }}
%%   if chunked
          scf.for %r = %rt to %rtend step %cg{{ tag }} {
            %ks = affine.apply affine_map<(d0)[s0] -> ((d0 - s0) floordiv {{ g }})>(%r)[%rt]
            vector.store %z32, %kacc[%ks, %c0] : {{ kacct }}, {{ v32 }}
          }
          scf.for %k0 = %c0 to %ckb step %ckc {
            %k1u = arith.addi %k0, %ckc : index
            %k1 = arith.minui %k1u, %ckb : index
%%   endif
          scf.for %r = %rt to %rtend step %cg{{ tag }} {
            %acc:{{ n_acc * pairs|length }} = scf.for %c = {{ "%k0" if chunked else "%c0" }} to {{ "%k1" if chunked else "%ckb" }} step %cc iter_args(<% for i, b in pairs %>%a{{ i }}_{{ b }} = %z32<% if n_acc == 2 %>, %b{{ i }}_{{ b }} = %z32<% endif %>{{ ", " if not loop.last }}<% endfor %>) -> ({{ t32 }}) {
%%   for i in range(g)
              {{ codes(i, "%r", i, prefetch_rows, 3, false) | indent(14) }}
%%   endfor
%%   for b in range(mb)
              {{ x_planes(b, "%xq", qt, xrows[b]) | indent(14) }}
%%   endfor
%%   for i, b in pairs
              {{ products("%d_%d" % (i, b), i, b, n_acc) | indent(14) }}
%%   endfor
              scf.yield <% for i, b in pairs %>%na{{ i }}_{{ b }}<% if n_acc == 2 %>, %nb{{ i }}_{{ b }}<% endif %>{{ ", " if not loop.last }}<% endfor %> : {{ t32 }}
            }
%%   set vs = []
%%   for i, b in pairs
%%     set p = loop.index0
%%     if n_acc == 1
%%       do vs.append("%%acc#%d" % p)
%%     else
            %all{{ p }} = arith.addi %acc#{{ 2 * p }}, %acc#{{ 2 * p + 1 }} : {{ v32 }}
%%       do vs.append("%%all%d" % p)
%%     endif
%%   endfor
            {{ reduce16("s", vs) | indent(12) }}
%%   if chunked
            %ks = affine.apply affine_map<(d0)[s0] -> ((d0 - s0) floordiv {{ g }})>(%r)[%rt]
            %kold = vector.load %kacc[%ks, %c0] : {{ kacct }}, {{ v32 }}
            %knew = arith.addi %kold, %sr3_0 : {{ v32 }}
            vector.store %knew, %kacc[%ks, %c0] : {{ kacct }}, {{ v32 }}
          }
          }
          scf.for %r = %rt to %rtend step %cg{{ tag }} {
            %ks = affine.apply affine_map<(d0)[s0] -> ((d0 - s0) floordiv {{ g }})>(%r)[%rt]
            %ktot = vector.load %kacc[%ks, %c0] : {{ kacct }}, {{ v32 }}
            %sdif = arith.subi %ktot, %sumv : {{ v32 }}
%%   else
            %sdif = arith.subi %sr3_0, %sumv : {{ v32 }}
%%   endif
            %sflt = arith.sitofp %sdif : {{ v32 }} to {{ vf }}
            %sy = arith.mulf %sflt, %fmv : {{ vf }}
%%   for b in range(mb)
            %y{{ b }} = vector.extract_strided_slice %sy offsets = [{{ b * g }}], sizes = [{{ g }}], strides = [1] : {{ vf }} to vector<{{ g }}xf32>
            %ocol{{ b }} = affine.apply affine_map<(d0) -> (d0 + {{ b }})>(%mrow)
            vector.store %y{{ b }}, %o[%ocol{{ b }}, %r] : {{ ot }}, vector<{{ g }}xf32>
%%   endfor
          }
        }
%% endmacro
%% set first_row = "%m16" if amx else "%c0"
%% set ends, starts = namespace(prev=first_row), namespace(prev=first_row)
%% set inputs = "%bq: !stream.binding, %bs: !stream.binding, " if prequantized else "%bx: !stream.binding, "
%% set inputs = inputs ~ ("%bv: !stream.binding, " if amx else "")
%% set xvt = "memref<?x%dxi8>" % (64 * kb)
%% call lib.executable(name, inputs ~ "%bw: !stream.binding, %bo: !stream.binding, %wscale: f32, %m: index", few=decode_workgroups, many=workgroups, m_min=blocks[-1][0])
{{ quant.common(kp, rows, eps, c127, lo, hi) }}
      %cr = arith.constant {{ rows }} : index
%% for mb, g, n_acc in blocks
      %cg{{ loop.index0 }} = arith.constant {{ g }} : index
      %cmb{{ loop.index0 }} = arith.constant {{ mb }} : index
%% endfor
      %ctile = arith.constant {{ tile_rows }} : index
%% if prequantized and kchunk and kchunk < kb
      %ckc = arith.constant {{ kchunk }} : index
      %kacc = memref.alloca() : {{ kacct }}
%% endif
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
%% if amx
      %crw = arith.constant {{ 16 * amx_rows }} : index
%% else
      %crw = arith.constant {{ rows }} : index
%% endif
      %rpr = arith.ceildivui %rpg, %crw : index
      %rpw = arith.muli %rpr, %crw : index
      %r0u = arith.muli %wg, %rpw : index
      %r0 = arith.minui %r0u, %cn : index
      %r1u = arith.addi %r0, %rpw : index
      %r1 = arith.minui %r1u, %cn : index
      %three = arith.constant dense<50529027> : {{ v32 }}
      %twelve = arith.constant dense<202116108> : {{ v32 }}
      %m55 = arith.constant dense<1431655765> : {{ v32 }}
      %s1 = arith.constant dense<1> : {{ v32 }}
%% for j in (2, 4, 6)
      %s{{ j }} = arith.constant dense<{{ j }}> : {{ v32 }}
%% endfor
      %two32 = arith.constant dense<2> : {{ v32 }}
      %c2i32 = arith.constant 2 : i32
      %z32 = arith.constant dense<0> : {{ v32 }}
%% if gfni
%%   for j in range(4)
      %gfa{{ j }}q = arith.constant dense<{{ 2 ** (2 * j + 56) + 2 ** (2 * j + 49) }}> : vector<8xi64>
      %gfa{{ j }} = vector.bitcast %gfa{{ j }}q : vector<8xi64> to {{ v8 }}
%%   endfor
      %gfb = arith.constant 0 : i8
%% endif
%% if amx
      %amc16 = arith.constant 16 : index
      %amcpad = arith.constant {{ 16 - amx_pad }} : index
      %ampad = arith.addi %m, %amcpad : index
      %nmb = arith.divui %ampad, %amc16 : index
      %m16b = arith.muli %nmb, %amc16 : index
      %m16 = arith.minui %m16b, %m : index
      %xv = stream.binding.subspan %bv[%c0] : !stream.binding -> {{ xvt }}{%nmb}
{{ amx_lib.amx_gemm(kb, n, amx_kc, amx_rows, amx_group, amx_super, wt, ot, vf, xvt) }}
%% endif
%% if prequantized
      %c0i32 = arith.constant 0 : i32
      %f0 = arith.constant 0.0 : f32
{# %mend{k}: the end of the rows of x in blocks of blocks[k] (from the end of those of blocks[k - 1]) #}
%%   for mb, g, n_acc in blocks
      %mleft{{ loop.index0 }} = arith.subi %m, {{ ends.prev }} : index
      %mblk{{ loop.index0 }} = arith.divui %mleft{{ loop.index0 }}, %cmb{{ loop.index0 }} : index
      %mlen{{ loop.index0 }} = arith.muli %mblk{{ loop.index0 }}, %cmb{{ loop.index0 }} : index
      %mend{{ loop.index0 }} = arith.addi {{ ends.prev }}, %mlen{{ loop.index0 }} : index
%%     set ends.prev = "%%mend%d" % loop.index0
%%   endfor
{#
  tiles of tile_rows weight rows outside, the blocks of x inside: each tile is read from
  memory once and meets every block of x from L1 / L2
#}
      scf.for %rt = %r0 to %r1 step %ctile {
        %rtend0 = arith.addi %rt, %ctile : index
        %rtend = arith.minui %rtend0, %r1 : index
%%   for mb, g, n_acc in blocks
{{ gemm_block(loop.index0, starts.prev, "%%mend%d" % loop.index0, mb, g, n_acc) }}
%%     set starts.prev = "%%mend%d" % loop.index0
%%   endfor
      }
      scf.for %mrow = {{ starts.prev }} to %m step %c1 {
{{ quant.row_stats(0, "%mrow", "%sx0", "%fm0") }}
{{ gemv_loop("%xq", qt, "%mrow", "%sx0", "%fm0") }}
      }
%% else
      scf.for %mrow = %c0 to %m step %c1 {
{{ quant.quantize_row(kp, 0, "%mrow", "%buf", "%c0", bt, "%sx0", "%amc0") }}
          %fm0 = arith.mulf %amc0, %wscale : f32
{{ gemv_loop("%buf", bt, "%c0", "%sx0", "%fm0") }}
      }
%% endif
%% endcall
