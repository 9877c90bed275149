{# params: name, heads, d, rows, interleaved #}
{#
  (x [T, H, D] f32, cos [T, D/2], sin [T, D/2], T: index) -> x rotated in the pairs
  (i, i + D/2): (x1 c - x2 s, x2 c + x1 s); `rows` positions a workgroup, 8 lanes at a
  time (D % 16 == 0). `interleaved`: the pairs (2i, 2i + 1) instead, 8 pairs a step taken
  apart from two 8-lane loads by shuffles (x1 the even lanes, x2 the odd) and put back
  together the same way, and its products summed as the FMAs IREE's generic lowering of
  the op is contracted to (x1 c + -(x2 s), x2 c + x1 s: the generic's floats bit for bit,
  where the neox kernel's separate products and sums can differ from it in the last bit).
#}
%% import "lib.mlir" as lib
%% import "rows_lib.mlir" as rl
%% set v8 = "vector<8xf32>"
%% set half = d // 2
%% set xt = "memref<?x%dx%dxf32>" % (heads, d)
%% set tt = "memref<?x%dxf32>" % half
%% call lib.executable(name, "%bx: !stream.binding, %bc: !stream.binding, %bs: !stream.binding, %bo: !stream.binding, %m: index", per_group=rows)
{{ rl.rows_prologue(rows) }}
      %ch = arith.constant {{ heads }} : index
      %chalf = arith.constant {{ half }} : index
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> {{ xt }}{%m}
      %cs = stream.binding.subspan %bc[%c0] : !stream.binding -> {{ tt }}{%m}
      %sn = stream.binding.subspan %bs[%c0] : !stream.binding -> {{ tt }}{%m}
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {{ xt }}{%m}
      scf.for %t = %r0 to %r1 step %c1 {
        scf.for %i = %c0 to %chalf step %c8 {
          %c = vector.load %cs[%t, %i] : {{ tt }}, {{ v8 }}
          %s = vector.load %sn[%t, %i] : {{ tt }}, {{ v8 }}
%% if interleaved
          %i2 = arith.addi %i, %i : index
          %j = arith.addi %i2, %c8 : index
%% else
          %j = arith.addi %i, %chalf : index
%% endif
          scf.for %h = %c0 to %ch step %c1 {
%% if interleaved
            %xa = vector.load %x[%t, %h, %i2] : {{ xt }}, {{ v8 }}
            %xb = vector.load %x[%t, %h, %j] : {{ xt }}, {{ v8 }}
            %x1 = vector.shuffle %xa, %xb [0, 2, 4, 6, 8, 10, 12, 14] : {{ v8 }}, {{ v8 }}
            %x2 = vector.shuffle %xa, %xb [1, 3, 5, 7, 9, 11, 13, 15] : {{ v8 }}, {{ v8 }}
%% else
            %x1 = vector.load %x[%t, %h, %i] : {{ xt }}, {{ v8 }}
            %x2 = vector.load %x[%t, %h, %j] : {{ xt }}, {{ v8 }}
%% endif
%% if interleaved
            %x2s = arith.mulf %x2, %s : {{ v8 }}
            %nx2s = arith.negf %x2s : {{ v8 }}
            %y1 = vector.fma %x1, %c, %nx2s : {{ v8 }}
            %x1s = arith.mulf %x1, %s : {{ v8 }}
            %y2 = vector.fma %x2, %c, %x1s : {{ v8 }}
%% else
            %x1c = arith.mulf %x1, %c : {{ v8 }}
            %x2s = arith.mulf %x2, %s : {{ v8 }}
            %y1 = arith.subf %x1c, %x2s : {{ v8 }}
            %x2c = arith.mulf %x2, %c : {{ v8 }}
            %x1s = arith.mulf %x1, %s : {{ v8 }}
            %y2 = arith.addf %x2c, %x1s : {{ v8 }}
%% endif
%% if interleaved
            %ya = vector.shuffle %y1, %y2 [0, 8, 1, 9, 2, 10, 3, 11] : {{ v8 }}, {{ v8 }}
            %yb = vector.shuffle %y1, %y2 [4, 12, 5, 13, 6, 14, 7, 15] : {{ v8 }}, {{ v8 }}
            vector.store %ya, %o[%t, %h, %i2] : {{ xt }}, {{ v8 }}
            vector.store %yb, %o[%t, %h, %j] : {{ xt }}, {{ v8 }}
%% else
            vector.store %y1, %o[%t, %h, %i] : {{ xt }}, {{ v8 }}
            vector.store %y2, %o[%t, %h, %j] : {{ xt }}, {{ v8 }}
%% endif
          }
        }
      }
%% endcall
