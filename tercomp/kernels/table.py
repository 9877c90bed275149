"""Every hand-written kernel a tern op can take, in ONE table, settled by ONE pass
(`kernels`, passes/kernels.py; the `ternary` pass settles the ternary matmuls it
creates through the same `choose`). This is where a new kernel is registered.

A row says everything about its kernel: the op, the kernel (the value of the op's kernel
attribute: `strategy` for ternary_matmul, `kernel` for the others), the targets it
compiles for, the CPU feature it needs, where it applies (`fits(types, attrs)`: the
whole condition under which it can emit an op with these operand types and attributes),
how it is emitted (`emit(ctx, op, operands)`, called by the lowering driver for an op
whose kernel attribute names the row), where "auto" prefers it (`picks`, for the
ternary matmul's measured choices; the other rows are picked wherever they fit), the
IREE flags it needs and why it exists.

For a compile, the pass gives each op the first row, in table order, that compiles for
every target of the compile (CPU features: the host's, for llvm-cpu alone; none for any
other target set, so the traced IR is the same on every host), whose feature is
present, which fits the op and which "auto" picks for it. An op no row takes keeps its
generic kernel (its op's own lowering, which every target compiles); the ternary matmul
has no generic form, and its "addsub" row fits and compiles everywhere. A kernel asked
for by name (in the IR, or `ternary=` of a compile) that does not fit the op is a
ConfigError when the op is made, never a silent fallback; the lowering never checks a
row again.

    op               kernel        targets   feature      fits; where "auto" picks it
    ternary_matmul   avx512-tall   llvm-cpu  avx512_vnni  M % 16 == 0 (a symbolic M's factor),
                                                          N % 4 == 0, 4 KB <= 6144; N <= 512
    ternary_matmul   amx           llvm-cpu  amx_int8     avx512's shapes with N % 32 == 0; M
                                                          symbolic or >= 16, N K >= 2^20
    ternary_matmul   avx512        llvm-cpu  avx512_vnni  KB % 64 == 0, N % 4 == 0, 4 KB <= 16384;
                                                          every M where it fits
    ternary_matmul   avx2          llvm-cpu  avx2         KB % 32 == 0, N % 4 == 0, 4 KB <= 8192;
                                                          every M where it fits
    ternary_matmul   dispatch-vnni CPU       avx512_vnni  every shape; M symbolic
    ternary_matmul   dispatch      CPU       -            every shape; M symbolic
    ternary_matmul   vnni          CPU       avx512_vnni  every shape; M <= 4
    ternary_matmul   blocked       CPU       -            every shape; M > 4
    ternary_matmul   addsub        all       -            every shape; every shape
    ternary_matmul   int8, f32     all       -            every shape; never (by name only)
    widening_matmul  avx512-vnni   llvm-cpu  avx512_vnni  i8 weights with a row scale, K % 64 == 0,
                                                          K <= 8192; where it fits
    widening_matmul  avx2          llvm-cpu  avx2         K % 16 == 0, f16 weights or i8 ones
                                                          with a row scale; where it fits
    rms_norm         cpu           llvm-cpu  -            f32 x [..., N], N % 8 == 0; where it fits
    rope             cpu           llvm-cpu  -            "neox" or "interleaved", f32 x [T, H, D]
                                                          or [1, T, H, D], D % 16 == 0; where
                                                          it fits
    cached_attention cpu           llvm-cpu  -            D % 8 == 0, D <= 512, an f16 or f32
                                                          cache; where it fits
    slot_attention   cpu           llvm-cpu  -            as cached_attention; where it fits
    kv_scatter       cpu           llvm-cpu  -            a static f16 or f32 cache whose rows
                                                          (KV x D) are whole 64-byte vectors;
                                                          where it fits

("CPU" is llvm-cpu and llvm-cpu-generic; KB is the packed weights' bytes a row, 4 KB the
padded K: padded_k makes every K above 256 a multiple of 256, so the avx512 row takes a
conv's patch rows of K = 576 or 1152 as well, their x zero-padded by the quantize
dispatch; before, "auto" asked K itself to be a multiple and gave such K the blocked
kernel, 2-5x slower at batch 1: bench/RESULTS.md. avx512-tall's products run over
4 KQ columns, K rounded up to 64, not the padded K: avx512_tall.q_columns.) Without
activation quantization the integer ternary kernels emit the exact
f32 kernel (kernels/ternary/emitters.py).

>>> choose("ternary_matmul", ternary_types(1, 4096, 4096), {"k": 4096, "n": 4096},
...        ["vulkan"]).kernel
'addsub'
>>> [r.kernel for r in rows("rms_norm")]
['cpu']
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import TraceError, ConfigError, UnsupportedError
from ..ir import TensorType, is_static
from ..ternary_pack import padded_k
from .attention import attention_cpu
from .dense import gemm_avx512, vnni_avx512, widening_avx2
from .host import host_cpu_features
from .rows import rows_cpu
from .ternary import amx, avx2, avx512, avx512_tall
from .ternary import emitters as te
from .ternary.emitters import GEMV_MAX_M, TernaryEmit

CPU_TARGETS = ("llvm-cpu", "llvm-cpu-generic")
ALL_TARGETS = CPU_TARGETS + ("vulkan", "cuda")
HOST = ("llvm-cpu",)
VNNI = "avx512_vnni"
AMX = "amx_int8"
AVX2 = "avx2"

_DATA_TILING = ("--iree-opt-data-tiling=true", "--iree-llvmcpu-enable-ukernels=all")
# Hoist the weight unpack (a constant expression that grows 4x or 16x) to module load:
# the size threshold lets the hoisting happen at all; const-eval=false keeps the
# compiler from evaluating it, so the .vmfb stores the 2-bit constant.
_HOIST_TO_LOAD = ("--iree-opt-const-expr-max-size-increase-threshold=4294967296",
                  "--iree-opt-const-eval=false")

Rule = Callable[[Sequence[TensorType], dict], bool]


@dataclass(frozen=True)
class KernelRow:
    """One kernel of one op. `fits(types, attrs)`: can it emit an op with these operand
    types and attributes (the whole condition: the pass gives an op this row only where
    it holds, and the lowering does not check again). `emit(ctx, op, operands) ->
    results`: the kernel, emitted at the current insertion point in place of the op's
    own lowering. `picks(types, attrs)`: where "auto" prefers it among the rows that fit
    (None: wherever it fits). `flags`: the IREE flags a module that uses it compiles
    with on top of the target's. `needs_feature`: it does not compile at all without
    `feature` (else the feature only makes it the fast choice), so asking for it by name
    on a host without it is refused. `codes`: the 2-bit code format (ternary_pack.CODES)
    a ternary matmul kernel reads fastest, which the pass stores its weights in."""
    op: str
    kernel: str
    targets: tuple[str, ...]
    feature: str | None
    fits: Rule
    emit: Callable
    why: str
    flags: tuple[str, ...] = ()
    needs_feature: bool = False
    picks: Rule | None = None
    codes: str = "signed"

    def compiles_for(self, targets: Sequence[str]) -> bool:
        return all(t in self.targets for t in targets)

    def available(self, targets: Sequence[str], features) -> bool:
        """Does it compile for every target, with its feature among `features`?"""
        return self.compiles_for(targets) and (self.feature is None or self.feature in features)

    def auto(self, types, attrs) -> bool:
        """Does "auto" give it an op with these operand types and attributes?"""
        return self.fits(types, attrs) and (self.picks is None or self.picks(types, attrs))

    def describe(self) -> str:
        """Why the pass gives an op this kernel, in one line (the main job prints it
        beside each layer's kernel).

        >>> print(row("ternary_matmul", "blocked").describe())
        ternary_matmul kernel 'blocked' (llvm-cpu, llvm-cpu-generic), picked for M > 4: prefill: NT weight rows unpacked at a time, i8 matmul ukernel per block
        """
        where = ", ".join(self.targets) if self.targets != ALL_TARGETS else "all targets"
        feature = f" with {self.feature}" if self.feature else ""
        return (f"{self.op} kernel {self.kernel!r} ({where}{feature}), picked for "
                f"{(self.picks or self.fits).__doc__}: {self.why}")


# ------------------------------------------------------------------ ternary_matmul
def ternary_types(m: int | None, k: int, n: int) -> list[TensorType]:
    """The operand types of a ternary matmul of x [m, k] (m None: a symbolic batch) and
    [n, k] weights packed by ternary_pack.pack_ternary."""
    return [TensorType((m if m is not None else "M", k), "f32"),
            TensorType((n, padded_k(k) // 4), "i8")]


def ternary_shape(types, attrs) -> tuple[int | None, int, int]:
    """(M or None for a symbolic batch, K, N) of a ternary matmul's x [M, K] and attrs."""
    m = types[0].shape[0]
    return (int(m) if is_static(m) else None), int(attrs["k"]), int(attrs["n"])


def _packed_bytes(types) -> int:
    """KB, the bytes a row of a ternary matmul's packed weights [N, KB]."""
    return int(types[1].shape[1])


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
    """Whether the avx2 ternary kernel takes a [N, K] weight (avx2.fits of its packed K/4)."""
    return avx2.fits(padded_k(k) // 4, n)


def _avx2_fits(types, attrs):
    """packed weights [N, KB] with KB a multiple of 32 (4 KB <= 8192) and N of 4"""
    return avx2.fits(_packed_bytes(types), int(attrs["n"]))


def _avx2_rule(types, attrs):
    """every M where the padded K/4 is a multiple of 32 and N of 4"""
    _, k, n = ternary_shape(types, attrs)
    return avx2_fits(k, n)


def avx512_fits(k: int, n: int) -> bool:
    """Whether the avx512 ternary kernel takes a [N, K] weight (avx512.fits of its packed
    K/4)."""
    return avx512.fits(padded_k(k) // 4, n)


def _avx512_fits(types, attrs):
    """packed weights [N, KB] with KB a multiple of 64 (4 KB <= 16384) and N of 4"""
    return avx512.fits(_packed_bytes(types), int(attrs["n"]))


def _avx512_rule(types, attrs):
    """every M where the padded K/4 is a multiple of 64 and N of 4"""
    _, k, n = ternary_shape(types, attrs)
    return avx512_fits(k, n)


def _amx_fits(types, attrs):
    """packed weights [N, KB] with KB a multiple of 64 (4 KB <= 16384) and N of 16"""
    return amx.fits(_packed_bytes(types), int(attrs["n"]))


def _amx_rule(types, attrs):
    """M symbolic or at least 16, the padded K/4 a multiple of 64, N of 32 and N x K at
    least 2^20 (amx.MIN_WEIGHTS: a smaller matrix saves less than its compile costs)"""
    m, k, n = ternary_shape(types, attrs)
    return ((m is None or m >= amx.MIN_M) and amx.fits(padded_k(k) // 4, n)
            and n * k >= amx.MIN_WEIGHTS)


def _tall_fits(types, attrs):
    """x [M, K] with M a multiple of 16 (static, or a symbolic M's factor), packed
    weights [N, KB] with 4 KB <= 6144 and N a multiple of 4"""
    return avx512_tall.fits(types[0].shape[0], _packed_bytes(types), int(attrs["n"]))


def _tall_rule(types, attrs):
    """M a multiple of 16 (or a symbolic M's factor) and at least TALL_MIN_M, N at most
    TALL_MAX_N: a convolution's patch rows"""
    m = avx512_tall.m_multiple(types[0].shape[0])
    return _tall_fits(types, attrs) and m >= TALL_MIN_M and int(attrs["n"]) <= TALL_MAX_N


def _always(types, attrs):
    """every shape"""
    return True


def _never(types, attrs):
    """no shape (asked for by name only)"""
    return False


# ------------------------------------------------------------------ the other ops
def _widening_avx2_fits(types, attrs):
    """K % 16 == 0, and f16 weights, or i8 weights with a row scale"""
    w = types[1]
    scaled = len(types) == 3
    return is_static(w.shape[1]) and widening_avx2.fits(int(w.shape[1])) and (
        w.dtype == "f16" and not scaled or w.dtype == "i8" and scaled)


def _widening_vnni_fits(types, attrs):
    """i8 weights with a row scale, K % 64 == 0, K <= 8192"""
    w = types[1]
    return len(types) == 3 and w.dtype == "i8" and is_static(w.shape[1]) \
        and vnni_avx512.fits(int(w.shape[1]))


def _rms_norm_cpu_fits(types, attrs):
    """f32 x [..., N] with N % 8 == 0"""
    x = types[0]
    return x.rank >= 2 and x.dtype == "f32" and is_static(x.shape[-1]) \
        and rows_cpu.norm_fits(int(x.shape[-1]))


def _kv_write_fits(types, attrs):
    """a static f16 or f32 cache [N, S, KV, D], KV x D x its bytes a multiple of 64"""
    return rows_cpu.kv_write_fits(types[0])


def _rope_cpu_fits(types, attrs):
    """"neox" or "interleaved" pairs of one sequence, f32 x [(1,) T, H, D] with D % 16 == 0"""
    x = types[0]
    return attrs["style"] in ("neox", "interleaved") and x.dtype == "f32" and is_static(x.shape[-1]) \
        and rows_cpu.rope_fits(int(x.shape[-1])) and all(d == 1 for d in x.shape[:-3])


def _attention_cpu_fits(types, attrs):
    """head dim D % 8 == 0, D <= 512, an f16 or f32 cache"""
    q, k = types[0], types[1]
    return is_static(q.shape[-1]) and attention_cpu.fits(int(q.shape[-1]), k.dtype)


#: Where "auto" gives a ternary matmul the avx512-tall kernel (M the rows' known factor):
#: measured against avx512 on bench/conv.py's shapes (bench/RESULTS.md).
TALL_MIN_M = 16
TALL_MAX_N = 512

_T = "ternary_matmul"
#: THE table. Order matters within an op: the pass takes the first row that fits.
# ------------------------------------------------------------------ f32 GEMMs
AVX512F = "avx512f"


def _static_f32(types) -> bool:
    return all(t.dtype == "f32" and t.is_static for t in types)


def _gemm_shared_fits(types, attrs):
    """f32 a [M, K] @ x [B, K, N] or @ x [K, N], static, N a multiple of 16, at least
    2^24 multiply-adds (not x transposed: a layer's constant weight would be copied
    transposed, at compile time or every call)"""
    a, x = types
    if attrs.get("transpose_b") or a.rank != 2 or x.rank not in (2, 3) or not _static_f32(types):
        return False
    m, k = (int(d) for d in a.shape)
    bt, n = (int(x.shape[0]), int(x.shape[2])) if x.rank == 3 else (1, int(x.shape[1]))
    return gemm_avx512.fits(bt, m, k, n)


def _gemm_sum_fits(types, attrs):
    """f32 a [B, M, N], x [B, K, N], static, M a multiple of 16, at least 2^24 multiply-adds"""
    a, x = types
    if not _static_f32(types):
        return False
    bt, m, n = (int(d) for d in a.shape)
    return gemm_avx512.fits(bt, int(x.shape[1]), n, m)


TABLE = (
    KernelRow(_T, "avx512-tall", HOST, VNNI, _tall_fits, TernaryEmit(te.AVX512_TALL),
              "rows of x in the vector lanes (no horizontal sum an output), workgroups over "
              "M: a convolution's patch rows (M >> N), where the avx512 kernel's "
              "reductions cost as much as its products",
              needs_feature=True, picks=_tall_rule, codes="offset"),
    KernelRow(_T, "amx", HOST, AMX, _amx_fits, TernaryEmit(te.AMX),
              "the avx512 kernel with AMX tiles (tdpbusd, 16 x 16 x 64 products an "
              "instruction) for blocks of 16 rows of x (a last one of 8 or more padded): a "
              "prefill's and a batched decode's matmuls, the weights spread to bytes once "
              "per chunk for every block",
              (f"--iree-llvmcpu-stack-allocation-limit={amx.STACK_LIMIT}",),
              needs_feature=True, picks=_amx_rule, codes="offset"),
    KernelRow(_T, "avx512", HOST, VNNI, _avx512_fits, TernaryEmit(te.AVX512),
              "the avx2 kernel on 512-bit vectors, products reduced with vpdpbusd (no i16 "
              "stage); on an AVX-512 VNNI host faster than avx2 at every M measured",
              needs_feature=True, picks=_avx512_rule, codes="offset"),
    KernelRow(_T, "avx2", HOST, AVX2, _avx2_fits, TernaryEmit(te.AVX2),
              "hand-scheduled vpmaddubsw kernel on the 2-bit codes for every M (a GEMV for "
              "single rows, 1 weight row x 4 x rows a step above); the fastest measured at "
              "every M on an AVX2 host, with no data tiling (no scf.if on M, no per-call "
              "re-layout)",
              (f"--iree-llvmcpu-stack-allocation-limit={avx2.STACK_LIMIT}",),
              needs_feature=True, picks=_avx2_rule, codes="offset"),
    KernelRow(_T, "dispatch-vnni", CPU_TARGETS, VNNI, _always, TernaryEmit(te.DISPATCH_VNNI),
              f"symbolic batch: scf.if on M, vnni for M <= {GEMV_MAX_M}, blocked above",
              _DATA_TILING, picks=_symbolic),
    KernelRow(_T, "dispatch", CPU_TARGETS, None, _always, TernaryEmit(te.DISPATCH),
              f"symbolic batch: scf.if on M, addsub for M <= {GEMV_MAX_M}, blocked above",
              _DATA_TILING, picks=_symbolic),
    KernelRow(_T, "vnni", CPU_TARGETS, VNNI, _always, TernaryEmit(te.VNNI),
              "decode: u8 codes x s8 activations reduced with vpdpbusd (slower than addsub "
              "without VNNI: LLVM widens the products to vpmaddwd)", picks=_decode),
    KernelRow(_T, "blocked", CPU_TARGETS, None, _always, TernaryEmit(te.BLOCKED),
              "prefill: NT weight rows unpacked at a time, i8 matmul ukernel per block",
              _DATA_TILING, picks=_prefill),
    KernelRow(_T, "addsub", ALL_TARGETS, None, _always, TernaryEmit(te.addsub),
              "int8 activations, masked add/sub over the 2-bit codes, i16 partial sums: "
              "compiles for every target"),
    KernelRow(_T, "int8", ALL_TARGETS, None, _always, TernaryEmit(te.int8),
              "weights unpacked to int8 at load (an unpacked copy in RAM), i8 matmul; "
              "never picked by auto (1 B a weight resident, 4 B without act_quant)",
              _DATA_TILING + _HOIST_TO_LOAD, picks=_never),
    KernelRow(_T, "f32", ALL_TARGETS, None, _always, TernaryEmit(te.f32),
              "exact f32 masked add/sub, the reference kernel; never picked by auto",
              picks=_never),
    KernelRow("widening_matmul", "avx512-vnni", HOST, VNNI, _widening_vnni_fits,
              vnni_avx512.emit_op,
              "int8 tables: x quantized to int8 a row at a time (act_quant), products summed "
              "by vpdpbusd; a batched decode's 8 rows cost about the table's read (the "
              "widening kernel's f32 FMAs: 3x its one-row time). Precision: logits' cosine "
              ">= 0.99993 against f32 x, top-1 kept on 252/256 probe hidden states of the "
              "700M table (the int8 table itself against f32: 254/256); a 700M generator's "
              "logits over 16 steps of 8 sequences: cosine >= 0.99994, top-1 126/128 "
              "(vnni_avx512's docstring, bench/RESULTS.md)",
              needs_feature=True),
    KernelRow("widening_matmul", "avx2", HOST, AVX2, _widening_avx2_fits, widening_avx2.emit_op,
              "f16 (or int8 with a row scale) weights widened in registers by a hand-written "
              "GEMV: IREE's data tiling re-lays the weights out on every call"),
    KernelRow("matmul", "avx512-f32", HOST, AVX512F, _gemm_shared_fits, gemm_avx512.emit_shared_op,
              "f32 products of static shape, a batch sharing their left matrix (a "
              "convolution's W^T @ g) or one (an MLP's training step): x's rows in the "
              "vector lanes, K in chunks whose rows of x stay in L1; 1.5-4x IREE's codegen "
              "without data tiling (bench/RESULTS.md)", needs_feature=True),
    KernelRow("matmul_sum", "avx512-f32", HOST, AVX512F, _gemm_sum_fits, gemm_avx512.emit_sum_op,
              "a batch of f32 products summed (a convolution's weight cotangent) inside one "
              "dispatch, no [B, M, K] intermediate; 1.5-4x IREE's batched matmul and sum",
              needs_feature=True),
    KernelRow("rms_norm", "cpu", HOST, None, _rms_norm_cpu_fits, rows_cpu.emit_rms_norm,
              "one row a workgroup step without masked loads (IREE masks a dynamic row "
              "count's tile of 8)"),
    KernelRow("rope", "cpu", HOST, None, _rope_cpu_fits, rows_cpu.emit_rope,
              "neox or interleaved pairs rotated 8 lanes at a time without masking (IREE's "
              "generic over the interleaved pairs' view took 5-8x as long at a prefill)"),
    KernelRow("cached_attention", "cpu", HOST, None, _attention_cpu_fits,
              attention_cpu.emit_cached,
              "one dispatch per step with an online softmax over chunks of the cache, for "
              "every T (no scf.if on T)"),
    KernelRow("slot_attention", "cpu", HOST, None, _attention_cpu_fits, attention_cpu.emit_slot,
              "a workgroup per (query, group of KV heads) reading each cache row's group of "
              "heads contiguously, 4 rows a step, with an online softmax per head"),
    KernelRow("kv_scatter", "cpu", HOST, None, _kv_write_fits, rows_cpu.emit_kv_write,
              "one workgroup a row, 64-byte vector copies into the cache in place (IREE's "
              "scatter copies element by element: 3.5x slower at a batched step's 8 rows)"),
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


def row_of(opname: str, attrs: dict) -> KernelRow | None:
    """The row an op's kernel attribute names; None for an op of no row and for one that
    asks for its generic kernel (or, a ternary matmul, for "auto"). What the lowering
    driver emits the op with."""
    if not any(r.op == opname for r in TABLE):
        return None
    return row(opname, attrs.get(attr_name(opname)))


def target_features(targets: Sequence[str]) -> frozenset:
    """The CPU features every target has: the host's for llvm-cpu alone (AMX only where
    this process may use its tiles: amx.enable), none else."""
    if list(targets) != ["llvm-cpu"]:
        return frozenset()
    features = host_cpu_features()
    return features if AMX not in features or amx.enable() else features - {AMX}


def choose(op: str, types, attrs: dict, targets: Sequence[str] = HOST,
           features: Sequence[str] | None = None) -> KernelRow | None:
    """The row the pass gives `op` (operand `types`, `attrs`) compiled for `targets`: the
    first of its rows that compiles for every target, whose feature is in `features`
    (default: `target_features(targets)`), which fits the op and which "auto" picks for
    it; None when no row does (the op keeps its generic lowering)."""
    features = target_features(targets) if features is None else frozenset(features)
    for r in rows(op):
        if r.available(targets, features) and r.auto(types, attrs):
            return r
    return None


def _what(op: str) -> str:
    return "ternary strategy" if op == _T else op + " kernel"


def check(op: str, kernel: str, targets: Sequence[str] = HOST) -> KernelRow:
    """The row of `op`'s `kernel` if it compiles for every target (and the host has the
    feature it cannot compile without), else a ConfigError (no such kernel) or an
    UnsupportedError (not for these targets, or not on this host) saying which would."""
    r = row(op, kernel)
    if r is None:
        raise ConfigError(f"{op} has no kernel {kernel!r}; expected one of "
                          f"{', '.join(map(repr, kernel_names(op)))}")
    missing = [t for t in targets if t not in r.targets]
    if missing:
        fits = [s.kernel for s in rows(op) if s.compiles_for(targets)]
        raise UnsupportedError(f"{_what(op)} {kernel!r} does not compile for {', '.join(missing)} "
                               f"(it supports {', '.join(r.targets)})",
                               hint=f"use ternary='auto' or one of {', '.join(fits)}" if op == _T
                               else f"use one of {', '.join(fits) or GENERIC}")
    if r.needs_feature and targets and r.feature not in target_features(targets):
        raise UnsupportedError(f"{_what(op)} {kernel!r} needs a CPU with {r.feature}, which this "
                               f"host lacks", hint="use ternary='auto' (it picks what the host has)")
    return r


def _operands(types) -> str:
    return ", ".join(f"[{', '.join(str(d) for d in t.shape)}] {t.dtype}" for t in types)


def check_fits(op: str, kernel: str, types, attrs: dict, error=ConfigError,
               loc=None) -> KernelRow:
    """The row of `op`'s `kernel` if it fits an op with these operand types and
    attributes, else an `error` (at the user's line `loc`) saying where it applies and
    which kernels fit."""
    r = row(op, kernel)
    if r is None:
        if op == _T:
            raise error(f"unknown ternary matmul strategy {kernel!r}; expected one of "
                        f"{', '.join(map(repr, ('auto', *kernel_names(op))))}", loc=loc)
        raise error(f"{op}: kernel must be one of {', '.join(kernel_names(op))}, got {kernel!r}",
                    loc=loc)
    if not r.fits(types, attrs):
        fit = [s.kernel for s in rows(op) if s.fits(types, attrs)]
        raise error(f"{_what(op)} {kernel!r} cannot emit {op} of operands {_operands(types)}: "
                    f"it takes {r.fits.__doc__}",
                    hint=f"use ternary='auto' or one of {', '.join(fit)}" if op == _T
                    else f"use one of {', '.join(fit + [GENERIC])}", loc=loc)
    return r


def check_attr(op: str, types, attrs: dict) -> None:
    """A TraceError unless `op`'s kernel attribute is "generic" ("auto"), or a kernel of
    the table that fits the op's operand `types` and `attrs` (each op's shape rule calls
    it, so no IR holds a kernel that cannot emit its op), and reads the 2-bit `codes`
    the op's weights are in."""
    kernel = attrs.get(attr_name(op))
    codes = attrs.get("codes") or "signed"
    if kernel == UNSETTLED.get(op, GENERIC) and codes == "signed":
        return
    r = check_fits(op, kernel, types, attrs, TraceError)
    if codes != "signed" and (codes != r.codes or not attrs.get("act_quant")):
        raise TraceError(f"the {kernel!r} {_what(op)} does not read {codes!r} 2-bit codes",
                         hint="pass the weights in the signed codes of pack_ternary")


def take(op: str, kernel: str, types, attrs: dict, targets: Sequence[str] = HOST,
         loc=None) -> KernelRow:
    """The row of `op`'s `kernel` asked for by name: it must compile for `targets` (`check`)
    and fit the op (`check_fits`), else a ConfigError or UnsupportedError (at the user's
    line `loc`)."""
    check(op, kernel, targets)
    return check_fits(op, kernel, types, attrs, loc=loc)


def flags(used: Sequence[KernelRow], targets: Sequence[str]) -> list[str]:
    """The IREE flags of the rows a module's ops were emitted with (table order, no
    repeats), each checked to compile for `targets`: a module that uses a CPU-only kernel
    fails here, by name, instead of inside IREE's GPU pipeline."""
    out = []
    for r in TABLE:
        if r in used:
            check(r.op, r.kernel, targets)
            out += [f for f in r.flags if f not in out]
    return out


#: Host features a row's kernel reads to choose its own code within the row (the avx512
#: ternary GEMM decodes with gf2p8affineqb where the host has GFNI; the widening
#: output-layer kernel multiplies 4 rows of x at a time with AVX-512): a compile-cache
#: key says which of them the host has, so a cached module never holds instructions
#: the host lacks.
KERNEL_FEATURES = ("gfni", "avx512f")


def table_key(targets: Sequence[str]) -> str:
    """What of the table a compile for `targets` on this host depends on, for a compile
    cache key taken before tracing: the rows available to it (feature present), each with
    its flags, and which of KERNEL_FEATURES the host has. Any edit to a rule changes
    tercomp's source digest as well."""
    features = target_features(targets)
    return repr(([(r.op, r.kernel, r.feature, r.flags, r.fits.__name__,
                   r.picks.__name__ if r.picks else None) for r in TABLE
                  if r.available(targets, features)],
                 [f for f in KERNEL_FEATURES if f in features]))
