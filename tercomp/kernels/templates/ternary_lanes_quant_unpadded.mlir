{# params: name, kb, c, h, w, kh, kw, sh, sw, dh, dw, oh, ow, pt, pl, segs, blocks, eps, c127 #}
{#
  ternary_lanes_quant.mlir's dispatch (the avx512-tall kernel's q and stats, the same
  codes and layout) reading a convolution's UNPADDED input x [N, C, H, W] (flattened),
  its zero padding (pt rows above, pl columns left; any below / right) left to masked
  loads: a convolution's pad copy (a `slow_memcpy` dispatch into a zero-filled buffer)
  is not needed. Its absmax map a [N, H, W] (avx512_tall.amax_map of x) is read the
  same way (a padded position's |x| is 0, the identity of the max).

  The case it takes (avx512_tall.quantized): a KH x KW kernel (> 1), K = 4 kb (four
  whole planes) and kb a multiple of KH KW, so packed column cb = c' KH KW + t (t =
  i KW + j) holds the channels c' + p kb / (KH KW) (p = 0..3) at kernel position t in
  its four planes: the columns are walked c' outer, t inner (unrolled: each t with its
  own load masks, loop-invariant), in the order they are stored, and the offsets are
  c' H W + a constant (no table). (t outer, c' inner ran slower than the padded
  dispatch: a 32x32 channel plane is 4 KiB, so the 64 channels' lines of one position
  share an L1 set and were evicted before the next t read them.) A block's 16
  patch rows are `segs` (avx512_tall.segments: `count` runs of `w` output positions of
  one row, each a load of `span` floats of which every sw-th is kept, merged by
  `steps`); a run's load mask at t: its input row in [0, H), each lane's input column
  in [0, W) and the lane among the `need` a run reads.
#}
%% import "lib.mlir" as lib
%% set vol = c * h * w
%% set hw = h * w
%% set cq = kb // (kh * kw)
%% set vf, vi, vb = "vector<16xf32>", "vector<16xi32>", "vector<64xi8>"
%% set sp = segs.span
%% set spf, spi, spm = "vector<%dxf32>" % sp, "vector<%dxi32>" % sp, "vector<%dxi1>" % sp
%% set xt = "memref<?xf32>"
%% set qt = "memref<?x%dxi8>" % (64 * kb)
%% set st = "memref<?x32xf32>"
{# %v{tag}: the column at offset `off` (an index) from the runs' bases `bases`{r} in `mem`, under the masks of kernel position t #}
%% macro load(tag, mem, bases, off, t)
%%   for r in range(segs.count)
%g{{ tag }}_{{ r }}a = arith.addi {{ bases }}{{ r }}, {{ off }} : index
{{ "%v" ~ tag if not segs.steps else "%%g%s_%d" % (tag, r) }} = vector.maskedload {{ mem }}[%g{{ tag }}_{{ r }}a], %mk{{ t }}_{{ r }}, %szf : {{ xt }}, {{ spm }}, {{ spf }} into {{ spf }}
%%   endfor
%%   for d, a, b, mask, la, lb in segs.steps
{{ "%v" ~ tag if loop.last else "%%g%s_%d" % (tag, d) }} = vector.shuffle %g{{ tag }}_{{ a }}, %g{{ tag }}_{{ b }} [{{ mask|join(", ") }}] : vector<{{ la }}xf32>, vector<{{ lb }}xf32>
%%   endfor
%% endmacro
{# a run r's position: (image, output row, output column) of row d0 + r w #}
%% macro img(r)
((d0 + {{ r * segs.w }}) floordiv {{ oh * ow }})
%%- endmacro
%% macro orow(r)
(((d0 + {{ r * segs.w }}) mod {{ oh * ow }}) floordiv {{ ow }})
%%- endmacro
%% macro plus(v)
{{ "+ %d" % v if v >= 0 else "- %d" % -v }}
%%- endmacro
%% macro ocol(r)
((d0 + {{ r * segs.w }}) mod {{ ow }})
%%- endmacro
%% call lib.executable(name, "%bx: !stream.binding, %ba: !stream.binding, %bq: !stream.binding, %bs: !stream.binding, %nimg: index, %m: index", per_group=16 * blocks)
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c16 = arith.constant 16 : index
      %cblocks = arith.constant {{ blocks }} : index
      %ccq = arith.constant {{ cq }} : index
      %ch = arith.constant {{ h }} : index
      %eps = arith.constant dense<{{ eps }}> : {{ vf }}
      %c127 = arith.constant dense<{{ c127 }}> : {{ vf }}
      %zf = arith.constant dense<0.0> : {{ vf }}
      %zi = arith.constant dense<0> : {{ vi }}
      %ff = arith.constant dense<255> : {{ vi }}
%% for j in range(1, 4)
      %sh{{ j }} = arith.constant dense<{{ 8 * j }}> : {{ vi }}
%% endfor
      %szf = arith.constant dense<0.0> : {{ spf }}
      %iota = arith.constant dense<[{{ range(sp)|join(", ") }}]> : {{ spi }}
      %wv = arith.constant dense<{{ w }}> : {{ spi }}
      %needm = vector.constant_mask [{{ segs.need }}] : {{ spm }}
%% for j in range(kw)
      %cj{{ j }} = arith.constant {{ j * dw }} : i32
%% endfor
      %mb = arith.divui %m, %c16 : index
      %xlen = affine.apply affine_map<(d0) -> (d0 * {{ vol }})>(%nimg)
      %alen = affine.apply affine_map<(d0) -> (d0 * {{ hw }})>(%nimg)
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> {{ xt }}{%xlen}
      %xa = stream.binding.subspan %ba[%c0] : !stream.binding -> {{ xt }}{%alen}
      %q = stream.binding.subspan %bq[%c0] : !stream.binding -> {{ qt }}{%mb}
      %xs = stream.binding.subspan %bs[%c0] : !stream.binding -> {{ st }}{%mb}
      %wg = stream.dispatch.workgroup.id[0] : index
      %b0 = arith.muli %wg, %cblocks : index
      %b1u = arith.addi %b0, %cblocks : index
      %b1 = arith.minui %b1u, %mb : index
      scf.for %blk = %b0 to %b1 step %c1 {
        %row0 = arith.muli %blk, %c16 : index
%% for r in range(segs.count)
        %sb{{ r }} = affine.apply affine_map<(d0) -> ({{ img(r) }} * {{ vol }} + {{ orow(r) }} * {{ sh * w }} + {{ ocol(r) }} * {{ sw }} {{ plus(-(pt * w + pl)) }})>(%row0)
        %sab{{ r }} = affine.apply affine_map<(d0) -> ({{ img(r) }} * {{ hw }} + {{ orow(r) }} * {{ sh * w }} + {{ ocol(r) }} * {{ sw }} {{ plus(-(pt * w + pl)) }})>(%row0)
        %xr{{ r }} = affine.apply affine_map<(d0) -> ({{ ocol(r) }} * {{ sw }} {{ plus(-pl) }})>(%row0)
        %xri{{ r }} = arith.index_cast %xr{{ r }} : index to i32
        %xrb{{ r }} = vector.broadcast %xri{{ r }} : i32 to {{ spi }}
        %xrv{{ r }} = arith.addi %xrb{{ r }}, %iota : {{ spi }}
%%   for i in range(kh)
        %ry{{ i }}_{{ r }} = affine.apply affine_map<(d0) -> ({{ orow(r) }} * {{ sh }} {{ plus(i * dh - pt) }})>(%row0)
        %rok{{ i }}_{{ r }} = arith.cmpi ult, %ry{{ i }}_{{ r }}, %ch : index
        %rb{{ i }}_{{ r }} = vector.broadcast %rok{{ i }}_{{ r }} : i1 to {{ spm }}
        %rn{{ i }}_{{ r }} = arith.andi %rb{{ i }}_{{ r }}, %needm : {{ spm }}
%%   endfor
%%   for j in range(kw)
        %cjb{{ j }}_{{ r }} = vector.broadcast %cj{{ j }} : i32 to {{ spi }}
        %cx{{ j }}_{{ r }} = arith.addi %xrv{{ r }}, %cjb{{ j }}_{{ r }} : {{ spi }}
        %cok{{ j }}_{{ r }} = arith.cmpi ult, %cx{{ j }}_{{ r }}, %wv : {{ spi }}
%%   endfor
%%   for i in range(kh)
%%     for j in range(kw)
        %mk{{ i * kw + j }}_{{ r }} = arith.andi %rn{{ i }}_{{ r }}, %cok{{ j }}_{{ r }} : {{ spm }}
%%     endfor
%%   endfor
%% endfor
%% set na = namespace(a="%zf")
%% for i in range(kh)
%%   for j in range(kw)
%%     set t = i * kw + j
        %ao{{ t }} = arith.constant {{ i * dh * w + j * dw }} : index
        {{ load("a%d" % t, "%xa", "%sab", "%%ao%d" % t, t) | indent(8) }}
        %am{{ t }} = arith.maximumf {{ na.a }}, %va{{ t }} fastmath<nnan,nsz> : {{ vf }}
%%     set na.a = "%%am%d" % t
%%   endfor
%% endfor
        %amc = arith.maximumf {{ na.a }}, %eps : {{ vf }}
        %qs = arith.divf %c127, %amc : {{ vf }}
        %sumv = scf.for %cc = %c0 to %ccq step %c1 iter_args(%sa = %zi) -> ({{ vi }}) {
%% set ns = namespace(sum="%sa")
%% for i in range(kh)
%%   for j in range(kw)
%%     set t = i * kw + j
%%     for p in range(4)
          %o{{ t }}_{{ p }} = affine.apply affine_map<(d0) -> (d0 * {{ hw }} + {{ p * cq * hw + i * dh * w + j * dw }})>(%cc)
          {{ load("p%d_%d" % (t, p), "%x", "%sb", "%%o%d_%d" % (t, p), t) | indent(10) }}
          %sc{{ t }}_{{ p }} = arith.mulf %vp{{ t }}_{{ p }}, %qs : {{ vf }}
          %rd{{ t }}_{{ p }} = llvm.call_intrinsic "llvm.roundeven.v16f32"(%sc{{ t }}_{{ p }}) : ({{ vf }}) -> {{ vf }}
          %qi{{ t }}_{{ p }} = arith.fptosi %rd{{ t }}_{{ p }} : {{ vf }} to {{ vi }}
          %s{{ t }}_{{ p }} = arith.addi {{ ns.sum }}, %qi{{ t }}_{{ p }} : {{ vi }}
%%       set ns.sum = "%%s%d_%d" % (t, p)
          %qm{{ t }}_{{ p }} = arith.andi %qi{{ t }}_{{ p }}, %ff : {{ vi }}
%%       if p > 0
          %qsh{{ t }}_{{ p }} = arith.shli %qm{{ t }}_{{ p }}, %sh{{ p }} : {{ vi }}
          %d{{ t }}_{{ p }} = arith.ori {{ "%%qm%d_0" % t if p == 1 else "%%d%d_%d" % (t, p - 1) }}, %qsh{{ t }}_{{ p }} : {{ vi }}
%%       endif
%%     endfor
          %db{{ t }} = vector.bitcast %d{{ t }}_3 : {{ vi }} to {{ vb }}
          %qo{{ t }} = affine.apply affine_map<(d0) -> ((d0 * {{ kh * kw }} + {{ t }}) * 64)>(%cc)
          vector.store %db{{ t }}, %q[%blk, %qo{{ t }}] : {{ qt }}, {{ vb }}
%%   endfor
%% endfor
          scf.yield {{ ns.sum }} : {{ vi }}
        }
        %sumf = arith.sitofp %sumv : {{ vi }} to {{ vf }}
        vector.store %sumf, %xs[%blk, %c0] : {{ st }}, {{ vf }}
        vector.store %amc, %xs[%blk, %c16] : {{ st }}, {{ vf }}
      }
%% endcall
