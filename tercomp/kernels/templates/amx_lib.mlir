{# AMX tiles for the avx512 ternary kernel (ternary/amx.py says why and what was measured). #}
{#
  address: `dst`, the i64 address of memref `mem` (`mem_type`)'s first element (the
  bindings and the stack buffers here have offset 0), for the tile loads and stores,
  which take a pointer and a row stride in bytes.
#}
%% macro address(dst, mem, mem_type)
{{ dst }}x = memref.extract_aligned_pointer_as_index {{ mem }} : {{ mem_type }} -> index
{{ dst }} = arith.index_cast {{ dst }}x : index to i64
%% endmacro
{# tile ops: one 16-row x 64-byte tile of x86_amx at i64 address `addr` with row stride `stride` (i64). #}
%% macro tile_load(dst, addr, stride)
{{ dst }}p = llvm.inttoptr {{ addr }} : i64 to !llvm.ptr
{{ dst }} = llvm.call_intrinsic "llvm.x86.tileloadd64.internal"(%tr16, %tc64, {{ dst }}p, {{ stride }}) : (i16, i16, !llvm.ptr, i64) -> !llvm.x86_amx
%% endmacro
%% macro tile_store(src, addr, stride)
{{ src }}sp = llvm.inttoptr {{ addr }} : i64 to !llvm.ptr
llvm.call_intrinsic "llvm.x86.tilestored64.internal"(%tr16, %tc64, {{ src }}sp, {{ stride }}, {{ src }}) : (i16, i16, !llvm.ptr, i64, !llvm.x86_amx) -> ()
%% endmacro
{#
  transpose16: %{tag}3_{r} (r < 16) the rows of the transpose of the 16 x 16 matrix of
  i32 whose rows are `rows` (16 vector<16xi32> names): four stages, the one for bit s
  swapping bit s of the row index with bit s of the column index by one two-source
  shuffle a row (64 shuffles: vpermt2d).
#}
%% macro transpose16(tag, rows)
%%   set ns = namespace(lvl=rows)
%%   for s in (1, 2, 4, 8)
%%     set st = loop.index0
%%     set nxt = [none] * 16
%%     for r in range(16)
%%       if r % (2 * s) < s
%%         set lo_mask, hi_mask = [], []
%%         for j in range(16)
%%           set jx = j + s if j % (2 * s) < s else j - s
%%           do lo_mask.append(16 + jx if j % (2 * s) >= s else j)
%%           do hi_mask.append(16 + j if j % (2 * s) >= s else jx)
%%         endfor
%{{ tag }}{{ st }}_{{ r }} = vector.shuffle {{ ns.lvl[r] }}, {{ ns.lvl[r + s] }} {{ lo_mask }} : vector<16xi32>, vector<16xi32>
%{{ tag }}{{ st }}_{{ r + s }} = vector.shuffle {{ ns.lvl[r] }}, {{ ns.lvl[r + s] }} {{ hi_mask }} : vector<16xi32>, vector<16xi32>
%%         do nxt.__setitem__(r, "%%%s%d_%d" % (tag, st, r))
%%         do nxt.__setitem__(r + s, "%%%s%d_%d" % (tag, st, r + s))
%%       endif
%%     endfor
%%     set ns.lvl = nxt
%%   endfor
%% endmacro
{#
  amx_decode: weight rows %nt .. %nt + 16 na - 1, packed columns `kc0` .. + 16 kt, as
  kt x na A tiles of %dec (step t's tile a: 16 rows x 64 bytes, row i byte 4 kk + j
  holding plane j of the packed byte at column kc0 + 16 t + kk of row %nt + 16 a + i, an
  offset code u = w + 1 in 0..2): each 64-byte chunk of a row is spread into four
  steps' rows, each quarter by a vpermb (every byte four times) and a vpmultishiftqb
  (byte i of a qword from bit 8 i + 2 (i % 4)) and an and with 3.
#}
%% macro amx_decode(tag, kc0, kt, na, wt, dect)
          scf.for %di = %c0 to %arows step %c1 {
            %drow{{ tag }} = arith.addi %nt, %di : index
%%   for c in range(kt // 4)
            %dcol{{ tag }}_{{ c }} = affine.apply affine_map<(d0) -> (d0 + {{ 64 * c }})>({{ kc0 }})
            %draw{{ tag }}_{{ c }} = vector.load %w[%drow{{ tag }}, %dcol{{ tag }}_{{ c }}] : {{ wt }}, vector<64xi8>
%%     for q in range(4)
%%       set rep = []
%%       for i in range(64)
%%         do rep.append(16 * q + i // 4)
%%       endfor
            %drep{{ tag }}_{{ c }}_{{ q }} = vector.shuffle %draw{{ tag }}_{{ c }}, %draw{{ tag }}_{{ c }} {{ rep }} : vector<64xi8>, vector<64xi8>
            %dsh{{ tag }}_{{ c }}_{{ q }} = llvm.call_intrinsic "llvm.x86.avx512.pmultishift.qb.512"(%mshift, %drep{{ tag }}_{{ c }}_{{ q }}) : (vector<64xi8>, vector<64xi8>) -> vector<64xi8>
            %du{{ tag }}_{{ c }}_{{ q }} = arith.andi %dsh{{ tag }}_{{ c }}_{{ q }}, %three8 : vector<64xi8>
            vector.store %du{{ tag }}_{{ c }}_{{ q }}, %dec[%c{{ 4 * c + q }}t, %di, %c0] : {{ dect }}, vector<64xi8>
%%     endfor
%%   endfor
          }
%% endmacro
{#
  amx_products: for the blocks of 16 rows of x %mg .. %mg + gsize - 1 and the na tiles of
  16 weight rows, C tiles (16 weight rows x 16 rows of x, i32) += the chunk's A tiles
  (%dec) x the B tiles of x (%xv: block mb, packed columns kc0 + 16 t ..: 16 rows of 16
  x 4 codes, one 1 KB tile): each A tile meets gsize B tiles and each B tile na A tiles,
  each tile loaded just before its first product (A0 B0 AB A1 AB B1 AB AB: 20.7 against
  27.6 ns a tdpbusd with the four loads first, tdpbusd alone 9.3 ns, in a loop of 2 x 2
  blocks on L1-resident tiles; the 8 tile registers leave no room to load ahead).
  C is zero when `first`, else loaded from, and always stored back to, its 1 KB of %cbuf
  (tile (mb - %ms) na + a: row i holds the sums of weight row %nt + 16 a + i with the
  block's 16 rows of x, until amx_finish turns it round into y).
#}
%% macro amx_products(tag, kc0, kt, na, gsize, first)
%%   for g in range(gsize)
          %mb{{ tag }}_{{ g }} = affine.apply affine_map<(d0) -> (d0 + {{ g }})>(%mg)
          %mbi{{ tag }}_{{ g }} = arith.index_cast %mb{{ tag }}_{{ g }} : index to i64
          %xboff{{ tag }}_{{ g }} = arith.muli %mbi{{ tag }}_{{ g }}, %xbstride : i64
          %xb{{ tag }}_{{ g }} = arith.addi %xvbase, %xboff{{ tag }}_{{ g }} : i64
          %mbl{{ tag }}_{{ g }} = arith.subi %mbi{{ tag }}_{{ g }}, %msi : i64
          %crow{{ tag }}_{{ g }} = arith.muli %mbl{{ tag }}_{{ g }}, %cbstride : i64
          %cb{{ tag }}_{{ g }} = arith.addi %cbase, %crow{{ tag }}_{{ g }} : i64
%%     for a in range(na)
          %oaddr{{ tag }}_{{ a }}_{{ g }} = arith.addi %cb{{ tag }}_{{ g }}, %i64c{{ 1024 * a }} : i64
%%       if first
          %cz{{ tag }}_{{ a }}_{{ g }}_0 = llvm.call_intrinsic "llvm.x86.tilezero.internal"(%tr16, %tc64) : (i16, i16) -> !llvm.x86_amx
%%       else
          {{ tile_load("%%cz%s_%d_%d_0" % (tag, a, g), "%%oaddr%s_%d_%d" % (tag, a, g), "%i64c64") | indent(10) }}
%%       endif
%%     endfor
%%   endfor
          %kc0i{{ tag }} = arith.index_cast {{ kc0 }} : index to i64
          %kc0b{{ tag }} = arith.muli %kc0i{{ tag }}, %i64c64 : i64
%%   for t in range(kt)
%%     for g in range(gsize)
%%       if g == 0
          %aaddr{{ tag }}_{{ t }}_0 = arith.addi %decbase, %i64c{{ 1024 * na * t }} : i64
          {{ tile_load("%%ta%s_%d_0" % (tag, t), "%%aaddr%s_%d_0" % (tag, t), "%i64c64") | indent(10) }}
%%       endif
          %bo{{ tag }}_{{ t }}_{{ g }} = arith.addi %xb{{ tag }}_{{ g }}, %kc0b{{ tag }} : i64
          %baddr{{ tag }}_{{ t }}_{{ g }} = arith.addi %bo{{ tag }}_{{ t }}_{{ g }}, %i64c{{ 1024 * t }} : i64
          {{ tile_load("%%tb%s_%d_%d" % (tag, t, g), "%%baddr%s_%d_%d" % (tag, t, g), "%i64c64") | indent(10) }}
%%       for a in range(na)
%%         if g == 0 and a > 0
          %aaddr{{ tag }}_{{ t }}_{{ a }} = arith.addi %decbase, %i64c{{ 1024 * (na * t + a) }} : i64
          {{ tile_load("%%ta%s_%d_%d" % (tag, t, a), "%%aaddr%s_%d_%d" % (tag, t, a), "%i64c64") | indent(10) }}
%%         endif
          %cz{{ tag }}_{{ a }}_{{ g }}_{{ t + 1 }} = llvm.call_intrinsic "llvm.x86.tdpbusd.internal"(%tr16, %tc64, %tc64, %cz{{ tag }}_{{ a }}_{{ g }}_{{ t }}, %ta{{ tag }}_{{ t }}_{{ a }}, %tb{{ tag }}_{{ t }}_{{ g }}) : (i16, i16, i16, !llvm.x86_amx, !llvm.x86_amx, !llvm.x86_amx) -> !llvm.x86_amx
%%       endfor
%%     endfor
%%   endfor
%%   for g in range(gsize)
%%     for a in range(na)
          {{ tile_store("%%cz%s_%d_%d_%d" % (tag, a, g, kt), "%%oaddr%s_%d_%d" % (tag, a, g), "%i64c64") | indent(10) }}
%%     endfor
%%   endfor
%% endmacro
{#
  amx_chunk: packed columns `kc0` .. + 16 kt of weight rows %nt .. %nt + 16 na - 1
  decoded once (amx_decode) and multiplied with every whole block of 16 rows of x,
  `group` blocks at a time (group x na C tiles, na A and group B tiles: at most the 8 tile
  registers), the blocks left over one at a time.
#}
%% macro amx_chunk(tag, kc0, kt, first, na, group, wt, dect)
{{ amx_decode(tag, kc0, kt, na, wt, dect) }}
          scf.for %mg = %ms to %msg step %agroup {
{{ amx_products(tag ~ "g", kc0, kt, na, group, first) }}
          }
          scf.for %mg = %msg to %msend step %c1 {
{{ amx_products(tag ~ "o", kc0, kt, na, 1, first) }}
          }
%% endmacro
{#
  amx_finish: the C tiles of weight rows `col` .. + 15 (tile `a` of na) and the
  superblock's blocks of x turned round (transpose16: row i held the sums of weight row
  col + i) and dequantized into y: y[m, col + i] = (sum(u x) - sum(x)) * fm, as the GEMM
  loop's; the rows of a padded last block from M on are not stored.
#}
%% macro amx_finish(tag, a, na, col, ot, vf, ct)
          scf.for %mbf{{ tag }} = %ms to %msend step %c1 {
            %fm0r{{ tag }} = arith.muli %mbf{{ tag }}, %ac16 : index
            %fct{{ tag }} = affine.apply affine_map<(d0)[s0] -> ((d0 - s0) * {{ na }} + {{ a }})>(%mbf{{ tag }})[%ms]
%%   set rows = []
%%   for i in range(16)
            %fr{{ tag }}{{ i }} = affine.apply affine_map<(d0) -> (d0 + {{ i }})>(%fm0r{{ tag }})
            %fv{{ tag }}{{ i }} = vector.load %cbuf[%fct{{ tag }}, %c{{ i }}t, %c0] : {{ ct }}, vector<16xi32>
%%     do rows.append("%%fv%s%d" % (tag, i))
%%   endfor
{{ transpose16("ft" ~ tag ~ "_", rows) }}
            %flast{{ tag }} = arith.subi %m, %c1 : index
%%   for j in range(16)
            %fok{{ tag }}{{ j }} = arith.cmpi ult, %fr{{ tag }}{{ j }}, %m : index
            %frc{{ tag }}{{ j }} = arith.select %fok{{ tag }}{{ j }}, %fr{{ tag }}{{ j }}, %flast{{ tag }} : index
            %fsxf{{ tag }}{{ j }} = memref.load %xs[%frc{{ tag }}{{ j }}, %c0] : memref<?x2xf32>
            %fsx{{ tag }}{{ j }} = arith.fptosi %fsxf{{ tag }}{{ j }} : f32 to i32
            %famc{{ tag }}{{ j }} = memref.load %xs[%frc{{ tag }}{{ j }}, %c1] : memref<?x2xf32>
            %ffm{{ tag }}{{ j }} = arith.mulf %famc{{ tag }}{{ j }}, %wscale : f32
            %fsv{{ tag }}{{ j }} = vector.broadcast %fsx{{ tag }}{{ j }} : i32 to vector<16xi32>
            %ffv{{ tag }}{{ j }} = vector.broadcast %ffm{{ tag }}{{ j }} : f32 to {{ vf }}
            %fd{{ tag }}{{ j }} = arith.subi %ft{{ tag }}_3_{{ j }}, %fsv{{ tag }}{{ j }} : vector<16xi32>
            %ff{{ tag }}{{ j }} = arith.sitofp %fd{{ tag }}{{ j }} : vector<16xi32> to {{ vf }}
            %fy{{ tag }}{{ j }} = arith.mulf %ff{{ tag }}{{ j }}, %ffv{{ tag }}{{ j }} : {{ vf }}
            scf.if %fok{{ tag }}{{ j }} {
              vector.store %fy{{ tag }}{{ j }}, %o[%fr{{ tag }}{{ j }}, {{ col }}] : {{ ot }}, {{ vf }}
            }
%%   endfor
          }
%% endmacro
{#
  amx_gemm: the whole blocks of 16 rows of x (%nmb of them, %xv their B tiles) against
  the workgroup's weight rows %r0 .. %r1 (whole tiles of 16 na), `msuper` blocks at a
  time (their C tiles in a stack buffer, contiguous: no y row a tile row, whose stride
  cost a TLB miss a row at 512 rows of x), for each 16 na weight rows: K
  in chunks of `kc` packed columns (the first peeled: its C tiles start at zero), the
  last one shorter where kc does not divide kb; then amx_finish. Everything the tiles
  need is defined here but %o, %w, %xs, %xv, %wscale, %nmb and the index constants %c0,
  %c1.
#}
%% macro amx_gemm(kb, n, kc, na, group, msuper, wt, ot, vf, xvt)
%%   set dect = "memref<%dx%dx64xi8>" % (kc // 16, 16 * na)
%%   set ct = "memref<%dx16x16xi32>" % (msuper * na)
      %tr16 = arith.constant 16 : i16
      %tc64 = arith.constant 64 : i16
      %i64c64 = arith.constant 64 : i64
%%   for t in range(1, [na * kc // 16, na]|max)
      %i64c{{ 1024 * t }} = arith.constant {{ 1024 * t }} : i64
%%   endfor
      %i64c4 = arith.constant 4 : i64
      %i64c0 = arith.constant 0 : i64
%%   for t in range([kc // 16, 16]|max)
      %c{{ t }}t = arith.constant {{ t }} : index
%%   endfor
      %ac16 = arith.constant 16 : index
      %arows = arith.constant {{ 16 * na }} : index
      %agroup = arith.constant {{ group }} : index
      %akc = arith.constant {{ kc }} : index
      %three8 = arith.constant dense<3> : vector<64xi8>
%%   set ms = []
%%   for i in range(64)
%%     do ms.append((8 * (i % 8) + 2 * (i % 4)) % 64)
%%   endfor
      %mshift = arith.constant dense<{{ ms }}> : vector<64xi8>
      %cbstride = arith.constant {{ 1024 * na }} : i64
      %xbstride = arith.constant {{ 64 * kb }} : i64
      %amsuper = arith.constant {{ msuper }} : index
      %dec = "memref.alloca"() <{alignment = 64 : i64, operandSegmentSizes = array<i32: 0, 0>}> : () -> {{ dect }}
      %cbuf = "memref.alloca"() <{alignment = 64 : i64, operandSegmentSizes = array<i32: 0, 0>}> : () -> {{ ct }}
{{ address("%decbase", "%dec", dect) }}
{{ address("%cbase", "%cbuf", ct) }}
{{ address("%xvbase", "%xv", xvt) }}
      scf.for %ms = %c0 to %nmb step %amsuper {
      %msi = arith.index_cast %ms : index to i64
      %msend0 = arith.addi %ms, %amsuper : index
      %msend = arith.minui %msend0, %nmb : index
      %msn = arith.subi %msend, %ms : index
      %msg0 = arith.divui %msn, %agroup : index
      %msg1 = arith.muli %msg0, %agroup : index
      %msg = arith.addi %ms, %msg1 : index
      scf.for %nt = %r0 to %r1 step %arows {
%%   for a in range(na)
        %nta{{ a }} = affine.apply affine_map<(d0) -> (d0 + {{ 16 * a }})>(%nt)
%%   endfor
%%   set full = kb // kc
%%   set tail = kb % kc
%%   if full
{{ amx_chunk("f", "%c0", kc // 16, true, na, group, wt, dect) }}
%%     if full > 1
        %kcend = arith.constant {{ full * kc }} : index
        scf.for %kc0 = %akc to %kcend step %akc {
{{ amx_chunk("m", "%kc0", kc // 16, false, na, group, wt, dect) }}
        }
%%     endif
%%   endif
%%   if tail
        %kctail = arith.constant {{ full * kc }} : index
{{ amx_chunk("t", "%kctail", tail // 16, not full, na, group, wt, dect) }}
%%   endif
%%   for a in range(na)
{{ amx_finish("a%d" % a, a, na, "%%nta%d" % a, ot, vf, ct) }}
%%   endfor
      }
      }
%% endmacro
{#
  xv_block: block `mb` (rows `m0` .. + 15, those from `m` on zeros: a padded last block)
  of the quantized x %q (`qt`) laid out as B tiles in %xv (`xvt`): xv[mb, 64 c + 4 m + j]
  = q[m0 + m, c + j KB], so row c holds, for
  each of the block's 16 rows, the 4 codes that meet the 4 planes of packed weight column
  c. Per 16 columns: 64 loads of 16 codes, shuffles interleaving each row's 4 planes, a
  16 x 16 transpose of i32, 16 stores of 64 bytes.
#}
%% macro xv_block(mb, m0, kb, qt, xvt, m)
%%   set v16 = "vector<16xi8>"
%%   set pair, quad = [], []
%%   for i in range(32)
%%     do pair.append(i // 2 + 16 * (i % 2))
%%   endfor
%%   for i in range(64)
%%     do quad.append(2 * (i // 4) + i % 4 if i % 4 < 2 else 32 + 2 * (i // 4) + i % 4 - 2)
%%   endfor
        %xvkb = arith.constant {{ kb }} : index
        %xv16 = arith.constant 16 : index
        %xv0 = arith.constant 0 : index
        %xv1 = arith.constant 1 : index
        %xvlast = arith.subi {{ m }}, %xv1 : index
        %xvz = arith.constant dense<0> : {{ v16 }}
%%   for r in range(16)
        %xrow{{ r }} = affine.apply affine_map<(d0) -> (d0 + {{ r }})>({{ m0 }})
        %xok{{ r }} = arith.cmpi ult, %xrow{{ r }}, {{ m }} : index
        %xrc{{ r }} = arith.select %xok{{ r }}, %xrow{{ r }}, %xvlast : index
%%   endfor
        scf.for %xc = %xv0 to %xvkb step %xv16 {
%%   set cols = []
%%   for r in range(16)
%%     for j in range(4)
          %xk{{ r }}_{{ j }} = affine.apply affine_map<(d0) -> (d0 + {{ j * kb }})>(%xc)
          %xl{{ r }}_{{ j }} = vector.load %q[%xrc{{ r }}, %xk{{ r }}_{{ j }}] : {{ qt }}, {{ v16 }}
          %xp{{ r }}_{{ j }} = arith.select %xok{{ r }}, %xl{{ r }}_{{ j }}, %xvz : {{ v16 }}
%%     endfor
          %xa{{ r }} = vector.shuffle %xp{{ r }}_0, %xp{{ r }}_1 {{ pair }} : {{ v16 }}, {{ v16 }}
          %xb{{ r }} = vector.shuffle %xp{{ r }}_2, %xp{{ r }}_3 {{ pair }} : {{ v16 }}, {{ v16 }}
          %xcol8_{{ r }} = vector.shuffle %xa{{ r }}, %xb{{ r }} {{ quad }} : vector<32xi8>, vector<32xi8>
          %xcol{{ r }} = vector.bitcast %xcol8_{{ r }} : vector<64xi8> to vector<16xi32>
%%     do cols.append("%%xcol%d" % r)
%%   endfor
{{ transpose16("xt", cols) }}
%%   for kk in range(16)
          %xo{{ kk }} = vector.bitcast %xt3_{{ kk }} : vector<16xi32> to vector<64xi8>
          %xoff{{ kk }} = affine.apply affine_map<(d0) -> ((d0 + {{ kk }}) * 64)>(%xc)
          vector.store %xo{{ kk }}, %xv[{{ mb }}, %xoff{{ kk }}] : {{ xvt }}, vector<64xi8>
%%   endfor
        }
%% endmacro
{#
  permit: ask Linux for this process's permission to use AMX tile data
  (arch_prctl(ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18), syscall 158),
  granted once per process and idempotent. The dispatches that lay out x's B tiles run
  it, and they run before every AMX matmul of that x, so a module with the kernel runs
  in any process that loads it (iree-run-module, iree-benchmark-module), not only in
  tercomp's, which asks too (host.enable_amx). A syscall a workgroup.
#}
%% macro permit()
      %prctl_nr = llvm.mlir.constant(158 : i64) : i64
      %prctl_cmd = llvm.mlir.constant(4131 : i64) : i64
      %prctl_feat = llvm.mlir.constant(18 : i64) : i64
      %prctl = llvm.inline_asm has_side_effects "syscall", "={rax},{rax},{rdi},{rsi},~{rcx},~{r11},~{memory}" %prctl_nr, %prctl_cmd, %prctl_feat : (i64, i64, i64) -> i64
%% endmacro
