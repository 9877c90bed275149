{# params: name, kb, kx, rows, eps, c127, lo, hi #}
{#
  The quantize dispatch of the avx2 ternary kernel: x [M, 4 KB] f32 quantized once for
  every matmul that reads it into q [M, 4 KB] i8 (the codes) and stats [M, 2] f32 (the
  codes' sum, exact in f32 below 2^24, and max(amax, eps)), `rows` rows a workgroup.
  With `kx` (a multiple of 8 below 4 KB) x is [M, kx], unpadded, and the codes' columns
  from kx on are zeros: the matmul's zero padding of K without a padded copy of x.
#}
%% import "lib.mlir" as lib
%% import "avx2_quant_lib.mlir" as quant
%% set kp = 4 * kb
%% set qt = "memref<?x%dxi8>" % kp
%% set xcols = kp if kx is none else kx
%% call lib.executable(name, "%bx: !stream.binding, %bq: !stream.binding, %bs: !stream.binding, %m: index", per_group=rows)
{{ quant.common(kp, 2, eps, c127, lo, hi) }}
      %crows = arith.constant {{ rows }} : index
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> memref<?x{{ xcols }}xf32>{%m}
%% if kx is not none
      %ckx = arith.constant {{ kx }} : index
      %zb8 = arith.constant dense<0> : vector<8xi8>
%% endif
      %q = stream.binding.subspan %bq[%c0] : !stream.binding -> {{ qt }}{%m}
      %xs = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?x2xf32>{%m}
      %wg = stream.dispatch.workgroup.id[0] : index
      %row0 = arith.muli %wg, %crows : index
      %row1u = arith.addi %row0, %crows : index
      %row1 = arith.minui %row1u, %m : index
      scf.for %row = %row0 to %row1 step %c1 {
{{ quant.quantize_row(kp, 0, "%row", "%q", "%row", qt, "%sx0", "%amc0", kx) }}
%% if kx is not none
        scf.for %k = %ckx to %ckp step %c8 {
          vector.store %zb8, %q[%row, %k] : {{ qt }}, vector<8xi8>
        }
%% endif
        %sxf0 = arith.sitofp %sx0 : i32 to f32
        memref.store %sxf0, %xs[%row, %c0] : memref<?x2xf32>
        memref.store %amc0, %xs[%row, %c1] : memref<?x2xf32>
      }
%% endcall
