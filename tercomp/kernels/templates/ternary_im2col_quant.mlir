{# params: name, kb, k, c, hp, wp, kh, kw, sh, sw, dh, dw, oh, ow, rows, eps, c127, lo, hi #}
{#
  The patches of a convolution quantized straight from its padded input: for x
  [N * C * HP * WP] f32 (the padded [N, C, HP, WP], flattened: a gather from a 2-D
  memref left index constants that IREE's LLVM lowering did not convert) and the convolution's
  kernel, stride and dilation, row r = (n, y, x) of the patch matrix [N * OH * OW, K]
  (K = C * KH * KW, columns in the order of a conv weight's [C, KH, KW] dims) is
  x[n, (y sh + i dh) WP + (x sw + j dw) + c HP WP] at column (c KH + i) KW + j, read 16
  columns at a time by one gather (a per-column offset table built on the stack), once
  for the row's absmax and again to quantize (a row buffer on the stack that the second
  pass read instead measured slower, 1.7x the matmul's time against 1.05x) and
  quantized as the avx2 kernel's quantize dispatch does (ternary_pack.act_quant, same
  f32 operations in the same order): q [M, 4 KB] i8 (columns from K on zero) and stats
  [M, 2] f32 (the codes' sum, max(amax, eps)), `rows` rows a workgroup. The same codes
  as the im2col generic followed by the quantize dispatch, without writing the f32
  patches (9x the input for a 3x3 kernel) and reading them back.
#}
%% import "lib.mlir" as lib
%% set kp = 4 * kb
%% set vol = c * hp * wp
%% set vf, vi, vb, vm = "vector<16xf32>", "vector<16xi32>", "vector<16xi8>", "vector<16xi1>"
%% set xt = "memref<?xf32>"
%% set qt = "memref<?x%dxi8>" % kp
%% set ot = "memref<%dxi32>" % k
%% call lib.executable(name, "%bx: !stream.binding, %bq: !stream.binding, %bs: !stream.binding, %nimg: index, %m: index", per_group=rows)
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c16 = arith.constant 16 : index
      %crows = arith.constant {{ rows }} : index
      %ck = arith.constant {{ k }} : index
      %ckp = arith.constant {{ kp }} : index
      %cow = arith.constant {{ ow }} : index
      %cpos = arith.constant {{ oh * ow }} : index
      %eps = arith.constant {{ eps }} : f32
      %c127 = arith.constant {{ c127 }} : f32
      %lov = arith.constant dense<{{ lo }}> : {{ vf }}
      %hiv = arith.constant dense<{{ hi }}> : {{ vf }}
      %zf = arith.constant dense<0.0> : {{ vf }}
      %zi = arith.constant dense<0> : {{ vi }}
      %zb = arith.constant dense<0> : {{ vb }}
      %all = vector.constant_mask [16] : {{ vm }}
      %xlen = affine.apply affine_map<(d0) -> (d0 * {{ vol }})>(%nimg)
      %x = stream.binding.subspan %bx[%c0] : !stream.binding -> {{ xt }}{%xlen}
      %q = stream.binding.subspan %bq[%c0] : !stream.binding -> {{ qt }}{%m}
      %xs = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?x2xf32>{%m}
      %off = memref.alloca() : {{ ot }}
      scf.for %col = %c0 to %ck step %c1 {
        %o = affine.apply affine_map<(d0) -> ((d0 floordiv {{ kh * kw }}) * {{ hp * wp }} + ((d0 mod {{ kh * kw }}) floordiv {{ kw }}) * {{ dh * wp }} + (d0 mod {{ kw }}) * {{ dw }})>(%col)
        %oi = arith.index_cast %o : index to i32
        memref.store %oi, %off[%col] : {{ ot }}
      }
      %wg = stream.dispatch.workgroup.id[0] : index
      %row0 = arith.muli %wg, %crows : index
      %row1u = arith.addi %row0, %crows : index
      %row1 = arith.minui %row1u, %m : index
      scf.for %row = %row0 to %row1 step %c1 {
        %n = arith.divui %row, %cpos : index
        %p = arith.remui %row, %cpos : index
        %py = arith.divui %p, %cow : index
        %px = arith.remui %p, %cow : index
        %base = affine.apply affine_map<(d0, d1, d2) -> (d0 * {{ vol }} + d1 * {{ sh * wp }} + d2 * {{ sw }})>(%n, %py, %px)
        %amv = scf.for %col = %c0 to %ck step %c16 iter_args(%a = %zf) -> ({{ vf }}) {
          %idx = vector.load %off[%col] : {{ ot }}, {{ vi }}
          %v = vector.gather %x[%base][%idx], %all, %zf : {{ xt }}, {{ vi }}, {{ vm }}, {{ vf }} into {{ vf }}
          %av = math.absf %v : {{ vf }}
          %an = arith.maximumf %a, %av : {{ vf }}
          scf.yield %an : {{ vf }}
        }
        %amax = vector.reduction <maximumf>, %amv : {{ vf }} into f32
        %amc = arith.maximumf %amax, %eps : f32
        %qs = arith.divf %c127, %amc : f32
        %qsv = vector.broadcast %qs : f32 to {{ vf }}
        %sxv = scf.for %col = %c0 to %ck step %c16 iter_args(%a = %zi) -> ({{ vi }}) {
          %idx = vector.load %off[%col] : {{ ot }}, {{ vi }}
          %v = vector.gather %x[%base][%idx], %all, %zf : {{ xt }}, {{ vi }}, {{ vm }}, {{ vf }} into {{ vf }}
          %sc = arith.mulf %v, %qsv : {{ vf }}
          %rd = llvm.call_intrinsic "llvm.roundeven.v16f32"(%sc) : ({{ vf }}) -> {{ vf }}
          %lo = arith.maximumf %rd, %lov : {{ vf }}
          %cl = arith.minimumf %lo, %hiv : {{ vf }}
          %qi = arith.fptosi %cl : {{ vf }} to {{ vi }}
          %qb = arith.trunci %qi : {{ vi }} to {{ vb }}
          vector.store %qb, %q[%row, %col] : {{ qt }}, {{ vb }}
          %an = arith.addi %a, %qi : {{ vi }}
          scf.yield %an : {{ vi }}
        }
        scf.for %col = %ck to %ckp step %c16 {
          vector.store %zb, %q[%row, %col] : {{ qt }}, {{ vb }}
        }
        %sx = vector.reduction <add>, %sxv : {{ vi }} into i32
        %sxf = arith.sitofp %sx : i32 to f32
        memref.store %sxf, %xs[%row, %c0] : memref<?x2xf32>
        memref.store %amc, %xs[%row, %c1] : memref<?x2xf32>
      }
%% endcall
