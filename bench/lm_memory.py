"""Peak resident memory and time of `models.load` + `tc.compile_lm` of a GGUF, by phase.

    python bench/lm_memory.py --preset 8b            # writes /tmp/tercomp-lm-memory/*.gguf
    python bench/lm_memory.py --preset 2b4t --decode 16
    python bench/lm_memory.py --model FILE.gguf --output-dtype float16

Writes the model with bench/lm.py's writer when it is not there yet (random ternary
TQ2_0 projections, f16 tables), then in this process: loads it, compiles it (no compile
cache), and prints after each phase (load, trace, passes, lowering, IREE, the generator)
the time and the resident memory, now and at its peak (Linux's VmRSS / VmHWM), and the
goal of issue #33: a peak of at most 2x the file + 1 GiB. `--decode N` then times a
32-token prefill and N greedy decode steps.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lm as bench_lm  # noqa: E402  (bench/lm.py: the writer)

PRESETS = {     # bench/lm.py's
    "8b": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256,
               arch="llama", act=None),
    "2b4t": dict(layers=30, hidden=2560, ffn=6912, heads=20, kv_heads=5, vocab=128256,
                 arch="bitnet", act="relu2"),
}


def status(key: str) -> float:
    """/proc/self/status's `key` in MiB."""
    with open("/proc/self/status") as f:
        return int(re.search(key + r":\s+(\d+)", f.read()).group(1)) / 1024


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--model", help="a GGUF file (instead of a preset's)")
    p.add_argument("--output-dtype", default=None, help="compile_lm's (default: its own)")
    p.add_argument("--max-seq", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode", type=int, default=0, help="greedy decode steps to time")
    a = p.parse_args()
    if (a.preset is None) == (a.model is None):
        p.error("give --preset or --model")
    if a.preset:
        shape = argparse.Namespace(**PRESETS[a.preset])
        d = os.path.join("/tmp", "tercomp-lm-memory")
        os.makedirs(d, exist_ok=True)
        a.model = os.path.join(d, f"{a.preset}.gguf")
        if not os.path.exists(a.model):
            t = time.perf_counter()
            bench_lm.write_model(a.model + ".part", shape)
            os.replace(a.model + ".part", a.model)
            print(f"wrote {a.model} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    t0 = time.perf_counter()
    import tercomp as tc
    from tercomp import build, models
    rows = []

    def mark(phase):
        rows.append({"phase": phase, "t_s": round(time.perf_counter() - t0, 1),
                     "rss_mib": round(status("VmRSS")), "peak_mib": round(status("VmHWM"))})
        print(json.dumps(rows[-1]), flush=True)

    mark("import")
    lm = models.load(a.model)
    mark("load")
    run_pipeline, compile_vmfb = build.run_pipeline, build.compile_vmfb

    def passes(*args):
        mark("trace")
        out = run_pipeline(*args)
        mark("passes")
        return out

    def iree(*args, **kw):
        mark("lowering")
        out = compile_vmfb(*args, **kw)
        mark("iree")
        return out
    build.run_pipeline, build.compile_vmfb = passes, iree
    try:
        kw = {} if a.output_dtype is None else {"output_dtype": a.output_dtype}
        gen = tc.compile_lm(lm, max_seq=a.max_seq, threads=a.threads, cache=False, **kw)
    finally:
        build.run_pipeline, build.compile_vmfb = run_pipeline, compile_vmfb
    mark("generator")
    size = os.path.getsize(a.model) / 2**20
    peak = status("VmHWM")
    out = {"file_mib": round(size), "peak_mib": round(peak), "peak_per_file": round(peak / size, 2),
           "goal_mib": round(2 * size + 1024), "weights_mib": round(len(gen.exe._weights) / 2**20),
           "output": gen.exe.meta["lm"]["output"]["dtype"],
           "load_s": round(rows[1]["t_s"] - rows[0]["t_s"], 1),
           "compile_s": round(rows[-1]["t_s"] - rows[1]["t_s"], 1)}
    if a.decode:
        ids = np.arange(3, 35, dtype=np.int32)
        t = time.perf_counter()
        tok = int(np.argmax(gen.prefill(ids, logits_to_keep=1)[-1]))
        out["prefill32_s"] = round(time.perf_counter() - t, 2)
        steps = []
        for _ in range(a.decode):
            t = time.perf_counter()
            tok = int(np.argmax(gen.decode(tok)))
            steps.append(time.perf_counter() - t)
        out["decode_tps_median"] = round(1 / float(np.median(steps)), 2)
        out["decode_tps_best"] = round(1 / min(steps), 2)
        mark("decoded")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
