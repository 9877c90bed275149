{# params: name, n, kb, kq, offset, positions, rows, blocks, groups #}
{#
  The "avx512-tall" ternary matmul (see ternary/avx512_tall.py for the why): rows of x
  in the vector lanes, for M much larger than N. x comes from ternary_lanes_quant.mlir's
  dispatch: q [M / 16, kb, 64] i8 (lane l of q[b, cb] the 4 codes of row 16 b + l at
  columns cb + j kb, j = 0..3) and stats [M / 16, 32] f32 (16 code sums, 16 max(amax,
  eps)). The workgroup decodes `rows` packed weight rows (offset codes u = w + 1, four
  2-bit planes a byte; signed codes remapped to them first, as the avx512 kernel does) into one i32 a column (byte j = plane j: the same 4 columns as a
  lane of q) on its stack, then for each `blocks` blocks of 16 rows of x runs

      acc[r][b] += vpdpbusd(broadcast(wdec[r, cb]), q[b, cb])   for cb < kb

  (u8 x s8 products, 4 to an i32 lane, each lane one row of x: no horizontal sum), and
  y[16 b + l, r] = (acc[r][b][l] - sum_l) * amc_l * wscale, stored transposed (`rows`
  floats a row); with `positions` (P, a multiple of 16: x the patch rows of a
  convolution, M = images x P) y is stored as [M / P, N, P] instead, a block's 16 lanes
  16 neighbouring floats (the convolution's NCHW output, no transpose after it). Workgroups split M, `groups` superblocks of `blocks` blocks each; all of
  N is done by each, its weights (N x kb bytes) read from L1/L2 for every superblock.

  `kq` (<= kb) is the columns of q: the products run over 4 kq columns of K, not the
  packed 4 kb. Where K is padded far past itself (padded_k: 576 -> 768, whose fourth
  plane is all padding) x is quantized in planes of kq = K / 4 rounded up to 16 columns
  and the decode regroups the weights to match: byte j of wdec[r, c] is the code of
  column c + j kq, read from packed byte (c + j kq) mod kb, plane (c + j kq) div kb (a
  chunk of 16 columns never crosses a plane: kb and kq multiples of 16). Codes past K
  meet zeros of q, so any code there adds nothing.
#}
%% import "lib.mlir" as lib
%% set v8, v32, vf = "vector<64xi8>", "vector<16xi32>", "vector<16xf32>"
%% set dp = 'llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"'
%% set dpt = "(%s, %s, %s) -> %s" % (v32, v8, v8, v32)
%% set qt = "memref<?x%dxi8>" % (64 * kq)
%% set st = "memref<?x32xf32>"
%% set wt = "memref<%dx%dxi8>" % (n, kb)
%% set ot = "memref<?x%dx%dxf32>" % (n, positions) if positions else "memref<?x%dxf32>" % n
%% set bt = "memref<%dx%dxi32>" % (rows, kq)
%% set tt, trt, vr = "vector<%dx16xf32>" % rows, "vector<16x%dxf32>" % rows, "vector<%dxf32>" % rows
{# superblock: `nb` blocks of 16 rows of x from block %sb on against weight rows %rg .. %rg + rows (decoded in %wdec) #}
%% macro superblock(nb)
%%   set pairs = []
%%   for r in range(rows)
%%     for b in range(nb)
%%       do pairs.append((r, b))
%%     endfor
%%   endfor
%%   set t32 = ([v32] * (pairs|length))|join(", ")
%%   for b in range(nb)
          %blk{{ b }} = affine.apply affine_map<(d0) -> (d0 + {{ b }})>(%sb)
%%   endfor
          %acc:{{ pairs|length }} = scf.for %cb = %c0 to %ckq step %c1 iter_args(<% for r, b in pairs %>%a{{ r }}_{{ b }} = %z32{{ ", " if not loop.last }}<% endfor %>) -> ({{ t32 }}) {
            %qo = affine.apply affine_map<(d0) -> (d0 * 64)>(%cb)
%%   for b in range(nb)
            %x{{ b }} = vector.load %xq[%blk{{ b }}, %qo] : {{ qt }}, {{ v8 }}
%%   endfor
%%   for r in range(rows)
            %ws{{ r }} = memref.load %wdec[%c{{ r }}, %cb] : {{ bt }}
            %wv{{ r }} = vector.broadcast %ws{{ r }} : i32 to {{ v32 }}
            %w{{ r }} = vector.bitcast %wv{{ r }} : {{ v32 }} to {{ v8 }}
%%   endfor
%%   for r, b in pairs
            %n{{ r }}_{{ b }} = {{ dp }}(%a{{ r }}_{{ b }}, %w{{ r }}, %x{{ b }}) : {{ dpt }}
%%   endfor
            scf.yield <% for r, b in pairs %>%n{{ r }}_{{ b }}{{ ", " if not loop.last }}<% endfor %> : {{ t32 }}
          }
%%   for b in range(nb)
          %sxf{{ b }} = vector.load %xs[%blk{{ b }}, %c0] : {{ st }}, {{ vf }}
          %sx{{ b }} = arith.fptosi %sxf{{ b }} : {{ vf }} to {{ v32 }}
          %amc{{ b }} = vector.load %xs[%blk{{ b }}, %c16] : {{ st }}, {{ vf }}
          %fm{{ b }} = arith.mulf %amc{{ b }}, %wsv : {{ vf }}
%%     set ns = namespace(t="%ztile")
%%     if positions
          %row{{ b }} = affine.apply affine_map<(d0) -> (d0 * 16)>(%blk{{ b }})
          %img{{ b }} = affine.apply affine_map<(d0) -> (d0 floordiv {{ positions }})>(%row{{ b }})
          %pos{{ b }} = affine.apply affine_map<(d0) -> (d0 mod {{ positions }})>(%row{{ b }})
%%     endif
%%     for r in range(rows)
          %d{{ r }}_{{ b }} = arith.subi %acc#{{ r * nb + b }}, %sx{{ b }} : {{ v32 }}
          %f{{ r }}_{{ b }} = arith.sitofp %d{{ r }}_{{ b }} : {{ v32 }} to {{ vf }}
          %y{{ r }}_{{ b }} = arith.mulf %f{{ r }}_{{ b }}, %fm{{ b }} : {{ vf }}
%%       if positions
          %oc{{ r }}_{{ b }} = affine.apply affine_map<(d0) -> (d0 + {{ r }})>(%rg)
          vector.store %y{{ r }}_{{ b }}, %o[%img{{ b }}, %oc{{ r }}_{{ b }}, %pos{{ b }}] : {{ ot }}, {{ vf }}
%%       else
          %t{{ r }}_{{ b }} = vector.insert %y{{ r }}_{{ b }}, {{ ns.t }} [{{ r }}] : {{ vf }} into {{ tt }}
%%         set ns.t = "%%t%d_%d" % (r, b)
%%       endif
%%     endfor
%%     if not positions
          %tr{{ b }} = vector.transpose {{ ns.t }}, [1, 0] : {{ tt }} to {{ trt }}
          %row{{ b }} = affine.apply affine_map<(d0) -> (d0 * 16)>(%blk{{ b }})
%%       for l in range(16)
          %e{{ b }}_{{ l }} = vector.extract %tr{{ b }}[{{ l }}] : {{ vr }} from {{ trt }}
          %or{{ b }}_{{ l }} = affine.apply affine_map<(d0) -> (d0 + {{ l }})>(%row{{ b }})
          vector.store %e{{ b }}_{{ l }}, %o[%or{{ b }}_{{ l }}, %rg] : {{ ot }}, {{ vr }}
%%       endfor
%%     endif
%%   endfor
%% endmacro
%% call lib.executable(name, "%bq: !stream.binding, %bs: !stream.binding, %bw: !stream.binding, %bo: !stream.binding, %wscale: f32, %m: index", per_group=16 * blocks * groups)
      %c0 = arith.constant 0 : index
%% for r in range(1, rows)
      %c{{ r }} = arith.constant {{ r }} : index
%% endfor
%% if rows <= 1
      %c1 = arith.constant 1 : index
%% endif
      %c16 = arith.constant 16 : index
      %cn = arith.constant {{ n }} : index
      %ckb = arith.constant {{ kb }} : index
      %ckq = arith.constant {{ kq }} : index
      %crows = arith.constant {{ rows }} : index
      %cnb = arith.constant {{ blocks }} : index
      %cper = arith.constant {{ blocks * groups }} : index
      %z32 = arith.constant dense<0> : {{ v32 }}
      %ztile = arith.constant dense<0.0> : {{ tt }}
      %m3 = arith.constant dense<50529027> : {{ v32 }}
      %s6 = arith.constant dense<6> : {{ v32 }}
%% if not offset
      %m55 = arith.constant dense<85> : {{ v32 }}
      %s1 = arith.constant dense<1> : {{ v32 }}
%% endif
      %s12 = arith.constant dense<12> : {{ v32 }}
      %s18 = arith.constant dense<18> : {{ v32 }}
%% if kq < kb
      %c3v = arith.constant dense<3> : {{ v32 }}
      %b8 = arith.constant dense<8> : {{ v32 }}
      %b16 = arith.constant dense<16> : {{ v32 }}
      %b24 = arith.constant dense<24> : {{ v32 }}
%% endif
%% if kb % 16
      %zb16 = arith.constant dense<0> : vector<16xi8>
%% endif
      %wsv = vector.broadcast %wscale : f32 to {{ vf }}
      %mb = arith.divui %m, %c16 : index
      %xq = stream.binding.subspan %bq[%c0] : !stream.binding -> {{ qt }}{%mb}
      %xs = stream.binding.subspan %bs[%c0] : !stream.binding -> {{ st }}{%mb}
      %w = stream.binding.subspan %bw[%c0] : !stream.binding -> {{ wt }}
%% if positions
      %cpos = arith.constant {{ positions }} : index
      %nimg = arith.divui %m, %cpos : index
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {{ ot }}{%nimg}
%% else
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {{ ot }}{%m}
%% endif
      %wdec = memref.alloca() : {{ bt }}
      %wg = stream.dispatch.workgroup.id[0] : index
      %b0 = arith.muli %wg, %cper : index
      %b1u = arith.addi %b0, %cper : index
      %b1 = arith.minui %b1u, %mb : index
      %nall = arith.subi %b1, %b0 : index
      %nsb = arith.divui %nall, %cnb : index
      %nfb = arith.muli %nsb, %cnb : index
      %bfull = arith.addi %b0, %nfb : index
      scf.for %rg = %c0 to %cn step %crows {
%% if kq < kb
        scf.for %cd = %c0 to %ckq step %c16 {
%%   for j in range(4)
          %cc{{ j }} = affine.apply affine_map<(d0) -> (d0 + {{ j * kq }})>(%cd)
          %pb{{ j }} = affine.apply affine_map<(d0) -> (d0 mod {{ kb }})>(%cc{{ j }})
          %pl{{ j }} = affine.apply affine_map<(d0) -> ((d0 floordiv {{ kb }}) * 2)>(%cc{{ j }})
          %pli{{ j }} = arith.index_cast %pl{{ j }} : index to i32
          %psh{{ j }} = vector.broadcast %pli{{ j }} : i32 to {{ v32 }}
%%   endfor
%%   for r in range(rows)
          %r{{ r }} = affine.apply affine_map<(d0) -> (d0 + {{ r }})>(%rg)
%%     for j in range(4)
          %u{{ r }}_{{ j }} = vector.load %w[%r{{ r }}, %pb{{ j }}] : {{ wt }}, vector<16xi8>
%%       if offset
          %z{{ r }}_{{ j }} = arith.extui %u{{ r }}_{{ j }} : vector<16xi8> to {{ v32 }}
%%       else
          %raw{{ r }}_{{ j }} = arith.extui %u{{ r }}_{{ j }} : vector<16xi8> to {{ v32 }}
          %lo{{ r }}_{{ j }} = arith.andi %raw{{ r }}_{{ j }}, %m55 : {{ v32 }}
          %hs{{ r }}_{{ j }} = arith.shrui %raw{{ r }}_{{ j }}, %s1 : {{ v32 }}
          %hi{{ r }}_{{ j }} = arith.andi %hs{{ r }}_{{ j }}, %m55 : {{ v32 }}
          %lp{{ r }}_{{ j }} = arith.addi %lo{{ r }}_{{ j }}, %m55 : {{ v32 }}
          %z{{ r }}_{{ j }} = arith.subi %lp{{ r }}_{{ j }}, %hi{{ r }}_{{ j }} : {{ v32 }}
%%       endif
          %e{{ r }}_{{ j }} = arith.shrui %z{{ r }}_{{ j }}, %psh{{ j }} : {{ v32 }}
          %f{{ r }}_{{ j }} = arith.andi %e{{ r }}_{{ j }}, %c3v : {{ v32 }}
%%       if j
          %g{{ r }}_{{ j }} = arith.shli %f{{ r }}_{{ j }}, %b{{ 8 * j }} : {{ v32 }}
%%       endif
%%     endfor
          %o1_{{ r }} = arith.ori %f{{ r }}_0, %g{{ r }}_1 : {{ v32 }}
          %o2_{{ r }} = arith.ori %g{{ r }}_2, %g{{ r }}_3 : {{ v32 }}
          %dec{{ r }} = arith.ori %o1_{{ r }}, %o2_{{ r }} : {{ v32 }}
          vector.store %dec{{ r }}, %wdec[%c{{ r }}, %cd] : {{ bt }}, {{ v32 }}
%%   endfor
        }
%% else
        scf.for %cd = %c0 to %ckb step %c16 {
%% if kb % 16
          %left = arith.subi %ckb, %cd : index
          %dmask = vector.create_mask %left : vector<16xi1>
%% endif
%% for r in range(rows)
          %r{{ r }} = affine.apply affine_map<(d0) -> (d0 + {{ r }})>(%rg)
%% if kb % 16
          %u{{ r }} = vector.maskedload %w[%r{{ r }}, %cd], %dmask, %zb16 : {{ wt }}, vector<16xi1>, vector<16xi8> into vector<16xi8>
%% else
          %u{{ r }} = vector.load %w[%r{{ r }}, %cd] : {{ wt }}, vector<16xi8>
%% endif
%% if offset
          %z{{ r }} = arith.extui %u{{ r }} : vector<16xi8> to {{ v32 }}
%% else
          %raw{{ r }} = arith.extui %u{{ r }} : vector<16xi8> to {{ v32 }}
          %lo{{ r }} = arith.andi %raw{{ r }}, %m55 : {{ v32 }}
          %hs{{ r }} = arith.shrui %raw{{ r }}, %s1 : {{ v32 }}
          %hi{{ r }} = arith.andi %hs{{ r }}, %m55 : {{ v32 }}
          %lp{{ r }} = arith.addi %lo{{ r }}, %m55 : {{ v32 }}
          %z{{ r }} = arith.subi %lp{{ r }}, %hi{{ r }} : {{ v32 }}
%% endif
          %t6_{{ r }} = arith.shli %z{{ r }}, %s6 : {{ v32 }}
          %t12_{{ r }} = arith.shli %z{{ r }}, %s12 : {{ v32 }}
          %t18_{{ r }} = arith.shli %z{{ r }}, %s18 : {{ v32 }}
          %o1_{{ r }} = arith.ori %z{{ r }}, %t6_{{ r }} : {{ v32 }}
          %o2_{{ r }} = arith.ori %t12_{{ r }}, %t18_{{ r }} : {{ v32 }}
          %o3_{{ r }} = arith.ori %o1_{{ r }}, %o2_{{ r }} : {{ v32 }}
          %dec{{ r }} = arith.andi %o3_{{ r }}, %m3 : {{ v32 }}
%% if kb % 16
          vector.maskedstore %wdec[%c{{ r }}, %cd], %dmask, %dec{{ r }} : {{ bt }}, vector<16xi1>, {{ v32 }}
%% else
          vector.store %dec{{ r }}, %wdec[%c{{ r }}, %cd] : {{ bt }}, {{ v32 }}
%% endif
%% endfor
        }
%% endif
        scf.for %sb = %b0 to %bfull step %cnb {
{{ superblock(blocks) }}
        }
        scf.for %sb = %bfull to %b1 step %c1 {
{{ superblock(1) }}
        }
      }
%% endcall
