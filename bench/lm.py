"""Generation speed of a ternary LM: tercomp (tc.compile_lm) against the strongest CPU
engines, each measured with its own tool, on the same weights.

    python bench/lm.py --ik-llama IK_BIN --bitnet-cpp BITNET_BIN --llama-cpp LLAMA_BIN
    python bench/lm.py --threads 1,2 --rounds 4 ...   # a thread sweep, 4 rounds in turns
    python bench/lm.py --layers 2                     # a quick check of the plumbing
    python bench/lm.py --preset 8b                    # Llama3-8B-1.58's shape (llama arch)
    python bench/lm.py --batch 8 --ik-llama IK_BIN    # batched decode: 1 and 8 sequences
    python bench/lm.py --preset 2b4t                  # BitNet b1.58 2B4T's shape (relu2)

Writes a random-ternary GGUF (TQ2_0 projections, tied f16 embedding) of the
bitnet_b1_58-large shape with `gguf` (hidden 1536, FFN 4096, 24 layers, 16 heads,
vocab 32002). Each peer is a build made outside this repository, given by the directory
holding its binaries (README.md says which projects, commits and cmake flags were
measured); bench/peers.py converts the weights into each one's best format with its
own `llama-quantize` (ik_llama.cpp IQ2_BN, repacked to R4 at load; bitnet.cpp I2_S;
llama.cpp the TQ2_0 file as written).

Before any timing, each peer's logits are checked against tercomp's: a 32-token prompt
in one batch (the prefill kernels) and its first token alone (the one-row kernels
decode runs), through the peer's `llama-embedding` (bench/peers.py): the cosine of every
position's logits must be >= 0.99, or, for a network deep enough to amplify rounding
past that, >= 1 - 3 x its precision floor (1 - the cosine between tercomp's logits with
an f16 and a float32 KV cache: `check_floor`); how often the greedy (top-1) token
agrees is printed too (random models have flat logits, so a top-1 may flip within
rounding). A peer that fails is still timed, marked "(wrong)" and left out of the
ratios.

Speed, for each thread count of --threads, the engines taking turns over --rounds
rounds, each run a fresh process:
- a peer: its `llama-bench -p 128,512 -n 64 -r 3 -t THREADS -o json`, every repetition's
  tokens/s of pp128 and pp512 (a 128- and a 512-token prompt, --prompt and
  --long-prompt) and tg64 (64 tokens generated one at a time, from an empty cache);
- tercomp: a saved generator (`tc.load`), `prefill(prompt, logits_to_keep=1)` of 128
  tokens; then, as llama-bench's tg64 runs, 64 tokens one at a time from an empty cache
  (positions 0-63: a one-token `prefill`, which starts over, then 63 `decode` calls),
  each followed by an argmax (the greedy loop); then a `prefill` of 512 tokens (starting
  over); 3 repetitions after a warm-up. (Until 2026-11-28 13:30 tercomp's decode
  continued at positions 128-191 after its prompt, where attention reads 2-6x the rows
  of the peers' tg64: a handicap of 5-10% at the 700M shape. The --batch table's decode,
  like llama-batched-bench's, still runs after the 128-token prompts.)
A prefill of 512 tokens takes about 4x one of 128 (in every engine), which each
repetition of each run pays once more; --long-prompt 0 leaves it out.
Printed: the median and the best of all repetitions of all rounds, tercomp's ratio to
each peer (median to median, best to best), the weights read per decoded token against
a plain streaming read with the same threads (a fresh process in every round, taking
its turn with the engines: the machine's read rate moves from minute to minute, so the
decode's median is set against the read's median and its best against the read's
best), the CPU and the load average.

With --batch B, a second table: batched decode, B sequences each with its own PROMPT-token
prompt, then GEN tokens generated for all B at once (aggregate tokens/s), and one
sequence alone for the scaling: tercomp through a generator compiled with max_batch=B
(`gen.prefill(prompt, slot=s)` for each slot, then `gen.step(tokens, slots)` GEN times,
the engine's decode step), each peer through its own `llama-batched-bench -npl 1,B`.

Files are made once per directory (--dir, or the default one with --keep) and reused by
later runs: the TQ2_0 model, each peer's conversion (its llama-quantize reads an f16 GGUF
of the same weights, written for it and removed after: 16 GB at the 8B shape), each
tercomp generator (`.tcm`, with its compile result and key in a `.json` beside it:
compiled again when the model file, the compile options, tercomp's sources or IREE's
version differ) and tercomp's side of the logits check (`.check.npz`, with its
generator). A run that reuses all of them converts and compiles nothing.

tercomp runs once per output-layer storage (--output-dtype, default "float16,int8": the
f16 table the peers also read, and an int8 table with a per-row scale at half the bytes).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import machine  # noqa: E402  (bench/machine.py)
import peers  # noqa: E402  (bench/peers.py)

COS_MIN = 0.99      # the logits check: every position's cosine to tercomp's


# -------------------------------------------------------------------------- the model
def write_model(path, a, projection="TQ2_0", tokens=None):
    """A random ternary GGUF. `bitnet`: projections in TQ2_0 (block scale 1 and an f32
    `.scale` per tensor), sub-norms, tied f16 token embedding. `llama` (the 1.58-bit
    llama family): TQ2_0 blocks whose scale is the weight scale, no sub-norms, an untied
    f16 `output.weight`. Streamed: the tensors' infos first, then each tensor made and
    written in turn, so no more than one tensor is ever in memory (an 8B model is 3.7 GB
    in TQ2_0, 16 GB in f16).

    The same weights in another form: `projection="F16"` writes each projection as its
    codes x the weight scale in float16 (what the peers' llama-quantize read,
    bench/peers.py: exact for the llama arch, whose TQ2_0 block scale is that f16 value;
    the bitnet arch's f32 scale 0.02 rounds to 0.0200043 there). `tokens` replaces the
    token strings (then no space prefix and no BOS; the peers' files use both)."""
    import gguf
    if projection not in ("TQ2_0", "F16"):
        raise ValueError(f"projection {projection!r}: TQ2_0 or F16")
    QT = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    h, ff, v, L = a.hidden, a.ffn, a.vocab, a.layers
    llama = a.arch == "llama"
    kvh = a.kv_heads or a.heads
    d = h // a.heads
    w = gguf.GGUFWriter(str(path), a.arch)
    w.add_context_length(2048)
    w.add_embedding_length(h)
    w.add_block_count(L)
    w.add_feed_forward_length(ff)
    w.add_head_count(a.heads)
    w.add_head_count_kv(kvh)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if getattr(a, "act", None):     # no converter writes it; tercomp reads it (2B4T: relu2)
        w.add_string(f"{a.arch}.hidden_activation", a.act)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens or [f"<t{i}>" for i in range(v)])
    w.add_token_scores([0.0] * v)
    if tokens:
        w.add_add_space_prefix(False)
        w.add_add_bos_token(False)
    # (name, shape, GGML type, make): `make` is called in this order (the random stream's)
    tensors = []

    def table():        # made 4096 rows at a time: the float64 draws of a 128k x 4096
        out = np.empty((v, h), np.float16)    # table whole would be 4 GiB (8 with the /)
        for r in range(0, v, 4096):
            out[r:r + 4096] = rng.standard_normal((min(4096, v - r), h)) / np.sqrt(h)
        return out
    tensors.append(("token_embd.weight", (v, h), QT.F16, table))
    tensors.append(("output_norm.weight", (h,), QT.F32, lambda: np.ones(h, np.float32)))
    if llama:
        tensors.append(("output.weight", (v, h), QT.F16, table))
    shapes = {"attn_q": (h, h), "attn_k": (kvh * d, h), "attn_v": (kvh * d, h),
              "attn_output": (h, h), "ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff)}
    norms = (("attn_norm", h), ("ffn_norm", h)) if llama else \
        (("attn_norm", h), ("attn_sub_norm", h), ("ffn_norm", h), ("ffn_sub_norm", ff))
    scale = np.float32(0.02)

    def weights(shape):
        def make():
            t = rng.integers(-1, 2, size=shape).astype(np.float32)
            if projection == "F16":
                return (t * scale).astype(np.float16)
            # llama: TQ2_0's block scale is the weight scale; bitnet: 1, and a `.scale`
            return gguf.quants.quantize(t * scale if llama else t, QT.TQ2_0)
        return make
    for i in range(L):
        for n, size in norms:
            tensors.append((f"blk.{i}.{n}.weight", (size,), QT.F32,
                            lambda size=size: np.ones(size, np.float32)))
        for n, shape in shapes.items():
            tensors.append((f"blk.{i}.{n}.weight", shape, QT[projection], weights(shape)))
            if projection == "TQ2_0" and not llama:     # as BitNet's GGUFs
                tensors.append((f"blk.{i}.{n}.scale", (1,), QT.F32,
                                lambda: np.array([scale], np.float32)))
    for name, shape, qtype, _ in tensors:
        if qtype == QT.TQ2_0:
            nbytes = shape[0] * shape[1] // 256 * 66
            w.add_tensor_info(name, gguf.quant_shape_to_byte_shape(shape, qtype), np.uint8,
                              nbytes, raw_dtype=qtype)
        else:
            dtype = np.float16 if qtype == QT.F16 else np.float32
            w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) *
                              np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, qtype, make in tensors:
        w.write_tensor_data(make())
    w.close()


# ----------------------------------------------------------------------- the workers
def worker_tercomp_compile(a):
    """Cold and cached compile times; saves the artifact for the run worker."""
    import tercomp as tc
    from tercomp import models
    cache_dir = tempfile.TemporaryDirectory(prefix="tercomp-bench-cache-")   # removed at exit
    os.environ["TERCOMP_CACHE_DIR"] = cache_dir.name
    out = {}
    for kind in ("cold", "cached"):
        t = time.perf_counter()
        gen = tc.compile_lm(models.load(a.model), max_seq=a.max_seq, threads=a.threads,
                            output_dtype=a.output_dtype, ternary=a.ternary,
                            **({"max_batch": a.max_batch} if a.max_batch > 1 else {}))
        out[f"compile_{kind}_s"] = time.perf_counter() - t
        if kind == "cold":      # the process's peak: load, trace, passes, IREE (in process)
            out["compile_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gen.save(a.artifact)
    if gen.exe._weights is not None:
        # every weight is read once a token, except an untied input embedding table, of
        # which a token reads one row (Llama3-8B's: 1 GiB of its 3.6)
        lm = models.load(a.model)
        untied = lm.embed_tokens.weight.nbytes if lm.lm_head is not None else 0
        out["bytes_per_token"] = len(gen.exe._weights) - untied
    else:
        out["bytes_per_token"] = None
    return out


def worker_tercomp_run(a):
    """pp, tg and pp_long tokens/s of every repetition: prefill(logits_to_keep=1) of the
    prompt; then `gen` tokens from an empty cache (a one-token prefill, then gen - 1
    decode calls), each followed by the argmax a greedy loop takes; then (a.long_prompt
    > 0) a prefill of a.long_prompt tokens, which starts over."""
    import tercomp as tc
    gen = tc.load(a.artifact, threads=a.threads)
    rng = np.random.default_rng(1)
    prompt = rng.integers(3, a.vocab, a.prompt).astype(np.int32)
    long_prompt = rng.integers(3, a.vocab, a.long_prompt).astype(np.int32)

    def prefill(ids):
        t = time.perf_counter()
        tok = int(np.argmax(gen.prefill(ids, logits_to_keep=1)[-1]))
        return tok, ids.size / (time.perf_counter() - t)

    def once():
        tok, pp = prefill(prompt)
        t = time.perf_counter()         # tg: from an empty cache, as llama-bench's
        tok = int(np.argmax(gen.prefill(np.array([tok], np.int32), logits_to_keep=1)[-1]))
        for _ in range(a.gen - 1):
            tok = int(np.argmax(gen.decode(tok)))
        tg = a.gen / (time.perf_counter() - t)
        return pp, tg, (prefill(long_prompt)[1] if a.long_prompt else None)
    once()                                                  # warm-up, as llama-bench's
    samples = [once() for _ in range(a.repeat)]
    out = {"pp": [s[0] for s in samples], "tg": [s[1] for s in samples]}
    if a.long_prompt:
        out["pp_long"] = [s[2] for s in samples]
    return out


def worker_tercomp_batched(a):
    """Aggregate tokens/s of batched decode with the max_batch artifact: for B = 1 and
    a.max_batch, B prompts prefilled one slot at a time, then a.gen steps of B tokens
    (each followed by the argmax of every row), a.repeat times after a warm-up of each.
    The batch sizes take turns, repetition by repetition (the order swapped each time):
    the machine's speed moves from minute to minute, and B's ratio to one sequence is
    the number that matters."""
    import tercomp as tc
    gen = tc.load(a.artifact, threads=a.threads)
    rng = np.random.default_rng(1)
    sizes = sorted({1, a.max_batch})
    prompts = {b: [rng.integers(3, a.vocab, a.prompt).astype(np.int32) for _ in range(b)]
               for b in sizes}

    def once(b):
        slots = np.arange(b, dtype=np.int32)
        t = time.perf_counter()
        toks = np.array([int(np.argmax(gen.prefill(p, slot=s, logits_to_keep=1)[-1]))
                         for s, p in enumerate(prompts[b])], np.int32)
        pp = time.perf_counter() - t
        t = time.perf_counter()
        for _ in range(a.gen):
            toks = np.argmax(gen.step(toks, slots=slots), axis=-1).astype(np.int32)
        tg = time.perf_counter() - t
        for s in range(b):
            gen.free(s)
        return b * a.prompt / pp, b * a.gen / tg
    for b in sizes:
        once(b)
    out = {str(b): {"pp": [], "tg": []} for b in sizes}
    for r in range(a.repeat):
        for b in (sizes if r % 2 == 0 else sizes[::-1]):
            pp, tg = once(b)
            out[str(b)]["pp"].append(pp)
            out[str(b)]["tg"].append(tg)
    return out


def worker_check(a):
    """tercomp's logits of a 32-token prompt (all positions) and of its first token alone,
    from the a.artifact generator (an f16 KV cache, as the peers keep theirs): what each
    peer's logits are checked against; and the same from a generator of the same model
    with a float32 KV cache, whose distance from the first is the network's precision
    noise floor (`check_floor`)."""
    import tercomp as tc
    from tercomp import models
    ids = np.random.default_rng(2).integers(3, a.vocab, 32).astype(np.int32)  # 0-2: unk, bos, eos
    out = {}
    for kv, gen in (("", lambda: tc.load(a.artifact, threads=a.threads)),
                    ("_f32kv", lambda: tc.compile_lm(
                        models.load(a.model), max_seq=len(ids), threads=a.threads,
                        output_dtype=a.output_dtype.split(",")[0],
                        ternary=a.ternary.split(",")[0], kv_dtype="float32", cache=False))):
        g = gen()
        out["batch" + kv] = np.asarray(g.prefill(ids), np.float32).reshape(len(ids), -1)
        out["one" + kv] = np.asarray(g.prefill(ids[:1]), np.float32).reshape(1, -1)
        del g
    np.savez(a.artifact + ".check.npz", ids=ids, **out)
    return {"path": a.artifact + ".check.npz"}


def check_floor(ref) -> tuple[float, float]:
    """(the precision floor, the cosine a peer must reach): the floor is 1 - the smallest
    cosine between tercomp's logits with an f16 and with a float32 KV cache. A deep random
    network amplifies rounding (int8 activation codes flip at their boundaries): at the
    2B4T shape (30 layers, relu2) the f16 cache alone moves the logits to cosine 0.985,
    where the 24-layer 700M shape stays above 0.999. Two engines that each round their
    cache to f16 (llama.cpp's default) at different points sit up to about twice the
    floor apart (independent errors of one size), so a peer must reach 1 - 3 x floor, and
    at most COS_MIN; a wrong network (a RoPE style, an activation) lands far below."""
    floor = 1.0 - min(peers.agreement(ref["batch"], ref["batch_f32kv"])["cos_min"],
                      peers.agreement(ref["one"], ref["one_f32kv"])["cos_min"])
    return floor, min(COS_MIN, 1.0 - 3.0 * floor)


def worker_stamp(a):
    """What a saved generator was compiled by: tercomp's sources (the compile cache's own
    digest) and IREE's version. An artifact with another stamp is compiled again."""
    from iree.compiler.version import VERSION
    from tercomp.build import compiler_digest
    return {"tercomp": compiler_digest(), "iree": VERSION}


def worker_stream(a):
    """A plain streaming read with `threads` threads (NumPy sums of 512 MiB, each thread
    its part; NumPy releases the GIL): the memory bandwidth a decode step can hope for.
    The GB/s of each of 5 sweeps after the first (which maps the pages)."""
    from concurrent.futures import ThreadPoolExecutor
    buf = np.ones(64 << 20, np.int64)           # 512 MiB, touched once
    parts = np.array_split(buf, a.threads)
    rates = []
    with ThreadPoolExecutor(a.threads) as pool:
        list(pool.map(np.sum, parts))
        for _ in range(5):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            rates.append(buf.nbytes / (time.perf_counter() - t) / 1e9)
    return {"stream_gbs": rates}


def stream_line(threads: int, stream_gbs: list, compiled: dict, rows: dict) -> str:
    """The streaming-read line: the read's median / best GB/s over every sweep of every
    round, and for each tercomp generator with a known `bytes_per_token` the GB/s its
    decode reads at its median and at its best tokens/s, each as a fraction of the read
    at the same statistic (median to median, best to best).

    >>> print(stream_line(2, [20.0, 21.0, 22.0], {"tercomp int8": {"bytes_per_token": 2**20 * 200}},
    ...                   {"tercomp int8": {"tg": [95.0, 100.0, 105.0]}}))
    a streaming read, 2 threads: 21.0 / 22.0 GB/s (median / best of 3 sweeps, in turns with the engines); tercomp int8 reads 200 MiB a token: 21.0 GB/s at its median (100% of the read's median), 22.0 at its best (100%)
    """
    med, best = float(np.median(stream_gbs)), float(np.max(stream_gbs))
    line = (f"a streaming read, {threads} thread{'s' if threads > 1 else ''}: {med:.1f} / "
            f"{best:.1f} GB/s (median / best of {len(stream_gbs)} sweeps, in turns with the "
            f"engines)")
    for n, r in compiled.items():
        if r.get("bytes_per_token") and rows.get(n, {}).get("tg"):
            tmed, tbest = summarize(rows[n]["tg"])
            gm, gb = r["bytes_per_token"] * tmed / 1e9, r["bytes_per_token"] * tbest / 1e9
            line += (f"; {n} reads {r['bytes_per_token'] / 2**20:.0f} MiB a token: {gm:.1f} "
                     f"GB/s at its median ({gm / med:.0%} of the read's median), {gb:.1f} at "
                     f"its best ({gb / best:.0%})")
    return line


WORKERS = {"tercomp-compile": worker_tercomp_compile, "tercomp-run": worker_tercomp_run,
           "tercomp-batched": worker_tercomp_batched,
           "tercomp-check": worker_check, "stream": worker_stream,
           "tercomp-stamp": worker_stamp}


def run_worker(name, a, extra=()):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name,
           *(f"--{k}={getattr(a, k)}" for k in ("model", "artifact") if getattr(a, k, None)),
           *a.passthrough, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        print(f"{name} failed:\n{r.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def compile_once(a, extra, stamp) -> dict | None:
    """The compile worker's result for the generator a.artifact: the one saved beside it
    (`.json`) when that artifact was compiled from this model file (size and mtime), with
    these options, by this tercomp and IREE (`stamp`, worker_stamp), else a fresh compile,
    saved with its key. A saved one comes back with "reused": True. A fresh compile drops
    the artifact's saved logits check (`.check.npz`)."""
    st = os.stat(a.model)
    key = {"stamp": stamp, "model": [os.path.basename(a.model), st.st_size, st.st_mtime_ns],
           "options": [x for x in a.passthrough if x.split("=")[0] not in
                       ("--prompt", "--long-prompt", "--gen", "--repeat")] + list(extra)}
    meta = a.artifact + ".json"
    if stamp is not None and os.path.exists(a.artifact) and os.path.exists(meta):
        try:
            with open(meta) as f:
                saved = json.load(f)
        except (OSError, ValueError):
            saved = {}
        if saved.get("key") == key:
            return {**saved["result"], "reused": True}
    for stale in (meta, a.artifact + ".check.npz"):
        if os.path.exists(stale):
            os.remove(stale)
    r = run_worker("tercomp-compile", a, extra)
    if r is not None and stamp is not None:
        with open(meta + ".part", "w") as f:
            json.dump({"key": key, "result": r}, f)
        os.replace(meta + ".part", meta)
    return r


# --------------------------------------------------------------------- the table
def summarize(samples) -> tuple[float, float]:
    """(median, best) tokens/s of all repetitions of all rounds."""
    return float(np.median(samples)), float(np.max(samples))


def format_table(rows: dict, prompt: int, gen: int, wrong=frozenset(),
                 long_prompt: int = 0) -> str:
    """The engines' pp and tg tokens/s, median / best, then tercomp's ratio to each peer
    (median to median, best to best). `rows` maps an engine's name to {"pp": [t/s, ...],
    "tg": [t/s, ...]} (engines named "tercomp ..." are ours), and with `long_prompt` a
    third column, "pp_long": [t/s, ...] (a prefill of long_prompt tokens: pp512); engines
    in `wrong` failed the logits check: shown, marked, and in no ratio.

    >>> print(format_table({"tercomp int8": {"pp": [400, 410], "tg": [80, 90]},
    ...                     "ik_llama.cpp": {"pp": [380, 390], "tg": [90, 92]}}, 128, 64))
    engine                          pp128 t/s median / best  tg64 t/s median / best
    tercomp int8                             405.0 /  410.0           85.0 /   90.0
    ik_llama.cpp                             385.0 /  390.0           91.0 /   92.0
    tercomp int8 / ik_llama.cpp               1.05x / 1.05x           0.93x / 0.98x
    """
    cols = {"pp": f"pp{prompt} t/s median / best", "tg": f"tg{gen} t/s median / best"}
    if long_prompt:
        cols["pp_long"] = f"pp{long_prompt} t/s median / best"
    ours = [n for n in rows if n.startswith("tercomp")]
    others = [n for n in rows if not n.startswith("tercomp")]
    width = max([30] + [len(n) + 9 for n in rows] +      # room for " (wrong)"
                [len(f"{o} / {p}") + 1 for o in ours for p in others])
    wide = {"pp": 25, "tg": 24, "pp_long": 25}
    lines = [f"{'engine':{width}}" + "".join(f"{c:>{wide[k]}}" for k, c in cols.items())]
    stats = {n: {k: summarize(r[k]) if r.get(k) else None for k in cols}
             for n, r in rows.items()}

    def cell(s):
        return f"{s[0]:.1f} / {s[1]:6.1f}" if s else "-"
    for n in rows:
        mark = " (wrong)" if n in wrong else ""
        lines.append(f"{n + mark:{width}}" +
                     "".join(f"{cell(stats[n][k]):>{wide[k]}}" for k in cols))
    def ratio(o, p, k):
        a, b = stats[o][k], stats[p][k]
        return f"{a[0] / b[0]:.2f}x / {a[1] / b[1]:.2f}x" if a and b else "-"
    for o in ours:
        for p in others:
            if p not in wrong:
                lines.append(f"{o + ' / ' + p:{width}}" +
                             "".join(f"{ratio(o, p, k):>{wide[k]}}" for k in cols))
    return "\n".join(lines)


# ------------------------------------------------------------------------ the driver
def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["8b", "2b4t"],
                   help="8b: Llama3-8B-1.58's shape (32 layers, hidden 4096, FFN 14336, GQA "
                        "32/8, vocab 128256, llama arch, untied f16 head); 2b4t: BitNet b1.58 "
                        "2B4T's (30 layers, hidden 2560, FFN 6912, GQA 20/5, vocab 128256, "
                        "relu2, sub-norms, tied f16 embedding)")
    p.add_argument("--act", choices=["silu", "relu2"], default=None,
                   help="the FFN activation written as {arch}.hidden_activation (default: "
                        "none written, the family decides: silu)")
    p.add_argument("--arch", choices=["bitnet", "bitnet-25", "llama"], default="bitnet",
                   help="bitnet-25: the arch BitNet's converter writes for 2B4T (relu2)")
    p.add_argument("--kv-heads", type=int, default=0, help="default: --heads")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32002)
    p.add_argument("--threads", default="2", help="a comma-separated list: one table each")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--long-prompt", type=int, default=512,
                   help="also time a prefill of this many tokens (pp512; 0: none)")
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3, help="repetitions in each run (-r)")
    p.add_argument("--rounds", type=int, default=4,
                   help="fresh-process runs of each engine, taken in turns")
    p.add_argument("--max-seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=0, metavar="B",
                   help="also measure batched decode of B sequences against 1 (tercomp "
                        "with max_batch=B, the peers' llama-batched-bench -npl 1,B)")
    p.add_argument("--max-batch", type=int, default=1, help=argparse.SUPPRESS)
    for name, peer in peers.PEERS.items():
        p.add_argument(f"--{peer.flag}", metavar="BIN_DIR",
                       help=f"{name}'s binaries (llama-quantize, llama-bench, "
                            f"llama-embedding), built outside this repository: {peer.label}")
    p.add_argument("--output-dtype", default="float16,int8",
                   help="tercomp's output layer (compile_lm output_dtype), a comma-separated "
                        "list of float16, int8, float32: one tercomp row each")
    p.add_argument("--ternary", default="auto",
                   help="tercomp's ternary kernels (compile_lm ternary), a comma-separated list "
                        "of strategies (auto, avx512, avx2, ...): one tercomp row each, "
                        "for every --output-dtype")
    p.add_argument("--dir", default=None, help="where the GGUFs and artifacts go (default: a "
                   "temporary directory, removed at the end unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the default directory's files "
                   "(reused by the next run with --keep; a --dir's files are always kept)")
    p.add_argument("--worker", choices=sorted(WORKERS))
    p.add_argument("--model")
    p.add_argument("--artifact")
    a = p.parse_args()
    if a.preset == "8b":
        a.layers, a.hidden, a.ffn, a.heads, a.kv_heads, a.vocab, a.arch = \
            32, 4096, 14336, 32, 8, 128256, "llama"
    elif a.preset == "2b4t":
        a.layers, a.hidden, a.ffn, a.heads, a.kv_heads, a.vocab, a.arch, a.act = \
            30, 2560, 6912, 20, 5, 128256, "bitnet-25", None
    try:
        a.thread_list = [int(t) for t in a.threads.split(",")]
    except ValueError:
        p.error(f"--threads: {a.threads!r} is not a comma-separated list of integers")
    a.threads = max(a.thread_list)
    for d in a.output_dtype.split(","):
        if d not in ("float16", "int8", "float32"):
            p.error(f"--output-dtype: {d!r} is not float16, int8 or float32")
    if a.long_prompt < 0 or a.max_seq < max(a.prompt + a.gen, a.long_prompt):
        p.error(f"--max-seq {a.max_seq} holds no prompt of {a.prompt} tokens and {a.gen} "
                f"generated, or no --long-prompt of {a.long_prompt} (0 or more): raise "
                f"--max-seq or shorten them")
    a.passthrough = [f"--{k}={getattr(a, k.replace('-', '_'))}" for k in
                     ("layers", "hidden", "ffn", "heads", "kv-heads", "vocab", "arch", "act",
                      "prompt", "long-prompt", "gen", "repeat", "max-seq", "max-batch")
                     if getattr(a, k.replace('-', '_')) is not None]
    if a.worker:
        print(json.dumps(WORKERS[a.worker](a)))
        return
    given = {}
    for name, peer in peers.PEERS.items():
        bin_dir = getattr(a, peer.flag.replace("-", "_"))
        if bin_dir is None:
            continue
        bin_dir = os.path.abspath(bin_dir)
        missing = peers.missing_tools(bin_dir)
        if missing:
            p.error(f"--{peer.flag} {bin_dir}: no {', '.join(missing)} there (the directory "
                    f"holding {name}'s built binaries)")
        given[name] = bin_dir
    if not given:
        print("no peer given (--ik-llama, --bitnet-cpp, --llama-cpp): tercomp alone",
              file=sys.stderr)
    cleanup = None
    if a.dir is None:
        a.dir = os.path.join(tempfile.gettempdir(), "tercomp-bench-lm")
        if not a.keep:
            cleanup = a.dir
    a.dir = os.path.abspath(a.dir)          # the peers' tools run in it
    os.makedirs(a.dir, exist_ok=True)
    t = time.perf_counter()
    try:
        report(a, given)
        print(f"the run took {time.perf_counter() - t:.0f} s")
    finally:
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)


def peer_files(a, given, tag) -> dict:
    """{peer name: its file}, converted by each peer's own llama-quantize (once per
    directory: reused with --keep) from an f16 GGUF of the same weights, written here and
    removed after (2 bytes a weight: 16 GB at 8B, never in memory whole); a peer whose
    conversion fails is left out, said why."""
    files, f16 = {}, os.path.join(a.dir, f"bitnet-{tag}-f16.gguf")
    for name, bin_dir in given.items():
        peer = peers.PEERS[name]
        if peer.quantize_type is None:
            files[name] = a.model
            continue
        out = os.path.join(a.dir, f"bitnet-{tag}-{peer.flag}-{peer.quantize_type}.gguf")
        if not os.path.exists(out):
            if not os.path.exists(f16):
                t = time.perf_counter()
                write_model(f16 + ".part", a, projection="F16",
                            tokens=peers.char_tokens(a.vocab))
                os.replace(f16 + ".part", f16)
                print(f"wrote {f16} ({os.path.getsize(f16) / 2**20:.0f} MiB) in "
                      f"{time.perf_counter() - t:.0f} s", file=sys.stderr)
            try:
                t = time.perf_counter()
                peers.convert(peer, bin_dir, f16, out)
                print(f"{name}: {peer.quantize_type} by its llama-quantize in "
                      f"{time.perf_counter() - t:.0f} s", file=sys.stderr)
            except RuntimeError as e:
                print(f"{name} left out: its llama-quantize could not make "
                      f"{peer.quantize_type}:\n{e}", file=sys.stderr)
                continue
        files[name] = out
    if os.path.exists(f16):
        os.remove(f16)              # not worth keeping: each peer's file is
    return files


def check_peers(a, given, files) -> set:
    """Each peer's logits against tercomp's (printed); the names of those that disagree.
    tercomp's side is saved beside its generator (`.check.npz`) and reused with it."""
    import gguf
    a.threads = a.thread_list[-1]
    path = a.artifact + ".check.npz"
    if not os.path.exists(path):
        c = run_worker("tercomp-check", a, [f"--threads={a.threads}"])
        if c is None:
            print("tercomp's logits for the check failed: every peer counts as unchecked")
            return set(files)
    ref = np.load(path)
    head = "output.weight" if a.arch == "llama" else "token_embd.weight"   # llama: untied
    embedding = next(np.asarray(t.data, np.float32) for t in gguf.GGUFReader(a.model).tensors
                     if t.name == head)       # 2 GiB at a 128k vocabulary: freed on return
    floor, need = check_floor(ref)
    print(f"tercomp's logits with an f16 against a float32 KV cache: cosine {1 - floor:.5f} "
          f"(the network's precision floor): a peer must reach {need:.4f}")
    wrong = set()
    for name, path in files.items():
        peer = peers.PEERS[name]
        try:
            batch = peers.agreement(ref["batch"], peers.embedding_logits(
                peer, given[name], path, ref["ids"], embedding, a.threads))
            one = peers.agreement(ref["one"], peers.embedding_logits(
                peer, given[name], path, ref["ids"][:1], embedding, a.threads))
        except RuntimeError as e:
            print(f"{peer.label}: logits check failed to run:\n{e}")
            wrong.add(peer.label)
            continue
        ok = min(batch["cos_min"], one["cos_min"]) >= need
        print(f"{peer.label} vs tercomp, logits: a {len(ref['ids'])}-token prompt in one "
              f"batch, cosine min {batch['cos_min']:.5f} mean {batch['cos_mean']:.5f}, greedy "
              f"token agrees at {batch['top1']:.2f}; one token alone, cosine "
              f"{one['cos_min']:.5f}: {'ok' if ok else 'WRONG'}")
        if not ok:
            wrong.add(peer.label)
    return wrong


def report(a, given):
    tag = f"L{a.layers}-h{a.hidden}-f{a.ffn}-H{a.heads}-v{a.vocab}"
    if a.arch != "bitnet" or a.kv_heads not in (0, a.heads):
        tag = f"{a.arch}-{tag}-kv{a.kv_heads or a.heads}"
    if a.act:
        tag += f"-{a.act}"
    # one TQ2_0 file for tercomp and llama.cpp, its token strings single characters so
    # that the peers' tools tokenize a prompt's text to its ids
    a.model = os.path.join(a.dir, f"bitnet-{tag}.gguf")
    if not os.path.exists(a.model):
        t = time.perf_counter()
        write_model(a.model + ".part", a, tokens=peers.char_tokens(a.vocab))
        os.replace(a.model + ".part", a.model)
        print(f"wrote {a.model} ({os.path.getsize(a.model) / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - t:.0f} s", file=sys.stderr)
    print(f"CPU: {machine.cpu()}; {machine.load()} before the run")
    a.stamp = run_worker("tercomp-stamp", a)
    compiled, runs = {}, {}
    for d in a.output_dtype.split(","):
        for t in a.ternary.split(","):
            name = f"tercomp {d}" + ("" if t == "auto" else f" {t}")
            a.artifact = os.path.join(a.dir, f"bitnet-{tag}-{d}-{t}.tcm")
            a.threads = max(a.thread_list)
            r = compile_once(a, [f"--output-dtype={d}", f"--ternary={t}",
                                 f"--threads={a.threads}"], a.stamp)
            if r is None:
                continue
            compiled[name] = r
            runs[name] = ("tercomp", a.artifact)
            print(f"{name}: {'reused its generator, ' if r.get('reused') else ''}compile cold "
                  f"{r['compile_cold_s']:.1f} s, cached {r['compile_cached_s']:.1f} s, peak "
                  f"{r['compile_peak_mb']:.0f} MiB")
    files = peer_files(a, given, tag)
    wrong = set()
    if files and runs:
        a.artifact = next(iter(runs.values()))[1]
        wrong = check_peers(a, given, files)
    builds = {}
    for name, path in files.items():
        runs[peers.PEERS[name].label] = (name, path)
    for threads in a.thread_list:
        a.threads = threads
        rows = {n: {"pp": [], "tg": [], "pp_long": []} for n in runs}
        stream_gbs = []
        # the engines take turns, each round in fresh processes: a change in the shared
        # machine's load then hits every engine alike (and the streaming read, which
        # takes its turn too)
        for _ in range(a.rounds):
            stream_artifact, a.artifact = a.artifact, a.model
            stream_gbs += (run_worker("stream", a, [f"--threads={threads}"]) or {}).get(
                "stream_gbs", [])
            a.artifact = stream_artifact
            for n, (engine, path) in runs.items():
                if engine == "tercomp":
                    a.artifact = path
                    r = run_worker("tercomp-run", a, [f"--threads={threads}"]) or {}
                else:
                    try:
                        b = peers.llama_bench(peers.PEERS[engine], given[engine], path,
                                              threads, [a.prompt] + ([a.long_prompt] if
                                                                     a.long_prompt else []),
                                              a.gen, a.repeat)
                    except (RuntimeError, ValueError) as e:
                        print(f"{n}: llama-bench failed:\n{e}", file=sys.stderr)
                        continue
                    builds[n] = b["build"]
                    r = {"pp": b["pp"].get(a.prompt, []), "tg": b["tg"][1],
                         "pp_long": b["pp"].get(a.long_prompt, [])}
                for k in ("pp", "tg", "pp_long"):
                    rows[n][k] += r.get(k, [])
        print(f"\n{threads} thread{'s' if threads > 1 else ''}; model {tag}; {a.rounds} rounds "
              f"in turns x {a.repeat} repetitions; {machine.load()}")
        print(format_table(rows, a.prompt, a.gen, wrong, a.long_prompt))
        if stream_gbs:
            print(stream_line(threads, stream_gbs, compiled, rows))
    for n, b in builds.items():
        print(f"{n}: {given[runs[n][0]]}, llama-bench build {b}")
    if a.batch > 1:
        batched(a, given, files, wrong)
    print(f"{machine.load()} after the run")


def batched(a, given, files, wrong):
    """The --batch table: aggregate pp / tg tokens/s of 1 and B sequences, engines in
    turns over a.rounds rounds, at the largest thread count; tercomp with the last
    --output-dtype (int8 by default: its default table)."""
    d = a.output_dtype.split(",")[-1]
    a.threads, a.max_batch = max(a.thread_list), a.batch
    a.passthrough = [x for x in a.passthrough if not x.startswith("--max-batch=")] + \
        [f"--max-batch={a.batch}"]
    a.artifact = os.path.join(a.dir, f"batched{a.batch}-{d}.tcm")
    r = compile_once(a, [f"--output-dtype={d}", f"--threads={a.threads}"], a.stamp)
    rows = {}
    files = dict(files)
    for name in list(files):        # a build without the tool: said once, not every round
        if not os.access(os.path.join(given[name], "llama-batched-bench"), os.X_OK):
            print(f"{peers.PEERS[name].label}: no llama-batched-bench in {given[name]}: "
                  "left out of the batched table", file=sys.stderr)
            del files[name]
    for _ in range(a.rounds):
        if r is not None:
            got = run_worker("tercomp-batched", a, [f"--threads={a.threads}"]) or {}
            for b, v in got.items():
                row = rows.setdefault(f"tercomp {d} x{b}", {"pp": [], "tg": []})
                row["pp"] += v["pp"]
                row["tg"] += v["tg"]
        for name, path in files.items():
            peer = peers.PEERS[name]
            try:
                got = peers.batched_bench(peer, given[name], path, a.threads, a.prompt, a.gen,
                                          [1, a.batch])
            except (RuntimeError, ValueError) as e:
                print(f"{name}: llama-batched-bench failed:\n{e}", file=sys.stderr)
                continue
            for b, (pp, tg) in got.items():
                row = rows.setdefault(f"{peer.label} x{b}", {"pp": [], "tg": []})
                row["pp"].append(pp)
                row["tg"].append(tg)
    print(f"\nbatched decode, {a.threads} threads: B sequences of {a.prompt}-token prompts, "
          f"then {a.gen} tokens for all B (aggregate tokens/s); {a.rounds} rounds in turns; "
          f"{machine.load()}")
    bad = {peers.PEERS[w].label for w in wrong}
    for b in (1, a.batch):      # ratios between rows of the same B only
        these = {n: v for n, v in rows.items() if n.endswith(f" x{b}")}
        print(format_table(these, a.prompt, a.gen, {n for n in these if n.rsplit(" x", 1)[0] in bad}))
    for b in (1, a.batch):
        ours = rows.get(f"tercomp {d} x{b}", {}).get("tg")
        if b == a.batch and ours and rows.get(f"tercomp {d} x1", {}).get("tg"):
            one = summarize(rows[f"tercomp {d} x1"]["tg"])[0]
            print(f"tercomp: {b} sequences decode {summarize(ours)[0] / one:.2f}x one "
                  f"sequence's tokens/s (medians)")


if __name__ == "__main__":
    main()
