{# params: name, c, hw, units #}
{#
  The absmax map of the avx512-tall kernel's quantize dispatch (ternary_lanes_quant.mlir
  with `amap`): a [N, HW] = max over the C channels of |x[n, c, p]| for the padded
  input x [N, C, HW] (HW = HP * WP), 16 positions a vector, 4 accumulators over the
  channels where C % 4 == 0. Workload: N * ceil(HW / 16) chunks of 16 positions,
  `units` of them a workgroup; a chunk past HW is masked (HW % 16 != 0).
#}
%% import "lib.mlir" as lib
%% set vf, vm, xt = "vector<16xf32>", "vector<16xi1>", "memref<?xf32>"
%% set chunks = (hw + 15) // 16
%% set masked = hw % 16 != 0
%% set acc = 4 if c % 4 == 0 else 1
%% macro ld(dst, addr)
%%   if masked
{{ dst }} = vector.maskedload %x[{{ addr }}], %mask, %zf : {{ xt }}, {{ vm }}, {{ vf }} into {{ vf }}
%%   else
{{ dst }} = vector.load %x[{{ addr }}] : {{ xt }}, {{ vf }}
%%   endif
%% endmacro
%% call lib.executable(name, "%bx: !stream.binding, %ba: !stream.binding, %nimg: index, %m: index", per_group=units)
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %cc = arith.constant {{ c }} : index
      %cacc = arith.constant {{ acc }} : index
      %cunits = arith.constant {{ units }} : index
      %chw = arith.constant {{ hw }} : index
      %zf = arith.constant dense<0.0> : {{ vf }}
      %xlen = affine.apply affine_map<(d0) -> (d0 * {{ c * hw }})>(%nimg)
      %alen = affine.apply affine_map<(d0) -> (d0 * {{ hw }})>(%nimg)
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> {{ xt }}{%xlen}
      %a = stream.binding.subspan %ba[%c0] : !stream.binding -> {{ xt }}{%alen}
      %wg = stream.dispatch.workgroup.id[0] : index
      %u0 = arith.muli %wg, %cunits : index
      %u1u = arith.addi %u0, %cunits : index
      %u1 = arith.minui %u1u, %m : index
      scf.for %u = %u0 to %u1 step %c1 {
        %p = affine.apply affine_map<(d0) -> ((d0 mod {{ chunks }}) * 16)>(%u)
        %xb = affine.apply affine_map<(d0) -> ((d0 floordiv {{ chunks }}) * {{ c * hw }} + (d0 mod {{ chunks }}) * 16)>(%u)
        %ab = affine.apply affine_map<(d0) -> ((d0 floordiv {{ chunks }}) * {{ hw }} + (d0 mod {{ chunks }}) * 16)>(%u)
%% if masked
        %left = arith.subi %chw, %p : index
        %mask = vector.create_mask %left : {{ vm }}
%% endif
        %am:{{ acc }} = scf.for %ch = %c0 to %cc step %cacc iter_args(<% for j in range(acc) %>%a{{ j }} = %zf{{ ", " if not loop.last }}<% endfor %>) -> (<% for j in range(acc) %>{{ vf }}{{ ", " if not loop.last }}<% endfor %>) {
%% for j in range(acc)
          %xa{{ j }} = affine.apply affine_map<(d0, d1) -> (d0 + (d1 + {{ j }}) * {{ hw }})>(%xb, %ch)
          {{ ld("%%v%d" % j, "%%xa%d" % j) | indent(10) }}
          %av{{ j }} = math.absf %v{{ j }} : {{ vf }}
          %an{{ j }} = arith.maximumf %a{{ j }}, %av{{ j }} fastmath<nnan,nsz> : {{ vf }}
%% endfor
          scf.yield <% for j in range(acc) %>%an{{ j }}{{ ", " if not loop.last }}<% endfor %> : <% for j in range(acc) %>{{ vf }}{{ ", " if not loop.last }}<% endfor %>
        }
%% if acc == 4
        %m01 = arith.maximumf %am#0, %am#1 fastmath<nnan,nsz> : {{ vf }}
        %m23 = arith.maximumf %am#2, %am#3 fastmath<nnan,nsz> : {{ vf }}
        %amv = arith.maximumf %m01, %m23 fastmath<nnan,nsz> : {{ vf }}
%% else
        %amv = arith.addf %am#0, %zf : {{ vf }}
%% endif
%% if masked
        vector.maskedstore %a[%ab], %mask, %amv : {{ xt }}, {{ vm }}, {{ vf }}
%% else
        vector.store %amv, %a[%ab] : {{ xt }}, {{ vf }}
%% endif
      }
%% endcall
