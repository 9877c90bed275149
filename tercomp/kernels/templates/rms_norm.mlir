{# params: name, n, rows #}
{#
  (x [R, N] f32, w [N] f32, eps: f32, R: index) -> x / sqrt(mean(x^2) + eps) * w, computed
  as x * rsqrt(...) * w like the op's decomposition; `rows` rows a workgroup, one at a
  time, 8 lanes at a time (N % 8 == 0).
#}
%% import "lib.mlir" as lib
%% import "rows_lib.mlir" as rl
%% set v8 = "vector<8xf32>"
%% set xt = "memref<?x%dxf32>" % n
%% call lib.executable(name, "%bx: !stream.binding, %bw: !stream.binding, %bo: !stream.binding, %eps: f32, %m: index", per_group=rows)
{{ rl.rows_prologue(rows) }}
      %cn = arith.constant {{ n }} : index
      %nf = arith.constant {{ "%r" % (n * 1.0) }} : f32
      %z8 = arith.constant dense<0.0> : {{ v8 }}
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> {{ xt }}{%m}
      %w = stream.binding.subspan %bw[%c0] : !stream.binding -> memref<{{ n }}xf32>
      %o = stream.binding.subspan %bo[%c0] : !stream.binding -> {{ xt }}{%m}
      scf.for %r = %r0 to %r1 step %c1 {
        %acc = scf.for %c = %c0 to %cn step %c8 iter_args(%a = %z8) -> ({{ v8 }}) {
          %xv = vector.load %x[%r, %c] : {{ xt }}, {{ v8 }}
          %a2 = vector.fma %xv, %xv, %a : {{ v8 }}
          scf.yield %a2 : {{ v8 }}
        }
        %ss = vector.reduction <add>, %acc fastmath<reassoc> : {{ v8 }} into f32
        %ms = arith.divf %ss, %nf : f32
        %me = arith.addf %ms, %eps : f32
        %inv = math.rsqrt %me : f32
        %invv = vector.broadcast %inv : f32 to {{ v8 }}
        scf.for %c = %c0 to %cn step %c8 {
          %xv = vector.load %x[%r, %c] : {{ xt }}, {{ v8 }}
          %wv = vector.load %w[%c] : memref<{{ n }}xf32>, {{ v8 }}
          %y = arith.mulf %xv, %invv : {{ v8 }}
          %yw = arith.mulf %y, %wv : {{ v8 }}
          vector.store %yw, %o[%r, %c] : {{ xt }}, {{ v8 }}
        }
      }
%% endcall
