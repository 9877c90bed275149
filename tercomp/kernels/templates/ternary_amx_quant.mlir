{# params: name, kb, kx, pad, small_rows, eps, c127, lo, hi #}
{#
  The AMX ternary kernel's quantize dispatch: the avx2 kernel's (ternary_avx2_quant.mlir:
  x [M, 4 KB] f32, or [M, kx] unpadded, into q [M, 4 KB] i8 and stats [M, 2] f32), 16
  rows a workgroup, and for a block of 16 rows its B tiles too (amx_lib.xv_block: xv
  [(M + 16 - pad) // 16, 64 KB] i8; a last block of `pad` rows or more padded with zeros)
  while the block's codes are in cache. Fewer than `pad` rows (a decode's) write none:
  the same work as avx2's quantize, in one dispatch, `small_rows` rows a workgroup (so a
  batched decode's rows are shared by the threads).
#}
%% import "lib.mlir" as lib
%% import "avx2_quant_lib.mlir" as quant
%% import "amx_lib.mlir" as amx
%% set kp = 4 * kb
%% set qt = "memref<?x%dxi8>" % kp
%% set xvt = "memref<?x%dxi8>" % (64 * kb)
%% set xcols = kp if kx is none else kx
%% call lib.executable(name, "%bx: !stream.binding, %bq: !stream.binding, %bs: !stream.binding, %bv: !stream.binding, %m: index", per_group=16, per_group_small=small_rows, m_min=pad)
{{ quant.common(kp, 2, eps, c127, lo, hi) }}
{{ amx.permit() }}
      %c16 = arith.constant 16 : index
      %csmall = arith.constant {{ small_rows }} : index
      %cpadm = arith.constant {{ pad }} : index
      %tiled = arith.cmpi uge, %m, %cpadm : index
      %crows = arith.select %tiled, %c16, %csmall : index
      %cpad = arith.constant {{ 16 - pad }} : index
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> memref<?x{{ xcols }}xf32>{%m}
%% if kx is not none
      %ckx = arith.constant {{ kx }} : index
      %zb8 = arith.constant dense<0> : vector<8xi8>
%% endif
      %mpad = arith.addi %m, %cpad : index
      %nmb = arith.divui %mpad, %c16 : index
      %q = stream.binding.subspan %bq[%c0] : !stream.binding -> {{ qt }}{%m}
      %xs = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?x2xf32>{%m}
      %xv = stream.binding.subspan %bv[%c0] : !stream.binding -> {{ xvt }}{%nmb}
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
      %whole = arith.cmpi ult, %wg, %nmb : index
      scf.if %whole {
{{ amx.xv_block("%wg", "%row0", kb, qt, xvt, "%m") }}
      }
%% endcall
