{# params: name, kb, pad #}
{#
  The AMX ternary kernel's B tiles of x (ternary/amx.py) from codes another dispatch
  quantized (a convolution's: im2col_quant): q [M, 4 KB] i8 -> xv [(M + 16 - pad) // 16, 64 KB] i8,
  amx_lib.xv_block for each whole block of 16 rows, one workgroup a block.
#}
%% import "lib.mlir" as lib
%% import "amx_lib.mlir" as amx
%% set qt = "memref<?x%dxi8>" % (4 * kb)
%% set xvt = "memref<?x%dxi8>" % (64 * kb)
%% call lib.executable(name, "%bq: !stream.binding, %bv: !stream.binding, %m: index", per_group=16)
      %c0 = arith.constant 0 : index
{{ amx.permit() }}
      %c16 = arith.constant 16 : index
      %cpad = arith.constant {{ 16 - pad }} : index
      %mpad = arith.addi %m, %cpad : index
      %nmb = arith.divui %mpad, %c16 : index
      %q = stream.binding.subspan %bq[%c0] : !stream.binding -> {{ qt }}{%m}
      %xv = stream.binding.subspan %bv[%c0] : !stream.binding -> {{ xvt }}{%nmb}
      %wg = stream.dispatch.workgroup.id[0] : index
      %ng = stream.dispatch.workgroup.count[0] : index
      scf.for %mb = %wg to %nmb step %ng {
        %m0 = arith.muli %mb, %c16 : index
{{ amx.xv_block("%mb", "%m0", kb, qt, xvt, "%m") }}
      }
%% endcall
