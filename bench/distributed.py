"""Data-parallel training over MPI: the share of a step that the gradient Allreduce takes
at 2 ranks on this machine, and an estimate of a 700M model's step on a real network.

    python bench/distributed.py               # runs its ranks under mpiexec -n 2
    python bench/distributed.py --steps 50

Two models, each trained with compile_train_step(data_parallel=True) on 2 ranks (half of
each batch per rank, one IREE thread per rank on a 2-core machine) and, for reference,
in one process on the whole batch with the fused step:

- the digits MLP of samples/train_digits.py (BitLinear 64 -> 256 -> 256 -> 10, batch 64);
- a 3-layer relu² BitNetLM (hidden 256, FFN 512, vocab 256, batch 6 x 96 tokens).

Per step: the wall time, the time inside the one Allreduce (it includes waiting for the
slower rank), and a bare Allreduce of the same buffer after a barrier (the transfer
alone). The estimate for the bitnet_b1_58-large shape (~728M parameters) assumes f32
gradients and a ring Allreduce, 2 (N - 1) / N x bytes over the link, and a step that
computes first and communicates after (tercomp's step does not overlap them).

What it shows on the 2-core development machine (shared, so the step times move by 2x
between runs): the bare Allreduce is small (0.07 ms of the MLP's 0.3 MiB, ~2-4 ms of the
LM's 7 MiB, a few % of a step), and most of the time a rank spends in the step's
Allreduce is waiting for the other rank to finish its backward pass. For a 700M model
the 2.9 GB of f32 gradients take 4.1-4.6 s per step over 10 Gb/s and 0.4-0.5 s over
100 Gb/s at 8-64 ranks: nothing against a CPU's step (tens of minutes), but the step
time itself on accelerators, where overlapping the Allreduce with the backward pass
or 16-bit gradients would be the next step.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import tercomp as tc  # noqa: E402
from tercomp import distributed, models, nn  # noqa: E402

LINKS_GBIT = (10, 25, 100)
RANKS = (8, 64)
LARGE = dict(layers=24, hidden=1536, ffn=4096, vocab=32002)     # bench/lm.py's default shape


class DigitsMLP(nn.Module):
    def __init__(self):
        self.fc1, self.fc2 = nn.BitLinear(64, 256), nn.BitLinear(256, 256)
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        return self.head(tc.relu(self.fc2(tc.relu(self.fc1(x)))))


def mlp_loss(model, x, y):
    return tc.cross_entropy(model(x), y)


def lm_loss(lm, x, y):
    return tc.cross_entropy(lm(x).reshape(-1, 256), y.reshape(-1))


def cases(rng):
    """(name, model, loss, x, y, tokens or examples per batch, model FLOPs per step)."""
    x = rng.standard_normal((64, 64)).astype(np.float32)
    y = rng.integers(0, 10, 64).astype(np.int32)
    nn.manual_seed(0)
    mlp = DigitsMLP()
    yield "digits MLP", mlp, mlp_loss, x, y
    cfg = models.BitNetConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                              hidden_act="relu2", rope_theta=10000.0, max_position_embeddings=96)
    nn.manual_seed(0)
    ids = rng.integers(0, 256, (6, 97)).astype(np.int32)
    yield "3-layer BitNet LM", models.BitNetLM(cfg), lm_loss, ids[:, :-1], ids[:, 1:]


def n_params(model) -> int:
    return sum(int(np.size(v)) for v in model.state_dict().values())


def time_steps(step, x, y, steps, warmup=5):
    for _ in range(warmup):
        step(x, y)
    t0 = time.perf_counter()
    for _ in range(steps):
        step(x, y)
    return (time.perf_counter() - t0) / steps


def worker(steps):
    """One rank: each case's data-parallel step, with its Allreduce timed."""
    world = distributed.init(timeout=600)
    threads = max(1, (os.cpu_count() or 1) // world.size)
    rows = []
    for name, model, loss, x, y in cases(np.random.default_rng(0)):
        m = len(x) // world.size
        xs, ys = x[world.rank * m:(world.rank + 1) * m], y[world.rank * m:(world.rank + 1) * m]
        step = tc.compile_train_step(loss, model, tc.optim.AdamW(1e-3), xs, ys, clip_norm=1.0,
                                     data_parallel=True, threads=threads)
        spent = []
        reduce = world.allreduce

        def timed(buf, what, reduce=reduce, spent=spent):
            t = time.perf_counter()
            out = reduce(buf, what)
            spent.append(time.perf_counter() - t)
            return out
        world.allreduce = timed
        t_step = time_steps(step, xs, ys, steps)
        world.allreduce = reduce
        in_step = float(np.mean(spent[-steps:]))
        buf = np.ones(step.layout.size, np.float32)
        bare = []
        for _ in range(max(steps, 20)):
            world.comm.Barrier()
            t = time.perf_counter()
            world.allreduce(buf, "bare Allreduce")
            bare.append(time.perf_counter() - t)
        rows.append(dict(name=name, params=n_params(model), bytes=int(buf.nbytes), step=t_step,
                         in_step=in_step, bare=float(np.median(bare)), threads=threads))
    if world.rank == 0:
        print(json.dumps(rows))


def single_process(steps):
    """Each case's fused step in this process, on the whole batch."""
    out = {}
    for name, model, loss, x, y in cases(np.random.default_rng(0)):
        step = tc.compile_train_step(loss, model, tc.optim.AdamW(1e-3), x, y, clip_norm=1.0)
        out[name] = time_steps(step, x, y, steps)
    return out


def memcpy_rate() -> float:
    """Bytes per second of a large host copy (the packed gradients cross it twice)."""
    a, b = np.ones(2 ** 25, np.float32), np.empty(2 ** 25, np.float32)
    np.copyto(b, a)
    t = time.perf_counter()
    for _ in range(5):
        np.copyto(b, a)
    return 5 * a.nbytes / (time.perf_counter() - t)


def large_params() -> int:
    """Parameters of bench/lm.py's default shape (bitnet_b1_58-large), tied embedding."""
    h, f, layers = LARGE["hidden"], LARGE["ffn"], LARGE["layers"]
    per_layer = 4 * h * h + 3 * h * f + 2 * h + h + f     # q k v o, gate up down, norms, sub-norms
    return layers * per_layer + LARGE["vocab"] * h + h


def estimate(lm_row):
    p = large_params()
    grad_bytes = 4 * p
    # this machine's training rate on the 3-layer LM, in model FLOPs (6 x params x tokens)
    tokens = 3 * 96                                            # per rank per step
    rate = 6 * lm_row["params"] * tokens / lm_row["step"]
    copy = 2 * grad_bytes / memcpy_rate()
    print(f"\nEstimate: bitnet_b1_58-large shape, {p / 1e6:.0f}M parameters, f32 gradients: "
          f"{grad_bytes / 2 ** 30:.2f} GiB Allreduced per step")
    print(f"  ring Allreduce time = 2 (N - 1) / N x {grad_bytes / 1e9:.2f} GB / link bandwidth:")
    print(f"  {'ranks':>6s} " + " ".join(f"{f'{g} Gb/s':>10s}" for g in LINKS_GBIT))
    for n in RANKS:
        cells = [2 * (n - 1) / n * grad_bytes / (g * 1e9 / 8) for g in LINKS_GBIT]
        print(f"  {n:6d} " + " ".join(f"{c:9.2f}s" for c in cells))
    compute = 6 * p * 8 * 1024 / rate
    print(f"  compute: this machine trained the 3-layer LM at {rate / 1e9:.1f} GFLOP/s per rank "
          f"(6 x params x tokens); at that rate one rank's step of 8 x 1024 tokens on the 700M "
          f"model takes ~{compute:.0f} s, plus ~{copy:.1f} s of host copies of the packed "
          f"gradients (device -> host -> device, {memcpy_rate() / 1e9:.1f} GB/s memcpy)")
    print(f"  {'ranks':>6s} " + " ".join(f"{f'{g} Gb/s':>18s}" for g in LINKS_GBIT) +
          "   (step time, Allreduce share)")
    for n in RANKS:
        cells = []
        for g in LINKS_GBIT:
            comm = 2 * (n - 1) / n * grad_bytes / (g * 1e9 / 8)
            total = compute + copy + comm
            cells.append(f"{total:8.0f}s ({100 * comm / total:4.1f}%)")
        print(f"  {n:6d} " + " ".join(f"{c:>18s}" for c in cells))
    # comm / (comm + compute) <= 10% when compute >= 9 x comm (comm at most 2 x bytes / link)
    need = {g: 9 * 2 * grad_bytes / (g * 1e9 / 8) for g in LINKS_GBIT}
    print("  the Allreduce stays under 10% of a step when a rank computes for at least "
          + ", ".join(f"{v:.0f} s at {g} Gb/s" for g, v in need.items()) +
          " (a GPU node computes 8 x 1024 tokens of this model in well under that: on fast "
          "hardware the link, not the compute, sets the step time, unless the Allreduce is "
          "overlapped with the backward pass or the gradients are sent in 16 bits)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.steps)
        return
    mpiexec = distributed.launcher()
    if distributed.mpi4py is None or mpiexec is None:
        raise SystemExit(f"needs mpi4py and mpiexec: {distributed.EXTRA}")
    print(f"{os.cpu_count()} CPUs; llvm-cpu, local-task; {args.steps} timed steps")
    one = single_process(args.steps)
    r = subprocess.run([mpiexec, "-n", "2", sys.executable, os.path.abspath(__file__),
                        "--worker", "--steps", str(args.steps)],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"the ranks failed:\n{r.stdout}\n{r.stderr[-3000:]}")
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    print(f"\n{'':20s} {'params':>8s} {'Allreduce':>10s} {'1 process':>10s} {'2 ranks':>9s} "
          f"{'Allreduce':>10s} {'share':>6s} {'bare':>9s}")
    print(f"{'':20s} {'':>8s} {'buffer':>10s} {'step':>10s} {'step':>9s} {'in step':>10s} "
          f"{'':>6s} {'Allreduce':>9s}")
    for row in rows:
        print(f"{row['name']:20s} {row['params'] / 1e3:7.0f}k {row['bytes'] / 2 ** 20:7.2f} MiB "
              f"{one[row['name']] * 1e3:7.2f} ms {row['step'] * 1e3:6.2f} ms "
              f"{row['in_step'] * 1e3:7.3f} ms {100 * row['in_step'] / row['step']:5.1f}% "
              f"{row['bare'] * 1e3:6.3f} ms")
    print(f"(1 process: the fused step on the whole batch with {os.cpu_count()} threads; 2 ranks: "
          f"half the batch each, {rows[0]['threads']} thread(s) per rank; 'Allreduce in step' "
          "includes waiting for the slower rank)")
    estimate(rows[-1])


if __name__ == "__main__":
    main(sys.argv[1:])
