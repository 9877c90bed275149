"""A ternary ResNet-style CNN compiled by tercomp against the same network in float32
under jax.jit (and PyTorch eager, if installed): forward in eval mode at batch 1 and 32,
and a training step (SGD, BatchNorm in training mode) at batch 32. One interleaved run:
each round times every contestant once, so load from other jobs hits all of them;
medians and minimums, and the ratio tercomp / JAX of each.

The network: a 3x3 stem, then one BasicBlock (conv-BN-ReLU-conv-BN + shortcut, ReLU)
per stage at 64, 128, 256, 512 channels (stride 2 between stages; `--blocks 2` is
ResNet-18's layout), global average pooling and a Linear head. tercomp's convs are
nn.BitConv2d (ternary weights, int8 activations, packed 2-bit in the artifact), JAX's
lax.conv_general_dilated in float32. Also reported: the resident memory a fresh process
adds by loading the saved ternary artifact and running it once, against its packed
weights (less the IREE runtime's fixed cost and the call's activations:
bench/artifact_memory.py).

    pip install jax                              # optional: without it only tercomp runs
    python bench/conv.py                         # 32x32 inputs, batch 1 and 32
    python bench/conv.py --size 56 --blocks 2 --rounds 10 --train
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tercomp as tc  # noqa: E402
from tercomp import nn  # noqa: E402

WIDTHS = (64, 128, 256, 512)


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        self.conv1 = nn.BitConv2d(cin, cout, 3, stride=stride, padding=1)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.BitConv2d(cout, cout, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.BitConv2d(cin, cout, 1, stride=stride)
            self.bn_down = nn.BatchNorm2d(cout)

    def forward(self, x):
        h = tc.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        short = x if self.down is None else self.bn_down(self.down(x))
        return tc.relu(h + short)


class ResNet(nn.Module):
    def __init__(self, blocks=1, classes=10):
        self.stem = nn.BitConv2d(3, WIDTHS[0], 3, padding=1)
        self.bn = nn.BatchNorm2d(WIDTHS[0])
        layers, cin = [], WIDTHS[0]
        for i, w in enumerate(WIDTHS):
            for j in range(blocks):
                layers.append(Block(cin, w, 2 if (i > 0 and j == 0) else 1))
                cin = w
        self.layers = layers
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        h = tc.relu(self.bn(self.stem(x)))
        for blk in self.layers:
            h = blk(h)
        return self.head(tc.mean(h, axis=(2, 3)))


def loss_fn(model, x, y):
    return tc.cross_entropy(model(x), y)


# -- the same network in JAX, float32 --------------------------------------------------------
def jax_functions(model):
    import jax
    import jax.numpy as jnp
    from jax import lax

    params = {k: jnp.asarray(v) for k, v in model.parameters().items()}
    buffers = {k: jnp.asarray(v) for k, v in model.buffers().items()}

    def conv(p, name, x, stride, pad):
        return lax.conv_general_dilated(x, p[f"{name}.weight"], (stride, stride), [(pad, pad)] * 2,
                                        dimension_numbers=("NCHW", "OIHW", "NCHW"))

    def bn(p, name, x, train):
        if train:
            mean, var = x.mean((0, 2, 3)), x.var((0, 2, 3))
        else:
            mean, var = buffers[f"{name}.running_mean"], buffers[f"{name}.running_var"]
        s = (1, -1, 1, 1)
        return (x - mean.reshape(s)) * lax.rsqrt(var.reshape(s) + 1e-5) * p[f"{name}.weight"].reshape(s) \
            + p[f"{name}.bias"].reshape(s)

    def forward(p, x, train=False):
        h = jax.nn.relu(bn(p, "bn", conv(p, "stem", x, 1, 1), train))
        for i, blk in enumerate(model.layers):
            n = f"layers.{i}"
            s = blk.conv1.stride[0]
            o = jax.nn.relu(bn(p, f"{n}.bn1", conv(p, f"{n}.conv1", h, s, 1), train))
            o = bn(p, f"{n}.bn2", conv(p, f"{n}.conv2", o, 1, 1), train)
            short = h if blk.down is None else bn(p, f"{n}.bn_down", conv(p, f"{n}.down", h, s, 0), train)
            h = jax.nn.relu(o + short)
        return h.mean((2, 3)) @ p["head.weight"].T + p["head.bias"]

    def loss(p, x, y):
        logits = forward(p, x, train=True)
        return jnp.mean(jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, y[:, None], -1)[:, 0])

    @jax.jit
    def step(p, x, y):
        value, g = jax.value_and_grad(loss)(p, x, y)
        return jax.tree_util.tree_map(lambda a, b: a - 0.01 * b, p, g), value

    fwd = jax.jit(lambda p, x: forward(p, x))
    return params, (lambda x: fwd(params, x).block_until_ready()), step


# -- timing ------------------------------------------------------------------------------------
def interleaved(contestants: dict, rounds: int) -> dict:
    times = {k: [] for k in contestants}
    for fn in contestants.values():
        fn()                                              # warm up (JIT, first dispatch)
    for _ in range(rounds):
        for k, fn in contestants.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: (float(np.median(v)), float(np.min(v))) for k, v in times.items()}


def report(title, results, base="jax"):
    print(f"\n{title}")
    for k, (med, mn) in results.items():
        ratio = ""
        if base in results and k != base:
            ratio = f"   {med / results[base][0]:.2f}x / {mn / results[base][1]:.2f}x {base}'s"
        print(f"  {k:28s} median {med * 1e3:9.2f} ms   min {mn * 1e3:9.2f} ms{ratio}")


def print_kernels(exe):
    """Which kernel-table row each ternary matmul (one per BitConv2d) got, from the
    `ternary` stage's IR: K (the patch length C_in * kernel), N and the strategy."""
    print("kernels of the ternary matmuls (K = C_in * kh * kw, N = C_out):")
    for line in exe.ir("ternary").splitlines():
        if '"tern.ternary_matmul"' in line:
            k, n, s = (re.search(pat, line).group(1) for pat in
                       (r"k = (\d+)", r"n = (\d+)", r'strategy = "([\w-]+)"'))
            print(f"  K {k:>5s}  N {n:>4s}  {s}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--train", action="store_true", help="also time a training step (long compile)")
    args = ap.parse_args(argv)
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"{open('/proc/cpuinfo').read().split('model name')[1].split(':')[1].splitlines()[0].strip()}"
          if os.path.exists("/proc/cpuinfo") else platform.processor())
    nn.manual_seed(0)
    model = ResNet(args.blocks)
    rng = np.random.default_rng(0)
    x32 = rng.standard_normal((32, 3, args.size, args.size)).astype(np.float32)
    y32 = (np.arange(32) % 10).astype(np.int32)
    model(x32)                      # running statistics for eval
    model.eval()
    t = time.perf_counter()
    exe = tc.compile(model, tc.spec(("B", 3, args.size, args.size)))
    print(f"tercomp forward compile: {time.perf_counter() - t:.1f} s")
    print_kernels(exe)
    try:
        import jax  # noqa: F401
        params, jax_fwd, jax_step = jax_functions(model)
    except ImportError:
        print("jax is not installed (pip install jax): tercomp alone")
        params = jax_fwd = jax_step = None
    try:
        import torch
    except ImportError:
        torch = None
    for batch in (1, 32):
        x = x32[:batch]
        runs = {"tercomp (packed ternary)": lambda x=x: exe(x)}
        if jax_fwd is not None:
            runs["jax"] = lambda x=x: jax_fwd(x)
        if torch is not None:
            runs["pytorch (eager, f32)"] = _torch_forward(torch, model, x)
        report(f"forward, batch {batch}, {args.size}x{args.size}", interleaved(runs, args.rounds))

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "resnet.tcm")
        exe.save(path)
        packed = sum(m.out_channels * -(-m.weight[0].size // 4) for m in _bitconvs(model))
        import artifact_memory      # bench/artifact_memory.py
        rows = artifact_memory.measure(path, (3, args.size, args.size), (1,))
        act = artifact_memory.conv_activations(model, (3, args.size, args.size), 1)
        grown = rows["b1"]["VmRSS"] - rows["runtime"]["VmRSS"]
        own = grown - act
        # the rule of bench/artifact_memory.py and tests/test_artifacts.py: a fresh
        # process's VmRSS growth over a weightless artifact's load and call (the IREE
        # runtime), after a batch-1 call, less the activations the model needs
        # (artifact_memory.conv_activations), against the 2-bit weights
        print(f"\nresident memory of the loaded artifact after a batch-1 call: {own:.2f} MiB, "
              f"{own * 2**20 / packed:.2f}x the {packed / 2**20:.2f} MiB of packed conv weights "
              f"(goal <= 1.2x): the growth {grown:.2f} MiB over the IREE runtime's fixed cost "
              f"({rows['runtime']['VmRSS'] - rows['start']['VmRSS']:.1f} MiB a process) less "
              f"the activations the model needs ({act:.2f} MiB: each conv's int8 patches and "
              f"f32 output, the input and output); bench/artifact_memory.py --conv: by step")

    if args.train:
        model.train()
        t = time.perf_counter()
        step = tc.compile_train_step(loss_fn, model, tc.optim.SGD(0.01), x32, y32)
        print(f"\ntercomp training step compile: {time.perf_counter() - t:.1f} s")
        runs = {"tercomp": lambda: step(x32, y32)}
        if jax_step is not None:
            state = {"p": params}

            def jstep():
                state["p"], v = jax_step(state["p"], x32, y32)
                v.block_until_ready()
            runs["jax"] = jstep
        report(f"training step, batch 32, {args.size}x{args.size}", interleaved(runs, args.rounds))


def _bitconvs(model):
    out = [model.stem]
    for blk in model.layers:
        out += [blk.conv1, blk.conv2] + ([blk.down] if blk.down is not None else [])
    return out


def _torch_forward(torch, model, x):
    import torch.nn.functional as F
    p = {k: torch.from_numpy(np.asarray(v)) for k, v in {**model.parameters(), **model.buffers()}.items()}
    xt = torch.from_numpy(x)

    def bn(name, h):
        return F.batch_norm(h, p[f"{name}.running_mean"], p[f"{name}.running_var"], p[f"{name}.weight"],
                            p[f"{name}.bias"], False, 0.0, 1e-5)

    @torch.no_grad()
    def run():
        h = F.relu(bn("bn", F.conv2d(xt, p["stem.weight"], padding=1)))
        for i, blk in enumerate(model.layers):
            n, s = f"layers.{i}", blk.conv1.stride[0]
            o = F.relu(bn(f"{n}.bn1", F.conv2d(h, p[f"{n}.conv1.weight"], stride=s, padding=1)))
            o = bn(f"{n}.bn2", F.conv2d(o, p[f"{n}.conv2.weight"], padding=1))
            short = h if blk.down is None else bn(f"{n}.bn_down", F.conv2d(h, p[f"{n}.down.weight"], stride=s))
            h = F.relu(o + short)
        return h.mean((2, 3)) @ p["head.weight"].T + p["head.bias"]
    return run


if __name__ == "__main__":
    main(sys.argv[1:])
