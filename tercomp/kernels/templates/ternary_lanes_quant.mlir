{# params: name, kb, k, c, hp, wp, kh, kw, sh, sw, dh, dw, oh, ow, contiguous, segs, offsets, amap, blocks, eps, c127 #}
{#
  The quantize dispatch of the "avx512-tall" ternary kernel (ternary_avx512_tall.mlir):
  the rows of x quantized as ternary_pack.act_quant does (roundeven(x * (127 / max(amax,
  eps))) clipped to +-127, the same f32 operations in the same order as the avx2
  kernel's quantize dispatches, less the clip: |x| <= max(amax, eps) = a, so
  |x * fl(127 / a)| <= 127 (1 + 2^-24)^2, which rounds to at most 127.00002 and
  roundeven to 127: the clip never changes a code (a NaN stays a NaN either way)), 16
  rows at a time, one row a vector lane, into the
  tall kernel's layout: for block b of 16 rows and packed column cb (0 <= cb < kb),
  64 bytes q[b, cb] whose lane l (4 bytes) holds the codes of row 16 b + l at columns
  cb, cb + kb, cb + 2 kb, cb + 3 kb (the four planes of a packed weight byte; zero from
  column k on); stats[b] = 16 code sums (f32, exact below 2^24), then 16 max(amax, eps).
  Both are the byte sizes of the avx2 quantize dispatch's q [M, 4 kb] and stats [M, 2].

  x is a convolution's padded input [N, C, HP, WP] flattened (M = N * OH * OW patch
  rows, column (c KH + i) KW + j of row (n, y, x) at x[n, c, y sh + i dh, x sw + j dw]),
  or a plain x [M, K] as the same with C = K and 1x1 images and kernel. A column of a
  block is a vector load where its 16 rows are 16 consecutive positions of one output
  row at stride 1 (`contiguous`: OW % 16 == 0, sw == 1). Otherwise, where the block
  is whole runs of one output row (`segs`: OW % 16 == 0 at a stride, or OW = 4 or 8,
  16 / OW output rows a block), a column is `segs.count` loads of `segs.span` floats
  (masked to the (w - 1) sw + 1 the run reads) merged by `segs.steps`' shuffles (each
  (dst, a, b, mask, len a, len b); the last one's dst is the column): the host's gathers
  run at ~1/4 the rate of loads and shuffles (a plain x [M, K], OW = 1, still gathers).
  Every block lies in one image (OH OW % 16 == 0: the kernel row's condition on M).
  A column's offset in the image is `offsets[col]`, a constant table in the module.
  (A 3x3 conv of 64+ channels takes ternary_lanes_quant_unpadded.mlir instead: the
  input before its padding, no pad copy.)

  With `amap`, a second input a [N, HP, WP] holds max over the channels of |x| at each
  padded position (avx512_tall.amax_map), and a row's absmax is the max of a over the
  kernel's KH KW positions (the same number: max is exact and associative), so the
  absmax reads KH KW values a row instead of K.
#}
%% import "lib.mlir" as lib
%% set kp = 4 * kb
%% set vol = c * hp * wp
%% set vf, vi, vb, vm = "vector<16xf32>", "vector<16xi32>", "vector<64xi8>", "vector<16xi1>"
%% set xt = "memref<?xf32>"
%% set qt = "memref<?x%dxi8>" % (64 * kb)
%% set st = "memref<?x32xf32>"
%% set ot = "memref<%dxi32>" % k
{# the 16 values of column `col` (an index) of the block: %v{tag} #}
%% macro column(tag, col)
%oi{{ tag }} = memref.load %off[{{ col }}] : {{ ot }}
%o{{ tag }} = arith.index_cast %oi{{ tag }} : i32 to index
%% if contiguous
%a{{ tag }} = arith.addi %base, %o{{ tag }} : index
%v{{ tag }} = vector.load %x[%a{{ tag }}] : {{ xt }}, {{ vf }}
%% elif segs
{{ seg_load(tag, "%x", "%sb", "%o" ~ tag) }}
%% else
%v{{ tag }} = vector.gather %x[%o{{ tag }}][%lbv], %all, %zf : {{ xt }}, {{ vi }}, {{ vm }}, {{ vf }} into {{ vf }}
%% endif
%% endmacro
{# %v{tag}: the column at offset `off` (an index) from the segments' bases `bases`{r} in `mem` #}
%% macro seg_load(tag, mem, bases, off)
%%   set st = "vector<%dxf32>" % segs.span
%%   for r in range(segs.count)
%g{{ tag }}_{{ r }}a = arith.addi {{ bases }}{{ r }}, {{ off }} : index
%%     if segs.masked
%g{{ tag }}_{{ r }} = vector.maskedload {{ mem }}[%g{{ tag }}_{{ r }}a], %smask, %szf : {{ xt }}, vector<{{ segs.span }}xi1>, {{ st }} into {{ st }}
%%     else
%g{{ tag }}_{{ r }} = vector.load {{ mem }}[%g{{ tag }}_{{ r }}a] : {{ xt }}, {{ st }}
%%     endif
%%   endfor
%%   for d, a, b, mask, la, lb in segs.steps
{{ "%v" ~ tag if loop.last else "%%g%s_%d" % (tag, d) }} = vector.shuffle %g{{ tag }}_{{ a }}, %g{{ tag }}_{{ b }} [{{ mask|join(", ") }}] : vector<{{ la }}xf32>, vector<{{ lb }}xf32>
%%   endfor
%% endmacro
%% set lims = []
%% set na = namespace(a="%zf")
%% for j in range(4)
%%   do lims.append([[k - j * kb, kb]|min, 0]|max)
%% endfor
%% set cuts = ([0, kb] + lims)|unique|sort
%% set abind = "%ba: !stream.binding, " if amap else ""
%% set prelude = '    memref.global "private" constant @%s_off : %s = dense<[%s]>' % (name, ot, offsets|join(", "))
%% call lib.executable(name, "%bx: !stream.binding, " ~ abind ~ "%bq: !stream.binding, %bs: !stream.binding, %nimg: index, %m: index", per_group=16 * blocks, prelude=prelude)
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c16 = arith.constant 16 : index
      %cblocks = arith.constant {{ blocks }} : index
      %ck = arith.constant {{ k }} : index
      %c4 = arith.constant 4 : index
      %ck4 = arith.constant {{ k - k % 4 }} : index
      %eps = arith.constant dense<{{ eps }}> : {{ vf }}
      %c127 = arith.constant dense<{{ c127 }}> : {{ vf }}
      %zf = arith.constant dense<0.0> : {{ vf }}
      %zi = arith.constant dense<0> : {{ vi }}
      %ff = arith.constant dense<255> : {{ vi }}
%% for j in range(1, 4)
      %sh{{ j }} = arith.constant dense<{{ 8 * j }}> : {{ vi }}
%% endfor
      %all = vector.constant_mask [16] : {{ vm }}
      %mb = arith.divui %m, %c16 : index
      %xlen = affine.apply affine_map<(d0) -> (d0 * {{ vol }})>(%nimg)
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> {{ xt }}{%xlen}
      %q = stream.binding.subspan %bq[%c0] : !stream.binding -> {{ qt }}{%mb}
      %xs = stream.binding.subspan %bs[%c0] : !stream.binding -> {{ st }}{%mb}
%% if amap
      %alen = affine.apply affine_map<(d0) -> (d0 * {{ hp * wp }})>(%nimg)
      %xa = stream.binding.subspan %ba[%c0] : !stream.binding -> {{ xt }}{%alen}
%% endif
      %off = memref.get_global @{{ name }}_off : {{ ot }}
%% if segs and segs.masked
      %smask = vector.constant_mask [{{ segs.need }}] : vector<{{ segs.span }}xi1>
      %szf = arith.constant dense<0.0> : vector<{{ segs.span }}xf32>
%% endif
%% if not contiguous and not segs
      %lb = memref.alloca() : memref<16xi32>
%%   if amap
      %lba = memref.alloca() : memref<16xi32>
%%   endif
%% endif
      %wg = stream.dispatch.workgroup.id[0] : index
      %b0 = arith.muli %wg, %cblocks : index
      %b1u = arith.addi %b0, %cblocks : index
      %b1 = arith.minui %b1u, %mb : index
      scf.for %blk = %b0 to %b1 step %c1 {
%% if contiguous or segs
        %row0 = arith.muli %blk, %c16 : index
%% endif
%% if contiguous
        %base = affine.apply affine_map<(d0) -> ((d0 floordiv {{ oh * ow }}) * {{ vol }} + ((d0 mod {{ oh * ow }}) floordiv {{ ow }}) * {{ sh * wp }} + (d0 mod {{ ow }}) * {{ sw }})>(%row0)
%% elif segs
%%   for r in range(segs.count)
        %sb{{ r }} = affine.apply affine_map<(d0) -> (((d0 + {{ r * segs.w }}) floordiv {{ oh * ow }}) * {{ vol }} + (((d0 + {{ r * segs.w }}) mod {{ oh * ow }}) floordiv {{ ow }}) * {{ sh * wp }} + ((d0 + {{ r * segs.w }}) mod {{ ow }}) * {{ sw }})>(%row0)
%%     if amap
        %sab{{ r }} = affine.apply affine_map<(d0) -> (((d0 + {{ r * segs.w }}) floordiv {{ oh * ow }}) * {{ hp * wp }} + (((d0 + {{ r * segs.w }}) mod {{ oh * ow }}) floordiv {{ ow }}) * {{ sh * wp }} + ((d0 + {{ r * segs.w }}) mod {{ ow }}) * {{ sw }})>(%row0)
%%     endif
%%   endfor
%% else
        scf.for %l = %c0 to %c16 step %c1 {
          %row = affine.apply affine_map<(d0, d1) -> (d0 * 16 + d1)>(%blk, %l)
          %lbase = affine.apply affine_map<(d0) -> ((d0 floordiv {{ oh * ow }}) * {{ vol }} + ((d0 mod {{ oh * ow }}) floordiv {{ ow }}) * {{ sh * wp }} + (d0 mod {{ ow }}) * {{ sw }})>(%row)
          %lbi = arith.index_cast %lbase : index to i32
          memref.store %lbi, %lb[%l] : memref<16xi32>
%%   if amap
          %labase = affine.apply affine_map<(d0) -> ((d0 floordiv {{ oh * ow }}) * {{ hp * wp }} + ((d0 mod {{ oh * ow }}) floordiv {{ ow }}) * {{ sh * wp }} + (d0 mod {{ ow }}) * {{ sw }})>(%row)
          %labi = arith.index_cast %labase : index to i32
          memref.store %labi, %lba[%l] : memref<16xi32>
%%   endif
        }
        %lbv = vector.load %lb[%c0] : memref<16xi32>, {{ vi }}
%%   if amap
        %lbav = vector.load %lba[%c0] : memref<16xi32>, {{ vi }}
%%   endif
%% endif
%% if amap
%%   if contiguous
        %abase = affine.apply affine_map<(d0) -> ((d0 floordiv {{ oh * ow }}) * {{ hp * wp }} + ((d0 mod {{ oh * ow }}) floordiv {{ ow }}) * {{ sh * wp }} + (d0 mod {{ ow }}) * {{ sw }})>(%row0)
%%   endif
%%   for i in range(kh)
%%     for j in range(kw)
%%       set t = i * kw + j
%%       if contiguous
        %aa{{ t }} = affine.apply affine_map<(d0) -> (d0 + {{ i * dh * wp + j * dw }})>(%abase)
        %va{{ t }} = vector.load %xa[%aa{{ t }}] : {{ xt }}, {{ vf }}
%%       elif segs
        %ao{{ t }} = arith.constant {{ i * dh * wp + j * dw }} : index
        {{ seg_load("a%d" % t, "%xa", "%sab", "%%ao%d" % t) | indent(8) }}
%%       else
        %ao{{ t }} = arith.constant {{ i * dh * wp + j * dw }} : index
        %va{{ t }} = vector.gather %xa[%ao{{ t }}][%lbav], %all, %zf : {{ xt }}, {{ vi }}, {{ vm }}, {{ vf }} into {{ vf }}
%%       endif
        %am{{ t }} = arith.maximumf {{ na.a }}, %va{{ t }} fastmath<nnan,nsz> : {{ vf }}
%%       set na.a = "%%am%d" % t
%%     endfor
%%   endfor
        %amc = arith.maximumf {{ na.a }}, %eps : {{ vf }}
%% else
        %am:4 = scf.for %col = %c0 to %ck4 step %c4 iter_args(%a0 = %zf, %a1 = %zf, %a2 = %zf, %a3 = %zf) -> ({{ vf }}, {{ vf }}, {{ vf }}, {{ vf }}) {
%% for u in range(4)
          %cu{{ u }} = affine.apply affine_map<(d0) -> (d0 + {{ u }})>(%col)
          {{ column("a%d" % u, "%%cu%d" % u) | indent(10) }}
          %av{{ u }} = math.absf %va{{ u }} : {{ vf }}
          %an{{ u }} = arith.maximumf %a{{ u }}, %av{{ u }} fastmath<nnan,nsz> : {{ vf }}
%% endfor
          scf.yield %an0, %an1, %an2, %an3 : {{ vf }}, {{ vf }}, {{ vf }}, {{ vf }}
        }
        %am01 = arith.maximumf %am#0, %am#1 fastmath<nnan,nsz> : {{ vf }}
        %am23 = arith.maximumf %am#2, %am#3 fastmath<nnan,nsz> : {{ vf }}
        %am4 = arith.maximumf %am01, %am23 fastmath<nnan,nsz> : {{ vf }}
        %amv = scf.for %col = %ck4 to %ck step %c1 iter_args(%a = %am4) -> ({{ vf }}) {
          {{ column("a", "%col") | indent(10) }}
          %av = math.absf %va : {{ vf }}
          %an = arith.maximumf %a, %av fastmath<nnan,nsz> : {{ vf }}
          scf.yield %an : {{ vf }}
        }
        %amc = arith.maximumf %amv, %eps : {{ vf }}
%% endif
        %qs = arith.divf %c127, %amc : {{ vf }}
%% set ns = namespace(sum="%zi")
%% for s in range(cuts|length - 1)
%%   set lo_c, hi_c = cuts[s], cuts[s + 1]
%%   set planes = []
%%   for j in range(4)
%%     if lims[j] >= hi_c
%%       do planes.append(j)
%%     endif
%%   endfor
%%   set acc = namespace(d="", s="%sa")
%%   if planes
        %cl{{ s }} = arith.constant {{ lo_c }} : index
        %ch{{ s }} = arith.constant {{ hi_c }} : index
        %sum{{ s }} = scf.for %cb = %cl{{ s }} to %ch{{ s }} step %c1 iter_args(%sa = {{ ns.sum }}) -> ({{ vi }}) {
%%     for j in planes
          %col{{ j }} = affine.apply affine_map<(d0) -> (d0 + {{ j * kb }})>(%cb)
          {{ column("p%d" % j, "%%col%d" % j) | indent(10) }}
          %sc{{ j }} = arith.mulf %vp{{ j }}, %qs : {{ vf }}
          %rd{{ j }} = llvm.call_intrinsic "llvm.roundeven.v16f32"(%sc{{ j }}) : ({{ vf }}) -> {{ vf }}
          %qi{{ j }} = arith.fptosi %rd{{ j }} : {{ vf }} to {{ vi }}
          %s{{ j }} = arith.addi {{ acc.s }}, %qi{{ j }} : {{ vi }}
%%       set acc.s = "%%s%d" % j
          %qm{{ j }} = arith.andi %qi{{ j }}, %ff : {{ vi }}
%%       if j == 0
%%         set acc.d = "%qm0"
%%       else
          %qsh{{ j }} = arith.shli %qm{{ j }}, %sh{{ j }} : {{ vi }}
          %d{{ j }} = arith.ori {{ acc.d }}, %qsh{{ j }} : {{ vi }}
%%         set acc.d = "%%d%d" % j
%%       endif
%%     endfor
          %db = vector.bitcast {{ acc.d }} : {{ vi }} to {{ vb }}
          %qo = affine.apply affine_map<(d0) -> (d0 * 64)>(%cb)
          vector.store %db, %q[%blk, %qo] : {{ qt }}, {{ vb }}
          scf.yield {{ acc.s }} : {{ vi }}
        }
%%     set ns.sum = "%%sum%d" % s
%%   endif
%% endfor
%% if lims[0] < kb
        %zb = arith.constant dense<0> : {{ vb }}
        %cz = arith.constant {{ lims[0] }} : index
        %ckb = arith.constant {{ kb }} : index
        scf.for %cb = %cz to %ckb step %c1 {
          %qo = affine.apply affine_map<(d0) -> (d0 * 64)>(%cb)
          vector.store %zb, %q[%blk, %qo] : {{ qt }}, {{ vb }}
        }
%% endif
        %sumf = arith.sitofp {{ ns.sum }} : {{ vi }} to {{ vf }}
        vector.store %sumf, %xs[%blk, %c0] : {{ st }}, {{ vf }}
        vector.store %amc, %xs[%blk, %c16] : {{ st }}, {{ vf }}
      }
%% endcall
