{# params: name, mode, batch, m, k, n, mr, nv, nw, mb, kc #}
{#
  f32 GEMM with the B operand's rows in the vector lanes (kernels/dense/gemm_avx512.py):

    mode "shared": c[b] = a @ x[b]            a [M, K], x [B, K, N], c [B, M, N]
                   a workgroup per (b, block of `nw` columns), all M rows
    mode "sum":    c = sum_b a[b] @ x[b]      a [B, M, K], x [B, K, N], c [M, N]
                   a workgroup per (block of `mb` rows, block of `nw` columns), every b

  In a workgroup, K goes in chunks of `kc`: the chunk of x's `nw` columns (kc x nw x 4
  bytes) is copied to the stack, where it stays in L1 across the row tiles (in x its
  rows are N floats apart: at N = 1024 all in the same L1 sets); for each chunk, tiles of `mr` rows x `nv`
  vectors of 16 columns: mr x nv accumulators in registers, loaded from c (the first
  chunk: zero), then per k of the chunk nv loads of x and mr scalars of a broadcast
  (vfmadd231ps with a {1to16} operand), stored back to c.
#}
%% import "lib.mlir" as lib
%% set vf = "vector<16xf32>"
%% set at = "memref<%dx%dxf32>" % (m, k) if mode == "shared" else "memref<%dx%dx%dxf32>" % (batch, m, k)
%% set xt = "memref<%dx%dx%dxf32>" % (batch, k, n)
%% set ct = "memref<%dx%dx%dxf32>" % (batch, m, n) if mode == "shared" else "memref<%dx%dxf32>" % (m, n)
%% set pt = "memref<%dx%dxf32>" % (kc, nw)
%% set pairs = []
%% for i in range(mr)
%%   for j in range(nv)
%%     do pairs.append((i, j))
%%   endfor
%% endfor
%% set types = ([vf] * pairs|length)|join(", ")
%% set nblocks = n // nw
%% set groups = batch * nblocks if mode == "shared" else (m // mb) * nblocks
%% macro aidx(row)
<%- if mode == "shared" %>{{ row }}, %kk<% else %>%bi, {{ row }}, %kk<% endif -%>
%% endmacro
%% macro cidx(row, col)
<%- if mode == "shared" %>%bi, {{ row }}, {{ col }}<% else %>{{ row }}, {{ col }}<% endif -%>
%% endmacro
%% call lib.executable(name, "%ba: !stream.binding, %bx: !stream.binding, %bc: !stream.binding, %m: index", groups=groups)
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %ck = arith.constant {{ k }} : index
      %ckc = arith.constant {{ kc }} : index
      %cmr = arith.constant {{ mr }} : index
      %cnt = arith.constant {{ 16 * nv }} : index
      %cnw = arith.constant {{ nw }} : index
      %c16 = arith.constant 16 : index
      %xp = "memref.alloca"() <{alignment = 64 : i64, operandSegmentSizes = array<i32: 0, 0>}> : () -> {{ pt }}
      %zf = arith.constant dense<0.0> : {{ vf }}
      %a = stream.binding.subspan %ba[%c0] : !stream.binding -> {{ at }}
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> {{ xt }}
      %c = stream.binding.subspan %bc[%c0] : !stream.binding -> {{ ct }}
      %wg = stream.dispatch.workgroup.id[0] : index
      %n0 = affine.apply affine_map<(d0) -> ((d0 mod {{ nblocks }}) * {{ nw }})>(%wg)
      %n1 = affine.apply affine_map<(d0) -> ((d0 mod {{ nblocks }}) * {{ nw }} + {{ nw }})>(%wg)
%% if mode == "shared"
      %r0 = arith.constant 0 : index
      %r1 = arith.constant {{ m }} : index
      %b0 = affine.apply affine_map<(d0) -> (d0 floordiv {{ nblocks }})>(%wg)
      %b1 = affine.apply affine_map<(d0) -> (d0 floordiv {{ nblocks }} + 1)>(%wg)
%% else
      %r0 = affine.apply affine_map<(d0) -> ((d0 floordiv {{ nblocks }}) * {{ mb }})>(%wg)
      %r1 = affine.apply affine_map<(d0) -> ((d0 floordiv {{ nblocks }}) * {{ mb }} + {{ mb }})>(%wg)
      %b0 = arith.constant 0 : index
      %b1 = arith.constant {{ batch }} : index
%% endif
      scf.for %bi = %b0 to %b1 step %c1 {
        %firstb = arith.cmpi eq, %bi, %b0 : index
        scf.for %k0 = %c0 to %ck step %ckc {
          %k1 = arith.addi %k0, %ckc : index
          %firstk = arith.cmpi eq, %k0, %c0 : index
          %first = arith.andi %firstb, %firstk : i1
{#          the chunk of x (kc rows of the workgroup's nw columns) copied to the stack:
            x's rows are N floats apart (4 KiB at N = 1024: every row in the same L1 sets) #}
          scf.for %pk = %c0 to %ckc step %c1 {
            %xk = arith.addi %k0, %pk : index
            scf.for %pn = %c0 to %cnw step %c16 {
              %xn = arith.addi %n0, %pn : index
              %pv = vector.load %x[%bi, %xk, %xn] : {{ xt }}, {{ vf }}
              vector.store %pv, %xp[%pk, %pn] : {{ pt }}, {{ vf }}
            }
          }
          scf.for %nt = %n0 to %n1 step %cnt {
%% for j in range(nv)
            %nc{{ j }} = affine.apply affine_map<(d0) -> (d0 + {{ 16 * j }})>(%nt)
            %pc{{ j }} = arith.subi %nc{{ j }}, %n0 : index
%% endfor
            scf.for %mt = %r0 to %r1 step %cmr {
%% for i in range(mr)
              %mi{{ i }} = affine.apply affine_map<(d0) -> (d0 + {{ i }})>(%mt)
%% endfor
%% for i, j in pairs
              %ld{{ i }}_{{ j }} = scf.if %first -> ({{ vf }}) {
                scf.yield %zf : {{ vf }}
              } else {
                %v = vector.load %c[{{ cidx("%%mi%d" % i, "%%nc%d" % j) }}] : {{ ct }}, {{ vf }}
                scf.yield %v : {{ vf }}
              }
%% endfor
              %acc:{{ pairs|length }} = scf.for %pkk = %c0 to %ckc step %c1 iter_args(<% for i, j in pairs %>%s{{ i }}_{{ j }} = %ld{{ i }}_{{ j }}{{ ", " if not loop.last }}<% endfor %>) -> ({{ types }}) {
                %kk = arith.addi %k0, %pkk : index
%% for j in range(nv)
                %xv{{ j }} = vector.load %xp[%pkk, %pc{{ j }}] : {{ pt }}, {{ vf }}
%% endfor
%% for i in range(mr)
                %as{{ i }} = memref.load %a[{{ aidx("%%mi%d" % i) }}] : {{ at }}
                %av{{ i }} = vector.broadcast %as{{ i }} : f32 to {{ vf }}
%%   for j in range(nv)
                %y{{ i }}_{{ j }} = vector.fma %av{{ i }}, %xv{{ j }}, %s{{ i }}_{{ j }} : {{ vf }}
%%   endfor
%% endfor
                scf.yield <% for i, j in pairs %>%y{{ i }}_{{ j }}{{ ", " if not loop.last }}<% endfor %> : {{ types }}
              }
%% for i, j in pairs
              vector.store %acc#{{ loop.index0 }}, %c[{{ cidx("%%mi%d" % i, "%%nc%d" % j) }}] : {{ ct }}, {{ vf }}
%% endfor
            }
          }
        }
      }
%% endcall
