"""The hand-written kernels are templates (tercomp/kernels/templates/*.mlir): each lists its
parameters, a render refuses a missing or an unknown one, and one rendered instance per
kernel parses as MLIR and is pinned here with FileCheck."""
import pytest

from conftest import run_filecheck
from tercomp.kernels import template
from tercomp.kernels.attention import attention_cpu
from tercomp.kernels.dense import gemm_avx512 as dense_gemm
from tercomp.kernels.dense import vnni_avx512 as dense_vnni
from tercomp.kernels.dense import widening_avx2 as dense_avx2
from tercomp.kernels.rows import rows_cpu
from tercomp.kernels.ternary import amx as ternary_amx
from tercomp.kernels.ternary import avx2 as ternary_avx2
from tercomp.kernels.ternary import avx512 as ternary_avx512
from tercomp.kernels.ternary import avx512_tall as ternary_avx512_tall
from tercomp.kernels.ternary import avx2_quant as ternary_avx2_quant
from tercomp.kernels.ternary import im2col_quant as ternary_im2col_quant
from tercomp.errors import TercompError

ir = pytest.importorskip("iree.compiler.ir")

KERNELS = ["attention", "attention_rows", "dense_avx2", "dense_vnni", "gemm_avx512", "kv_write", "rms_norm", "rope", "ternary_amax_map",
           "ternary_amx_quant", "ternary_avx2", "ternary_avx2_quant", "ternary_avx512", "ternary_avx512_tall",
           "ternary_im2col_quant", "ternary_lanes_quant", "ternary_lanes_quant_unpadded"]


def test_every_template_declares_exactly_the_parameters_it_reads():
    assert template.names() == KERNELS
    for name in KERNELS:
        assert set(template.params(name)) == template.used(name), name


def test_render_refuses_a_missing_or_an_unknown_parameter():
    with pytest.raises(TercompError, match="rms_norm.mlir: missing rows; unknown m"):
        template.render("rms_norm", name="k", n=8, m=1)


def parsed(text: str) -> str:
    with ir.Context():
        return str(ir.Operation.parse(text))


def check(text: str, checks: str):
    parsed(text)                    # IREE's parser takes it
    run_filecheck(text, checks)


def test_kv_write():
    check(rows_cpu.kv_write_text("tern_kv_write_8x512x1536_f16", 8, 512, 1536, "f16"), """
CHECK-LABEL: stream.executable private @tern_kv_write_8x512x1536_f16
CHECK:   %g = affine.apply affine_map<()[s0] -> (s0 ceildiv 1)>()[%m]
CHECK:   func.func @tern_kv_write_8x512x1536_f16(%bc: !stream.binding, %br: !stream.binding, %bs: !stream.binding, %bp: !stream.binding, %m: index)
CHECK:     %cl = arith.constant 32 : index
CHECK:     %cache = stream.binding.subspan %bc[%c0] : !stream.binding -> memref<8x512x1536xf16>
CHECK:     %slot = arith.index_cast %s32 : i32 to index
CHECK:     scf.for %c = %c0 to %cw step %cl
CHECK:       %v = vector.load %rows[%t, %c] : memref<?x1536xf16>, vector<32xf16>
CHECK:       vector.store %v, %cache[%slot, %pos, %c] : memref<8x512x1536xf16>, vector<32xf16>
""")
    assert "vector<16xf32>" in rows_cpu.kv_write_text("k", 2, 4, 64, "f32")


def test_rms_norm():
    check(rows_cpu.rms_norm_text("tern_rms_norm_64", 64), """
CHECK-LABEL: stream.executable private @tern_rms_norm_64
CHECK:   %g = affine.apply affine_map<()[s0] -> (s0 ceildiv 4)>()[%m]
CHECK:   func.func @tern_rms_norm_64(%bx: !stream.binding, %bw: !stream.binding, %bo: !stream.binding, %eps: f32, %m: index)
CHECK:     %nf = arith.constant 64.0 : f32
CHECK:     %[[ACC:.*]] = scf.for %c = %c0 to %cn step %c8 iter_args(%a = %z8) -> (vector<8xf32>)
CHECK:       vector.fma %xv, %xv, %a : vector<8xf32>
CHECK:     vector.reduction <add>, %[[ACC]] fastmath<reassoc>
CHECK:     math.rsqrt
CHECK:     vector.store %yw, %o[%r, %c] : memref<?x64xf32>, vector<8xf32>
""")


def test_rope():
    check(rows_cpu.rope_text("tern_rope_2x32", 2, 32), """
CHECK-LABEL: stream.executable private @tern_rope_2x32
CHECK:   func.func @tern_rope_2x32(%bx: !stream.binding, %bc: !stream.binding, %bs: !stream.binding, %bo: !stream.binding, %m: index)
CHECK:     %chalf = arith.constant 16 : index
CHECK:     %j = arith.addi %i, %chalf : index
CHECK:     %y1 = arith.subf %x1c, %x2s : vector<8xf32>
CHECK:     %y2 = arith.addf %x2c, %x1s : vector<8xf32>
CHECK:     vector.store %y2, %o[%t, %h, %j] : memref<?x2x32xf32>, vector<8xf32>
""")


def test_attention():
    check(attention_cpu.executable_text("tern_attention", 4, 2, 16, 64, "f16"), f"""
CHECK-LABEL: stream.executable private @tern_attention
CHECK:   %g = arith.constant 4 : index
CHECK:   func.func @tern_attention(%bq: !stream.binding, %bk: !stream.binding, %bv: !stream.binding, %bo: !stream.binding, %scale: f32, %p: index, %m: index)
CHECK:     %col1 = arith.constant 8 : index
CHECK:     %cgroup = arith.constant 2 : index
CHECK:     %k = stream.binding.subspan %bk[%c0] : !stream.binding -> memref<64x2x16xf16>
CHECK:     scf.for %t0 = %c0 to %mfull step %cqb
CHECK:       %last1 = arith.addi %p, %t1 : index
CHECK:       %k0 = vector.load %k[%s, %kh, %colw0] : memref<64x2x16xf16>, vector<16xf16>
CHECK:       %kf0 = arith.extf %k0 : vector<16xf16> to vector<16xf32>
CHECK:       %q1_0 = vector.load %q[%t1, %h, %colw0]
CHECK:       %d1_0 = vector.fma %q1_0, %kf0, %z16 : vector<16xf32>
CHECK:       %dhi1 = vector.shuffle %d1_0, %d1_0 [8, 9, 10, 11, 12, 13, 14, 15]
CHECK:       %dsum1 = arith.addf %dhi1, %dlo1 : vector<8xf32>
CHECK:       %in1 = arith.cmpi ule, %s, %last1 : index
CHECK:       %sd1 = arith.select %in1, %sd0_1, %ninf : f32
CHECK:       math.exp %xd : vector<8xf32>
CHECK:       %wn{attention_cpu.QBLOCK - 1}_0 = vector.fma %eb{attention_cpu.QBLOCK - 1}, %vf0
CHECK:       vector.store %g1_0, %o[%t1, %h, %colw0]
CHECK:     scf.for %t0 = %mfull to %m step %c1
CHECK-NOT:   arith.select
CHECK:       %k1 = vector.load %k[%s, %kh, %col1] : memref<64x2x16xf16>, vector<8xf16>
CHECK:       %dsum0 = arith.addf %d0_1, %d0_0 : vector<8xf32>
CHECK:       vector.store %g0_1, %o[%t0, %h, %col1]
""")
    check(attention_cpu.rows_text("tern_slot_attention_rows", 4, 4, 8, 16, "f32", 3), """
CHECK:   %g = arith.muli %m, %times : index
CHECK:   func.func @tern_slot_attention_rows(%bq: !stream.binding, %bk: !stream.binding, %bv: !stream.binding, %bs: !stream.binding, %bp: !stream.binding, %bo: !stream.binding, %scale: f32, %m: index)
CHECK:     %slot = arith.index_cast %slot32 : i32 to index
CHECK:     %rr3 = arith.minui %rs3, %last : index
CHECK:     memref.prefetch %k[%slot, %sp0, %pk0, %pcol0]
CHECK:     %k3_0 = vector.load %k[%slot, %rr3, %kv, %col0] : memref<3x16x4x8xf32>, vector<8xf32>
CHECK:     %kf3_0 = arith.addf %k3_0, %z8 : vector<8xf32>
CHECK:     memref.store %ninf, %sc[%hh, %j] : memref<2x256xf32>
CHECK:     %a4_0 = vector.fma %eb3, %vf3_0, %a3_0 : vector<8xf32>
""")


def test_dense_avx2():
    check(dense_avx2.executable_text("tern_avx2_i8_gemv_40x32_m2", 40, 32, "i8", 2), """
CHECK-LABEL: stream.executable private @tern_avx2_i8_gemv_40x32_m2
CHECK:   %g = arith.constant 10 : index
CHECK:   func.func @tern_avx2_i8_gemv_40x32_m2(%bx: !stream.binding, %bw: !stream.binding, %bs: !stream.binding, %bo: !stream.binding, %m: index)
CHECK:     %rpw = arith.constant 4 : index
CHECK:     %sc = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?xf32>{%cn}
CHECK:     %rs3 = affine.apply affine_map<(d0)[s0] -> (d0 + s0 * 3)>(%rb)[%groups]
CHECK:     scf.for %mi = %c0 to %mwhole step %c2
CHECK:       %acc:8 = scf.for %c = %c0 to %ck step %cl
CHECK:         memref.prefetch %w[%prewh0, %c], read, locality<3>, data : memref<40x32xi8>
CHECK:         %wf0 = arith.sitofp %wh0 : vector<16xi8> to vector<16xf32>
CHECK:         %n0_1 = vector.fma %wf0, %xv1, %a0_1 : vector<16xf32>
CHECK:       %y3_1 = vector.reduction <add>, %acc#7 fastmath<reassoc> : vector<16xf32> into f32
CHECK:       %ys3_1 = arith.mulf %y3_1, %s3 : f32
CHECK:     scf.for %mi = %mwhole to %m step %c1
CHECK:   scf.for %rt = %rg to %r1 step %c1
CHECK:     memref.prefetch %w[%prewh0, %c], read, locality<0>, data : memref<40x32xi8>
""")


def test_dense_vnni():
    check(dense_vnni.executable_text("tern_vnni_i8_gemv_40x128", 40, 128), """
CHECK-LABEL: stream.executable private @tern_vnni_i8_gemv_40x128
CHECK:   %g = arith.constant 10 : index
CHECK:   func.func @tern_vnni_i8_gemv_40x128(%bx: !stream.binding, %bw: !stream.binding, %bs: !stream.binding, %bo: !stream.binding, %m: index)
CHECK:     %cmb = arith.constant 8 : index
CHECK:     %flip = arith.constant dense<-128> : vector<64xi8>
CHECK:     %xq = memref.alloca() : memref<8x128xi8>
CHECK:     scf.for %mi = %c0 to %mwhole step %cmb
CHECK:         %rd = llvm.call_intrinsic "llvm.roundeven.v8f32"(%sc) : (vector<8xf32>) -> vector<8xf32>
CHECK:         %qcorrb = arith.muli %qsumb, %c128i : i32
CHECK:       %accbp0:16 = scf.for %c = %c0 to %ck step %c64
CHECK:         memref.prefetch %w[%wp0, %c], read, locality<3>, data : memref<40x128xi8>
CHECK:         %wu0 = arith.xori %wv0, %flip : vector<64xi8>
CHECK:         %n1_7 = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"(%a1_7, %wu1, %xv7)
CHECK:       %dfbp0_1_7 = arith.subi %rdbp0_1_7, %crbp0_7 : i32
CHECK:       %ybp0_1_7 = arith.mulf %fxbp0_1_7, %wsbp0_1 : f32
CHECK:       %accbp2:16 = scf.for
CHECK:     scf.for %rt = %rg to %r1 step %c1
CHECK:     scf.if %one
CHECK:       %accrs:4 = scf.for %c = %c0 to %ck step %c64
CHECK:     scf.if %some
CHECK:       vector.store %zb, %xq[%zj, %zk]
CHECK:         scf.if %gdpp0_0_1
""")


def test_gemm_avx512():
    """sum: 9 workgroups of 8 rows (72 = 9 x 8, every b in each), K = 256 in chunks of
    64 copied to the stack, 8 x 2 accumulators from zero at the first chunk of the first
    b, else from c; shared: a workgroup per (b, 64 columns), c per b."""
    check(dense_gemm.executable_text("g", "sum", 4, 72, 256, 64), """
CHECK-LABEL: stream.executable private @g
CHECK:   %g = arith.constant 9 : index
CHECK:   func.func @g(%ba: !stream.binding, %bx: !stream.binding, %bc: !stream.binding, %m: index)
CHECK:     %ckc = arith.constant 64 : index
CHECK:     %xp = "memref.alloca"() <{alignment = 64 : i64, operandSegmentSizes = array<i32: 0, 0>}> : () -> memref<64x64xf32>
CHECK:     %a = stream.binding.subspan %ba[%c0] : !stream.binding -> memref<4x72x256xf32>
CHECK:     %r0 = affine.apply affine_map<(d0) -> ((d0 floordiv 1) * 8)>(%wg)
CHECK:     scf.for %bi = %b0 to %b1 step %c1
CHECK:         %first = arith.andi %firstb, %firstk : i1
CHECK:             vector.store %pv, %xp[%pk, %pn] : memref<64x64xf32>, vector<16xf32>
CHECK:               %ld7_1 = scf.if %first -> (vector<16xf32>)
CHECK:                 %v = vector.load %c[%mi7, %nc1] : memref<72x64xf32>, vector<16xf32>
CHECK:               %acc:16 = scf.for %pkk = %c0 to %ckc step %c1
CHECK:                 %as7 = memref.load %a[%bi, %mi7, %kk] : memref<4x72x256xf32>
CHECK:                 %y7_1 = vector.fma %av7, %xv1, %s7_1 : vector<16xf32>
CHECK:               vector.store %acc#15, %c[%mi7, %nc1] : memref<72x64xf32>, vector<16xf32>
""")
    check(dense_gemm.executable_text("s", "shared", 2, 16, 32, 16), """
CHECK-LABEL: stream.executable private @s
CHECK:   %g = arith.constant 2 : index
CHECK:     %b0 = affine.apply affine_map<(d0) -> (d0 floordiv 1)>(%wg)
CHECK:               %acc:16 = scf.for %pkk = %c0 to %ckc step %c1
CHECK:                 %as15 = memref.load %a[%mi15, %kk] : memref<16x32xf32>
CHECK:               vector.store %acc#15, %c[%bi, %mi15, %nc0] : memref<2x16x16xf32>, vector<16xf32>
""")


def test_ternary_avx2():
    check(ternary_avx2.executable_text("tern_avx2_gemv_8x32", 8, 32), """
CHECK-LABEL: stream.executable private @tern_avx2_gemv_8x32
CHECK:   %g = arith.select %big, %many, %few : index
CHECK:   func.func @tern_avx2_gemv_8x32(%bx: !stream.binding, %bw: !stream.binding, %bo: !stream.binding, %wscale: f32, %m: index)
CHECK:     %buf = memref.alloca() : memref<4x128xi8>
CHECK:     scf.for %mrow = %c0 to %mfull step %cmb
CHECK:       %sx3 = vector.reduction <add>, %sxv3 : vector<8xi32> into i32
CHECK:       %fm3 = arith.mulf %amc3, %wscale : f32
CHECK:       scf.for %r = %r0 to %r1 step %cg
CHECK:         %u0 = arith.subi %lp0, %hi0 : vector<32xi8>
CHECK:         %q0_3 = arith.shrui %u0, %s6 : vector<32xi8>
CHECK:         %e0_3_3 = llvm.call_intrinsic "llvm.x86.avx2.pmadd.ub.sw"(%q0_3, %x3_3)
CHECK:         %n0_3 = arith.addi %s0_3, %g0_3 : vector<16xi16>
CHECK:       %dif0_3 = arith.subi %red0_3, %sx3 : i32
CHECK:     scf.for %mrow = %mfull to %m step %c1
CHECK:       %rq3 = arith.addi %rj, %qoff3 : index
CHECK:         memref.prefetch %w[%preraw3_0, %c], read, locality<3>, data : memref<8x32xi8>
CHECK:         %q3_3 = arith.andi %t3_2, %twelve : vector<32xi8>
CHECK:         %h3 = arith.addi %ph3, %f3b : vector<16xi16>
CHECK:       %wl3 = llvm.call_intrinsic "llvm.x86.avx2.pmadd.wd"(%part#6, %fours16)
CHECK:       %red3_0 = arith.shrsi %red43_0, %c2i32 : i32
CHECK:       memref.store %y3_0, %o[%ocol3_0, %rq3] : memref<?x8xf32>
""")
    check(ternary_avx2.executable_text("tern_avx2_gemv_8x32_offset_q", 8, 32, True, True), """
CHECK:   func.func @tern_avx2_gemv_8x32_offset_q(%bq: !stream.binding, %bs: !stream.binding, %bw: !stream.binding, %bo: !stream.binding, %wscale: f32, %m: index)
CHECK:     %xs = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?x2xf32>{%m}
CHECK:       %sx0 = arith.fptosi %sxf0 : f32 to i32
CHECK-NOT:   %u0 =
CHECK:         %q0_0 = arith.andi %raw0_0, %three : vector<32xi8>
""")


def test_ternary_amx():
    """The avx512 kernel with the AMX loop ahead of its GEMM blocks (packed K 192: a chunk
    of 128 columns whose C tiles start at zero, then a 64-column tail that loads them),
    and its quantize dispatch that lays out the B tiles of whole blocks of 16 rows."""
    check(ternary_amx.executable_text("tern_amx_gemm_32x192_offset_q", 32, 192, gfni=True), """
CHECK-LABEL: stream.executable private @tern_amx_gemm_32x192_offset_q
CHECK:   func.func @tern_amx_gemm_32x192_offset_q(%bq: !stream.binding, %bs: !stream.binding, %bv: !stream.binding, %bw: !stream.binding, %bo: !stream.binding, %wscale: f32, %m: index)
CHECK:     %crw = arith.constant 32 : index
CHECK:     %xv = stream.binding.subspan %bv[%c0] : !stream.binding -> memref<?x12288xi8>{%nmb}
CHECK:     %dec = "memref.alloca"() <{alignment = 64 : i64, operandSegmentSizes = array<i32: 0, 0>}> : () -> memref<8x32x64xi8>
CHECK:     %cbuf = "memref.alloca"() <{alignment = 64 : i64, operandSegmentSizes = array<i32: 0, 0>}> : () -> memref<16x16x16xi32>
CHECK:     scf.for %ms = %c0 to %nmb step %amsuper
CHECK:     scf.for %nt = %r0 to %r1 step %arows
CHECK:         %dshf_0_0 = llvm.call_intrinsic "llvm.x86.avx512.pmultishift.qb.512"(%mshift, %drepf_0_0)
CHECK:         scf.for %mg = %ms to %msg step %agroup
CHECK:           %czfg_0_0_0 = llvm.call_intrinsic "llvm.x86.tilezero.internal"(%tr16, %tc64)
CHECK:           %tafg_0_0 = llvm.call_intrinsic "llvm.x86.tileloadd64.internal"
CHECK:           %bofg_0_0 =
CHECK:           %tbfg_0_0 = llvm.call_intrinsic "llvm.x86.tileloadd64.internal"
CHECK:           %czfg_0_0_1 = llvm.call_intrinsic "llvm.x86.tdpbusd.internal"(%tr16, %tc64, %tc64, %czfg_0_0_0, %tafg_0_0, %tbfg_0_0)
CHECK:           %tafg_0_1 = llvm.call_intrinsic "llvm.x86.tileloadd64.internal"
CHECK:           %czfg_1_0_1 = llvm.call_intrinsic "llvm.x86.tdpbusd.internal"
CHECK:           llvm.call_intrinsic "llvm.x86.tilestored64.internal"(%tr16, %tc64, %czfg_0_0_8sp, %i64c64, %czfg_0_0_8)
CHECK:         scf.for %mg = %msg to %msend step %c1
CHECK:       %kctail = arith.constant 128 : index
CHECK:           %czto_0_0_0 = llvm.call_intrinsic "llvm.x86.tileloadd64.internal"(%tr16, %tc64, %czto_0_0_0p, %i64c64)
CHECK:           vector.store %fya00, %o[%fra00, %nta0] : memref<?x32xf32>, vector<16xf32>
CHECK:     %mend0 = arith.addi %m16, %mlen0 : index
CHECK:       scf.for %mrow = %m16 to %mend0 step %cmb0
""")
    check(ternary_amx.quantize_text("tern_amx_quant_64", 64), """
CHECK-LABEL: stream.executable private @tern_amx_quant_64
CHECK:   %big = arith.cmpi uge, %m, %mmin : index
CHECK:   %gbig = affine.apply affine_map<()[s0] -> (s0 ceildiv 16)>()[%m]
CHECK:   %gsmall = affine.apply affine_map<()[s0] -> (s0 ceildiv 4)>()[%m]
CHECK:   %g = arith.select %big, %gbig, %gsmall : index
CHECK:   func.func @tern_amx_quant_64(%bx: !stream.binding, %bq: !stream.binding, %bs: !stream.binding, %bv: !stream.binding, %m: index)
CHECK:     %csmall = arith.constant 4 : index
CHECK:     %tiled = arith.cmpi uge, %m, %cpadm : index
CHECK:     %crows = arith.select %tiled, %c16, %csmall : index
CHECK:     scf.if %whole
CHECK:         %xcol8_0 = vector.shuffle %xa0, %xb0 [0, 1, 32, 33, 2, 3, 34, 35,
CHECK:         %xt3_0 = vector.shuffle %xt2_0, %xt2_8 [0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23]
CHECK:         vector.store %xo0, %xv[%wg, %xoff0] : memref<?x4096xi8>, vector<64xi8>
""")


def test_ternary_avx512():
    check(ternary_avx512.executable_text("tern_avx512_gemv_8x64_offset_q", 8, 64, True, True,
                                         gfni=True), """
CHECK-LABEL: stream.executable private @tern_avx512_gemv_8x64_offset_q
CHECK:   %g = arith.select %big, %many, %few : index
CHECK:   func.func @tern_avx512_gemv_8x64_offset_q(%bq: !stream.binding, %bs: !stream.binding, %bw: !stream.binding, %bo: !stream.binding, %wscale: f32, %m: index)
CHECK:     %cg0 = arith.constant 2 : index
CHECK:     %cmb0 = arith.constant 8 : index
CHECK:     %cmb2 = arith.constant 2 : index
CHECK:     %ctile = arith.constant 32 : index
CHECK:     %xq = stream.binding.subspan %bq[%c0] : !stream.binding -> memref<?x256xi8>{%m}
CHECK:     %gfa0q = arith.constant dense<72620543991349248> : vector<8xi64>
CHECK:     %gfa3q = arith.constant dense<4647714815446351872> : vector<8xi64>
CHECK:     %mend0 = arith.addi %c0, %mlen0 : index
CHECK:     %mleft1 = arith.subi %m, %mend0 : index
CHECK:     %mend2 = arith.addi %mend1, %mlen2 : index
CHECK:     scf.for %rt = %r0 to %r1 step %ctile
CHECK:       scf.for %mrow = %c0 to %mend0 step %cmb0
CHECK:         %fm7 = arith.mulf %amc7, %wscale : f32
CHECK:         %sumv = vector.from_elements %sx0, %sx0, %sx1, %sx1, %sx2, %sx2, %sx3, %sx3, %sx4, %sx4, %sx5, %sx5, %sx6, %sx6, %sx7, %sx7 : vector<16xi32>
CHECK:         scf.for %r = %rt to %rtend step %cg0
CHECK:           %acc:16 = scf.for %c = %c0 to %ckb step %cc iter_args(%a0_0 = %z32, %a1_0 = %z32, %a0_1 = %z32,
CHECK:             %raw0b = vector.load %w[%rowraw0, %c] : memref<8x64xi8>, vector<64xi8>
CHECK:             memref.prefetch %w[%preraw0, %c], read, locality<3>, data : memref<8x64xi8>
CHECK:             %q0_3 = llvm.call_intrinsic "llvm.x86.vgf2p8affineqb.512"(%raw0b, %gfa3, %gfb) : (vector<64xi8>, vector<64xi8>, i8) -> vector<64xi8>
CHECK:             %x7_3 = vector.load %xq[%xr7, %xo7_3] : memref<?x256xi8>, vector<64xi8>
CHECK:             %na1_7 = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"(%pc1_7, %q1_3, %x7_3) : (vector<16xi32>, vector<64xi8>, vector<64xi8>) -> vector<16xi32>
CHECK:           %sr0_0l = vector.shuffle %acc#0, %acc#1 [0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29]
CHECK:           %sr1_0l = vector.shuffle %sr0_0, %sr0_1 [0, 1, 16, 17,
CHECK:           %sr2_0l = vector.shuffle %sr1_0, %sr1_1 [0, 1, 2, 3, 8, 9, 10, 11, 16,
CHECK:           %sr3_0 = arith.addi %sr3_0l, %sr3_0h : vector<16xi32>
CHECK:           %sdif = arith.subi %sr3_0, %sumv : vector<16xi32>
CHECK:           %y7 = vector.extract_strided_slice %sy offsets = [14], sizes = [2], strides = [1] : vector<16xf32> to vector<2xf32>
CHECK:           vector.store %y7, %o[%ocol7, %r] : memref<?x8xf32>, vector<2xf32>
CHECK:       scf.for %mrow = %mend0 to %mend1 step %cmb1
CHECK:           %acc:16 = scf.for %c = %c0 to %ckb step %cc iter_args(%a0_0 = %z32, %b0_0 = %z32,
CHECK:           %all7 = arith.addi %acc#14, %acc#15 : vector<16xi32>
CHECK:       scf.for %mrow = %mend1 to %mend2 step %cmb2
CHECK:           %acc:8 = scf.for
CHECK:     scf.for %mrow = %mend2 to %m step %c1
CHECK:       scf.for %rj = %r0 to %rqend step %c1
CHECK:           memref.prefetch %w[%preraw3, %c], read, locality<3>, data : memref<8x64xi8>
CHECK:           %qw3_1 = arith.andi %raw3, %twelve : vector<16xi32>
CHECK:           %nb3_0 = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"(%pb3_0, %q3_3, %x0_3)
CHECK:         memref.store %y3, %o[%mrow, %rq3] : memref<?x8xf32>
""")
    # without GFNI (or on signed codes) the GEMM loop decodes each plane with a shift and an and
    check(ternary_avx512.executable_text("tern_avx512_gemv_8x64_q", 8, 64, False, True,
                                         gfni=True), """
CHECK-NOT:   vgf2p8affineqb
CHECK:       %u0 = arith.subi %lp0, %hi0 : vector<16xi32>
CHECK:       %t0_3 = arith.shrui %u0, %s6 : vector<16xi32>
CHECK:       %qw0_3 = arith.andi %t0_3, %three : vector<16xi32>
""")
    check(ternary_avx512.executable_text("tern_avx512_gemv_8x64_offset_q", 8, 64, True, True,
                                         gfni=False), """
CHECK-NOT:   vgf2p8affineqb
CHECK:       %t0_2 = arith.shrui %raw0, %s4 : vector<16xi32>
CHECK:       %qw0_2 = arith.andi %t0_2, %three : vector<16xi32>
""")
    check(ternary_avx512.executable_text("tern_avx512_gemv_8x64", 8, 64), """
CHECK:   func.func @tern_avx512_gemv_8x64(%bx: !stream.binding, %bw: !stream.binding, %bo: !stream.binding, %wscale: f32, %m: index)
CHECK:     %buf = memref.alloca() : memref<1x256xi8>
CHECK-NOT: scf.for %rt
CHECK:     scf.for %mrow = %c0 to %m step %c1
CHECK:       vector.store %qb, %buf[%c0, %k] : memref<1x256xi8>, vector<8xi8>
CHECK:         %u0 = arith.subi %lp0, %hi0 : vector<16xi32>
CHECK:         %q0_0 = vector.bitcast %qw0_0 : vector<16xi32> to vector<64xi8>
""")


def test_ternary_avx2_quant():
    check(ternary_avx2_quant.quantize_text("tern_avx2_quant_16", 16), """
CHECK-LABEL: stream.executable private @tern_avx2_quant_16
CHECK:   %g = affine.apply affine_map<()[s0] -> (s0 ceildiv 4)>()[%m]
CHECK:   func.func @tern_avx2_quant_16(%bx: !stream.binding, %bq: !stream.binding, %bs: !stream.binding, %m: index)
CHECK:     %c127 = arith.constant 1.270000000e+02 : f32
CHECK:     scf.for %row = %row0 to %row1 step %c1
CHECK:       %rd = llvm.call_intrinsic "llvm.roundeven.v8f32"(%sc) : (vector<8xf32>) -> vector<8xf32>
CHECK:       vector.store %qb, %q[%row, %k] : memref<?x64xi8>, vector<8xi8>
CHECK:       %sxf0 = arith.sitofp %sx0 : i32 to f32
CHECK:       memref.store %amc0, %xs[%row, %c1] : memref<?x2xf32>
""")


def test_ternary_avx2_quant_of_an_unpadded_x():
    """x [M, 40] read as it is, its codes [M, 64] zero from column 40 on."""
    check(ternary_avx2_quant.quantize_text("tern_avx2_quant_16_x40", 16, 40), """
CHECK-LABEL: stream.executable private @tern_avx2_quant_16_x40
CHECK:   %x = stream.binding.subspan %bx[%c0] : !stream.binding -> memref<?x40xf32>{%m}
CHECK:   %ckx = arith.constant 40 : index
CHECK:   scf.for %k = %c0 to %ckx step %c8
CHECK:     vector.load %x[%row, %k] : memref<?x40xf32>, vector<8xf32>
CHECK:   scf.for %k = %ckx to %ckp step %c8
CHECK:     vector.store %zb8, %q[%row, %k] : memref<?x64xi8>, vector<8xi8>
""")


def test_ternary_avx512_tall():
    """Rows of x in the lanes: workgroups over M (16 x 4 x 4 rows each), each weight row
    group of 4 decoded to one i32 a packed byte on the stack, 4 x 4 vpdpbusd a column
    with the weights broadcast, and (64 positions an image) the output stored as
    [images, N, P], 16 floats a store."""
    check(ternary_avx512_tall.executable_text("tern_avx512_tall_8x64_offset_p64", 8, 64, True, 64), """
CHECK-LABEL: stream.executable private @tern_avx512_tall_8x64_offset_p64
CHECK:   %g = affine.apply affine_map<()[s0] -> (s0 ceildiv 256)>()[%m]
CHECK:   func.func @tern_avx512_tall_8x64_offset_p64(%bq: !stream.binding, %bs: !stream.binding, %bw: !stream.binding, %bo: !stream.binding, %wscale: f32, %m: index)
CHECK:     %xq = stream.binding.subspan %bq[%c0] : !stream.binding -> memref<?x4096xi8>{%mb}
CHECK:     %xs = stream.binding.subspan %bs[%c0] : !stream.binding -> memref<?x32xf32>{%mb}
CHECK:     %o = stream.binding.subspan %bo[%c0] : !stream.binding -> memref<?x8x64xf32>{%nimg}
CHECK:     %wdec = memref.alloca() : memref<4x64xi32>
CHECK:     scf.for %rg = %c0 to %cn step %crows
CHECK:       %dec0 = arith.andi %o3_0, %m3 : vector<16xi32>
CHECK:       scf.for %sb = %b0 to %bfull step %cnb
CHECK:         %acc:16 = scf.for %cb = %c0 to %ckq step %c1
CHECK:           %x3 = vector.load %xq[%blk3, %qo] : memref<?x4096xi8>, vector<64xi8>
CHECK:           %ws3 = memref.load %wdec[%c3, %cb] : memref<4x64xi32>
CHECK:           %n3_3 = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"(%a3_3, %w3, %x3)
CHECK:         %pos0 = affine.apply affine_map<(d0) -> (d0 mod 64)>(%row0)
CHECK:         vector.store %y0_0, %o[%img0, %oc0_0, %pos0] : memref<?x8x64xf32>, vector<16xf32>
CHECK:       scf.for %sb = %bfull to %b1 step %c1
CHECK:         %acc:4 = scf.for %cb = %c0 to %ckq step %c1
""")
    # signed codes remapped in the decode; [M, N] out: a 4x16 tile transposed to rows
    check(ternary_avx512_tall.executable_text("t", 8, 7, False, 0), """
CHECK:     %o = stream.binding.subspan %bo[%c0] : !stream.binding -> memref<?x8xf32>{%m}
CHECK:       %dmask = vector.create_mask %left : vector<16xi1>
CHECK:       %u0 = vector.maskedload %w[%r0, %cd], %dmask, %zb16
CHECK:       %z0 = arith.subi %lp0, %hi0 : vector<16xi32>
CHECK:         %tr0 = vector.transpose %t3_0, [1, 0] : vector<4x16xf32> to vector<16x4xf32>
CHECK:         vector.store %e0_15, %o[%or0_15, %rg] : memref<?x8xf32>, vector<4xf32>
""")
    # K = 576 packed in 192 bytes a row, q in planes of 144: the products run over 144
    # bytes, the decode regroups column c + j 144 from packed byte (c + j 144) mod 192,
    # plane (c + j 144) div 192
    check(ternary_avx512_tall.executable_text("t", 8, 192, True, 0, 144), """
CHECK:     %xq = stream.binding.subspan %bq[%c0] : !stream.binding -> memref<?x9216xi8>{%mb}
CHECK:     %wdec = memref.alloca() : memref<4x144xi32>
CHECK:       scf.for %cd = %c0 to %ckq step %c16
CHECK:         %cc3 = affine.apply affine_map<(d0) -> (d0 + 432)>(%cd)
CHECK:         %pb3 = affine.apply affine_map<(d0) -> (d0 mod 192)>(%cc3)
CHECK:         %pl3 = affine.apply affine_map<(d0) -> ((d0 floordiv 192) * 2)>(%cc3)
CHECK:         %u0_3 = vector.load %w[%r0, %pb3] : memref<8x192xi8>, vector<16xi8>
CHECK:         %e0_3 = arith.shrui %z0_3, %psh3 : vector<16xi32>
CHECK:         %g0_3 = arith.shli %f0_3, %b24 : vector<16xi32>
CHECK:         vector.store %dec0, %wdec[%c0, %cd] : memref<4x144xi32>, vector<16xi32>
CHECK:         %acc:16 = scf.for %cb = %c0 to %ckq step %c1
""")


def test_ternary_lanes_quant():
    """The tall kernel's quantize dispatch: 3x3 stride 1 over [N, 16, 18, 18] (16x16
    outputs), each block's column one vector load at its image, row and x; K = 144 of
    KB = 64: planes 0-1 whole, plane 2 on columns below 16, plane 3 zero."""
    check(ternary_avx512_tall.quantize_text("q", 64, 144, (16, 18, 18), (3, 3), (1, 1), (1, 1),
                                            (16, 16)), """
CHECK-LABEL: stream.executable private @q
CHECK:   %g = affine.apply affine_map<()[s0] -> (s0 ceildiv 64)>()[%m]
CHECK:     memref.global "private" constant @q_off : memref<144xi32> = dense<[0, 1, 2, 18, 19, 20, 36, 37, 38, 324, 325,
CHECK:     %q = stream.binding.subspan %bq[%c0] : !stream.binding -> memref<?x4096xi8>{%mb}
CHECK:     %off = memref.get_global @q_off : memref<144xi32>
CHECK:     %base = affine.apply affine_map<(d0) -> ((d0 floordiv 256) * 5184 + ((d0 mod 256) floordiv 16) * 18 + (d0 mod 16) * 1)>(%row0)
CHECK:       %va3 = vector.load %x[%aa3] : memref<?xf32>, vector<16xf32>
CHECK:       arith.maximumf %a3, %av3 fastmath<nnan,nsz> : vector<16xf32>
CHECK:     %qs = arith.divf %c127, %amc : vector<16xf32>
CHECK:     %sum0 = scf.for %cb = %cl0 to %ch0 step %c1
CHECK:       %rd2 = llvm.call_intrinsic "llvm.roundeven.v16f32"(%sc2)
CHECK-NOT:   %col3
CHECK:       vector.store %db, %q[%blk, %qo] : memref<?x4096xi8>, vector<64xi8>
CHECK:     %sum1 = scf.for %cb = %cl1 to %ch1 step %c1 iter_args(%sa = %sum0)
CHECK-NOT:   %col2
CHECK:     vector.store %amc, %xs[%blk, %c16] : memref<?x32xf32>, vector<16xf32>
""")
    # a stride of 2 at 8 outputs a row: a block is two runs, each a load of the 15
    # floats it reads (masked to them), the evens of both kept by one shuffle
    check(ternary_avx512_tall.quantize_text("q", 64, 144, (16, 18, 18), (3, 3), (2, 2), (1, 1),
                                            (8, 8)), """
CHECK:     %smask = vector.constant_mask [15] : vector<16xi1>
CHECK:       %sb1 = affine.apply affine_map<(d0) -> (((d0 + 8) floordiv 64) * 5184 + (((d0 + 8) mod 64) floordiv 8) * 36 + ((d0 + 8) mod 8) * 2)>(%row0)
CHECK:         %ga0_1a = arith.addi %sb1, %oa0 : index
CHECK:         %ga0_1 = vector.maskedload %x[%ga0_1a], %smask, %szf
CHECK:         %va0 = vector.shuffle %ga0_0, %ga0_1 [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30]
CHECK-NOT:   vector.gather
""")
    # 6 outputs a row (runs do not tile a block): gathered, each lane from its own base
    check(ternary_avx512_tall.quantize_text("q", 64, 144, (16, 14, 14), (3, 3), (2, 2), (1, 1),
                                            (6, 6)), """
CHECK:     %lb = memref.alloca() : memref<16xi32>
CHECK:       %va0 = vector.gather %x[%oa0][%lbv], %all, %zf
""")
    # with the absmax map: 9 loads of the map a block (its image, row and x), no K loop
    check(ternary_avx512_tall.quantize_text("q", 64, 144, (16, 18, 18), (3, 3), (1, 1), (1, 1),
                                            (16, 16), amap=True), """
CHECK:   func.func @q(%bx: !stream.binding, %ba: !stream.binding, %bq: !stream.binding, %bs: !stream.binding, %nimg: index, %m: index)
CHECK:     %xa = stream.binding.subspan %ba[%c0] : !stream.binding -> memref<?xf32>{%alen}
CHECK:     %abase = affine.apply affine_map<(d0) -> ((d0 floordiv 256) * 324 + ((d0 mod 256) floordiv 16) * 18 + (d0 mod 16) * 1)>(%row0)
CHECK:     %aa8 = affine.apply affine_map<(d0) -> (d0 + 38)>(%abase)
CHECK:     %am8 = arith.maximumf %am7, %va8
CHECK:     %amc = arith.maximumf %am8, %eps
CHECK-NOT: %am:4
CHECK:     %qs = arith.divf %c127, %amc
""")
    # stride 2 with the map: the map read by the same two runs
    check(ternary_avx512_tall.quantize_text("q", 64, 144, (16, 18, 18), (3, 3), (2, 2), (1, 1),
                                            (8, 8), amap=True), """
CHECK:     %sab1 = affine.apply affine_map<(d0) -> (((d0 + 8) floordiv 64) * 324 + (((d0 + 8) mod 64) floordiv 8) * 36 + ((d0 + 8) mod 8) * 2)>(%row0)
CHECK:     %ao4 = arith.constant 19 : index
CHECK:     %ga4_1a = arith.addi %sab1, %ao4 : index
CHECK:     %va4 = vector.shuffle %ga4_0, %ga4_1
""")


def test_ternary_lanes_quant_unpadded():
    """The tall kernel's quantize from a 3x3 conv's unpadded input [N, 64, 16, 16] (pad
    1): a block's base one row and column before its first position, the load mask of
    kernel position (i, j) its input row in range and each lane's column, channels outer
    and the 9 positions inside, offsets c H W + a constant, stored in packed-column order."""
    check(ternary_avx512_tall.unpadded_text("u", 144, (64, 16, 16), (3, 3), (1, 1), (1, 1),
                                            (16, 16), (1, 1)), """
CHECK-LABEL: stream.executable private @u
CHECK:   func.func @u(%bx: !stream.binding, %ba: !stream.binding, %bq: !stream.binding, %bs: !stream.binding, %nimg: index, %m: index)
CHECK:     %sb0 = affine.apply affine_map<(d0) -> (((d0 + 0) floordiv 256) * 16384 + (((d0 + 0) mod 256) floordiv 16) * 16 + ((d0 + 0) mod 16) * 1 - 17)>(%row0)
CHECK:     %ry0_0 = affine.apply affine_map<(d0) -> ((((d0 + 0) mod 256) floordiv 16) * 1 - 1)>(%row0)
CHECK:     %rok0_0 = arith.cmpi ult, %ry0_0, %ch : index
CHECK:     %cok0_0 = arith.cmpi ult, %cx0_0, %wv : vector<16xi32>
CHECK:     %mk8_0 = arith.andi %rn2_0, %cok2_0 : vector<16xi1>
CHECK:     %ga8_0 = vector.maskedload %xa[%ga8_0a], %mk8_0, %szf
CHECK:     %amc = arith.maximumf %am8, %eps
CHECK:     %sumv = scf.for %cc = %c0 to %ccq step %c1 iter_args(%sa = %zi)
CHECK:       %o8_3 = affine.apply affine_map<(d0) -> (d0 * 256 + 12322)>(%cc)
CHECK:       %gp8_3_0 = vector.maskedload %x[%gp8_3_0a], %mk8_0, %szf
CHECK:       %qo8 = affine.apply affine_map<(d0) -> ((d0 * 9 + 8) * 64)>(%cc)
CHECK:       vector.store %db8, %q[%blk, %qo8] : memref<?x9216xi8>, vector<64xi8>
CHECK:     %sumf = arith.sitofp %sumv
""")


def test_ternary_amax_map():
    """The absmax map over the channels: 16 positions a vector, 4 accumulators over C,
    the last chunk of HW = 100 masked."""
    from tercomp.kernels.template import render
    check(render("ternary_amax_map", name="a", c=8, hw=100, units=16), """
CHECK:   %g = affine.apply affine_map<()[s0] -> (s0 ceildiv 16)>()[%m]
CHECK:     %xb = affine.apply affine_map<(d0) -> ((d0 floordiv 7) * 800 + (d0 mod 7) * 16)>(%u)
CHECK:     %mask = vector.create_mask %left
CHECK:     %am:4 = scf.for %ch = %c0 to %cc step %cacc
CHECK:       %xa3 = affine.apply affine_map<(d0, d1) -> (d0 + (d1 + 3) * 100)>(%xb, %ch)
CHECK:       %v3 = vector.maskedload %x[%xa3], %mask, %zf
CHECK:       %an3 = arith.maximumf %a3, %av3 fastmath<nnan,nsz>
CHECK:     vector.maskedstore %a[%ab], %mask, %amv
""")
    check(render("ternary_amax_map", name="a", c=3, hw=64, units=16), """
CHECK:     %am:1 = scf.for
CHECK:       %v0 = vector.load %x[%xa0]
CHECK:     vector.store %amv, %a[%ab]
""")


def test_ternary_im2col_quant():
    """A 3x3 conv, stride 2, dilation 1, over padded [N, 16, 10, 10] images (4x4 outputs):
    per-column offsets c * 100 + i * 10 + j on the stack, each row's base at its image and
    (2 y, 2 x), two passes of 16-column gathers, the codes' columns from K = 144 on zero."""
    check(ternary_im2col_quant.quantize_text("tern_im2col_quant_64", 64, (16, 10, 10), (3, 3),
                                             (2, 2), (1, 1), (4, 4)), """
CHECK-LABEL: stream.executable private @tern_im2col_quant_64
CHECK:   %g = affine.apply affine_map<()[s0] -> (s0 ceildiv 16)>()[%m]
CHECK:   func.func @tern_im2col_quant_64(%bx: !stream.binding, %bq: !stream.binding, %bs: !stream.binding, %nimg: index, %m: index)
CHECK:     %ck = arith.constant 144 : index
CHECK:     %ckp = arith.constant 256 : index
CHECK:     %cpos = arith.constant 16 : index
CHECK:     %off = memref.alloca() : memref<144xi32>
CHECK:     affine_map<(d0) -> ((d0 floordiv 9) * 100 + ((d0 mod 9) floordiv 3) * 10 + (d0 mod 3) * 1)>
CHECK:     %base = affine.apply affine_map<(d0, d1, d2) -> (d0 * 1600 + d1 * 20 + d2 * 2)>(%n, %py, %px)
CHECK:     vector.gather %x[%base][%idx], %all, %zf : memref<?xf32>, vector<16xi32>, vector<16xi1>, vector<16xf32> into vector<16xf32>
CHECK:     %amc = arith.maximumf %amax, %eps : f32
CHECK:     vector.gather %x[%base][%idx]
CHECK:     %rd = llvm.call_intrinsic "llvm.roundeven.v16f32"(%sc) : (vector<16xf32>) -> vector<16xf32>
CHECK:     vector.store %qb, %q[%row, %col] : memref<?x256xi8>, vector<16xi8>
CHECK:     scf.for %col = %ck to %ckp step %c16
CHECK:     memref.store %amc, %xs[%row, %c1] : memref<?x2xf32>
""")
