"""The ternary matmul strategies: the rows of op `ternary_matmul` in the one kernel
table (kernels/table.py: their targets, CPU features, where each fits and where "auto"
picks it, what each emits (kernels/ternary/emitters.py), the 2-bit codes it reads,
IREE flags and why), seen by strategy name. Read by the `ternary` pass (which settles
"auto" per target and per shape), the compile drivers (a strategy checked against the
targets) and the CLI (`--ternary` choices).

"auto" takes the first row, in table order, that compiles for every target of the
compile (on llvm-cpu: with the host's features), which fits the shape and which "auto"
picks for it (M None: a symbolic batch): amx on a host with AMX-INT8 (whose process
Linux lets use the tiles) for a symbolic M or one of 16 or more where avx512 fits and N
is a multiple of 32, avx512 on an AVX-512 VNNI host where the shape fits, avx2 on an AVX2 host where the shape fits, else for a symbolic batch
dispatch-vnni (a VNNI host) or dispatch, for M <= 4 vnni (VNNI) or addsub, for
M > 4 blocked, and addsub on GPUs and for CPU + GPU artifacts. int8 and f32 are never
picked: int8 keeps an unpacked int8 copy of every weight in RAM (1 B a weight, 4 B
without act_quant), made at load; f32 is the exact reference.

Every strategy but int8 reads only the 2-bit constant, so one copy of each weight
exists at run time (blocked unpacks NT rows at a time into a cache-sized temporary).
"avx2" is llvm-cpu (compiled for the host) on a CPU with AVX2, for K/4 a multiple of
32 and N of 4 (`avx2.fits`); it is a hand-scheduled dispatch (`avx2`), and with
"avx512" the only strategies that do not compile without their feature, so asking for
them elsewhere fails by name, as does asking for them for a shape they do not fit (the
other strategies fit every shape). On this project's AVX2 host it is the fastest kernel
measured at every M, and needs no data tiling (so no scf.if on M, no per-call re-layout).
"avx512" (`avx512`: the same dispatch on zmm registers with `vpdpbusd`, K/4 a multiple
of 64) comes before it and is picked only on an AVX-512 VNNI host, where it measured
faster than avx2 at every M (bench/RESULTS.md); the vnni rows stay for shapes neither
hand-scheduled kernel takes. "amx" (`amx`) is avx512's dispatch with AMX tiles for the
whole blocks of 16 rows of x, the other rows through avx512's loops: 1.5-3.5x avx512 at
a prefill's M on a Sapphire/Emerald Rapids Xeon, a decode's rows alike.
"vnni" needs llvm-cpu on a host with AVX-512 VNNI (`vpdpbusd`) to be fast; elsewhere
(AVX2) it still compiles but LLVM widens the products to i32 `vpmaddwd`, slower than
addsub. The measurements behind these choices are in bench/RESULTS.md.
"""
from __future__ import annotations

from typing import Sequence

from iree.compiler import ir

from ...errors import ConfigError, UnsupportedError
from ...ir import TensorType
from .. import table as kt
from . import emitters

OP = "ternary_matmul"
#: The strategies, in table order (the rows of op ternary_matmul).
TABLE = kt.rows(OP)
STRATEGIES = {r.kernel: r for r in TABLE}
NAMES = tuple(STRATEGIES)
#: What tc.compile(ternary=...) and `tercomp compile --ternary` accept.
CHOICES = ("auto", *NAMES, "off")


def check_strategy(strategy, targets: Sequence[str] = ("llvm-cpu",), *,
                   choices: Sequence[str] = CHOICES) -> str:
    """`strategy` if it is one of `choices` and compiles for every target, else a
    TercompError saying which strategies would."""
    if strategy not in choices:
        raise ConfigError(f"unknown ternary strategy {strategy!r}; expected one of "
                          f"{', '.join(map(repr, choices))}")
    if strategy in STRATEGIES:
        kt.check(OP, strategy, targets)
    return strategy


def choose_row(m: int | None, k: int, n: int, targets: Sequence[str] = ("llvm-cpu",),
               features: Sequence[str] | None = None) -> kt.KernelRow:
    """The table row "auto" means for an [m, k] x [k, n] ternary matmul (see
    `choose_strategy`)."""
    found = kt.choose(OP, kt.ternary_types(m, k, n), {"k": k, "n": n}, targets, features)
    if found is None:
        raise UnsupportedError(f"no ternary strategy compiles for {', '.join(targets)}")
    return found


def choose_strategy(m: int | None, k: int, n: int, targets: Sequence[str] = ("llvm-cpu",),
                    features: Sequence[str] | None = None) -> str:
    """The strategy "auto" means for an [m, k] x [k, n] ternary matmul compiled for
    `targets` (m None: a symbolic batch): the first ternary_matmul row of the kernel
    table that supports every target, whose feature is in `features` (default:
    `target_features(targets)`), which fits the shape and which "auto" picks for m.

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
    checked to compile for `targets` (kernel_table.flags).

    >>> flags_for({"addsub", "blocked"}, ["llvm-cpu"]) == strategy_flags("blocked")
    True
    """
    return kt.flags([STRATEGIES[check_strategy(s, (), choices=NAMES)] for s in strategies],
                    targets)


def weight_codes(strategy: str, k: int, n: int) -> str:
    """The 2-bit code format the `strategy` kernel reads fastest for a [N, K] weight
    packed by pack_ternary ("signed" where the strategy does not fit it).

    >>> weight_codes("avx2", 4096, 4096), weight_codes("addsub", 4096, 4096)
    ('offset', 'signed')
    """
    r = STRATEGIES[strategy]
    return r.codes if r.fits(kt.ternary_types(None, k, n), {"k": k, "n": n}) else "signed"


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
    that fits the shape (else a TercompError), or "auto" (`choose_strategy(M or None, K,
    N, targets)`); compile with `strategy_flags` of the strategy used. Returns a
    `tensor<M x N x f32>` value.
    """
    check_strategy(strategy, (), choices=("auto", *NAMES))
    m, packed = emitters.checked(x, packed, k, n)
    if strategy == "auto":
        strategy = choose_strategy(m, k, n, targets)
    r = STRATEGIES[strategy]
    if codes != "signed" and (codes != r.codes or not act_quant):
        raise UnsupportedError(f"the {strategy!r} ternary kernel for {n}x{k} weights does not "
                               f"read {codes!r} 2-bit codes",
                               hint="pass the weights in the signed codes of pack_ternary")
    kb = (ir.RankedTensorType(packed.type).get_dim_size(1) if isinstance(packed, ir.Value)
          else packed.shape[1])
    kt.check_fits(OP, strategy, [TensorType((m if m is not None else "M", k), "f32"),
                                 TensorType((n, kb), "i8")], {"k": k, "n": n})
    return emitters.emit(r.emit.kernel, x, packed, k, n, scale, act_quant=act_quant,
                         codes=codes, m=m)
