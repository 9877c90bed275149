"""Train a ternary CNN (BitConv2d + BatchNorm + pooling) on scikit-learn's 8x8 digits with
a compiled training step, then compile the trained model for inference, its conv and
linear weights packed 2 bits each, and report the packed artifact's test accuracy.

    python samples/cnn_digits.py             # ~2 min on 2 cores (compile ~40 s), ~99% accuracy
    python samples/cnn_digits.py --ir        # also print conv2's packed ternary matmul

The data set (1797 8x8 images of the digits 0-9) ships with scikit-learn: no download.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import tercomp as tc
from tercomp import nn
from train_digits import load_data


class CNN(nn.Module):
    """[B, 1, 8, 8] -> BitConv2d 3x3 (32) -> BN -> ReLU -> BitConv2d 3x3 (64) -> BN -> ReLU
    -> 2x2 max pool -> BitConv2d 3x3 (64) -> BN -> ReLU -> global average -> Linear head."""

    def __init__(self, width=32):
        self.conv1 = nn.BitConv2d(1, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.BitConv2d(width, 2 * width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.pool = nn.MaxPool2d(2)
        self.conv3 = nn.BitConv2d(2 * width, 2 * width, 3, padding=1)
        self.bn3 = nn.BatchNorm2d(2 * width)
        self.head = nn.Linear(2 * width, 10)

    def forward(self, x):
        h = tc.relu(self.bn1(self.conv1(x)))
        h = self.pool(tc.relu(self.bn2(self.conv2(h))))
        h = tc.relu(self.bn3(self.conv3(h)))
        return self.head(tc.mean(h, axis=(2, 3)))           # global average pooling


def loss_fn(model, x, y):
    logits = model(x)
    acc = tc.mean(tc.cast(tc.equal(tc.argmax(logits, axis=-1), y), "float32"))
    return tc.cross_entropy(logits, y), {"accuracy": acc}


def main(argv=None) -> float:
    """Train and evaluate; returns the test accuracy of the packed ternary artifact."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ir", action="store_true", help="print the ternary stage's IR of conv2")
    args = ap.parse_args(argv)

    x_tr, y_tr, x_te, y_te = load_data(args.seed)
    x_tr, x_te = x_tr.reshape(-1, 1, 8, 8), x_te.reshape(-1, 1, 8, 8)
    nn.manual_seed(args.seed)
    model = CNN(args.width)
    steps_per_epoch = len(x_tr) // args.batch
    total = args.epochs * steps_per_epoch
    opt = tc.optim.AdamW(lr=tc.optim.cosine(args.lr, total_steps=total, warmup_steps=total // 10),
                         weight_decay=1e-4)
    t0 = time.perf_counter()
    step = tc.compile_train_step(loss_fn, model, opt, tc.spec(("B", 1, 8, 8)), tc.spec(("B",), "int32"),
                                 clip_norm=1.0)
    t_compile = time.perf_counter() - t0
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        order = rng.permutation(len(x_tr))
        for i in range(steps_per_epoch):
            idx = order[i * args.batch:(i + 1) * args.batch]
            loss, metrics = step(x_tr[idx], y_tr[idx])
    t_train = time.perf_counter() - t0

    step.sync_to(model)                       # weights and BatchNorm's running statistics
    model.eval()
    exe = tc.compile(model, tc.spec(("B", 1, 8, 8)), ternary="auto")
    acc = float((np.asarray(exe(x_te)).argmax(-1) == y_te).mean())
    packed = [line.strip() for line in exe.ir("ternary").splitlines() if "tern.ternary_matmul" in line]
    print(f"{total} steps in {t_train:.1f} s (compile {t_compile:.1f} s); final loss {loss:.4f}")
    print(f"{len(packed)} ternary matmuls in the artifact (the three BitConv2d layers, packed 2-bit)")
    print(f"test accuracy of the packed ternary CNN: {acc:.4f} ({len(y_te)} images)")
    if args.ir:
        print(next(line for line in packed if f"k = {9 * args.width} " in line))
    return acc


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
