"""The ternary matmul strategies: the rows of op `ternary_matmul` in the one kernel
table (kernels/table.py: their targets, CPU features, shape rules, IREE flags and
why), and here what each emits and which 2-bit codes it reads. Read by the `ternary`
pass (which settles "auto" per target and per shape), the lowering (the IREE flags of
the strategies a module uses, codegen.lower) and the CLI (`--ternary` choices).

"auto" takes the first row, in table order, that compiles for every target of the
compile (on llvm-cpu: with the host's features) and whose rule accepts the shape (M
None: a symbolic batch): avx512 on an AVX-512 VNNI host where the shape fits, avx2 on
an AVX2 host where the shape fits, else for a symbolic
batch dispatch-vnni (a VNNI host) or dispatch, for M <= 4 vnni (VNNI) or addsub, for
M > 4 blocked, and addsub on GPUs and for CPU + GPU artifacts. int8 and f32 are never
picked: int8 keeps an unpacked int8 copy of every weight in RAM (1 B a weight, 4 B
without act_quant), made at load; f32 is the exact reference.

Every strategy but int8 reads only the 2-bit constant, so one copy of each weight
exists at run time (blocked unpacks NT rows at a time into a cache-sized temporary).
"avx2" is llvm-cpu (compiled for the host) on a CPU with AVX2, for K/4 a multiple of
32 and N of 4 (`avx2.fits`); it is a hand-scheduled dispatch (`avx2`), and with
"avx512" the only strategies that do not compile without their feature, so asking for
them elsewhere fails by name. On this project's AVX2 host it is the fastest kernel
measured at every M, and needs no data tiling (so no scf.if on M, no per-call re-layout).
"avx512" (`avx512`: the same dispatch on zmm registers with `vpdpbusd`, K/4 a multiple
of 64) comes before it and is picked only on an AVX-512 VNNI host, where it measured
faster than avx2 at every M (bench/RESULTS.md); the vnni rows stay for shapes neither
hand-scheduled kernel takes.
"vnni" needs llvm-cpu on a host with AVX-512 VNNI (`vpdpbusd`) to be fast; elsewhere
(AVX2) it still compiles but LLVM widens the products to i32 `vpmaddwd`, slower than
addsub. The measurements behind these choices are in bench/RESULTS.md.
"""
from __future__ import annotations

from typing import Callable, Sequence

from iree.compiler import ir
from iree.compiler.dialects import arith, scf

from ...errors import TercompError
from ...ir import TensorType
from .. import table as kt
from . import avx2, avx512
from ...codegen.builders import const
from ..table import GEMV_MAX_M, avx2_fits, avx512_fits
from .blocked import blocked
from .builder import TernaryBuilder, check_packed
from .vnni import vnni

OP = "ternary_matmul"
#: The strategies, in table order (the rows of op ternary_matmul).
TABLE = kt.rows(OP)
STRATEGIES = {r.kernel: r for r in TABLE}
NAMES = tuple(STRATEGIES)
#: What tc.compile(ternary=...) and `tercomp compile --ternary` accept.
CHOICES = ("auto", *NAMES, "off")


def _f32(kern: TernaryBuilder, act_quant: bool) -> ir.Value:
    return kern.addsub(integer=False, act_quant=act_quant)


def _int_only(emit):
    # Without activation quantization there are no int8 activations to multiply: the
    # exact f32 masked add/sub kernel, on the same 2-bit constant.
    return lambda kern, aq: emit(kern) if aq else _f32(kern, aq)


def _dispatch(small: str, large: str):
    """scf.if on the batch size, one kernel for M <= GEMV_MAX_M and another above;
    both read the same 2-bit constant (a static M gets its branch directly)."""
    def emit(kern: TernaryBuilder, aq: bool) -> ir.Value:
        if kern.m is not None:
            return EMIT[small if kern.m <= GEMV_MAX_M else large](kern, aq)
        kern.pin_weights()      # else IREE folds each branch's view into its own constant
        is_small = arith.cmpi(arith.CmpIPredicate.ule, kern.m_values[0],
                              const(GEMV_MAX_M, kern.index))
        branch = scf.IfOp(is_small, [kern.ttype([kern.n], kern.f32)], has_else=True)
        with ir.InsertionPoint(branch.then_block):
            scf.YieldOp([EMIT[small](kern, aq)])
        with ir.InsertionPoint(branch.else_block):
            scf.YieldOp([EMIT[large](kern, aq)])
        return branch.results[0]
    return emit


def _avx2(kern: TernaryBuilder) -> ir.Value:
    # a packed matrix whose KB or N the kernel does not take gets the portable kernel
    if not avx2.fits(kern.kb, kern.n):
        return kern.addsub(integer=True, act_quant=True)
    return avx2.emit(kern)


def _avx512(kern: TernaryBuilder) -> ir.Value:
    # a packed matrix whose KB or N the kernel does not take gets the avx2 kernel, then
    # the portable one
    return avx512.emit(kern) if avx512.fits(kern.kb, kern.n) else _avx2(kern)


#: strategy -> (kernel, act_quant) -> y: what each row of the table emits
EMIT: dict[str, Callable[[TernaryBuilder, bool], ir.Value]] = {
    "avx512": _int_only(_avx512),
    "avx2": _int_only(_avx2),
    "dispatch-vnni": _dispatch("vnni", "blocked"),
    "dispatch": _dispatch("addsub", "blocked"),
    "vnni": _int_only(vnni),
    "blocked": _int_only(blocked),
    "addsub": lambda kern, aq: kern.addsub(integer=aq, act_quant=aq),
    "int8": lambda kern, aq: kern.int8_matmul(aq),
    "f32": _f32,
}
#: strategy -> (K, N) -> the 2-bit code format (ternary_pack.CODES) the kernel reads
#: fastest; the ternary pass re-codes a constant weight to it. Every kernel also reads
#: "signed"; a strategy not listed reads only "signed".
CODES = {"avx512": lambda k, n: "offset" if avx512_fits(k, n) or avx2_fits(k, n) else "signed",
         "avx2": lambda k, n: "offset" if avx2_fits(k, n) else "signed"}


def check_strategy(strategy, targets: Sequence[str] = ("llvm-cpu",), *,
                   choices: Sequence[str] = CHOICES) -> str:
    """`strategy` if it is one of `choices` and compiles for every target, else a
    TercompError saying which strategies would."""
    if strategy not in choices:
        raise TercompError(f"unknown ternary strategy {strategy!r}; expected one of "
                           f"{', '.join(map(repr, choices))}")
    if strategy in STRATEGIES:
        kt.check(OP, strategy, targets)
    return strategy


def choose_row(m: int | None, k: int, n: int, targets: Sequence[str] = ("llvm-cpu",),
               features: Sequence[str] | None = None) -> kt.KernelRow:
    """The table row "auto" means for an [m, k] x [k, n] ternary matmul (see
    `choose_strategy`)."""
    x = TensorType((m if m is not None else "M", k), "f32")
    found = kt.choose(OP, [x], {"k": k, "n": n}, targets, features)
    if found is None:
        raise TercompError(f"no ternary strategy compiles for {', '.join(targets)}")
    return found


def choose_strategy(m: int | None, k: int, n: int, targets: Sequence[str] = ("llvm-cpu",),
                    features: Sequence[str] | None = None) -> str:
    """The strategy "auto" means for an [m, k] x [k, n] ternary matmul compiled for
    `targets` (m None: a symbolic batch): the first ternary_matmul row of the kernel
    table that supports every target, whose feature is in `features` (default:
    `target_features(targets)`), and whose rule accepts m.

    >>> choose_strategy(128, 2048, 2048, features=()), choose_strategy(1, 64, 64, ["llvm-cpu", "cuda"])
    ('blocked', 'addsub')
    >>> choose_strategy(None, 4096, 4096, features=()), choose_strategy(1, 4096, 4096, features=())
    ('dispatch', 'addsub')
    >>> choose_strategy(None, 4096, 4096, targets=("vulkan",))
    'addsub'
    """
    return choose_row(m, k, n, targets, features).kernel


def strategy_flags(strategy: str) -> list[str]:
    """The IREE flags a strategy needs on top of its target's.

    >>> strategy_flags("addsub")
    []
    >>> strategy_flags("int8")[:2]
    ['--iree-opt-data-tiling=true', '--iree-llvmcpu-enable-ukernels=all']
    """
    return list(STRATEGIES[check_strategy(strategy, (), choices=NAMES)].flags)


def flags_for(strategies, targets: Sequence[str]) -> list[str]:
    """The flags of every strategy in `strategies` (table order, no repeats), each
    checked to compile for `targets`: a module that uses a CPU-only kernel fails here,
    by name, instead of inside IREE's GPU pipeline. "auto" (an op the ternary pass did
    not settle) counts as what it lowers to for a symbolic batch on llvm-cpu.

    >>> flags_for({"addsub", "blocked"}, ["llvm-cpu"]) == strategy_flags("blocked")
    True
    """
    strategies = {choose_strategy(None, 1, 1) if s == "auto" else s for s in strategies}
    out = []
    for s in TABLE:
        if s.kernel in strategies:
            check_strategy(s.kernel, targets, choices=NAMES)
            out += [f for f in s.flags if f not in out]
    return out


def weight_codes(strategy: str, k: int, n: int) -> str:
    """The 2-bit code format a settled `strategy` reads fastest for a [N, K] weight.

    >>> weight_codes("avx2", 4096, 4096), weight_codes("addsub", 4096, 4096)
    ('offset', 'signed')
    """
    return CODES[strategy](k, n) if strategy in CODES else "signed"


def emit_ternary_matmul(x: ir.Value, packed, k: int, n: int, scale: float, *,
                        strategy: str, act_quant: bool, codes: str = "signed",
                        targets: Sequence[str] = ("llvm-cpu",)) -> ir.Value:
    """Emit `y = scale * x @ T^T` at the current insertion point; returns y.

    `x` is a `tensor<M x K x f32>` value (M static or dynamic), `packed` the uint8
    [N, KB] output of `pack_ternary` (KB * 4 >= K; columns past K are zero-padded in the
    kernel too), embedded as a constant, or a `tensor<N x KB x i8>` value holding the
    same bytes at run time, in `codes` (ternary_pack.CODES: "offset" only for a strategy
    whose `weight_codes` it is); `scale` the absmean scale. With `act_quant`, x is quantized
    per row to int8 first (`act_quant` in ternary_pack). `strategy` is a name of TABLE
    or "auto" (`choose_strategy(M or None, K, N, targets)`); compile with
    `strategy_flags` of the strategy used. Returns a `tensor<M x N x f32>` value.
    """
    check_strategy(strategy, (), choices=("auto", *NAMES))
    packed = check_packed(packed, k, n)
    x_type = ir.RankedTensorType(x.type)
    if (x_type.rank != 2 or x_type.is_dynamic_dim(1) or x_type.get_dim_size(1) != k
            or not isinstance(x_type.element_type, ir.F32Type)):
        raise TercompError(f"ternary matmul expects x of type tensor<?x{k}xf32> (M static "
                           f"or dynamic), got {x_type}")
    m = None if x_type.is_dynamic_dim(0) else x_type.get_dim_size(0)
    if strategy == "auto":
        strategy = choose_strategy(m, k, n, targets)
    if codes != "signed" and (codes != weight_codes(strategy, k, n) or not act_quant):
        raise TercompError(f"the {strategy!r} ternary kernel for {n}x{k} weights does not "
                           f"read {codes!r} 2-bit codes",
                           hint="pass the weights in the signed codes of pack_ternary")
    return EMIT[strategy](TernaryBuilder(x, m, k, n, packed, float(scale), codes), act_quant)
