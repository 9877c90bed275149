"""The ternary matmul strategies: ONE table, read by the `ternary` pass (which settles
"auto" per target and per shape), the lowering (which reports the IREE flags of the
strategies a module uses, codegen.lower) and the CLI (`--ternary` choices).

Each row: the name, the emitter (`ternary_kernels`, `ternary_vnni`, `ternary_blocked`),
the IREE flags it needs on top of the target's, the targets it compiles for, the CPU
feature it needs, and the rule under which "auto" picks it. "auto" takes the first row,
in table order, that compiles for every target of the compile (on llvm-cpu: with the
host's features) and whose rule accepts the shape (M None: a symbolic batch).

    name           targets   auto picks it for
    avx2           host+AVX2 every M (static or symbolic) where the shape fits
    dispatch-vnni  CPU+VNNI  M symbolic: scf.if on M, vnni for M <= 4, blocked above
    dispatch       CPU       M symbolic: scf.if on M, addsub for M <= 4, blocked above
    vnni           CPU+VNNI  M <= 4
    blocked        CPU       M > 4
    addsub         all       every other case (GPUs, CPU + GPU artifacts, decode
                             without VNNI)
    int8           all       never: keeps an unpacked int8 copy of every weight in RAM
                             (1 B a weight, 4 B without act_quant), made at load
    f32            all       never: exact float sums, the reference kernel

Every strategy but int8 reads only the 2-bit constant, so one copy of each weight
exists at run time (blocked unpacks NT rows at a time into a cache-sized temporary).
"host+AVX2" is llvm-cpu (compiled for the host) on a CPU with AVX2, for K/4 a multiple of
32 and N of 4 (`ternary_avx2.fits`); it is a hand-scheduled dispatch (`ternary_avx2`) and
the only strategy that does not compile without its feature, so asking for it elsewhere
fails by name. It comes first: on this project's AVX2 host it is the fastest kernel
measured at every M, and needs no data tiling (so no scf.if on M, no per-call re-layout);
on AVX-512 VNNI hosts it was not measured against vnni.
CPU+VNNI is llvm-cpu on a host with AVX-512 VNNI (`vpdpbusd`); elsewhere (AVX2) "vnni"
still compiles but LLVM widens the products to i32 `vpmaddwd`, slower than addsub.

Measured with bench/ternary_kernels.py (bare kernels) and bench/ternary_matmul.py
(through `exe(x)`), ratios to NumPy f32 on the same dense weights in the same
interleaved run, median / min:
- 2026-11-23, 2-core AMD EPYC VM with AVX-512 VNNI, before this table: 1x4096x4096
  vnni 0.13x / 0.11x, addsub 0.17x / 0.14x, int8 0.26x / 0.21x; 8x4096x4096 int8
  0.18x / 0.15x, vnni 0.21x / 0.14x; 128x2048x2048 int8 0.46x / 0.43x, vnni 0.75x.
- 2026-11-23 17:00-17:45 UTC, 2-core AMD EPYC (Zen 3, AVX2, no AVX-512/VNNI) VM under a
  load average of 6-11 from other jobs (NumPy's own times varied 3-10x between rounds,
  so only the ratios within a run mean anything), symbolic-batch modules through
  `exe(x)`: 1x4096x4096 auto (addsub here) 0.25x / 0.57x, int8 0.66x / 1.19x, vnni
  (without VNNI) 0.72x min in the bare-kernel run against addsub 0.16x; 8x4096x4096
  auto (blocked) 0.27x / 0.35x, addsub 0.21x / 0.51x, int8 0.07x / 0.06x;
  128x2048x2048 auto (blocked) 0.34x / 0.47x, int8 0.27x / 0.43x, addsub 0.96x /
  2.11x; cold decode, 8 distinct 4096x4096 layers as .irpa parameters, per layer: auto
  0.26x / 0.23x (bare invoke 0.26x / 0.08x), int8 0.42x / 0.51x. Resident memory of a
  fresh process loading a saved 16-layer 4096x4096 artifact (64 MiB packed): auto
  +70 MiB after a B=1 call, +89 MiB after B=128 (int8: +389 MiB).
  Inner loops seen (`--iree-hal-dump-executable-files-to`): addsub, per 32 packed
  bytes (128 weights), vpand / vpcmpeqb masks, vpmovsxbw, vpblendvb / vpandn selects
  and vpaddw into i16 accumulators (about 70 instructions), no horizontal add inside
  the K loop; vnni on AVX2, vpmovzxbd + vpmaddwd on 8 products at a time. The blocked
  kernel's cost at M = 8 is the per-call unpack and IREE's pack of each block (about
  5x int8's time there); unpacking straight into the mmt4d tile layout is the next step.
- 2026-11-24 03:35-04:15 UTC, the same 2-core Zen 3 VM, `top` showing ~50% steal time
  (the host busy), avx2 on its offset codes with 8 workgroups, median / min:
  through `exe(x)` 1x4096x4096 0.13x / 0.15x (bare invoke 0.10x / 0.13x), 8x4096x4096
  0.17x / 0.18x, 128x4096x4096 0.46x / 0.45x with 4 workgroups (0.44x / 0.48x with 8 in
  the bare-kernel run that chose them, against 0.60x / 0.64x with 4); cold, 16 distinct
  layers, bare kernels: offset codes 0.16x / 0.14x, signed codes 0.13x / 0.13x (the
  same within the noise: decode is bound by memory and the shared core, not by the
  remap); the same layer 16 times (cache-resident): 0.08x at the minimum. Per call,
  exe(x) costs 12 us more than IREE's invoke (median of paired rounds,
  `bench/ternary_matmul.py --overhead`). Inner loops (`--iree-hal-dump-executable-
  files-to`): GEMV, per 64 packed bytes of 4 rows, 32 vpmaddubsw, 32 vpaddw, 32 vpand,
  24 vpsrlw, 8 loads, 4 prefetchnta (~18 instructions per 32 bytes of a row, from ~22
  with the in-register remap); GEMM, per 32 packed bytes of one row against 4 rows of
  x, 16 vpmaddubsw (x as memory operands), 16 vpaddw, 4 vpand, 3 vpsrlw, 1 load.
- 2026-11-24 05:15-06:40 UTC, the same VM (quiet at first, then NumPy's own medians
  moving 1.5x between runs), after the GEMV's four row streams and one-shift decode and
  the quantize dispatch (M symbolic or >= 4), median / min, symbolic-batch modules
  through `exe(x)`: cold decode, 16 distinct 4096x4096 layers as .irpa parameters, per
  layer 0.09x-0.11x / 0.09x; warm 1x4096x4096 one call 0.17x-0.22x / 0.12x-0.20x (IREE's
  invoke of a one-dispatch module costs 35 us at the minimum and 90-150 us at the median
  here: the task system's wake-ups), the kernel alone (the one layer 16 times in one
  call) 0.10x-0.16x / 0.06x-0.10x; 8x4096x4096 0.24x / 0.15x; 128x4096x4096 0.34x /
  0.28x-0.32x. Checked in one process with both versions loaded twice, in both orders
  (the module loaded first measures slowest): cold decode 0.10x-0.12x against
  0.15x-0.20x with adjacent rows; 128 rows 0.34x-0.35x against 0.45x-0.53x when each
  workgroup quantized x itself; a symbolic decode alike with the quantize dispatch and
  without it. GEMV inner loop, per chunk of 4 rows: 16 vpmaddubsw, 16 vpand, 16
  vpaddw, 4 vpsrlw, 4 + 4 loads, 4 prefetcht0 (13 vector instructions a row, from 15).

>>> choose_strategy(None, 4096, 4096, features=()), choose_strategy(1, 4096, 4096, features=())
('dispatch', 'addsub')
>>> choose_strategy(None, 4096, 4096, targets=("vulkan",))
'addsub'
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

from iree.compiler import ir
from iree.compiler.dialects import arith, scf

from ..errors import TercompError
from . import ternary_avx2
from .ternary_blocked import blocked
from .builders import const
from .ternary_kernels import _Kernel, check_packed
from .ternary_vnni import vnni

CPU_TARGETS = ("llvm-cpu", "llvm-cpu-generic")
ALL_TARGETS = CPU_TARGETS + ("vulkan", "cuda")
#: The largest M the dispatch strategies send to their decode kernel.
GEMV_MAX_M = 4
VNNI = "avx512_vnni"
AVX2 = "avx2"

_DATA_TILING = ("--iree-opt-data-tiling=true", "--iree-llvmcpu-enable-ukernels=all")
# Hoist the weight unpack (a constant expression that grows 4x or 16x) to module load:
# the size threshold lets the hoisting happen at all; const-eval=false keeps the
# compiler from evaluating it, so the .vmfb stores the 2-bit constant.
_HOIST_TO_LOAD = ("--iree-opt-const-expr-max-size-increase-threshold=4294967296",
                  "--iree-opt-const-eval=false")


@dataclass(frozen=True)
class Strategy:
    name: str
    emit: Callable[[_Kernel, bool], ir.Value]        # (kernel, act_quant) -> y
    flags: tuple[str, ...]
    targets: tuple[str, ...]
    feature: str | None                              # CPU feature "auto" requires
    auto: Callable[[int | None, int, int], bool]     # (M or None: symbolic, K, N) -> picked?
    summary: str
    needs_feature: bool = False                      # does not compile without `feature`
    # (K, N) -> the 2-bit code format (ternary_pack.CODES) the kernel reads fastest; the
    # ternary pass re-codes a constant weight to it. Every kernel also reads "signed".
    codes: Callable[[int, int], str] = lambda k, n: "signed"


def _f32(kern: _Kernel, act_quant: bool) -> ir.Value:
    return kern.addsub(integer=False, act_quant=act_quant)


def _int_only(emit):
    # Without activation quantization there are no int8 activations to multiply: the
    # exact f32 masked add/sub kernel, on the same 2-bit constant.
    return lambda kern, aq: emit(kern) if aq else _f32(kern, aq)


def _dispatch(small: str, large: str):
    """scf.if on the batch size, one kernel for M <= GEMV_MAX_M and another above;
    both read the same 2-bit constant (a static M gets its branch directly)."""
    def emit(kern: _Kernel, aq: bool) -> ir.Value:
        if kern.m is not None:
            return STRATEGIES[small if kern.m <= GEMV_MAX_M else large].emit(kern, aq)
        kern.pin_weights()      # else IREE folds each branch's view into its own constant
        is_small = arith.cmpi(arith.CmpIPredicate.ule, kern.m_values[0],
                              const(GEMV_MAX_M, kern.index))
        branch = scf.IfOp(is_small, [kern.ttype([kern.n], kern.f32)], has_else=True)
        with ir.InsertionPoint(branch.then_block):
            scf.YieldOp([STRATEGIES[small].emit(kern, aq)])
        with ir.InsertionPoint(branch.else_block):
            scf.YieldOp([STRATEGIES[large].emit(kern, aq)])
        return branch.results[0]
    return emit


def _symbolic(m, k, n):
    return m is None


def _never(m, k, n):
    return False


def _decode(m, k, n):
    return m is not None and m <= GEMV_MAX_M


def _avx2_fits(k, n):
    return ternary_avx2.fits(-(-k // 4), n)


def _avx2(kern: _Kernel) -> ir.Value:
    # a packed matrix whose KB or N the kernel does not take gets the portable kernel
    if not ternary_avx2.fits(kern.kb, kern.n):
        return kern.addsub(integer=True, act_quant=True)
    return ternary_avx2.emit(kern)


TABLE = (
    Strategy("avx2", _int_only(_avx2), (f"--iree-llvmcpu-stack-allocation-limit="
                                        f"{ternary_avx2.STACK_LIMIT}",), ("llvm-cpu",), AVX2,
             lambda m, k, n: _avx2_fits(k, n),
             "hand-scheduled vpmaddubsw kernel on the 2-bit codes for every M (a GEMV "
             "for single rows, 1 weight row x 4 x rows a step above)", needs_feature=True,
             codes=lambda k, n: "offset" if _avx2_fits(k, n) else "signed"),
    Strategy("dispatch-vnni", _dispatch("vnni", "blocked"), _DATA_TILING, CPU_TARGETS, VNNI,
             _symbolic, f"scf.if on M: vnni for M <= {GEMV_MAX_M}, blocked above"),
    Strategy("dispatch", _dispatch("addsub", "blocked"), _DATA_TILING, CPU_TARGETS, None,
             _symbolic, f"scf.if on M: addsub for M <= {GEMV_MAX_M}, blocked above"),
    Strategy("vnni", _int_only(vnni), (), CPU_TARGETS, VNNI, _decode,
             "u8 codes x s8 activations reduced with vpdpbusd (decode)"),
    Strategy("blocked", _int_only(blocked), _DATA_TILING, CPU_TARGETS, None,
             lambda m, k, n: m is not None and m > GEMV_MAX_M,
             "NT weight rows unpacked at a time, i8 matmul ukernel per block (prefill)"),
    Strategy("addsub", lambda kern, aq: kern.addsub(integer=aq, act_quant=aq), (),
             ALL_TARGETS, None, lambda m, k, n: True,
             "int8 activations, masked add/sub over the 2-bit codes, i16 partial sums"),
    Strategy("int8", lambda kern, aq: kern.int8_matmul(aq), _DATA_TILING + _HOIST_TO_LOAD,
             ALL_TARGETS, None, _never,
             "weights unpacked to int8 at load (an unpacked copy in RAM), i8 matmul"),
    Strategy("f32", _f32, (), ALL_TARGETS, None, _never, "exact f32 masked add/sub"),
)
STRATEGIES = {s.name: s for s in TABLE}
NAMES = tuple(STRATEGIES)
#: What tc.compile(ternary=...) and `tercomp compile --ternary` accept.
CHOICES = ("auto", *NAMES, "off")


@functools.lru_cache(maxsize=1)
def host_cpu_features() -> frozenset:
    """The host CPU's feature flags as Linux names them (/proc/cpuinfo), empty elsewhere:
    what `--iree-llvmcpu-target-cpu=host` compiles for."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def target_features(targets: Sequence[str]) -> frozenset:
    """The CPU features every target has: the host's for llvm-cpu alone, none else."""
    return host_cpu_features() if list(targets) == ["llvm-cpu"] else frozenset()


def check_strategy(strategy, targets: Sequence[str] = ("llvm-cpu",), *,
                   choices: Sequence[str] = CHOICES) -> str:
    """`strategy` if it is one of `choices` and compiles for every target, else a
    TercompError saying which strategies would."""
    if strategy not in choices:
        raise TercompError(f"unknown ternary strategy {strategy!r}; expected one of "
                           f"{', '.join(map(repr, choices))}")
    row = STRATEGIES.get(strategy)
    if row is not None:
        missing = [t for t in targets if t not in row.targets]
        if missing:
            fits = [s.name for s in TABLE if all(t in s.targets for t in targets)]
            raise TercompError(f"ternary strategy {strategy!r} does not compile for "
                               f"{', '.join(missing)} (it supports {', '.join(row.targets)})",
                               hint=f"use ternary='auto' or one of {', '.join(fits)}")
        if row.needs_feature and targets and row.feature not in target_features(targets):
            raise TercompError(f"ternary strategy {strategy!r} needs a CPU with "
                               f"{row.feature}, which this host lacks",
                               hint="use ternary='auto' (it picks what the host has)")
    return strategy


def choose_strategy(m: int | None, k: int, n: int, targets: Sequence[str] = ("llvm-cpu",),
                    features: Sequence[str] | None = None) -> str:
    """The strategy "auto" means for an [m, k] x [k, n] ternary matmul compiled for
    `targets` (m None: a symbolic batch): the first row of TABLE that supports every
    target, whose feature is in `features` (default: `target_features(targets)`), and
    whose rule accepts m.

    >>> choose_strategy(128, 2048, 2048, features=()), choose_strategy(1, 64, 64, ["llvm-cpu", "cuda"])
    ('blocked', 'addsub')
    """
    features = target_features(targets) if features is None else frozenset(features)
    for s in TABLE:
        if (all(t in s.targets for t in targets) and (s.feature is None or s.feature in features)
                and s.auto(m, k, n)):
            return s.name
    raise TercompError(f"no ternary strategy compiles for {', '.join(targets)}")


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
        if s.name in strategies:
            check_strategy(s.name, targets, choices=NAMES)
            out += [f for f in s.flags if f not in out]
    return out


def weight_codes(strategy: str, k: int, n: int) -> str:
    """The 2-bit code format a settled `strategy` reads fastest for a [N, K] weight.

    >>> weight_codes("avx2", 4096, 4096), weight_codes("addsub", 4096, 4096)
    ('offset', 'signed')
    """
    return STRATEGIES[strategy].codes(k, n)


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
    return STRATEGIES[strategy].emit(_Kernel(x, m, k, n, packed, float(scale), codes),
                                     act_quant)
