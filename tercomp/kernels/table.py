"""Every hand-written kernel a tern op can take, in ONE table, settled by ONE pass
(`kernels`, passes/kernels.py; the `ternary` pass settles the ternary matmuls it
creates through the same `choose`). This is where a new kernel is registered.

A row: the op, the kernel (the value of the op's kernel attribute: `strategy` for
ternary_matmul, `kernel` for the others), the targets it compiles for, the CPU feature
it needs, the shape rule under which the pass picks it, and why. For a compile, the
pass gives each op the first row, in table order, that compiles for every target of
the compile (CPU features: the host's, for llvm-cpu alone; none for any other target
set, so the traced IR is the same on every host), whose feature is present, and whose
shape rule accepts the op's operand types and attributes. An op no row takes keeps its
generic lowering (every target compiles it); the ternary matmul has no generic form,
and its last rows ("addsub" first) compile everywhere.

    op                kernel         targets    feature      picked for
    ternary_matmul    avx512         llvm-cpu   avx512_vnni  every M where K/4 % 64 == 0, N % 4 == 0
    ternary_matmul    avx2           llvm-cpu   avx2         every M where K/4 % 32 == 0, N % 4 == 0
    ternary_matmul    dispatch-vnni  CPU        avx512_vnni  M symbolic
    ternary_matmul    dispatch       CPU        -            M symbolic
    ternary_matmul    vnni           CPU        avx512_vnni  M <= 4
    ternary_matmul    blocked        CPU        -            M > 4
    ternary_matmul    addsub         all        -            every shape
    ternary_matmul    int8, f32      all        -            never (asked for by name only)
    widening_matmul   avx2           llvm-cpu   avx2         every shape (the lowering checks K % 16)
    rms_norm          cpu            llvm-cpu   -            every shape (the lowering checks N % 8, f32)
    rope              cpu            llvm-cpu   -            every shape (the lowering checks "neox", D % 16)
    cached_attention  cpu            llvm-cpu   -            every shape (the lowering checks D, the cache type)
    slot_attention    cpu            llvm-cpu   -            every shape (the lowering checks D, the cache type)

("CPU" is llvm-cpu and llvm-cpu-generic.) The kernels of the rows after the ternary
matmul's fall back to the op's generic lowering where their shape does not fit, so the
rules of those rows accept every shape and the kernel's own `fits` decides at lowering.

>>> choose("ternary_matmul", [TensorType((1, 4096), "f32")], {"k": 4096, "n": 4096},
...        ["vulkan"]).kernel
'addsub'
>>> [r.kernel for r in rows("rms_norm")]
['cpu']
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import TercompError
from ..ir import TensorType, is_static
from .ternary import avx2, avx512

CPU_TARGETS = ("llvm-cpu", "llvm-cpu-generic")
ALL_TARGETS = CPU_TARGETS + ("vulkan", "cuda")
HOST = ("llvm-cpu",)
VNNI = "avx512_vnni"
AVX2 = "avx2"
#: The largest M the ternary dispatch strategies send to their decode kernel.
GEMV_MAX_M = 4

_DATA_TILING = ("--iree-opt-data-tiling=true", "--iree-llvmcpu-enable-ukernels=all")
# Hoist the weight unpack (a constant expression that grows 4x or 16x) to module load:
# the size threshold lets the hoisting happen at all; const-eval=false keeps the
# compiler from evaluating it, so the .vmfb stores the 2-bit constant.
_HOIST_TO_LOAD = ("--iree-opt-const-expr-max-size-increase-threshold=4294967296",
                  "--iree-opt-const-eval=false")


@dataclass(frozen=True)
class KernelRow:
    """One kernel of one op. `rule(types, attrs)`: does the pass pick it for an op with
    these operand types and attributes? `flags`: the IREE flags a module that uses it
    compiles with on top of the target's. `needs_feature`: it does not compile at all
    without `feature` (else the feature only makes it the fast choice), so asking for it
    by name on a host without it is refused."""
    op: str
    kernel: str
    targets: tuple[str, ...]
    feature: str | None
    rule: Callable[[Sequence[TensorType], dict], bool]
    why: str
    flags: tuple[str, ...] = ()
    needs_feature: bool = False

    def compiles_for(self, targets: Sequence[str]) -> bool:
        return all(t in self.targets for t in targets)

    def describe(self) -> str:
        """Why the pass gives an op this kernel, in one line (the main job prints it
        beside each layer's kernel).

        >>> print(row("ternary_matmul", "blocked").describe())
        ternary_matmul kernel 'blocked' (llvm-cpu, llvm-cpu-generic), picked for M > 4: prefill: NT weight rows unpacked at a time, i8 matmul ukernel per block
        """
        where = ", ".join(self.targets) if self.targets != ALL_TARGETS else "all targets"
        feature = f" with {self.feature}" if self.feature else ""
        return (f"{self.op} kernel {self.kernel!r} ({where}{feature}), picked for "
                f"{self.rule.__doc__}: {self.why}")


# ------------------------------------------------------------------ shape rules
def ternary_shape(types, attrs) -> tuple[int | None, int, int]:
    """(M or None for a symbolic batch, K, N) of a ternary matmul's x [M, K] and attrs."""
    m = types[0].shape[0]
    return (int(m) if is_static(m) else None), int(attrs["k"]), int(attrs["n"])


def _symbolic(types, attrs):
    """a symbolic batch M"""
    return ternary_shape(types, attrs)[0] is None


def _decode(types, attrs):
    """M <= 4"""
    m = ternary_shape(types, attrs)[0]
    return m is not None and m <= GEMV_MAX_M


def _prefill(types, attrs):
    """M > 4"""
    m = ternary_shape(types, attrs)[0]
    return m is not None and m > GEMV_MAX_M


def avx2_fits(k: int, n: int) -> bool:
    """Whether the avx2 ternary kernel takes a [N, K] weight (avx2.fits)."""
    return avx2.fits(-(-k // 4), n)


def _avx2_rule(types, attrs):
    """every M where K/4 is a multiple of 32 and N of 4"""
    _, k, n = ternary_shape(types, attrs)
    return avx2_fits(k, n)


def avx512_fits(k: int, n: int) -> bool:
    """Whether the avx512 ternary kernel takes a [N, K] weight (avx512.fits)."""
    return avx512.fits(-(-k // 4), n)


def _avx512_rule(types, attrs):
    """every M where K/4 is a multiple of 64 and N of 4"""
    _, k, n = ternary_shape(types, attrs)
    return avx512_fits(k, n)


def _always(types, attrs):
    """every shape"""
    return True


def _never(types, attrs):
    """no shape (asked for by name only)"""
    return False


_T = "ternary_matmul"
_ATTENTION_FITS = "falls back to linalg unless D % 8 == 0, D <= 512 and the cache is f16 or f32"
#: THE table. Order matters within an op: the pass takes the first row that fits.
TABLE = (
    KernelRow(_T, "avx512", HOST, VNNI, _avx512_rule,
              "the avx2 kernel on 512-bit vectors, products reduced with vpdpbusd (no i16 "
              "stage); on an AVX-512 VNNI host faster than avx2 at every M measured",
              needs_feature=True),
    KernelRow(_T, "avx2", HOST, AVX2, _avx2_rule,
              "hand-scheduled vpmaddubsw kernel on the 2-bit codes for every M (a GEMV for "
              "single rows, 1 weight row x 4 x rows a step above); the fastest measured at "
              "every M on an AVX2 host, with no data tiling (no scf.if on M, no per-call "
              "re-layout)",
              (f"--iree-llvmcpu-stack-allocation-limit={avx2.STACK_LIMIT}",),
              needs_feature=True),
    KernelRow(_T, "dispatch-vnni", CPU_TARGETS, VNNI, _symbolic,
              f"symbolic batch: scf.if on M, vnni for M <= {GEMV_MAX_M}, blocked above",
              _DATA_TILING),
    KernelRow(_T, "dispatch", CPU_TARGETS, None, _symbolic,
              f"symbolic batch: scf.if on M, addsub for M <= {GEMV_MAX_M}, blocked above",
              _DATA_TILING),
    KernelRow(_T, "vnni", CPU_TARGETS, VNNI, _decode,
              "decode: u8 codes x s8 activations reduced with vpdpbusd (slower than addsub "
              "without VNNI: LLVM widens the products to vpmaddwd)"),
    KernelRow(_T, "blocked", CPU_TARGETS, None, _prefill,
              "prefill: NT weight rows unpacked at a time, i8 matmul ukernel per block",
              _DATA_TILING),
    KernelRow(_T, "addsub", ALL_TARGETS, None, _always,
              "int8 activations, masked add/sub over the 2-bit codes, i16 partial sums: "
              "compiles for every target"),
    KernelRow(_T, "int8", ALL_TARGETS, None, _never,
              "weights unpacked to int8 at load (an unpacked copy in RAM), i8 matmul; "
              "never picked by auto (1 B a weight resident, 4 B without act_quant)",
              _DATA_TILING + _HOIST_TO_LOAD),
    KernelRow(_T, "f32", ALL_TARGETS, None, _never,
              "exact f32 masked add/sub, the reference kernel; never picked by auto"),
    KernelRow("widening_matmul", "avx2", HOST, AVX2, _always,
              "f16 (or int8 with a row scale) weights widened in registers by a hand-written "
              "GEMV: IREE's data tiling re-lays the weights out on every call; falls back "
              "to the generic contraction unless K % 16 == 0"),
    KernelRow("rms_norm", "cpu", HOST, None, _always,
              "one row a workgroup step without masked loads (IREE masks a dynamic row "
              "count's tile of 8); falls back to the decomposition unless f32 and N % 8 == 0"),
    KernelRow("rope", "cpu", HOST, None, _always,
              "neox pairs rotated 8 lanes at a time without masking; falls back to the "
              "decomposition for interleaved pairs, D % 16 != 0 or a batch of sequences"),
    KernelRow("cached_attention", "cpu", HOST, None, _always,
              "one dispatch per step with an online softmax over chunks of the cache, for "
              f"every T (no scf.if on T); {_ATTENTION_FITS}"),
    KernelRow("slot_attention", "cpu", HOST, None, _always,
              f"the cached_attention kernel over a cache of slots; {_ATTENTION_FITS}"),
)

#: The value of an op's kernel attribute that asks the pass to choose: "auto" for the
#: ternary matmul, whose attribute is `strategy`, the generic lowering for the others.
KERNEL_ATTR = {_T: "strategy"}
UNSETTLED = {_T: "auto"}
GENERIC = "generic"


def rows(op: str) -> tuple[KernelRow, ...]:
    """The rows of `op`, in table order."""
    return tuple(r for r in TABLE if r.op == op)


def ops() -> tuple[str, ...]:
    """The ops the table has kernels for, in table order."""
    return tuple(dict.fromkeys(r.op for r in TABLE))


def row(op: str, kernel: str) -> KernelRow | None:
    return next((r for r in TABLE if r.op == op and r.kernel == kernel), None)


def attr_name(op: str) -> str:
    """The attribute of `op` that holds its kernel."""
    return KERNEL_ATTR.get(op, "kernel")


def kernel_names(op: str) -> tuple[str, ...]:
    """Every value `op`'s kernel attribute may hold: "generic" (the op's own lowering)
    and the table's kernels (the ternary matmul: its kernels only, no generic form)."""
    own = tuple(r.kernel for r in rows(op))
    return own if op in UNSETTLED else (GENERIC, *own)


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


def choose(op: str, types, attrs: dict, targets: Sequence[str] = HOST,
           features: Sequence[str] | None = None) -> KernelRow | None:
    """The row the pass gives `op` (operand `types`, `attrs`) compiled for `targets`: the
    first of its rows that compiles for every target, whose feature is in `features`
    (default: `target_features(targets)`), and whose shape rule accepts the op; None
    when no row does (the op keeps its generic lowering)."""
    features = target_features(targets) if features is None else frozenset(features)
    for r in rows(op):
        if r.compiles_for(targets) and (r.feature is None or r.feature in features) \
                and r.rule(types, attrs):
            return r
    return None


def check(op: str, kernel: str, targets: Sequence[str] = HOST) -> KernelRow:
    """The row of `op`'s `kernel` if it compiles for every target (and the host has the
    feature it cannot compile without), else a TercompError saying which would."""
    r = row(op, kernel)
    if r is None:
        raise TercompError(f"{op} has no kernel {kernel!r}; expected one of "
                           f"{', '.join(map(repr, kernel_names(op)))}")
    missing = [t for t in targets if t not in r.targets]
    if missing:
        fits = [s.kernel for s in rows(op) if s.compiles_for(targets)]
        raise TercompError(f"{'ternary strategy' if op == _T else op + ' kernel'} {kernel!r} "
                           f"does not compile for {', '.join(missing)} (it supports "
                           f"{', '.join(r.targets)})",
                           hint=f"use ternary='auto' or one of {', '.join(fits)}" if op == _T
                           else f"use one of {', '.join(fits) or GENERIC}")
    if r.needs_feature and targets and r.feature not in target_features(targets):
        raise TercompError(f"{'ternary strategy' if op == _T else op + ' kernel'} {kernel!r} "
                           f"needs a CPU with {r.feature}, which this host lacks",
                           hint="use ternary='auto' (it picks what the host has)")
    return r


def table_key(targets: Sequence[str]) -> str:
    """What of the table a compile for `targets` on this host depends on, for a compile
    cache key taken before tracing: the rows available to it (feature present), each with
    its flags. Any edit to a rule changes tercomp's source digest as well."""
    features = target_features(targets)
    return repr([(r.op, r.kernel, r.feature, r.flags, r.rule.__name__) for r in TABLE
                 if r.compiles_for(targets) and (r.feature is None or r.feature in features)])
