"""tc.compile_lm: a BitNet language model compiled for generation.

One IREE module with two entry points over ONE copy of the weights (2-bit packed
ternary projections, read as parameters that both functions load) and a KV cache that
lives on the device as mutable globals (tercomp/codegen/state.py):

    prefill(ids: i32 [T], start: i32) -> logits [T, vocab]    T dynamic: one call per prompt
    decode(ids: i32 [1], start: i32)  -> logits [1, vocab]    T = 1: the decode kernels

Both run the same traced step (`_Step.forward`): embed, then per layer RoPE'd q/k/v,
`cache_write` of this call's k/v rows at `start`, `cached_attention` over cache rows
0..start+T-1 (tercomp/ops/cache.py), and the output layer. Tracing it twice, with T
symbolic and with T = 1, lets the ternary pass pick the prefill kernel for a dynamic
batch and the decode kernel for one token. The runtime side (validation, sampling,
`generate`, saving) is tercomp/runtime/generator.py.

    >>> gen = tc.compile_lm(lm, max_seq=2048)
    >>> logits = gen.prefill(np.array([1, 2, 3], np.int32))     # [3, vocab]
    >>> nxt = gen.decode(int(logits[-1].argmax()))               # [vocab]
    >>> new_tokens = gen.generate([1, 2, 3], max_new_tokens=64)
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
from functools import partial

import numpy as np
from iree.compiler.version import VERSION as IREE_VERSION

from . import __version__, nn
from .codegen.iree_session import compile_module, new_session
from .codegen.params import ParamTable, parameterized
from .codegen.state import Entry, StateVar, to_stateful_mlir
from .codegen.targets import (check_extra_flags, compile_with_tool, needs_tool, resolve_targets,
                              target_flags)
from .codegen.ternary_strategies import check_strategy, choose_strategy, flags_for
from .errors import TercompError
from .ir import TensorType
from .models.bitnet import BitNetLM, apply_rope, rope_tables
from .passes import Dumper, run_pipeline
from .runtime import cache as compile_cache
from .runtime.generator import KV_DTYPES, LMGenerator
from .runtime.module import CompiledModule, check_threads, pick_device
from .runtime.signature import Signature
from .trace import api as _t
from .trace import spec, trace
from .trace.tracer import apply

__all__ = ["compile_lm"]

DEFAULT_MAX_SEQ = 2048


class _Step(nn.Module):
    """One step of the LM over the KV cache: (ids [T], start, caches) -> (logits [T,
    vocab], caches). `caches` is [k_0, v_0, k_1, v_1, ...], each [max_seq, KV, D]."""

    def __init__(self, lm: BitNetLM, max_seq: int, kv_dtype: str):
        self.lm = lm
        c = lm.config
        cos, sin = rope_tables(c, np.arange(max_seq))
        self._cos, self._sin = cos, sin           # [max_seq, D/2]: not parameters
        self._kv_dtype = kv_dtype

    def forward(self, ids, start, caches):
        lm, c = self.lm, self.lm.config
        h, kv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        pos = apply("arange", ids, start)
        cos, sin = _t.take(self._cos, pos, axis=0), _t.take(self._sin, pos, axis=0)
        x = lm.embed_tokens(_t.expand_dims(ids, 0))                  # [1, T, hidden]
        out = []
        for i, layer in enumerate(lm.layers):
            a = layer.attn
            n = layer.input_layernorm(x)
            q = apply_rope(a.q_proj(n).reshape(1, -1, h, d), cos, sin, c.rope_style)
            k = apply_rope(a.k_proj(n).reshape(1, -1, kv, d), cos, sin, c.rope_style)
            v = a.v_proj(n).reshape(-1, kv, d)
            kc = apply("cache_write", caches[2 * i], k.reshape(-1, kv, d).astype(self._kv_dtype), start)
            vc = apply("cache_write", caches[2 * i + 1], v.astype(self._kv_dtype), start)
            o = apply("cached_attention", q.reshape(-1, h, d), kc, vc, start,
                      scale=float(1.0 / np.sqrt(d)))
            x = x + a.o_proj(a.attn_sub_norm(o.reshape(1, -1, h * d)))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            out += [kc, vc]
        logits = lm.logits(lm.norm(x))
        return logits.reshape(-1, c.vocab_size), out


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


def _share_constants(graphs) -> None:
    """Make equal constants of `graphs` the same array, so each becomes ONE parameter
    (the ternary pass packs the weights of each traced graph anew)."""
    seen = {}
    for g in graphs:
        for op in g.ops:
            v = op.attrs.get("value") if op.opname == "constant" else None
            if isinstance(v, np.ndarray) and v.size >= 64:
                key = (v.dtype.str, v.shape, hashlib.sha256(np.ascontiguousarray(v).data).digest())
                op.attrs["value"] = seen.setdefault(key, v)


def compile_lm(lm, max_seq: int | None = None, kv_dtype: str = "float16", *, target="llvm-cpu",
               ternary: str = "auto", device: str | None = None, threads: int | None = None,
               cache: bool = True, dump_dir: str | None = None, flags=()) -> LMGenerator:
    """Compile `lm` (a models.BitNetLM) into a generator with `prefill`, `decode`,
    `generate`, `reset` and `save` (tercomp.runtime.generator.LMGenerator).

    `max_seq` is the KV cache length (prompt plus generated tokens; default the model's
    max_position_embeddings, at most 2048), `kv_dtype` the
    cache's element type ("float16", as llama.cpp keeps it, or "float32"). `ternary`
    chooses the ternary kernels as in tc.compile ("auto": per shape, so decode and
    prefill may differ). The cache of each layer is two `[max_seq, kv_heads, head_dim]`
    globals on the device; a decode step transfers one token id in and the logits out.

    >>> gen = tc.compile_lm(lm, max_seq=512)
    >>> gen.generate([1, 15043], max_new_tokens=16, temperature=0.8, top_p=0.9, seed=1)
    """
    max_seq, kv = _check_args(lm, max_seq, kv_dtype)
    targets = resolve_targets(target)
    names = [t.name for t in targets]
    check_strategy(ternary, names)
    device = pick_device(names, device)
    check_threads(names, device, threads)
    c = lm.config
    cache_type = TensorType((max_seq, c.num_key_value_heads, c.head_dim), kv)
    caches = [spec(cache_type.shape, kv)] * (2 * c.num_hidden_layers)
    step = _Step(lm, max_seq, kv)
    pipeline = ["simplify"] if ternary == "off" else \
        [("ternary", {"strategy": ternary, "targets": names}), "simplify"]
    stages, graphs = {}, {}
    for entry, t in (("prefill", "T"), ("decode", 1)):
        dumper = Dumper(os.path.join(dump_dir, entry) if dump_dir else None)
        g = trace(step, spec((t,), "int32"), spec((), "int32"), caches, name=f"{entry}_step")
        graphs[entry] = run_pipeline(g, pipeline, dumper)
        stages.update({f"{entry}.{k}": v for k, v in dumper.stages.items()})
    _share_constants(graphs.values())
    n = 2 * c.num_hidden_layers
    state = [StateVar(f"kv{i}", cache_type) for i in range(n)]
    bind_in = {2 + i: f"kv{i}" for i in range(n)}
    bind_out = {1 + i: f"kv{i}" for i in range(n)}
    entries = [Entry(e, g, bind_in, bind_out) for e, g in graphs.items()]
    session, ctx = new_session()
    table = ParamTable()
    with parameterized(list(graphs.values()), table):
        module = to_stateful_mlir(entries, state, ctx, params=table)
    irpa = table.archive()
    with ctx:
        stages["mlir"] = module.operation.get_asm(large_elements_limit=16)
    all_flags = target_flags(names) + check_extra_flags(flags)
    used = {op.attrs["strategy"] for g in graphs.values() for op in g.ops
            if op.opname == "ternary_matmul"}
    used = {choose_strategy(None, 1, 1, names) if s == "auto" else s for s in used}
    all_flags += [f for f in flags_for(used, names) if f not in all_flags]
    meta = {"flags": all_flags, "drivers": [d for t in targets for d in t.drivers],
            "iree_version": IREE_VERSION, "cache_hit": False, "weights": "irpa",
            "parameters": sorted(table.arrays)}
    key = hit = None
    if cache:
        with ctx:
            full = module.operation.get_asm(binary=True, large_elements_limit=None,
                                            large_resource_limit=None, assume_verified=True)
        digest = hashlib.sha256(irpa).hexdigest() if irpa is not None else ""
        key = compile_cache.key(full, "\0".join(all_flags), __version__, IREE_VERSION, digest)
        hit = compile_cache.lookup(key)
        meta.update(cache_key=key, cache_hit=hit is not None)
    if hit is not None:
        _, vmfb, irpa = hit
    else:
        build = compile_with_tool if needs_tool(all_flags) else partial(compile_module, session)
        vmfb = build(module, all_flags, stage=f"the IREE compile of the LM for {', '.join(names)}")
    sig = dataclasses.replace(Signature.from_graph(graphs["prefill"]), function="prefill")
    meta["lm"] = LMGenerator.describe(c.to_dict(), max_seq, kv, tokenizer=_tokenizer_json(lm))
    exe = CompiledModule(vmfb, sig, stages, device=device, threads=threads, targets=names,
                         meta=meta, weights=irpa, weights_scope=table.scope)
    if key is not None and hit is None:
        compile_cache.store(key, exe)
    return LMGenerator(exe)


def _tokenizer_json(lm):
    tok = getattr(lm, "tokenizer", None)
    if tok is None or not hasattr(tok, "to_str"):
        return None
    try:
        return tok.to_str()
    except Exception:       # a tokenizer that cannot be serialized: ids still work
        return None
