"""The "vnni" decode kernel (llvm-cpu; fast with AVX-512 VNNI): u8 x s8 products reduced
with `vpdpbusd` over the 2-bit planar constant. Without VNNI (AVX2) LLVM widens the
products to i32 lanes (`vpmovzxbd` + `vpmaddwd`, 8 products an instruction), slower than
"addsub": the strategy table only picks it on a VNNI host.

It computes `sum_k c_k x_k - sum_k x_k = sum_k w_k x_k` with the u8 codes c = w + 1 in
{0, 1, 2}, recoded from each 2-bit field inside the kernel (so the 2-bit constant is
the only copy of the weights: recoding it ahead would make IREE hoist a second, recoded
copy to module load when the weights are .irpa parameters), and the int8-quantized x.
The tiling is fixed by a CPU-only `#iree_codegen.compilation_info`: GPU targets never
get this kernel (the kernel table, kernels/table.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from iree.compiler import ir
from iree.compiler.dialects import arith, linalg, tensor

from ...codegen.builders import PARALLEL, REDUCTION, affine_map, const, generic
from .builder import TernaryBuilder


@dataclass(frozen=True)
class Tiles:
    """The tiling of the (M, N, plane, KB) reduction generic.

    `dist` (M, N): rows of each workgroup (IREE's local-task splits the workgroups over
    the cores); `vec` (M, N): the outputs of one vector step, each the
    `vector.reduce.add` of `k_bytes` products (0: `_k_tile(KB)`), which LLVM's X86 ISel
    lowers to a chain of `vpdpbusd` and one horizontal add.
    """
    dist: tuple[int, int]
    vec: tuple[int, int]
    k_bytes: int = 0


# 2 output rows per vector step share the loads of x; 32 rows per workgroup.
GEMV = Tiles(dist=(1, 32), vec=(1, 2))


def vnni(kern: TernaryBuilder) -> ir.Value:
    """y = scale * x @ T^T with int8-quantized x, for any (small) M."""
    i8, i32, kb = kern.i8, kern.i32, kern.kb
    amax = kern.row_absmax()
    xq = kern.pad_k(kern.quantize(amax, i8))
    # x [M, KP] as [M, 4, KB]: plane j is the contiguous K slice j*KB .. (j+1)*KB.
    xe = tensor.expand_shape(kern.ttype([4, kb], i8), xq, [[0], [1, 2]],
                             kern.m_values, [kern.m_static, 4, kb])
    part = _products(kern, xe, kern.weights(), GEMV)
    rowsum = generic(kern.ttype([], i32), [xq], kern.zeros([], i32),
                      [affine_map(2, [0, 1]), affine_map(2, [0])], [PARALLEL, REDUCTION],
                      lambda v, acc: arith.addi(acc, arith.extsi(i32, v)))
    total = generic(kern.ttype([kern.n], i32), [part, rowsum], kern.empty([kern.n], i32),
                     [affine_map(2, [0, 1]), affine_map(2, [0]), affine_map(2, [0, 1])], [PARALLEL, PARALLEL],
                     lambda v, rs, _o: arith.subi(v, rs))
    return kern.dequant(total, amax)


def _products(kern: TernaryBuilder, xe: ir.Value, w: ir.Value, tiles: Tiles) -> ir.Value:
    """sum over (plane j, KB) of extui(code) * extsi(x) as tensor<M x N x i32>.

    One reduction generic over (M, N, j, KB) whose body extracts plane j's 2-bit code,
    recodes it to c = w + 1 and multiply-adds into a scalar i32 accumulator. The
    compilation_info makes each vector step `vector.reduce.add(mul(zext <k_bytes x i8>,
    sext ...))` in one basic block, the form LLVM lowers to `vpdpbusd`. IREE's default
    tiling (8 rows x 64 bytes) also gets `vpdpbusd` but pays a horizontal add per 64
    bytes; a loop-carried vector accumulator (a (KO, KI) split of KB) gets only
    `vpmaddwd`/`vpdpwssd` from this LLVM.
    """
    i8, i32 = kern.i8, kern.i32
    red = tiles.k_bytes or _k_tile(kern.kb)
    (dm, dn), (vm, vn) = tiles.dist, tiles.vec
    if kern.m == 1:
        # No unit M dimension: IREE would fold it away and drop the compilation_info.
        xe = tensor.collapse_shape(ir.RankedTensorType.get([4, kern.kb], i8), xe,
                                   [[0, 1], [2]])
        maps = [affine_map(3, [1, 2]), affine_map(3, [0, 2]), affine_map(3, [0])]
        iters, jdim = [PARALLEL, REDUCTION, REDUCTION], 1
        part_t = ir.RankedTensorType.get([kern.n], i32)
        init = linalg.fill(const(0, i32), outs=[tensor.empty([kern.n], i32)])
        tiles_ = ([dn, 0, 0], [vn, 0, 0], [0, 1, red])
    else:
        maps = [affine_map(4, [0, 2, 3]), affine_map(4, [1, 3]), affine_map(4, [0, 1])]
        iters, jdim = [PARALLEL, PARALLEL, REDUCTION, REDUCTION], 2
        part_t = kern.ttype([kern.n], i32)
        init = kern.zeros([kern.n], i32)
        tiles_ = ([dm, dn, 0, 0], [vm, vn, 0, 0], [0, 0, 1, red])
    zero, one, two, three = (const(v, i8) for v in (0, 1, 2, 3))

    def body(a, p, acc):
        j = arith.index_cast(i8, linalg.IndexOp(jdim).result)
        f = arith.andi(arith.shrui(p, arith.muli(j, two)), three)
        # c = w + 1 from the 2-bit code f (0 -> 1, +1 -> 2, -1 -> 0)
        c = arith.select(arith.cmpi(arith.CmpIPredicate.eq, f, two), zero, arith.addi(f, one))
        return arith.addi(acc, arith.muli(arith.extui(i32, c), arith.extsi(i32, a)))

    part = generic(part_t, [xe, w], init, maps, iters, body)
    dist, par, redt = (", ".join(map(str, t)) for t in tiles_)
    part.owner.attributes["compilation_info"] = ir.Attribute.parse(
        "#iree_codegen.compilation_info<lowering_config = #iree_cpu.lowering_config<"
        f"distribution = [{dist}], vector_common_parallel = [{par}], "
        f"vector_reduction = [{redt}]>, translation_info = "
        "#iree_codegen.translation_info<pipeline = #iree_cpu.pipeline<DoubleTilingExpert>>>")
    if kern.m == 1:
        part = tensor.expand_shape(kern.ttype([kern.n], i32), part, [[0, 1]], [], [1, kern.n])
    return part


def _k_tile(kb: int) -> int:
    """The KB tile of one vector step: 512 bytes (8 x 64-byte `vpdpbusd`), or the
    largest power-of-two divisor of KB below that, or KB itself when no such divisor
    is a multiple of 64 (small or odd widths; the step is then a plain vector loop)."""
    t = 512
    while t >= 64:
        if kb % t == 0:
            return t
        t //= 2
    return kb if kb <= 512 else 64
