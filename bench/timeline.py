"""Where a compiled LM's step spends its time, per dispatch kind and per byte (issue #33).

    python bench/timeline.py MODEL.gguf [--threads 2] [--max-batch B] [--max-seq S]
        [--pos 130] [--prompt 128] [--iters 20] [--rounds 5] [--events]

For a tc.compile_lm generator (max_batch B; the single-sequence one for B = 1) it times
three calls: a decode step (M = 1 token at position --pos), a batched step (M = B
tokens, one per slot, each at --pos; B > 1 only) and a --prompt-token prefill
(logits_to_keep=1), and prints for each:

- the time per dispatch kind (ternary matmul by shape, output layer, attention, rms
  norm, quantize, rope, KV writes, other), as IREE's own HAL profiler measures each
  dispatch: `iree-benchmark-module --device_profiling_mode=host-execution` over the
  generator's vmfb and weights (the wall span of every dispatch on the local-task
  pool; `iree-profile dispatch --dispatch_events` reads them back), medians over the
  --iters calls; with the weight bytes each matmul kind reads per token and the GB/s
  that makes;
- their sum against the wall time of the call: the command buffer's span (first
  dispatch start to last dispatch end; the remainder is the barriers and gaps between
  dispatches, negative where independent dispatches overlap, e.g. a prefill's q/k/v
  matmuls) and the profiled calls' mean time (the rest: the runtime's per-call cost,
  submission, argument buffers, the logits' transfer); then, --rounds times
  interleaved, iree-benchmark-module's time per call without the profiler and the
  generator's own call from Python (`gen.extend` / `gen.forward` / `gen.prefill`:
  tercomp's checks, the binding and the logits' copy on top). On a shared machine
  compare only numbers of one run: the profiled pass and the rounds run at different
  moments.

Numbers are WARM: the same call repeated, so the weights' pages are mapped and the KV
rows and activations may sit in cache; the weights (hundreds of MB) do not fit in any
cache, so every step still streams them from DRAM. The cache contents are the
benchmark's (zeros in iree-benchmark-module, a prompt in the generator): no kernel's
time depends on the values. Dispatch names come from the kernels (tern_*) and IREE's
dispatch formation (step_dispatch_*); `--events` prints every distinct one.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

import tercomp as tc  # noqa: E402
from tercomp import models  # noqa: E402

#: kinds in print order; `kind()` maps a dispatch name to one
KINDS = ("ternary", "output", "attention", "rms_norm", "quantize", "rope", "kv_write", "other")


def find_tool(name: str) -> str:
    """An IREE runtime tool (iree-benchmark-module, iree-profile): the iree-base-runtime
    wheel's, else one on PATH."""
    import iree._runtime_libs as libs
    path = os.path.join(os.path.dirname(libs.__file__), name)
    found = path if os.access(path, os.X_OK) else shutil.which(name)
    if not found:
        raise SystemExit(f"{name} not found: install iree-base-runtime (pip)")
    return found


def kind(name: str, vocab: int) -> tuple[str, str]:
    """(kind, label) of a dispatch: ternary matmuls by their shape (the name's NxK),
    the output layer by the vocabulary in its shape."""
    shape = re.search(r"_(\d+)x(\d+)", name)
    if shape and int(shape.group(1)) == vocab and re.search(r"gemv|gemm|matmul|table|output", name):
        return "output", name
    if "attention" in name:
        return "attention", name
    if "rms_norm" in name:
        return "rms_norm", name
    if "rope" in name:
        return "rope", name
    # the batched cache's rows go in by the kv_write kernel (or iree_linalg_ext.scatter,
    # the generic kernel); the single one's (tensor.insert_slice into the global) by
    # IREE's copy dispatch, `slow_memcpy`
    if re.search(r"kv_write|scatter|cache_write|update_slice|insert_slice|memcpy", name):
        return "kv_write", name
    if re.search(r"gemv|gemm|matmul|ternary|tl_", name) and name.startswith("tern_"):
        return "ternary", name
    if "quant" in name:
        return "quantize", name
    if "matmul" in name or "mmt4d" in name:
        return "ternary" if "i8" in name or "i2" in name else "other", name
    return "other", name


def weight_bytes(name: str) -> int:
    """Bytes of weights a ternary or output-layer matmul dispatch reads: its name's
    N x (bytes per row) for the 2-bit GEMV/GEMM kernels (`gemv_1536x384`: N = 1536 rows
    of 384 bytes) and the int8/f16 output table (`i8_gemv_32002x1536`: 32002 rows of
    1536 int8; f16 twice that). 0 where the name does not say."""
    m = re.search(r"(gemv|gemm)\w*?_(\d+)x(\d+)", name)
    if not m:
        return 0
    n, k = int(m.group(2)), int(m.group(3))
    return n * k * (2 if "f16" in name else 1)


# ---------------------------------------------------------------------------- calls
def calls(gen, batch: int, pos: int, prompt: int, vocab: int):
    """[(label, tokens, module inputs as iree-run-module strings, python call)]: the
    step's named inputs (runtime/step_abi.py) and the generator call that runs them."""
    rng = np.random.default_rng(0)
    prompt_ids = rng.integers(3, vocab, size=prompt, dtype=np.int32)
    ctx_ids = rng.integers(3, vocab, size=pos + 1, dtype=np.int32)

    def arr(xs):
        xs = list(map(int, xs))
        return f"{len(xs)}xi32=" + " ".join(map(str, xs))
    def start(p):      # a scalar argument (StepABI), a 0-d tensor in older modules
        gen._fn()
        return str(p) if gen._scalar else f"i32={p}"
    out = []
    if batch == 1:
        gen.prefill(ctx_ids)
        tok = int(ctx_ids[-1])
        out.append(("decode M=1", 1, [arr([tok]), start(pos), arr([0])],
                    lambda: gen.extend([tok], start=pos, logits_to_keep=1)))
        out.append((f"prefill T={prompt}", prompt,
                    [arr(prompt_ids), start(0), arr([prompt - 1])],
                    lambda: gen.extend(prompt_ids, start=0, logits_to_keep=1)))
        return out, lambda: gen.prefill(ctx_ids)
    for s in range(batch):
        gen.prefill(ctx_ids, slot=s, logits_to_keep=1)
    toks = rng.integers(3, vocab, size=batch, dtype=np.int32)
    slots = np.arange(batch, dtype=np.int32)
    at = np.full(batch, pos, np.int32)
    out.append(("step M=1", 1, [arr(toks[:1]), arr([0]), arr([pos]), arr([0])],
                lambda: gen.forward(toks[:1], slots[:1], at[:1])))
    out.append((f"step M={batch}", batch, [arr(toks), arr(slots), arr(at), arr(slots)],
                lambda: gen.forward(toks, slots, at)))
    # the prompt goes into the last slot, so the others keep their rows for the steps
    last = batch - 1
    out.append((f"prefill T={prompt}", prompt,
                [arr(prompt_ids), arr([last] * prompt), arr(range(prompt)), arr([prompt - 1])],
                lambda: gen.prefill(prompt_ids, slot=last, logits_to_keep=1)))
    return out, lambda: gen.prefill(ctx_ids, slot=last, logits_to_keep=1)


# ---------------------------------------------------------------------------- runs
def bench_module(vmfb, irpa, scope, inputs, threads, iters, profile=None,
                 function="step") -> float:
    """iree-benchmark-module's mean real time per call (s) of `function` over `iters`
    calls (the weights: the .irpa `irpa` as parameter scope `scope`, or None); with
    `profile` (a path) the HAL profiler's host-execution events are written there."""
    cmd = [find_tool("iree-benchmark-module"), f"--module={vmfb}", f"--function={function}",
           "--device=local-task", f"--task_topology_group_count={threads}",
           f"--benchmark_min_time={iters}x", "--benchmark_format=json"]
    if irpa:
        cmd.append(f"--parameters={scope}={irpa}")
    cmd += [f"--input={x}" for x in inputs]
    if profile:
        cmd += ["--device_profiling_mode=host-execution", f"--device_profiling_output={profile}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"iree-benchmark-module failed:\n{r.stderr[-3000:]}")
    got = json.loads(r.stdout[r.stdout.index("{"):])
    b = got["benchmarks"][0]
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b["time_unit"]]
    return b["real_time"] * scale


def dispatch_events(path: str) -> dict:
    """{submission id: [(name, start ns, end ns)]} from a .ireeprof bundle."""
    r = subprocess.run([find_tool("iree-profile"), "dispatch", "--dispatch_events",
                        "--format=jsonl", path], capture_output=True, text=True, check=True)
    subs = defaultdict(list)
    for line in r.stdout.splitlines():
        ev = json.loads(line)
        if ev.get("type") in ("host_dispatch_event", "dispatch_event") and ev.get("valid", True):
            subs[ev["submission_id"]].append((ev["key"], ev["start_host_time_ns"],
                                              ev["end_host_time_ns"]))
    return subs


def per_call(subs: dict, vocab: int):
    """Medians over the calls (submissions with the step's full command buffer) of:
    the time per dispatch name, per kind, their sum and the command buffer's span (s);
    and each name's dispatch count per call."""
    full = max(len(v) for v in subs.values())
    calls_ = [v for v in subs.values() if len(v) == full]
    names = defaultdict(list)
    kinds = defaultdict(list)
    sums, spans = [], []
    count = defaultdict(int)
    for ev in calls_:
        by_name, by_kind = defaultdict(float), defaultdict(float)
        for name, a, b in ev:
            by_name[name] += (b - a) * 1e-9
            by_kind[kind(name, vocab)[0]] += (b - a) * 1e-9
        for name in by_name:
            names[name].append(by_name[name])
        for k in KINDS:
            kinds[k].append(by_kind.get(k, 0.0))
        sums.append(sum(by_name.values()))
        spans.append((max(e[2] for e in ev) - min(e[1] for e in ev)) * 1e-9)
    for name, _, _ in calls_[0]:
        count[name] += 1
    med = statistics.median
    return ({n: med(v) for n, v in names.items()}, {k: med(v) for k, v in kinds.items()},
            med(sums), med(spans), dict(count), len(calls_))


def py_times(fn, rounds: int, reps: int) -> list:
    """Wall time (s) of `fn()` per call: the median of `reps` calls, `rounds` times."""
    fn()
    out = []
    for _ in range(rounds):
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        out.append(statistics.median(ts))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a BitNet GGUF")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=1)
    ap.add_argument("--max-seq", type=int, default=512)
    ap.add_argument("--pos", type=int, default=130, help="position of the decode steps")
    ap.add_argument("--prompt", type=int, default=128, help="prefill length")
    ap.add_argument("--iters", type=int, default=20, help="profiled calls per step kind")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    ap.add_argument("--output-dtype", default=None)
    ap.add_argument("--only", default="", help="comma-separated call labels' first words "
                    "to run (decode, step, prefill; default all)")
    ap.add_argument("--events", action="store_true", help="print every dispatch name")
    a = ap.parse_args(argv)
    if a.pos + 1 > a.max_seq or a.prompt > a.max_seq:
        raise SystemExit("--pos and --prompt must fit in --max-seq")

    lm = models.load(a.model)
    vocab = lm.config.vocab_size
    t0 = time.perf_counter()
    gen = tc.compile_lm(lm, max_seq=a.max_seq, threads=a.threads,
                        max_batch=a.max_batch if a.max_batch > 1 else None,
                        output_dtype=a.output_dtype)
    print(f"compile_lm: {time.perf_counter() - t0:.1f} s; max_batch {a.max_batch}, max_seq "
          f"{a.max_seq}, {a.threads} threads, output table "
          f"{gen.exe.meta['lm']['output']['dtype']}; decode at position {a.pos}")
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} (1 and 5 min)")
    with tempfile.TemporaryDirectory(prefix="tc-timeline-") as tmp:
        vmfb, irpa = os.path.join(tmp, "step.vmfb"), os.path.join(tmp, "weights.irpa")
        with open(vmfb, "wb") as f:
            f.write(gen.exe.vmfb_view)
        with open(irpa, "wb") as f:
            f.write(gen.exe.weights_view)
        scope = gen.exe.weights_scope
        todo, restore = calls(gen, a.max_batch, a.pos, a.prompt, vocab)
        only = set(filter(None, a.only.split(",")))
        for label, tokens, inputs, fn in todo:
            if only and label.split()[0] not in only and label not in only:
                continue
            reps = 3 if tokens > 16 else 10
            prof = os.path.join(tmp, "p.ireeprof")
            profiled = bench_module(vmfb, irpa, scope, inputs, a.threads, a.iters, profile=prof)
            names, kinds, dsum, span, count, n = per_call(dispatch_events(prof), vocab)
            mod, py = [], []
            for _ in range(a.rounds):      # interleaved: module alone, then from Python
                mod.append(bench_module(vmfb, irpa, scope, inputs, a.threads, reps))
                py += py_times(fn, 1, reps)
            restore()
            report(label, tokens, names, kinds, dsum, span, count, n, profiled, mod, py, vocab,
                   a.events)
    print(f"load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} (1 and 5 min)")


def report(label, tokens, names, kinds, dsum, span, count, n, profiled, mod, py, vocab, events):
    ms = 1e3
    med = statistics.median
    print(f"\n== {label}: {sum(count.values())} dispatches a call ({n} profiled calls, "
          f"medians)")
    print(f"  {'kind':<44} {'ms':>8} {'share':>6} {'n':>5} {'MB/tok':>8} {'GB/s':>6}")
    by_kind = defaultdict(list)
    for name in names:
        by_kind[kind(name, vocab)[0]].append(name)
    for k in KINDS:
        if k not in by_kind:
            continue
        print(f"  {k:<44} {kinds[k] * ms:8.3f} {kinds[k] / dsum:6.1%} "
              f"{sum(count[x] for x in by_kind[k]):5d}")
        if k in ("ternary", "output") or events:
            for name in sorted(by_kind[k], key=lambda x: -names[x]):
                wb = weight_bytes(name) * count[name]
                per_tok = f"{wb / tokens / 1e6:8.2f}" if wb else " " * 8
                rate = f"{wb / names[name] / 1e9:6.1f}" if wb else ""
                print(f"    {name[:42]:<42} {names[name] * ms:8.3f} {names[name] / dsum:6.1%} "
                      f"{count[name]:5d} {per_tok} {rate}")
    wb = sum(weight_bytes(x) * count[x] for x in names)
    print(f"  {'sum of dispatches':<44} {dsum * ms:8.3f} {'':6} {'':5} "
          f"{wb / tokens / 1e6:8.2f} {wb / dsum / 1e9:6.1f}")
    print(f"  {'command buffer span (+ barriers, gaps)':<44} {span * ms:8.3f}  "
          f"(+{(span - dsum) * ms:.3f})")
    print(f"  {'the profiled calls, mean (+ runtime)':<44} {profiled * ms:8.3f}  "
          f"(+{(profiled - span) * ms:.3f})")
    mm, pm = med(mod), med(py)
    print(f"  interleaved, median / min: iree-benchmark-module {mm * ms:.3f} / {min(mod) * ms:.3f}, "
          f"the generator from Python {pm * ms:.3f} / {min(py) * ms:.3f} (Python +{(pm - mm) * ms:.3f})")
    print(f"  -> {tokens / pm:.1f} tokens/s from Python; weights {wb / tokens / 1e6:.1f} MB a "
          f"token at {wb / pm / 1e9:.1f} GB/s over the whole call")


if __name__ == "__main__":
    main()
