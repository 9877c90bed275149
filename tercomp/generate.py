"""tc.compile_lm: a BitNet language model compiled for generation.

One IREE module over ONE copy of the weights (2-bit packed ternary projections and an
f16 output table, read as parameters) and a KV cache that lives on the device as mutable
globals (tercomp/codegen/state.py), with one exported function that serves prefill and
decode alike:

    step(ids: i32 [T], start: i32, rows: i32 [L]) -> logits [L, vocab]

T is dynamic: a prompt is one call, a decoded token a call with T = 1 (the ternary
"dispatch" strategies pick the GEMV by the row count at run time). `rows` picks the
positions of the call whose logits are computed (all of them for teacher-forced logits,
the last one to generate). One function, not a prefill and a separately traced decode:
IREE's host-side passes cost grow with the program, and a separate T = 1 trace gave no
measurable decode gain (11-22 ms vs 11-19 ms a token, 2 layers of the bench shape on a
shared 2-core AVX2 machine).

The step (`_Step.forward`), on a [T, hidden] residual stream: embed, then per layer
RoPE'd q/k/v, `cache_write` of this call's k/v rows at `start`, `cached_attention` over
cache rows 0..start+T-1 (tercomp/ops/cache.py), and the output layer on the rows asked
for. For a module compiled for llvm-cpu alone, attention, `rms_norm` and `rope` are
hand-written CPU dispatches (kernel="cpu": codegen/attention_cpu.py, rows_cpu.py). The
compile cache is keyed on the model's arrays and the options, so a cached compile skips
tracing. The runtime side (validation, sampling, `generate`, saving) is
tercomp/runtime/generator.py.

    >>> gen = tc.compile_lm(lm, max_seq=2048)
    >>> logits = gen.prefill(np.array([1, 2, 3], np.int32))     # [3, vocab]
    >>> nxt = gen.decode(int(logits[-1].argmax()))               # [vocab]
    >>> new_tokens = gen.generate([1, 2, 3], max_new_tokens=64)
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os

import numpy as np
from iree.compiler.version import VERSION as IREE_VERSION

from . import __version__, nn
from .codegen.iree_session import compile_vmfb, new_session
from .codegen.lower import check_storage
from .codegen.params import ParamTable, parameterized
from .codegen.state import Entry, StateVar, to_stateful_mlir
from .codegen.targets import (WITH_16BIT_STORAGE, check_extra_flags, needs_isolation,
                              resolve_targets, target_flags)
from .codegen.ternary_strategies import AVX2, check_strategy, target_features
from .errors import TercompError
from .ir import TensorType
from .models.bitnet import BitNetLM, rope_tables
from .passes import Dumper, run_pipeline
from .passes.numerics import enabled as numerics_enabled
from .runtime import cache as compile_cache
from .runtime.loader import from_parts
from .runtime.generator import KV_DTYPES, STEP, LMGenerator
from .runtime.devices import check_threads, pick_device
from .runtime.module import CompiledModule
from .runtime.signature import Signature
from .trace import api as _t
from .trace import spec, trace
from .trace.tracer import apply

__all__ = ["compile_lm"]

DEFAULT_MAX_SEQ = 2048


class _Step(nn.Module):
    """One step of the LM over the KV cache: (ids [T], start, rows [L], caches) ->
    (logits [L, vocab] of the positions `rows` of this call, caches). `caches` is [k_0,
    v_0, k_1, v_1, ...], each [max_seq, KV, D]. `rows` lets a prompt ask for the last
    position's logits only (what generation needs), so the output layer, the largest
    matmul of a step, runs on one row instead of T.

    The output layer (and, tied, the token embedding: one copy) is read from `_table`
    stored in f16 by default, widened in registers (`tern.widening_matmul`)."""

    def __init__(self, lm: BitNetLM, max_seq: int, kv_dtype: str,
                 output_dtype: str = "float16", kernel: str = "generic",
                 attention: str = "generic"):
        self.lm = lm
        c = lm.config
        cos, sin = rope_tables(c, np.arange(max_seq))
        self._cos, self._sin = cos, sin           # [max_seq, D/2]: not parameters
        self._kv_dtype = kv_dtype
        self._kernel = kernel
        self._attention = attention
        self._rows = "cpu" if attention == "cpu" else "generic"     # rms_norm and rope
        self._table = self._scale = None
        w = lm.lm_head.weight if lm.lm_head is not None else lm.embed_tokens.weight
        if output_dtype == "float16":
            self._table = np.asarray(w, np.float32).astype(np.float16)
        elif output_dtype == "int8":
            self._table, self._scale = quantize_rows(w)

    def _embed(self, ids):
        """[T, hidden]: rows of the output table when the embedding is tied to it."""
        if self._table is None or self.lm.lm_head is not None:
            return self.lm.embed_tokens(ids)
        rows = _t.take(self._table, ids, axis=0).astype("float32")
        if self._scale is None:
            return rows
        return rows * _t.expand_dims(_t.take(self._scale, ids, axis=0), 1)

    def _logits(self, h):
        """[L, vocab] for final-normed hidden states h [L, hidden]."""
        if self._table is None:
            return self.lm.logits(h)
        scale = () if self._scale is None else (self._scale,)
        return apply("widening_matmul", h, self._table, *scale, kernel=self._kernel)

    def _norm(self, norm, x):
        return apply("rms_norm", x, norm.weight, eps=norm.eps, kernel=self._rows)

    def _rope(self, x, heads, cos, sin):
        return apply("rope", x.reshape(-1, heads, self.lm.config.head_dim), cos, sin,
                     style=self.lm.config.rope_style, kernel=self._rows)

    def forward(self, ids, start, rows, caches):
        lm, c = self.lm, self.lm.config
        h, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        pos = apply("arange", ids, start)
        cos, sin = _t.take(self._cos, pos, axis=0), _t.take(self._sin, pos, axis=0)
        x = self._embed(ids)                                         # [T, hidden]
        out = []
        for i, layer in enumerate(lm.layers):
            a, mlp = layer.attn, layer.mlp
            n = self._norm(layer.input_layernorm, x)
            q = self._rope(a.q_proj(n), h, cos, sin)
            k = self._rope(a.k_proj(n), kv, cos, sin)
            v = a.v_proj(n).reshape(-1, kv, d)
            kc = apply("cache_write", caches[2 * i], k.astype(self._kv_dtype), start)
            vc = apply("cache_write", caches[2 * i + 1], v.astype(self._kv_dtype), start)
            o = apply("cached_attention", q, kc, vc, start,
                      scale=float(1.0 / np.sqrt(d)), kernel=self._attention)
            x = x + a.o_proj(self._norm(a.attn_sub_norm, o.reshape(-1, h * d)))
            m = self._norm(layer.post_attention_layernorm, x)
            x = x + mlp.down_proj(self._norm(mlp.ffn_sub_norm, mlp.activation(mlp.gate_proj(m)) *
                                             mlp.up_proj(m)))
            out += [kc, vc]
        last = _t.take(x, rows, axis=0)                               # [L, hidden]
        return self._logits(self._norm(lm.norm, last)), out


#: compile_lm's output_dtype choices: how the output table is stored
OUTPUT_DTYPES = ("float16", "int8", "float32")


def quantize_rows(w) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [N, K], scale f32 [N]) with w ~= q * scale[:, None]: each row scaled by its
    largest magnitude / 127, rounded to nearest (llama.cpp's Q8_0 does the same per 32
    weights; one scale a row keeps the kernel's inner loop free of scales)."""
    w = np.asarray(w, np.float32)
    top = np.abs(w).max(axis=1)
    scale = np.where(top > 0, top / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale


def _check_args(lm, max_seq, kv_dtype):
    if not isinstance(lm, BitNetLM):
        raise TercompError(f"compile_lm expects a models.BitNetLM, got {type(lm).__name__}",
                           hint="load one with models.load(path) or build models.BitNetLM(config)")
    if max_seq is None:
        max_seq = min(DEFAULT_MAX_SEQ, lm.config.max_position_embeddings)
    if isinstance(max_seq, bool) or not isinstance(max_seq, (int, np.integer)) or max_seq < 1:
        raise TercompError(f"compile_lm: max_seq must be a positive integer, got {max_seq!r}")
    if max_seq > lm.config.max_position_embeddings:
        raise TercompError(f"compile_lm: max_seq {max_seq} exceeds the model's "
                           f"max_position_embeddings {lm.config.max_position_embeddings}")
    if kv_dtype not in KV_DTYPES:
        raise TercompError(f"compile_lm: kv_dtype must be one of {', '.join(sorted(KV_DTYPES))}, "
                           f"got {kv_dtype!r}")
    return int(max_seq), KV_DTYPES[kv_dtype]


def compile_lm(lm, max_seq: int | None = None, kv_dtype: str | None = None, *,
               target="llvm-cpu", ternary: str = "auto", device: str | None = None,
               threads: int | None = None, cache: bool = True, dump_dir: str | None = None,
               flags=(), isolate: bool | None = None, check_numerics: bool | None = None,
               output_dtype: str | None = None, vulkan_target: str | None = None,
               cuda_target: str | None = None) -> LMGenerator:
    """Compile `lm` (a models.BitNetLM) into a generator with `prefill`, `decode`,
    `generate`, `reset` and `save` (tercomp.runtime.generator.LMGenerator).

    `max_seq` is the KV cache length (prompt plus generated tokens; default the model's
    max_position_embeddings, at most 2048), `kv_dtype` the
    cache's element type ("float16", as llama.cpp keeps it, or "float32"; default
    float16, or float32 for a target without 16-bit storage: the default Vulkan target,
    see codegen.targets.NO_16BIT_STORAGE). `ternary`
    chooses the ternary kernels as in tc.compile ("auto": per shape, so decode and
    prefill may differ). The cache of each layer is two `[max_seq, kv_heads, head_dim]`
    globals on the device; a decode step transfers one token id in and the logits out.

    `output_dtype` is how the output layer (and the token embedding, when tied: one
    table serves both) is stored and read on every step, which at 700M parameters is
    more than a third of a decode step's memory traffic: "float16" (default; llama.cpp
    keeps it so, and a GGUF's f16 embedding is exact in it), "int8" (one scale per row,
    half the bytes of f16; the logits move by the rounding of each weight to 1/254 of its
    row's largest) or "float32" (the model's own arrays, twice the bytes of f16; the
    default where kv_dtype's is float32).

    `target`, `vulkan_target`, `cuda_target`, `device` and `threads` are as in tc.compile:
    the step compiles for "llvm-cpu" (with the hand-written CPU attention, norm and RoPE
    dispatches), "llvm-cpu-generic", "vulkan", "cuda" or a list of them.

    `isolate` and `check_numerics` are as in tc.compile (with check_numerics, a NaN or Inf
    raises NumericsError after the step, whose cache rows are then already written).

    >>> gen = tc.compile_lm(lm, max_seq=512)
    >>> gen.generate([1, 15043], max_new_tokens=16, temperature=0.8, top_p=0.9, seed=1)
    """
    targets = resolve_targets(target, vulkan_target=vulkan_target, cuda_target=cuda_target)
    names = [t.name for t in targets]
    if len(targets) > 1:
        # Measured with IREE 3.13: a step built for local+vulkan or local+cuda computes
        # wrong logits on every device, NaN on local-sync, and one variant segfaulted
        # the process on its first prefill; each target alone is right, and so is the
        # same step compiled for both without its cache globals (tc.compile)
        raise TercompError(f"compile_lm compiles for one target at a time, got {', '.join(names)}",
                           hint="compile one generator per target: IREE 3.13's modules for "
                                "several targets corrupt the step's cache globals")
    no16 = [t for t in targets if not t.stores_16bit]
    narrow = "float32" if no16 else "float16"
    for what, value in (("kv_dtype", kv_dtype), ("output_dtype", output_dtype)):
        if no16 and value in ("float16", "f16"):
            raise TercompError(f"compile_lm: {what}={value!r} needs 16-bit storage, which the "
                               f"{no16[0].name} target {no16[0].arch!r} does not have",
                               hint=f"leave {what} out (float32 there), or pass a vulkan_target "
                                    f"that stores f16: {', '.join(map(repr, WITH_16BIT_STORAGE))}, ...")
    max_seq, kv = _check_args(lm, max_seq, kv_dtype or narrow)
    output_dtype = output_dtype or narrow
    if output_dtype not in OUTPUT_DTYPES:
        raise TercompError(f"compile_lm: output_dtype must be one of "
                           f"{', '.join(map(repr, OUTPUT_DTYPES))}, got {output_dtype!r}")
    # the hand-written f16 GEMV where the module is for this host and it has AVX2
    kernel = "avx2" if AVX2 in target_features(names) else "generic"
    # the hand-written decode attention where the module is for CPUs only
    attention = "cpu" if names == ["llvm-cpu"] else "generic"
    check_strategy(ternary, names)
    device = pick_device(names, device)
    check_threads(names, device, threads)
    c = lm.config
    meta = {"drivers": [d for t in targets for d in t.drivers], "iree_version": IREE_VERSION,
            "cache_hit": False, "weights": "irpa",
            "lm": LMGenerator.describe(c.to_dict(), max_seq, kv, tokenizer=_tokenizer_json(lm))}
    user_flags = check_extra_flags(flags)
    key = None
    if cache:
        # Keyed on the model and the options, not on the traced IR: a hit skips tracing,
        # the passes and the lowering, which cost more than IREE for a large model.
        key = compile_cache.key("compile_lm", _source_digest(), _model_digest(lm), max_seq, kv,
                                ternary, output_dtype, kernel, attention,
                                "\0".join(f for t in targets for f in t.flags),
                                "\0".join(user_flags), STEP,
                                numerics_enabled(check_numerics),
                                __version__, IREE_VERSION)
        hit = compile_cache.lookup(key)
        if hit is not None:
            cached, vmfb, irpa = hit
            exe = from_parts(cached, vmfb, irpa, device=device, threads=threads, cache_key=key,
                             cache_hit=True, lm=meta["lm"])
            return LMGenerator(exe)
    exe = _build(step=_Step(lm, max_seq, kv, output_dtype, kernel, attention), config=c, cache_type=TensorType(
        (max_seq, c.num_key_value_heads, c.head_dim), kv), ternary=ternary, targets=targets,
        user_flags=user_flags, dump_dir=dump_dir, meta=meta, device=device, threads=threads,
        isolate=isolate, numerics=numerics_enabled(check_numerics))
    if key is not None:
        exe.meta["cache_key"] = key
        compile_cache.store(key, exe)
    return LMGenerator(exe)


def _build(step, config, cache_type, ternary, targets, user_flags, dump_dir, meta, device,
           threads, isolate=None, numerics=False) -> CompiledModule:
    """Trace the step, run the passes, lower both entry points and compile with IREE."""
    names = [t.name for t in targets]
    n = 2 * config.num_hidden_layers
    caches = [spec(cache_type.shape, cache_type.dtype)] * n
    pipeline = ["simplify"] if ternary == "off" else \
        [("ternary", {"strategy": ternary, "targets": names}), "simplify"]
    if numerics:
        pipeline.append("check_numerics")     # an extra output after the logits and caches
    dumper = Dumper(os.path.join(dump_dir, STEP) if dump_dir else None)
    g = trace(step, spec(("T",), "int32"), spec((), "int32"), spec(("L",), "int32"), caches,
              name=f"{STEP}_body")
    g = run_pipeline(g, pipeline, dumper)
    check_storage(g, targets)
    stages = {f"{STEP}.{k}": v for k, v in dumper.stages.items()}
    state = [StateVar(f"kv{i}", cache_type) for i in range(n)]
    bind_in = {3 + i: f"kv{i}" for i in range(n)}
    bind_out = {1 + i: f"kv{i}" for i in range(n)}
    entries = [Entry(STEP, g, bind_in, bind_out)]
    session, ctx = new_session()
    table = ParamTable()
    with parameterized([g], table):
        module, kernel_flags, _ = to_stateful_mlir(entries, state, ctx, params=table, targets=names)
    irpa = table.archive()
    with ctx:
        stages["mlir"] = module.operation.get_asm(large_elements_limit=16)
    all_flags = target_flags(names, **_arch_options(targets)) + user_flags
    all_flags += [f for f in kernel_flags if f not in all_flags]
    vmfb = compile_vmfb(module, all_flags, session=session,
                        isolate=needs_isolation(names, all_flags, user_flags, isolate),
                        stage=f"the IREE compile of the LM for {', '.join(names)}")
    sig = dataclasses.replace(Signature.from_graph(g), function=STEP)
    meta = {**meta, "flags": all_flags, "parameters": sorted(table.arrays),
            "numerics": g.meta.get("numerics")}
    return CompiledModule(vmfb, sig, stages, device=device, threads=threads, targets=names,
                          meta=meta, weights=irpa, weights_scope=table.scope)


def _arch_options(targets) -> dict:
    """vulkan_target= / cuda_target= of resolved `targets`, for target_flags."""
    return {f"{t.name}_target": t.arch for t in targets if t.name in ("vulkan", "cuda")}


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """sha256 of tercomp's own source files: a compile-cache key part that changes with
    any change to the compiler, since the key is taken before tracing."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for d, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            if f.endswith(".py"):
                with open(os.path.join(d, f), "rb") as fh:
                    h.update(f.encode() + b"\0" + fh.read())
    return h.hexdigest()


def _model_digest(lm) -> str:
    """sha256 of everything in the module tree of `lm` that can change the compiled
    module: every array (frozen 2-bit weights and scales in private attributes too),
    number and string, by attribute path."""
    h = hashlib.sha256()

    def visit(obj, path):
        if isinstance(obj, nn.Module):
            for k in sorted(vars(obj)):
                visit(vars(obj)[k], f"{path}.{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                visit(v, f"{path}.{i}")
        elif isinstance(obj, np.ndarray):
            h.update(f"{path}:{obj.dtype.str}:{obj.shape}".encode())
            h.update(np.ascontiguousarray(obj).data)
        elif isinstance(obj, (bool, int, float, str, np.generic)) or obj is None:
            h.update(f"{path}={obj!r}".encode())
        elif dataclasses.is_dataclass(obj):
            h.update(f"{path}={obj!r}".encode())
    visit(lm, "lm")
    return h.hexdigest()


def _tokenizer_json(lm):
    tok = getattr(lm, "tokenizer", None)
    if tok is None or not hasattr(tok, "to_str"):
        return None
    try:
        return tok.to_str()
    except Exception:       # a tokenizer that cannot be serialized: ids still work
        return None
