"""Many streams: aggregate decode throughput of a batched generator (tc.compile_lm with
max_batch) at 1, 4, 8 and 16 concurrent streams, against llama.cpp's own batched
decoding of the same GGUF with the same threads, in the same run.

    python bench/streams.py                   # bitnet_b1_58-large shape (~700M parameters)
    python bench/streams.py --layers 4        # quicker
    python bench/streams.py --no-peer         # tercomp only

The model is bench/lm.py's random-ternary GGUF (TQ2_0 projections, tied f16 embedding).
Each engine runs in its own fresh process with `--threads` threads:

- tercomp single: the single-stream generator (max_batch 1), decode tokens/s after a
  `--prompt`-token prompt: the baseline of the "x single" column;
- tercomp batched: one generator with max_batch = the largest stream count; every
  stream is prefilled with its own prompt, then B streams decode together, one call of
  the step per token of all B (`gen.step`), `--gen` steps, best of `--repeat`;
- tercomp engine e2e: the same through runtime.Engine (continuous batching, sampling and
  bookkeeping on the host included): B requests of `--gen` tokens submitted at once,
  generated tokens over the wall time from the first submit to the last token, which
  includes the B prompts' prefill (with the defaults, 32 prompt tokens a request for 16
  generated: most of that time is prefill; not a decode rate);
- llama.cpp: llama-cpp-python's low-level API (llama_batch with one sequence id per
  stream, a unified KV cache of n_ctx = B x max_seq, as llama-batched-bench decodes):
  every stream prefilled, then B tokens per llama_decode.

Aggregate tokens/s = B x steps / seconds. The engines take turns (`--rounds`), each
round in fresh processes; the table gives the median and the best of every timing, and
the ratios of both, from the same run.
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

import machine  # noqa: E402  (bench/machine.py)
from lm import write_model  # noqa: E402  (bench/lm.py)


def _prompts(a, n):
    rng = np.random.default_rng(1)
    return [rng.integers(0, a.vocab, a.prompt).astype(np.int32) for _ in range(n)]


def _times(fn, repeat):
    """`repeat` timings of fn() (seconds)."""
    return [fn() for _ in range(repeat)]


def worker_tercomp(a):
    import tercomp as tc
    from tercomp import models
    from tercomp.runtime.scheduler import Engine
    streams = [int(s) for s in a.streams.split(",")]
    lm = models.load(a.model)
    out = {}
    single = tc.compile_lm(lm, max_seq=a.max_seq, threads=a.threads, ternary=a.ternary)
    prompt = _prompts(a, 1)[0]

    def one():
        single.prefill(prompt, logits_to_keep=1)
        t = time.perf_counter()
        for i in range(a.gen):
            single.decode(int(prompt[i % a.prompt]))
        return time.perf_counter() - t
    one()
    out["single_tps"] = [a.gen / t for t in _times(one, a.repeat)]
    del single
    t = time.perf_counter()
    gen = tc.compile_lm(lm, max_seq=a.max_seq, max_batch=max(streams), threads=a.threads,
                        ternary=a.ternary)
    out["compile_batched_s"] = time.perf_counter() - t
    prompts = _prompts(a, max(streams))
    for b in streams:
        slots = np.arange(b, dtype=np.int32)

        def run():
            for s in range(b):
                gen.prefill(prompts[s], slot=s, logits_to_keep=1)
            tok = prompts[0][:b].copy()
            t = time.perf_counter()
            for _ in range(a.gen):
                tok = gen.step(tok, slots).argmax(-1).astype(np.int32)
            return time.perf_counter() - t
        run()
        out[f"step_{b}"] = [b * a.gen / t for t in _times(run, a.repeat)]
    engine = Engine(gen)
    for b in streams:
        def served():
            t = time.perf_counter()
            reqs = [engine.submit(prompts[s], max_tokens=a.gen) for s in range(b)]
            n = sum(len(r.result(timeout=600)) for r in reqs)
            return (time.perf_counter() - t) / n
        served()
        out[f"engine_{b}"] = [1.0 / t for t in _times(served, a.repeat)]
    engine.close()
    return out


def worker_llama(a):
    import ctypes
    import llama_cpp as L
    streams = [int(s) for s in a.streams.split(",")]
    n_seq = max(streams)
    L.llama_backend_init()
    mp = L.llama_model_default_params()
    model = L.llama_model_load_from_file(a.model.encode(), mp)
    cp = L.llama_context_default_params()
    cp.n_ctx = n_seq * a.max_seq
    cp.n_batch = max(a.prompt, n_seq)
    cp.n_ubatch = cp.n_batch
    cp.n_seq_max = n_seq
    cp.n_threads = cp.n_threads_batch = a.threads
    cp.kv_unified = True
    ctx = L.llama_init_from_model(model, cp)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(cp.n_batch, 0, n_seq)
    mem = L.llama_get_memory(ctx)

    def submit(tokens, seqs, positions, want_logits):
        batch.n_tokens = len(tokens)
        for i, (tok, s, p, w) in enumerate(zip(tokens, seqs, positions, want_logits)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(tok), int(p), 1
            batch.seq_id[i][0] = int(s)
            batch.logits[i] = bool(w)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i):
        row = L.llama_get_logits_ith(ctx, i)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)),
                                                   shape=(n_vocab,))))
    prompts = _prompts(a, n_seq)
    out = {}
    for b in streams:
        def run():
            L.llama_memory_clear(mem, True)
            for s in range(b):
                n = len(prompts[s])
                submit(prompts[s], [s] * n, range(n), [False] * (n - 1) + [True])
            tok = [int(t) for t in prompts[0][:b]]
            t = time.perf_counter()
            for step in range(a.gen):
                submit(tok, range(b), [a.prompt + step] * b, [True] * b)
                tok = [argmax(i) for i in range(b)]
            return time.perf_counter() - t
        run()
        out[f"step_{b}"] = [b * a.gen / t for t in _times(run, a.repeat)]
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return out


WORKERS = {"tercomp": worker_tercomp, "llama": worker_llama}


def run_worker(name, a, extra=()):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--model", a.model,
           *a.passthrough, *extra]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(f"{name} failed:\n{r.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32002)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream")
    p.add_argument("--gen", type=int, default=32, help="decode steps measured")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="turns each engine gets")
    p.add_argument("--max-seq", type=int, default=256, help="cache rows per stream")
    p.add_argument("--streams", default="1,4,8,16")
    p.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    p.add_argument("--ternary", default="auto",
                   help="tercomp's ternary kernels (compile_lm ternary), a comma-separated list "
                        "of strategies (auto, avx512, avx2, ...): one tercomp engine each, "
                        "all taking turns")
    p.add_argument("--keep", action="store_true", help="keep the GGUF (in --dir)")
    p.add_argument("--dir", default=None)
    p.add_argument("--worker", choices=sorted(WORKERS))
    p.add_argument("--model")
    a = p.parse_args()
    a.arch, a.kv_heads = "bitnet", 0
    if a.worker:
        print(json.dumps(WORKERS[a.worker](a)))
        return
    a.passthrough = []
    for k in ("layers", "hidden", "ffn", "heads", "vocab", "threads", "prompt", "gen", "repeat",
              "max_seq", "streams"):
        a.passthrough += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    d = a.dir or tempfile.mkdtemp(prefix="tercomp-bench-serve-")
    os.makedirs(d, exist_ok=True)
    a.model = os.path.join(d, f"bitnet-{a.layers}x{a.hidden}.gguf")
    try:
        if not os.path.exists(a.model):
            write_model(a.model, a)
        print(f"CPU: {machine.cpu()}; {a.threads} threads; {machine.load()} before the run")
        print(f"model: {a.layers} layers, hidden {a.hidden}, ffn {a.ffn}, vocab {a.vocab}; "
              f"prompt {a.prompt} per stream, {a.gen} decode steps, max_seq {a.max_seq}")
        peer = not a.no_peer
        if peer:
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                print("llama.cpp: not installed (pip install -e '.[peer]'); its columns are empty")
                peer = False
        # the engines take turns, each round in fresh processes: a change in the shared
        # machine's load hits both alike; every timing of every round is kept
        ternaries = a.ternary.split(",")
        ours, theirs = {t: {} for t in ternaries}, {}
        engines = [("tercomp", ours[t], ["--ternary", t]) for t in ternaries]
        engines += [("llama", theirs, [])] if peer else []
        for _ in range(a.rounds):
            for name, into, extra in engines:
                for k, v in (run_worker(name, a, extra) or {}).items():
                    into.setdefault(k, []).extend(v if isinstance(v, list) else [v])
        if not all(ours.values()):
            sys.exit(1)
        pmed = {k: float(np.median(v)) for k, v in theirs.items()}
        pbest = {k: float(np.max(v)) for k, v in theirs.items()}
        for t in ternaries:
            med = {k: float(np.median(v)) for k, v in ours[t].items()}
            best = {k: float(np.max(v)) for k, v in ours[t].items()}
            print(f"ternary={t}: tokens/s, median / best of {a.rounds} rounds x {a.repeat} runs, "
                  f"engines in turns; single-stream generator (max_batch 1): "
                  f"{med['single_tps']:.1f} / {best['single_tps']:.1f}; batched compile "
                  f"{best['compile_batched_s']:.1f} s")
            print(f"{'streams':>7} {'tercomp':>13} {'x single':>11} {'llama.cpp':>13} "
                  f"{'tercomp/llama':>13} {'engine e2e':>13}")
            for b in (int(s) for s in a.streams.split(",")):
                k = f"step_{b}"
                ratio = f"{med[k] / pmed[k]:6.2f} /{best[k] / pbest[k]:5.2f}" if k in pmed else "-"
                lc = f"{pmed[k]:6.1f} /{pbest[k]:6.1f}" if k in pmed else "-"
                print(f"{b:7d} {med[k]:6.1f} /{best[k]:6.1f} {med[k] / med['single_tps']:4.2f} /"
                      f"{best[k] / best['single_tps']:5.2f} {lc:>13} {ratio:>13} "
                      f"{med[f'engine_{b}']:6.1f} /{best[f'engine_{b}']:5.1f}")
        print(f"{machine.load()} after the run")
    finally:
        if not a.keep and a.dir is None:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
