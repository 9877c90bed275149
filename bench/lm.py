"""Generation speed of a ternary LM: tercomp (tc.compile_lm) against llama.cpp on one file.

    python bench/lm.py                      # bitnet_b1_58-large shape (~700M parameters)
    python bench/lm.py --layers 4           # a quicker, smaller run
    python bench/lm.py --no-peer            # tercomp only
    python bench/lm.py --bitnet-cpp BUILD   # and bitnet.cpp (bench/build_bitnet_cpp.sh)
    python bench/lm.py --preset 8b          # Llama3-8B-1.58's shape (llama arch, ~3.9 GB)

Writes a random-ternary GGUF (TQ2_0 projections, tied f16 embedding) of the
bitnet_b1_58-large shape with `gguf` (hidden 1536, FFN 4096, 24 layers, 16 heads,
vocab 32002), then measures, each engine in its own fresh process with 2 threads:

- compile time: cold (load + pack + IREE compile, empty compile cache) and cached;
- prefill: a 128-token prompt, tokens/s (best of 3), computing the last position's logits
  as llama.cpp's `eval` and generation do; tercomp also with all 128 positions' logits;
- decode: 64 tokens after that prompt, tokens/s (best of 3);
- decode at position 64 with max_seq 2048 vs 128 (the cache must cost O(position)),
  measured interleaved in one process;
- resident memory (VmRSS) after warm-up, the cache sized n_ctx = max_seq.

tercomp runs once per output-layer storage (--output-dtype, default "float16,int8": the
f16 table llama.cpp also reads, and an int8 table with a per-row scale at half the bytes).

llama.cpp runs through llama-cpp-python when it is installed (the `peer` extra); its
rows are skipped otherwise. bitnet.cpp (Microsoft's BitNet engine) runs from a build
given with --bitnet-cpp: one column per ternary kernel, I2_S and TL2, on files holding the
same weights (bench/bitnet_cpp.py makes them and checks its logits against tercomp's).
Ratios are tercomp / llama.cpp and tercomp / bitnet.cpp's best kernel in each row (of
those whose logits agree), from the same run; speeds are the best of the rounds, and
their median is shown too.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bitnet_cpp  # noqa: E402  (bench/bitnet_cpp.py)
import machine  # noqa: E402  (bench/machine.py)


# -------------------------------------------------------------------------- the model
def write_model(path, a, projection=None, tokens=None):
    """A random ternary GGUF. `bitnet`: projections in TQ2_0 (block scale 1 and an f32
    `.scale` per tensor), sub-norms, tied f16 token embedding. `llama` (the 1.58-bit
    llama family): TQ2_0 blocks whose scale is the weight scale, no sub-norms, an untied
    f16 `output.weight`. Written one tensor at a time (a model of 8B parameters is
    never whole in memory as floats).

    The same weights in another form: `projection(writer, gguf, name, codes, scale,
    arch)` writes each projection (codes -1/0/1 as float32) instead of TQ2_0, and
    `tokens` replaces the token strings (then no space prefix and no BOS; bitnet_cpp.py
    uses both)."""
    import gguf
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
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens or [f"<t{i}>" for i in range(v)])
    w.add_token_scores([0.0] * v)
    if tokens:
        w.add_add_space_prefix(False)
        w.add_add_bos_token(False)
    w.add_tensor("token_embd.weight", (rng.standard_normal((v, h)) / np.sqrt(h)).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    if llama:
        w.add_tensor("output.weight", (rng.standard_normal((v, h)) / np.sqrt(h)).astype(np.float16))
    shapes = {"attn_q": (h, h), "attn_k": (kvh * d, h), "attn_v": (kvh * d, h),
              "attn_output": (h, h), "ffn_gate": (ff, h), "ffn_up": (ff, h), "ffn_down": (h, ff)}
    norms = (("attn_norm", h), ("ffn_norm", h)) if llama else \
        (("attn_norm", h), ("attn_sub_norm", h), ("ffn_norm", h), ("ffn_sub_norm", ff))
    for i in range(L):
        for n, size in norms:
            w.add_tensor(f"blk.{i}.{n}.weight", np.ones(size, np.float32))
        for n, shape in shapes.items():
            t = rng.integers(-1, 2, size=shape).astype(np.float32)
            (projection or tq2_projection)(w, gguf, f"blk.{i}.{n}", t, 0.02, a.arch)
            del t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tq2_projection(w, gguf, name, t, scale, arch):
    """The bench's own form: TQ2_0 codes whose block scale is the weight scale (`llama`),
    or 1 with the scale in an f32 `.scale` tensor (`bitnet`, as BitNet's GGUFs)."""
    QT = gguf.GGMLQuantizationType
    if arch == "llama":
        w.add_tensor(f"{name}.weight", gguf.quants.quantize(t * np.float32(scale), QT.TQ2_0),
                     raw_dtype=QT.TQ2_0)
    else:
        w.add_tensor(f"{name}.weight", gguf.quants.quantize(t, QT.TQ2_0), raw_dtype=QT.TQ2_0)
        w.add_tensor(f"{name}.scale", np.array([scale], np.float32))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def best_rate(fn, tokens: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return tokens / best


# ----------------------------------------------------------------------- the workers
def worker_tercomp_compile(a):
    """Cold and cached compile times; saves the artifact for the run worker."""
    import tercomp as tc
    from tercomp import models
    cache_dir = tempfile.TemporaryDirectory(prefix="tercomp-bench-cache-")   # removed at exit
    os.environ["TERCOMP_CACHE_DIR"] = cache_dir.name
    import resource
    out = {}
    for kind in ("cold", "cached"):
        t = time.perf_counter()
        gen = tc.compile_lm(models.load(a.model), max_seq=a.max_seq, threads=a.threads,
                            output_dtype=a.output_dtype, ternary=a.ternary)
        out[f"compile_{kind}_s"] = time.perf_counter() - t
        if kind == "cold":      # the process's peak: load, trace, passes, IREE (in process)
            out["compile_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    gen.save(a.artifact)
    if os.path.exists(a.artifact + ".128"):      # from an earlier run
        os.remove(a.artifact + ".128")
    if a.scaling:       # the same model with a short cache, for the O(position) check
        gen = tc.compile_lm(models.load(a.model), max_seq=128, threads=a.threads,
                            output_dtype=a.output_dtype, ternary=a.ternary)
        gen.save(a.artifact + ".128")
    return out


def worker_tercomp_run(a):
    import tercomp as tc
    t = time.perf_counter()
    gen = tc.load(a.artifact, threads=a.threads)
    load_s = time.perf_counter() - t
    prompt = np.random.default_rng(1).integers(0, a.vocab, a.prompt).astype(np.int32)
    gen.prefill(prompt)                                     # warm-up
    # as llama.cpp's eval and generate: the logits of the last position only
    out = {"prefill_tps": best_rate(lambda: gen.prefill(prompt, logits_to_keep=1), a.prompt,
                                    a.repeat),
           "prefill_all_tps": best_rate(lambda: gen.prefill(prompt), a.prompt, a.repeat)}

    def decode():
        gen.prefill(prompt)
        t = time.perf_counter()
        for i in range(a.gen):
            gen.decode(int(prompt[i % a.prompt]))
        return time.perf_counter() - t
    out["decode_tps"] = a.gen / min(decode() for _ in range(a.repeat))
    out["rss_mb"] = rss_mb()
    out["load_s"] = load_s
    # what a decode step reads: every parameter (the 2-bit projections, the output table)
    # once; the cache rows are small next to them at this position
    out["bytes_per_token_mb"] = len(gen.exe._weights) / 2**20 if gen.exe._weights is not None else None
    if os.path.exists(a.artifact + ".128"):
        short = tc.load(a.artifact + ".128", threads=a.threads)
        out["decode_pos64_ms"], out["decode_pos64_ms_seq128"] = _decode_at_64(
            [gen, short], prompt, a.repeat)
    return out


def _decode_at_64(gens, prompt, repeat):
    """The best decode time in ms at position 64 of each generator, measured interleaved
    (one step of each in turn), so a change in the machine's load hits both alike."""
    for gen in gens:
        gen.prefill(prompt[:64])
    best = [float("inf")] * len(gens)
    for _ in range(repeat * 10):
        for i, gen in enumerate(gens):
            gen.position = 64           # rewrite row 64 each time: same position, same work
            t = time.perf_counter()
            gen.decode(int(prompt[0]))
            best[i] = min(best[i], time.perf_counter() - t)
    return [b * 1e3 for b in best]


def worker_llama(a):
    import llama_cpp
    t = time.perf_counter()
    llm = llama_cpp.Llama(a.model, n_ctx=a.max_seq, n_threads=a.threads, n_batch=a.prompt,
                          verbose=False)
    out = {"compile_cold_s": time.perf_counter() - t, "load_s": time.perf_counter() - t,
           "bytes_per_token_mb": os.path.getsize(a.model) / 2**20}
    prompt = np.random.default_rng(1).integers(0, a.vocab, a.prompt).tolist()

    def prefill():      # logits_all=False (the default): the last position's logits only
        llm.reset()
        llm.eval(prompt)
    prefill()
    out["prefill_tps"] = best_rate(prefill, a.prompt, a.repeat)

    def decode():
        prefill()
        t = time.perf_counter()
        for i in range(a.gen):
            llm.eval([prompt[i % a.prompt]])
        return time.perf_counter() - t
    out["decode_tps"] = a.gen / min(decode() for _ in range(a.repeat))
    out["rss_mb"] = rss_mb()
    return out


def worker_stream(a):
    """A plain streaming read with `threads` threads (NumPy sums of 512 MiB, each thread
    its part; NumPy releases the GIL): the memory bandwidth a decode step can hope for."""
    from concurrent.futures import ThreadPoolExecutor
    buf = np.ones(64 << 20, np.int64)           # 512 MiB, touched once
    parts = np.array_split(buf, a.threads)
    with ThreadPoolExecutor(a.threads) as pool:
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - t)
    return {"stream_gbs": buf.nbytes / best / 1e9}


WORKERS = {"tercomp-compile": worker_tercomp_compile, "tercomp-run": worker_tercomp_run,
           "llama": worker_llama, "stream": worker_stream,
           "bitnet-cpp": bitnet_cpp.worker_bench, "bitnet-check": bitnet_cpp.worker_check,
           "bitnet-tl2": lambda a: bitnet_cpp.write_tl2(a, write_model)}


def run_worker(name, a, extra=()):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--model", a.model,
           "--artifact", a.artifact, *a.passthrough, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"{name} failed:\n{r.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["8b"],
                   help="8b: Llama3-8B-1.58's shape (32 layers, hidden 4096, FFN 14336, GQA "
                        "32/8, vocab 128256, llama arch, untied f16 head)")
    p.add_argument("--arch", choices=["bitnet", "llama"], default="bitnet")
    p.add_argument("--kv-heads", type=int, default=0, help="default: --heads")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32002)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--gen", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2,
                   help="fresh-process runs of each engine, taken in turns (best kept)")
    p.add_argument("--max-seq", type=int, default=2048)
    p.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    p.add_argument("--bitnet-cpp", metavar="BUILD", help="bitnet.cpp's build directory (from "
                   "bench/build_bitnet_cpp.sh): adds its I2_S and TL2 rows (bitnet arch only)")
    p.add_argument("--output-dtype", default="float16,int8",
                   help="tercomp's output layer (compile_lm output_dtype), a comma-separated "
                        "list of float16, int8, float32: one tercomp column each")
    p.add_argument("--ternary", default="auto",
                   help="tercomp's ternary kernels (compile_lm ternary), a comma-separated list "
                        "of strategies (auto, avx512, avx2, ...): one tercomp column each, "
                        "for every --output-dtype")
    p.add_argument("--no-scaling", dest="scaling", action="store_false",
                   help="skip the max_seq 128 compile of the O(position) check")
    p.add_argument("--dir", default=None, help="where the GGUF and artifacts go (default: a "
                   "temporary directory, removed at the end unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the default directory's files "
                   "(reused by the next run with --keep)")
    p.add_argument("--worker", choices=sorted(WORKERS))
    p.add_argument("--model")
    p.add_argument("--artifact")
    p.add_argument("--bitnet-files", help=argparse.SUPPRESS)     # the check worker's input
    a = p.parse_args()
    if a.preset == "8b":
        a.layers, a.hidden, a.ffn, a.heads, a.kv_heads, a.vocab, a.arch = \
            32, 4096, 14336, 32, 8, 128256, "llama"
    a.passthrough = [f"--{k}={getattr(a, k.replace('-', '_'))}" for k in
                     ("layers", "hidden", "ffn", "heads", "kv-heads", "vocab", "arch", "threads",
                      "prompt", "gen", "repeat", "max-seq")] + ([] if a.scaling else ["--no-scaling"])
    if a.bitnet_cpp:
        a.bitnet_cpp = os.path.abspath(a.bitnet_cpp)
        a.passthrough.append(f"--bitnet-cpp={a.bitnet_cpp}")
    if a.worker:
        print(json.dumps(WORKERS[a.worker](a)))
        return
    cleanup = None
    if a.dir is None:
        a.dir = os.path.join(tempfile.gettempdir(), "tercomp-bench-lm")
        if not a.keep:
            cleanup = a.dir
    os.makedirs(a.dir, exist_ok=True)
    try:
        report(p, a)
    finally:
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)


def report(p, a):
    tag = f"L{a.layers}-h{a.hidden}-f{a.ffn}-H{a.heads}-v{a.vocab}"
    if a.arch != "bitnet" or a.kv_heads not in (0, a.heads):
        tag = f"{a.arch}-{tag}-kv{a.kv_heads or a.heads}"
    a.model = os.path.join(a.dir, f"bitnet-{tag}.gguf")
    if not os.path.exists(a.model):
        t = time.perf_counter()
        write_model(a.model + ".part", a)
        os.replace(a.model + ".part", a.model)
        print(f"wrote {a.model} ({os.path.getsize(a.model) / 2**20:.0f} MiB) in "
              f"{time.perf_counter() - t:.0f} s", file=sys.stderr)
    dtypes = a.output_dtype.split(",")
    for d in dtypes:
        if d not in ("float16", "int8", "float32"):
            p.error(f"--output-dtype: {d!r} is not float16, int8 or float32")
    peer = not a.no_peer
    if peer:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama-cpp-python is not installed: llama.cpp rows skipped "
                  "(pip install 'tercomp[peer]')", file=sys.stderr)
            peer = False
    rows, runs = {}, {}
    ternaries = a.ternary.split(",")
    for d in dtypes:
        for t in ternaries:
            name = f"tercomp {d}" + ("" if t == "auto" else f" {t}")
            artifact = os.path.join(a.dir, f"bitnet-{tag}-{d}-{t}.tcm")
            a.artifact = artifact
            extra = [f"--output-dtype={d}", f"--ternary={t}"]
            rows[name] = run_worker("tercomp-compile", a, extra) or {}
            runs[name] = ("tercomp-run", artifact, extra)
    if peer:
        rows["llama.cpp"] = {}
        runs["llama.cpp"] = ("llama", a.artifact, [])
    bitnet_files = bitnet_cpp_files(a, tag)
    for name, path in bitnet_files.items():
        rows[name] = {}
        runs[name] = ("bitnet-cpp", path, [])
    # the engines take turns, each round in fresh processes, and the best of the rounds
    # is kept: a change in the shared machine's load then hits every engine alike
    for _ in range(a.rounds):
        for name, (worker, artifact, extra) in runs.items():
            a.artifact = artifact
            for k, v in (run_worker(worker, a, extra) or {}).items():
                old = rows[name].get(k)
                better = max if k.endswith("_tps") or k == "rss_mb" else min   # RSS: the worst
                rows[name][k] = v if old is None else better(old, v)
                if k in ("decode_tps", "prefill_tps"):
                    rows[name].setdefault(k + "_rounds", []).append(v)
    for r in rows.values():
        for k in ("decode_tps", "prefill_tps"):
            if r.get(k + "_rounds"):
                r[k + "_median"] = float(np.median(r[k + "_rounds"]))
    print(f"CPU: {machine.cpu()}; {machine.load()} before the run")
    wrong = set()           # (row, key): figures of kernels whose logits are wrong
    if bitnet_files:        # the same weights? bitnet.cpp's logits against tercomp's
        a.artifact = runs[f"tercomp {dtypes[0]}"][1]
        files = [f"--bitnet-files={json.dumps(bitnet_files)}"]
        for name, c in (run_worker("bitnet-check", a, files) or {}).items():
            batch, one = c["prefill"], c["step"]
            print(f"{name} vs tercomp {dtypes[0]}, logits: a 32-token prompt in one batch, "
                  f"cosine min {batch['cos_min']:.5f} mean {batch['cos_mean']:.5f} (top-1 "
                  f"agrees at {batch['top1']:.2f}); one token alone, cosine {one['cos_min']:.5f}")
            for key, check in (("prefill_tps", batch), ("decode_tps", one)):
                if check["cos_min"] < 0.99:
                    wrong.add((name, key))
                    print(f"  {name}: {key} left out of bitnet.cpp's best: its logits are wrong")
    stream = run_worker("stream", a) or {}
    keys = [("decode_tps", "decode tokens/s", "{:.1f}"),
            ("decode_tps_median", "decode tokens/s, median of rounds", "{:.1f}"),
            ("prefill_tps", f"prefill pp{a.prompt} tokens/s", "{:.1f}"),
            ("prefill_tps_median", f"prefill pp{a.prompt}, median of rounds", "{:.1f}"),
            ("prefill_all_tps", f"prefill pp{a.prompt}, all logits", "{:.1f}"),
            ("rss_mb", "resident memory MiB", "{:.0f}"), ("load_s", "load s (tc.load / Llama())", "{:.2f}"),
            ("bytes_per_token_mb", "weights read per token MiB", "{:.0f}"),
            ("gbs", "decode GB/s (weights x tokens/s)", "{:.1f}"),
            ("compile_cold_s", "compile cold s", "{:.1f}"),
            ("compile_cached_s", "compile cached s", "{:.1f}"),
            ("compile_peak_mb", "compile peak memory MiB", "{:.0f}"),
            ("decode_pos64_ms", f"decode @64, max_seq {a.max_seq} ms", "{:.2f}"),
            ("decode_pos64_ms_seq128", "decode @64, max_seq 128 ms", "{:.2f}")]
    print(f"model file {os.path.getsize(a.model) / 2**20:.0f} MiB; the compile peak goal is "
          f"2x the file + 1 GiB = {2 * os.path.getsize(a.model) / 2**20 + 1024:.0f} MiB")
    print(f"model {tag}, {a.threads} threads, prompt {a.prompt}, {a.gen} new tokens, best of "
          f"{a.repeat} in each of {a.rounds} rounds taken in turns; tercomp's output layer "
          f"stored as {', '.join(dtypes)}")
    for r in rows.values():
        if r.get("bytes_per_token_mb") and r.get("decode_tps"):
            r["gbs"] = r["bytes_per_token_mb"] * 2**20 * r["decode_tps"] / 1e9
    if stream:
        print(f"a plain streaming read with {a.threads} threads: {stream['stream_gbs']:.1f} GB/s "
              f"(the ceiling of the decode GB/s row)")
    # each tercomp row against each peer; bitnet.cpp's best kernel in each row, of those
    # whose logits agree with tercomp's
    derived = {"decode_tps_median": "decode_tps", "gbs": "decode_tps",
               "prefill_tps_median": "prefill_tps"}

    def wrong_cell(n, k):
        return (n, derived.get(k, k)) in wrong
    groups = {"llama": ["llama.cpp"] if peer else [], "bitnet.cpp": list(bitnet_files)}
    groups = {g: members for g, members in groups.items() if members}
    names = list(rows)
    ours = [n for n in names if n.startswith("tercomp ")]
    ratios = [(n, g) for g in groups for n in ours]
    print(f"{'':34}" + "".join(f"{n:>16}" for n in names) +
          "".join(f"{n.replace('tercomp ', '') + ' / ' + g:>22}" for n, g in ratios))
    for k, label, fmt in keys:
        vals = [rows[n].get(k) for n in names]
        if all(v is None for v in vals):
            continue
        line = f"{label:34}" + "".join(
            f"{(fmt.format(v) if v is not None else '-') + (' (wrong)' if wrong_cell(n, k) else ''):>16}"
            for n, v in zip(names, vals))
        best = max if "_tps" in k or k == "gbs" else min
        for n, g in ratios:
            v = rows[n].get(k)
            peer_vals = [rows[m][k] for m in groups[g]
                         if rows[m].get(k) is not None and not wrong_cell(m, k)]
            peer_v = best(peer_vals) if peer_vals else None
            line += f"{v / peer_v:>21.2f}x" if v is not None and peer_v else f"{'-':>22}"
        print(line)
    if len(bitnet_files) > 1:
        fastest = max(bitnet_files, key=lambda m: 0 if (m, "decode_tps") in wrong
                      else rows[m].get("decode_tps") or 0)
        print(f"bitnet.cpp's fastest decode: {fastest}")
    print(f"{machine.load()} after the run")


def bitnet_cpp_files(a, tag) -> dict:
    """bitnet.cpp's files of the model, {column name: path}, or {} with the reason printed."""
    if not a.bitnet_cpp:
        print("bitnet.cpp rows skipped: no --bitnet-cpp BUILD (bench/build_bitnet_cpp.sh "
              "builds one)", file=sys.stderr)
        return {}
    problem = bitnet_cpp.find(a.bitnet_cpp)
    if problem is None and a.arch != "bitnet":
        problem = "its files are made for the bitnet arch only"
    if problem:
        print(f"bitnet.cpp rows skipped: {problem}", file=sys.stderr)
        return {}
    return bitnet_cpp.prepare(a, write_model, run_worker, tag)

if __name__ == "__main__":
    main()
