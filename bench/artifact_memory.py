"""Where a tc.load-ed artifact's resident memory goes, step by step (issues #33 and #34).

    python bench/artifact_memory.py                 # 16 BitLinear 4096x4096 (64 MiB packed)
    python bench/artifact_memory.py --layers 4      # 16 MiB packed
    python bench/artifact_memory.py --conv          # bench/conv.py's ternary ResNet, 32x32

Compiles the artifact here, saves it, then measures a fresh process (Linux's VmRSS,
RssAnon and RssFile from /proc/self/status) after each step:

  start     numpy and tercomp imported, the inputs allocated (the caller's arrays)
  runtime   a weightless artifact (one exp) loaded and called: the IREE instance, the
            local-task device and its worker threads, the first call's allocator arenas,
            which any IREE program pays once per process
  load      tc.load of the artifact (the file mapped, its digests checked)
  context   the module loaded into a context (its weights bound in place)
  b<N>      a call at batch N, its output held (and `again`: a second call)

The artifact's own resident memory is the growth from `runtime`, less the activations
of the call (the output the caller holds, the input's device copy and the intermediates,
which glibc keeps for the next call); the goal is the packed weights once (<= 1.1x for
BitLinear stacks, #33; <= 1.2x for the conv network, #34).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tercomp as tc  # noqa: E402
from tercomp import nn  # noqa: E402


class Stack(nn.Module):
    """`layers` BitLinear(width, width) in a row: layers * width^2 / 4 bytes packed."""
    def __init__(self, layers, width):
        self.layers = [nn.BitLinear(width, width) for _ in range(layers)]

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

_SCRIPT = r"""
import json, sys
import numpy as np
def status():
    keys = ("VmRSS", "RssAnon", "RssFile")
    with open("/proc/self/status") as f:
        return {k: int(l.split()[1]) / 1024 for l in f for k in keys if l.startswith(k + ":")}
rows = []
def mark(step):
    rows.append(dict(step=step, **status()))
import tercomp as tc
path, empty, shape, batches = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
x = np.ones([max(batches)] + shape, np.float32)
mark("start")
tc.load(empty)(np.ones(4, np.float32))
mark("runtime")
exe = tc.load(path)
mark("load")
exe.function(exe.signature.function)
mark("context")
for b in batches:
    y = exe(x[:b])
    mark(f"b{b}")
    del y
    y = exe(x[:b])
    mark(f"b{b} again")
    del y
print(json.dumps(rows))
"""


def weightless(d: str) -> str:
    """An artifact without weights (one exp over a vector): loading and calling it pays
    the IREE runtime's fixed cost."""
    path = os.path.join(d, "empty.tcm")
    tc.compile(lambda a: tc.exp(a), tc.spec(("N",))).save(path)
    return path


def measure(path: str, sample_shape, batches=(1, 128), empty: str | None = None) -> dict:
    """Resident MiB of a fresh process after each step (the module docstring's), as
    {step: {"VmRSS", "RssAnon", "RssFile"}}, for the artifact at `path` called with
    float32 inputs [batch, *sample_shape]."""
    with tempfile.TemporaryDirectory() as d:
        empty = empty or weightless(d)
        r = subprocess.run([sys.executable, "-c", _SCRIPT, path, empty,
                            json.dumps(list(sample_shape)), json.dumps(list(batches))],
                           capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    return {row.pop("step"): row for row in json.loads(r.stdout.splitlines()[-1])}


def report(rows: dict, packed_mib: float, activations=None) -> str:
    """A table of the steps, each with its growth over the previous one and, after the
    runtime, the growth against the packed weights (less the call's `activations`
    {batch: MiB} where given)."""
    lines = [f"{'step':12s} {'VmRSS':>8s} {'+':>7s} {'anon +':>7s} {'file +':>7s} "
             f"{'from runtime':>13s} {'/ packed':>9s}"]
    prev, base = None, rows["runtime"]["VmRSS"]
    for step, r in rows.items():
        d = {k: r[k] - (prev or r)[k] for k in r}
        line = (f"{step:12s} {r['VmRSS']:8.1f} {d['VmRSS']:+7.1f} {d['RssAnon']:+7.1f} "
                f"{d['RssFile']:+7.1f}")
        if step not in ("start", "runtime"):
            grown = r["VmRSS"] - base
            line += f" {grown:13.1f} {grown / packed_mib:8.2f}x"
            b = int(step[1:].split()[0]) if step.startswith("b") else None
            if activations and b in activations:
                line += f"  (less {activations[b]:.1f} MiB of activations: " \
                        f"{(grown - activations[b]) / packed_mib:.2f}x)"
        lines.append(line)
        prev = r
    return "\n".join(lines)


def stack_activations(batch: int, width: int, widest: int | None = None) -> float:
    """MiB of activations a call of a BitLinear stack holds at its peak: the output the
    caller keeps and IREE's buffer of it, the input's device copy, and a layer's f32
    input and output (the widest, `widest` features) with its int8 quantization."""
    widest = widest or width
    return batch * 4 * (3 * width + 2 * widest + widest / 4) / 2**20


def conv_activations(model, sample_shape, batch: int) -> float:
    """MiB of activations a call of a ternary conv network holds at its peak, counted
    from its layers: the input's device copy, the output the caller keeps and IREE's
    buffer of it, and for every BitConv layer its int8 patch matrix (C_in * kernel
    bytes per output position) and its f32 output, each once. The layers' shapes come
    from a run of `model` at batch 1 in which each BitConv returns zeros of its output's
    shape (the network's other layers run as they are)."""
    from tercomp.nn.bitconv import _BitConvNd
    from tercomp.tracing.conv_api import resolve_padding
    total = [0]

    def shape_only(self, x):
        pads = resolve_padding(self.padding, self.nd, type(self).__name__,
                               same=(self.kernel_size, x.shape[2:], self.stride, self.dilation))
        out = [(d + lo + hi - (dl * (k - 1) + 1)) // s + 1 for d, k, s, dl, (lo, hi) in
               zip(x.shape[2:], self.kernel_size, self.stride, self.dilation, pads)]
        positions = int(np.prod(out))
        total[0] += positions * self.in_channels * int(np.prod(self.kernel_size)) \
            + positions * self.out_channels * 4
        return np.zeros((x.shape[0], self.out_channels, *out), np.float32)

    original = _BitConvNd.forward
    _BitConvNd.forward = shape_only
    try:
        out = model(np.zeros((1,) + tuple(sample_shape), np.float32))
    finally:
        _BitConvNd.forward = original
    total[0] += int(np.prod(sample_shape)) * 4 + 2 * int(np.size(out)) * 4
    return batch * total[0] / 2**20


def _modules(m, seen=None):
    """`m` and every nn.Module under it (attributes, lists)."""
    seen = seen if seen is not None else set()
    if id(m) in seen:
        return
    seen.add(id(m))
    yield m
    for v in vars(m).values():
        for item in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(item, nn.Module):
                yield from _modules(item, seen)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--conv", action="store_true", help="bench/conv.py's ternary ResNet")
    ap.add_argument("--size", type=int, default=32, help="--conv's input size")
    ap.add_argument("--batches", default="1,128")
    args = ap.parse_args(argv)
    import time
    batches = [int(b) for b in args.batches.split(",")]
    nn.manual_seed(0)
    if args.conv:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import conv as bench_conv
        model = bench_conv.ResNet(1)
        model(np.random.default_rng(0).standard_normal((2, 3, args.size, args.size)).astype(np.float32))
        model.eval()
        shape = (3, args.size, args.size)
        packed = sum(m.out_channels * -(-m.weight[0].size // 4)
                     for m in bench_conv._bitconvs(model)) / 2**20
        activations = {b: conv_activations(model, shape, b) for b in batches}
    else:
        model = Stack(args.layers, args.width)
        shape = (args.width,)
        packed = args.layers * args.width * args.width / 4 / 2**20
        activations = {b: stack_activations(b, args.width) for b in batches}
    t = time.perf_counter()
    exe = tc.compile(model, tc.spec(("B",) + shape), cache=False)
    print(f"compile: {time.perf_counter() - t:.1f} s; packed weights {packed:.2f} MiB")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "a.tcm")
        exe.save(path)
        print(report(measure(path, shape, batches), packed, activations))


if __name__ == "__main__":
    main()
