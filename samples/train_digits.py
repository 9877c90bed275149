"""Train a ternary (BitLinear) MLP on scikit-learn's digits with a compiled training step,
then compile the trained model for inference and report its test accuracy.

    python samples/train_digits.py                       # ~10 s on 2 cores
    python samples/train_digits.py --epochs 60 --plot loss.png
    python samples/train_digits.py --seconds 20          # cap training time
    mpiexec -n 2 python samples/train_digits.py --data-parallel   # 2 ranks, half batches each

The data set (1797 8x8 images of the digits 0-9) ships with scikit-learn: no download.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import tercomp as tc
from tercomp import nn

HAVE_BITLINEAR = hasattr(nn, "BitLinear")


class MLP(nn.Module):
    """64 -> hidden -> hidden -> 10; BitLinear hidden layers, a full-precision head."""

    def __init__(self, hidden=256):
        layer = nn.BitLinear if HAVE_BITLINEAR else nn.Linear
        self.fc1 = layer(64, hidden)
        self.fc2 = layer(hidden, hidden)
        self.head = nn.Linear(hidden, 10)

    def forward(self, x):
        h = tc.relu(self.fc1(x))
        h = tc.relu(self.fc2(h))
        return self.head(h)


def loss_fn(model, x, y):
    logits = model(x)
    loss = tc.cross_entropy(logits, y)
    acc = tc.mean(tc.cast(tc.equal(tc.argmax(logits, axis=-1), y), "float32"))
    return loss, {"accuracy": acc}


def load_data(seed=0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    mean, std = x_tr.mean(0), x_tr.std(0) + 1e-3      # some pixels are always 0
    return (x_tr - mean) / std, y_tr, (x_te - mean) / std, y_te


def _plot(losses, path):
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed (pip install -e '.[samples]'): no plot written to {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(np.arange(1, len(losses) + 1), losses, lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title("digits, BitLinear MLP" if HAVE_BITLINEAR else "digits, Linear MLP")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curve written to {path}")


def _agree(data_parallel, flag) -> bool:
    """Rank 0's `flag` on every rank (one small broadcast) when data parallel."""
    if not data_parallel:
        return flag
    return bool(tc.distributed.init().broadcast(np.array([flag], np.int8), "--seconds")[0])


def main(argv=None) -> float | None:
    """Train and evaluate; returns the test accuracy of the compiled inference artifact
    (None on ranks other than 0 with --data-parallel)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=None, help="stop training after N seconds")
    ap.add_argument("--plot", metavar="PNG", default=None, help="write a loss curve (matplotlib)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    ap.add_argument("--data-parallel", action="store_true",
                    help="under mpiexec -n N: each rank trains on 1/N of every batch")
    args = ap.parse_args(argv)
    # Data parallel: every rank draws the same batches (same seed) and takes its slice;
    # the step averages the gradients over ranks, and rank 0 alone prints and evaluates.
    rank, ranks = ((tc.distributed.rank(), tc.distributed.world_size()) if args.data_parallel
                   else (0, 1))
    if args.batch % ranks:
        raise SystemExit(f"--batch {args.batch} does not split into {ranks} equal shards")
    shard = args.batch // ranks
    log = print if rank == 0 else (lambda *a, **k: None)

    if not HAVE_BITLINEAR:
        log("nn.BitLinear is not available in this tercomp: training a full-precision "
              "Linear MLP instead")
    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    nn.manual_seed(args.seed)
    model = MLP(args.hidden)
    steps_per_epoch = len(x_tr) // args.batch
    total = args.epochs * steps_per_epoch
    opt = tc.optim.AdamW(lr=tc.optim.cosine(args.lr, total_steps=total,
                                            warmup_steps=min(50, total // 10)),
                         weight_decay=1e-4)
    t0 = time.perf_counter()
    step = tc.compile_train_step(loss_fn, model, opt, x_tr[:shard], y_tr[:shard],
                                 clip_norm=1.0, data_parallel=args.data_parallel)
    t_compile = time.perf_counter() - t0
    if args.data_parallel:
        log(f"data parallel: {ranks} rank(s), {shard} of each batch of {args.batch} per rank")

    from tqdm import tqdm
    rng = np.random.default_rng(args.seed)
    losses = []
    t0 = time.perf_counter()
    # a progress bar only on a terminal: piped into a log it would print a line per update
    bar = tqdm(total=total, disable=args.quiet or rank != 0 or not sys.stderr.isatty(),
               unit="step", desc="train")
    out_of_time = False
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_tr))
        for i in range(steps_per_epoch):
            idx = order[i * args.batch:(i + 1) * args.batch][rank * shard:(rank + 1) * shard]
            loss, metrics = step(x_tr[idx], y_tr[idx])
            losses.append(loss)
            bar.update(1)
            if i % 10 == 0:
                bar.set_postfix(epoch=epoch, loss=f"{loss:.3f}", acc=f"{metrics['accuracy']:.2f}")
            # (every rank must stop at the same step: rank 0's clock decides)
            if args.seconds is not None and _agree(args.data_parallel,
                                                   time.perf_counter() - t0 > args.seconds):
                out_of_time = True
                break
        if out_of_time or step.stopped:
            break
    bar.close()
    t_train = time.perf_counter() - t0
    if rank != 0:
        return None

    step.sync_to(model)
    ternary = {"ternary": "auto"} if HAVE_BITLINEAR else {}
    exe = tc.compile(model, tc.spec(("B", 64), "float32"), **ternary)
    pred = np.asarray(exe(x_te)).argmax(-1)
    acc = float((pred == y_te).mean())
    kind = "ternary (packed BitLinear)" if HAVE_BITLINEAR else "full-precision"
    print(f"{len(losses)} steps in {t_train:.1f} s ({len(losses) / max(t_train, 1e-9):.0f} steps/s; "
          f"compile {t_compile:.1f} s); final loss {losses[-1]:.4f}")
    print(f"test accuracy of the compiled {kind} model: {acc:.4f} ({len(y_te)} images)")
    if args.plot:
        _plot(losses, args.plot)
    return acc


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
