"""tc.compile_lm: a BitNet language model compiled for generation.

One IREE module over ONE copy of the weights (2-bit packed ternary projections and an
f16 output table, read as parameters) and a KV cache that lives on the device as mutable
globals (tercomp/lowering/state.py), with one exported function that serves prefill and
decode alike:

    step(ids: i32 [T], start: i32, rows: i32 [L]) -> logits [L, vocab]

(a batched module, max_batch > 1, also has `copy_rows`, which copies KV rows between
slots: runtime/step_abi.py, runtime.BatchedLMGenerator.copy_prefix).

T is dynamic: a prompt is one call, a decoded token a call with T = 1 (the ternary
"dispatch" strategies pick the GEMV by the row count at run time). `rows` picks the
positions of the call whose logits are computed (all of them for teacher-forced logits,
the last one to generate). One function, not a prefill and a separately traced decode:
IREE's host-side passes cost grow with the program, and a separate T = 1 trace gave no
measurable decode gain (11-22 ms vs 11-19 ms a token, 2 layers of the bench shape on a
shared 2-core AVX2 machine).

The step (`_Step.forward`) is the model's own forward (`lm.hidden_states` with a
models.KVCache: this call's k/v rows go into the cache at `start`, attention reads
cache rows 0..start+T-1; tercomp/ops/kv_cache_ops.py) and its output layer on the rows asked
for; this file holds no layer math, so a changed model is the model compiled. For a
module compiled for llvm-cpu alone, the `kernels` pass (passes/kernels.py) gives
attention, `rms_norm`, `rope` and the output layer their hand-written CPU dispatches
(tercomp/kernels/: attention_cpu, rows_cpu, widening_avx2). The module is built as
tc.compile's are (tercomp/build.py: its Pipeline is `_pipeline`). The compile cache is
keyed on the traced step (build.Pipeline.key), so a subclassed layer, a patched method or
a swapped activation is compiled anew; a hit skips the passes, the lowering and IREE.
The runtime side (validation, sampling, `generate`, saving) is
tercomp/runtime/generator.py.

    >>> gen = tc.compile_lm(lm, max_seq=2048)
    >>> logits = gen.prefill(np.array([1, 2, 3], np.int32))     # [3, vocab]
    >>> nxt = gen.decode(int(logits[-1].argmax()))               # [vocab]
    >>> new_tokens = gen.generate([1, 2, 3], max_new_tokens=64)
"""
from __future__ import annotations

import json
import os

import numpy as np

from . import nn
from .build import BuildOptions, Pipeline, build, compiler_digest
from .lowering import Entry, StateVar, to_stateful_mlir
from .codegen.targets import WITH_16BIT_STORAGE
from .errors import ConfigError, UnsupportedError
from .ir import TensorType
from .ir.digest import digest
from .models.bitnet import BitNetLM
from .models.kv_cache import KVCache
from .nn.stored import StoredTable, choose_table
from .passes import Dumper
from .passes.check_numerics import enabled as numerics_enabled
from .runtime.batched import BatchedLMGenerator
from .runtime.generator import KV_DTYPES, LMGenerator
from .runtime.step_abi import COPY, COPY_INPUTS, StepABI
from .tracing import api as _t
from .tracing import spec, trace

__all__ = ["compile_lm"]

DEFAULT_MAX_SEQ = 2048


def _choose_table(w, norm_weight, cache: bool):
    """nn.stored.choose_table, its answer remembered in the cache directory (with `cache`)
    under a BLAKE3 digest of the table's and the norm's bytes and of tercomp's sources:
    the probe is ~0.5 s of a cached 700M compile_lm, the digest ~0.05 s. What is
    remembered is the dtype and why; the table is made again from `w` (the compile
    cache key covers the trace that reads it)."""
    if not cache:
        return choose_table(w, norm_weight)
    import blake3
    from .runtime.files import cache_dir, write_atomic
    h = blake3.blake3(f"choose_table\0{compiler_digest()}\0".encode())
    for a in (w, norm_weight):
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}:{a.shape}\0".encode())
        h.update(a.view(np.uint8).data if a.size else b"")
    path = os.path.join(cache_dir(), "output-table", h.hexdigest())
    try:
        with open(path, encoding="utf-8") as f:
            got = json.loads(f.read(4096))
        if got["dtype"] in ("int8", "float16") and isinstance(got["why"], str):
            return got["dtype"], StoredTable.from_weight(w, got["dtype"]), got["why"]
    except (OSError, ValueError, KeyError, TypeError):
        pass                            # not remembered (or unreadable): probe
    dtype, table, why = choose_table(w, norm_weight)
    try:
        write_atomic(path, json.dumps({"dtype": dtype, "why": why}).encode(), "output-table "
                     "choice", make_dirs=True)
    except Exception:                   # a cache that cannot be written: probe next time
        pass
    return dtype, table, why


class _Step(nn.Module):
    """One step of the LM over the KV cache: (ids [T], start, rows [L], caches) ->
    (logits [L, vocab] of the positions `rows` of this call, caches). `caches` is [k_0,
    v_0, k_1, v_1, ...], each [max_seq, KV, D]. The network is the model's own forward
    (`lm.hidden_states` with a models.KVCache over the caches); `rows` lets a
    prompt ask for the last position's logits only (what generation needs), so the
    output layer, the largest matmul of a step, runs on one row instead of T. The output
    layer (and, tied, the token embedding: one copy) reads a table stored as
    `output_dtype` (BitNetLM.with_stored_output)."""

    def __init__(self, lm: BitNetLM, kv_dtype: str, output_dtype: str = "float16", table=None):
        self.lm = lm.with_stored_output(output_dtype, table)
        self._kv_dtype = kv_dtype

    def forward(self, ids, start, rows, caches):
        cache = KVCache(caches, self._kv_dtype, start=start)
        h = self.lm.hidden_states(ids.reshape(1, -1), cache=cache)          # [1, T, hidden]
        last = _t.take(h.reshape(-1, h.shape[-1]), rows, axis=0)             # [L, hidden]
        return self.lm.logits(last), cache.updated


def _copy_rows(src, dst, positions, caches):
    """copy_rows (runtime/step_abi.py): every cache [N, S, KV, D] with row positions[r]
    of slot dst[r] set to row positions[r] of slot src[r] (R rows, R dynamic: a copy of
    a prompt prefix moves its rows only). The rows are gathered from the cache as it was
    (`take` over its [N * S] rows), then written with kv_scatter, the step's own write."""
    n, s = caches[0].shape[0], caches[0].shape[1]
    at = src * s + positions                                     # i32 [R]: flat row index
    out = []
    for c in caches:
        rows = _t.take(c.reshape(n * s, *c.shape[2:]), at, axis=0)          # [R, KV, D]
        out.append(_t.apply("kv_scatter", c, rows, dst, positions))
    return out


class _BatchStep(_Step):
    """One step of the batched generator: (ids [T], slots [T], positions [T], rows [L],
    caches) -> (logits [L, vocab], caches), token t at position positions[t] of the
    sequence in cache slot slots[t]; caches [N, max_seq, KV, D] (models.KVCache over slots).
    The same network as _Step: the model's own forward."""

    def forward(self, ids, slots, positions, rows, caches):
        cache = KVCache(caches, self._kv_dtype, slots=slots, positions=positions)
        h = self.lm.hidden_states(ids.reshape(1, -1), cache=cache)
        last = _t.take(h.reshape(-1, h.shape[-1]), rows, axis=0)
        return self.lm.logits(last), cache.updated


#: compile_lm's output_dtype choices: how the output table is stored ("auto": int8 where
#: it keeps the model's top-1 token, nn.stored.choose_table)
OUTPUT_DTYPES = ("auto", "float16", "int8", "float32")


def _check_args(lm, max_seq, kv_dtype):
    if not isinstance(lm, BitNetLM):
        raise ConfigError(f"compile_lm expects a models.BitNetLM, got {type(lm).__name__}",
                          hint="load one with models.load(path) or build models.BitNetLM(config)")
    if max_seq is None:
        max_seq = min(DEFAULT_MAX_SEQ, lm.config.max_position_embeddings)
    if isinstance(max_seq, bool) or not isinstance(max_seq, (int, np.integer)) or max_seq < 1:
        raise ConfigError(f"compile_lm: max_seq must be a positive integer, got {max_seq!r}")
    if max_seq > lm.config.max_position_embeddings:
        raise ConfigError(f"compile_lm: max_seq {max_seq} exceeds the model's "
                          f"max_position_embeddings {lm.config.max_position_embeddings}")
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"compile_lm: kv_dtype must be one of {', '.join(sorted(KV_DTYPES))}, "
                          f"got {kv_dtype!r}")
    return int(max_seq), KV_DTYPES[kv_dtype]


def compile_lm(lm, max_seq: int | None = None, kv_dtype: str | None = None, *,
               target="llvm-cpu", ternary: str = "auto", device: str | None = None,
               threads: int | None = None, cache: bool = True, dump_dir: str | None = None,
               flags=(), isolate: bool | None = None, check_numerics: bool | None = None,
               output_dtype: str | None = None, vulkan_target: str | None = None,
               cuda_target: str | None = None, max_batch: int | None = None):
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
    more than a third of a decode step's memory traffic: "auto" (the default): "int8" for
    a table of 2^23 elements or more when it gives the model's top-1 token on 32 probe
    hidden states, else "float16" (nn.stored.choose_table; the choice and why are in
    `gen.exe.meta["lm"]["output"]`); "float16" (as llama.cpp keeps it; a GGUF's f16
    embedding is exact in it); "int8" (one scale per row, half the bytes of f16; the
    logits move by the rounding of each weight to 1/254 of its row's largest); or
    "float32" (the model's own arrays, twice the bytes of f16; the default where
    kv_dtype's is float32).

    `target`, `vulkan_target`, `cuda_target`, `device` and `threads` are as in tc.compile:
    the step compiles for "llvm-cpu" (with the hand-written CPU attention, norm and RoPE
    dispatches), "llvm-cpu-generic", "vulkan", "cuda" or a list of them.

    `isolate` and `check_numerics` are as in tc.compile (with check_numerics, a NaN or Inf
    raises NumericsError after the step, whose cache rows are then already written).

    `max_batch=N` (N > 1) gives a runtime.BatchedLMGenerator instead: a cache of N slots
    of max_seq rows, one sequence each, and a step that runs tokens of several slots at
    their own positions in one call (`step(tokens, slots)` decodes a batch, `prefill(ids,
    slot=s)` fills one slot; runtime.Engine schedules requests over it). The default
    (None or 1) is the single-sequence LMGenerator.

    >>> gen = tc.compile_lm(lm, max_seq=512)
    >>> gen.generate([1, 15043], max_new_tokens=16, temperature=0.8, top_p=0.9, seed=1)
    """
    opts = BuildOptions.resolve(target, vulkan_target=vulkan_target, cuda_target=cuda_target,
                                flags=tuple(flags) + (ASYNC_EXTERNAL,), device=device,
                                threads=threads, ternary=ternary, isolate=isolate)
    if len(opts.targets) > 1:
        # Measured with IREE 3.13: a step built for local+vulkan or local+cuda computes
        # wrong logits on every device, NaN on local-sync, and one variant segfaulted
        # the process on its first prefill; each target alone is right, and so is the
        # same step compiled for both without its cache globals (tc.compile)
        raise ConfigError(f"compile_lm compiles for one target at a time, got "
                          f"{', '.join(opts.names)}",
                          hint="compile one generator per target: IREE 3.13's modules for "
                               "several targets corrupt the step's cache globals")
    no16 = [t for t in opts.targets if not t.stores_16bit]
    narrow = "float32" if no16 else "float16"
    for what, value in (("kv_dtype", kv_dtype), ("output_dtype", output_dtype)):
        if no16 and value in ("float16", "f16"):
            raise UnsupportedError(f"compile_lm: {what}={value!r} needs 16-bit storage, which the "
                                   f"{no16[0].name} target {no16[0].arch!r} does not have",
                                   hint=f"leave {what} out (float32 there), or pass a vulkan_target "
                                        f"that stores f16: {', '.join(map(repr, WITH_16BIT_STORAGE))}, ...")
    max_seq, kv = _check_args(lm, max_seq, kv_dtype or narrow)
    max_batch = _check_batch(max_batch)
    output_dtype = output_dtype or ("auto" if narrow == "float16" else narrow)
    if output_dtype not in OUTPUT_DTYPES:
        raise ConfigError(f"compile_lm: output_dtype must be one of "
                          f"{', '.join(map(repr, OUTPUT_DTYPES))}, got {output_dtype!r}")
    numerics = numerics_enabled(check_numerics)
    c = lm.config
    lm_meta = LMGenerator.describe(c.to_dict(), max_seq, kv, tokenizer=_tokenizer_json(lm),
                                   chat=_chat_template(lm), max_batch=max_batch)
    wrap = LMGenerator if max_batch == 1 else BatchedLMGenerator
    abi = StepABI.of(max_batch)
    table = None
    if output_dtype == "auto":
        w = lm.lm_head.weight if lm.lm_head is not None else lm.embed_tokens.weight
        output_dtype, table, why = _choose_table(w, lm.norm.weight, cache)
        lm_meta["output"] = {"dtype": output_dtype, "why": why}
    else:
        lm_meta["output"] = {"dtype": output_dtype, "why": "asked for"}
    step = (_BatchStep if abi.batched else _Step)(lm, kv, output_dtype, table)
    cache_type = TensorType(abi.cache_shape(max_batch, max_seq, c.num_key_value_heads,
                                            c.head_dim), kv)
    n = 2 * c.num_hidden_layers
    dumper = Dumper(os.path.join(dump_dir, abi.function) if dump_dir else None)
    # The compile cache is keyed on this trace (build.Pipeline.key): the model's own
    # forward, whatever code it runs, and every weight it reads.
    graph = trace(step, *[spec(s, "int32") for s in abi.input_shapes],
                  [spec(cache_type.shape, kv)] * n, name=f"{abi.function}_body")
    copy = None
    if abi.batched:
        copy = trace(_copy_rows, *[spec(("R",), "int32")] * len(COPY_INPUTS),
                     [spec(cache_type.shape, kv)] * n, name=f"{COPY}_body")
    exe = build(_pipeline(abi, n, cache_type, ternary, opts, numerics, copy), graph, opts,
                dumper=dumper, cache=cache, meta={"lm": lm_meta}, hit_meta={"lm": lm_meta},
                stage=f"the IREE compile of the LM for {', '.join(opts.names)}")
    return wrap(exe)


#: The step's functions return once their work is queued and take a wait and a signal
#: fence (IREE's "coarse-fences" ABI): the generators wait by sleeping, not inside
#: IREE, whose wait cost the host thread CPU that a 2-core machine's workers needed
#: (runtime/fenced.py: 700M decode at 2 threads 7.63 -> 6.90 ms a token).
ASYNC_EXTERNAL = "--iree-execution-model=async-external"


def _pipeline(abi: StepABI, n_caches: int, cache_type, ternary, opts: BuildOptions,
              numerics: bool, copy=None) -> Pipeline:
    """compile_lm's Pipeline: the ternary pass (unless "off"), the kernels pass, simplify
    (and check_numerics); the step lowered as the exported function of `abi` over one
    mutable global per cache, bound as the ABI says, and with a batched ABI the traced
    `copy` (copy_rows: no weights, no passes) as a second function over the same
    globals. A cache hit skips the passes."""
    names = opts.names
    passes = ([] if ternary == "off" else [("ternary", {"strategy": ternary, "targets": names})]) \
        + [("kernels", {"targets": names}), "simplify"]
    if numerics:
        passes.append("check_numerics")     # an extra output after the logits and caches
    state = [StateVar(name, cache_type) for name in abi.cache_names(n_caches)]
    bind_in, bind_out = abi.bind_inputs(n_caches), abi.bind_outputs(n_caches)

    entries = []
    if copy is not None:
        entries.append(Entry(COPY, copy, abi.bind_inputs(n_caches, len(COPY_INPUTS)),
                             abi.bind_outputs(n_caches, 0)))

    def lower(g, ctx, params):
        return to_stateful_mlir([Entry(abi.function, g, bind_in, bind_out, abi.scalars),
                                 *entries], state,
                                ctx, params=params, targets=names)
    return Pipeline("compile_lm", tuple(passes), lower,
                    lower_key=repr((abi, sorted(abi.scalars), cache_type, sorted(bind_in.items()),
                                    sorted(bind_out.items()),
                                    copy and digest(copy))),
                    weights="irpa", function=abi.function, stages_on_hit=False,
                    stage_prefix=f"{abi.function}.")


def _check_batch(max_batch) -> int:
    if max_batch is None:
        return 1
    if isinstance(max_batch, bool) or not isinstance(max_batch, (int, np.integer)) \
            or not 1 <= max_batch <= MAX_BATCH:
        raise ConfigError(f"compile_lm: max_batch must be an int from 1 to {MAX_BATCH}, "
                          f"got {max_batch!r}")
    return int(max_batch)


#: the most slots a batched generator's cache has
MAX_BATCH = 256


def _chat_template(lm):
    template = getattr(getattr(lm, "tokenizer", None), "chat_template", None)
    return template.to_dict() if template is not None else None


def _tokenizer_json(lm):
    tok = getattr(lm, "tokenizer", None)
    if tok is None or not hasattr(tok, "to_str"):
        return None
    try:
        return tok.to_str()
    except Exception:       # a tokenizer that cannot be serialized: ids still work
        return None
