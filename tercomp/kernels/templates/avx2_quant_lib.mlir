{# Activation quantization for the avx2 ternary kernel (no parameters of its own). #}
{#
  common: the constants the quantization and the kernels use (index constants %c0 ..
  %c{n_index - 1} among them); `eps`, `c127`, `lo`, `hi` are f32 literals.
#}
%% macro common(kp, n_index, eps, c127, lo, hi)
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
%% for b in range(2, n_index)
      %c{{ b }} = arith.constant {{ b }} : index
%% endfor
      %c8 = arith.constant 8 : index
      %c0x = arith.constant 0 : index
      %c8x = arith.constant 8 : index
      %c16x = arith.constant 16 : index
      %c24x = arith.constant 24 : index
      %c32 = arith.constant 32 : index
      %ckp = arith.constant {{ kp }} : index
      %eps = arith.constant {{ eps }} : f32
      %c127 = arith.constant {{ c127 }} : f32
      %lov = arith.constant dense<{{ lo }}> : vector<8xf32>
      %hiv = arith.constant dense<{{ hi }}> : vector<8xf32>
      %zf8 = arith.constant dense<0.0> : vector<8xf32>
      %zi8 = arith.constant dense<0> : vector<8xi32>
%% endmacro
{#
  quantize_row: x[row, :] (x: %x, memref<?xKPxf32>, or memref<?xKXxf32> with `kx`, whose
  columns %ckx bounds) quantized into dst[dst_row, :] (i8) as
  ternary_pack.act_quant does (roundeven(x * (127 / max(amax, eps))) clipped to +-127, in
  f32 and in that order, so the codes agree exactly; roundeven as LLVM's intrinsic, one
  vroundps, where math.roundeven expanded to ~30 instructions a vector: a 512 x 1536
  quantize 1.3 -> 0.85 ms on one thread); defines `sum` (the sum of the codes, i32) and
  `amc` (max(amax, eps): the codes times amc / 127 are x's approximation); `b` tags its
  other values.
#}
%% macro quantize_row(kp, b, row, dst, dst_row, dst_type, sum, amc, kx=none)
%% set vf, vi, vb = "vector<8xf32>", "vector<8xi32>", "vector<8xi8>"
%% set xt = "memref<?x%dxf32>" % (kp if kx is none else kx)
%% set bound = "%ckp" if kx is none else "%ckx"
%% if (kp if kx is none else kx) % 32 == 0
{# four independent max chains (a NaN-propagating max is 3-4 dependent instructions a
   vector: one chain bounded the row at ~1 cycle an element); max is exact in any order #}
          %amq{{ b }}:4 = scf.for %k = %c0 to {{ bound }} step %c32 iter_args(%a0 = %zf8, %a1 = %zf8, %a2 = %zf8, %a3 = %zf8) -> ({{ vf }}, {{ vf }}, {{ vf }}, {{ vf }}) {
%% for j in range(4)
            %k{{ j }} = arith.addi %k, %c{{ 8 * j }}x : index
            %v{{ j }} = vector.load %x[{{ row }}, %k{{ j }}] : {{ xt }}, {{ vf }}
            %av{{ j }} = math.absf %v{{ j }} : {{ vf }}
            %an{{ j }} = arith.maximumf %a{{ j }}, %av{{ j }} : {{ vf }}
%% endfor
            scf.yield %an0, %an1, %an2, %an3 : {{ vf }}, {{ vf }}, {{ vf }}, {{ vf }}
          }
          %amp{{ b }} = arith.maximumf %amq{{ b }}#0, %amq{{ b }}#1 : {{ vf }}
          %amr{{ b }} = arith.maximumf %amq{{ b }}#2, %amq{{ b }}#3 : {{ vf }}
          %amv{{ b }} = arith.maximumf %amp{{ b }}, %amr{{ b }} : {{ vf }}
%% else
          %amv{{ b }} = scf.for %k = %c0 to {{ bound }} step %c8 iter_args(%a = %zf8) -> ({{ vf }}) {
            %v = vector.load %x[{{ row }}, %k] : {{ xt }}, {{ vf }}
            %av = math.absf %v : {{ vf }}
            %an = arith.maximumf %a, %av : {{ vf }}
            scf.yield %an : {{ vf }}
          }
%% endif
          %amax{{ b }} = vector.reduction <maximumf>, %amv{{ b }} : {{ vf }} into f32
          {{ amc }} = arith.maximumf %amax{{ b }}, %eps : f32
          %qs{{ b }} = arith.divf %c127, {{ amc }} : f32
          %qsv{{ b }} = vector.broadcast %qs{{ b }} : f32 to {{ vf }}
          %sxv{{ b }} = scf.for %k = %c0 to {{ bound }} step %c8 iter_args(%a = %zi8) -> ({{ vi }}) {
            %v = vector.load %x[{{ row }}, %k] : {{ xt }}, {{ vf }}
            %sc = arith.mulf %v, %qsv{{ b }} : {{ vf }}
            %rd = llvm.call_intrinsic "llvm.roundeven.v8f32"(%sc) : ({{ vf }}) -> {{ vf }}
            %lo = arith.maximumf %rd, %lov : {{ vf }}
            %cl = arith.minimumf %lo, %hiv : {{ vf }}
            %qi = arith.fptosi %cl : {{ vf }} to {{ vi }}
            %qb = arith.trunci %qi : {{ vi }} to {{ vb }}
            vector.store %qb, {{ dst }}[{{ dst_row }}, %k] : {{ dst_type }}, {{ vb }}
            %an = arith.addi %a, %qi : {{ vi }}
            scf.yield %an : {{ vi }}
          }
          {{ sum }} = vector.reduction <add>, %sxv{{ b }} : {{ vi }} into i32
%% endmacro
{#
  row_stats: `sum` and `fm` (the dequantization factor amc * wscale) of quantized row
  `row` of x, from the quantize dispatch's statistics (%xs [M, 2]: sum, amc); `b` tags
  its other values.
#}
%% macro row_stats(b, row, sum, fm)
          %sxf{{ b }} = memref.load %xs[{{ row }}, %c0] : memref<?x2xf32>
          {{ sum }} = arith.fptosi %sxf{{ b }} : f32 to i32
          %amc{{ b }} = memref.load %xs[{{ row }}, %c1] : memref<?x2xf32>
          {{ fm }} = arith.mulf %amc{{ b }}, %wscale : f32
%% endmacro
