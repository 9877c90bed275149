"""Train a small Mamba-style model (selective SSM blocks with ternary BitLinear
projections) on selective copying, with a compiled training step, then report its
accuracy on fresh sequences with the compiled (ternary-packed) model.

    python samples/ssm.py                      # about a minute on 2 cores
    python samples/ssm.py --steps 600 --accumulate-calls 2

Selective copying: a sequence of `context` positions holds `k` data tokens at random
places among blanks, followed by `k` markers; at the markers the model must output the
data tokens in order. Which positions matter depends on the input, so a linear
time-invariant recurrence cannot solve it: the input-dependent step size of the
selective SSM lets the state keep the data tokens and skip the blanks.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import tercomp as tc
from tercomp import nn

BLANK, MARKER, FIRST_DATA = 0, 1, 2


def make_batch(rng, batch, context, k, n_data):
    """ids [batch, context + k] int32 and the targets [batch, k] int32."""
    ids = np.full((batch, context + k), BLANK, np.int32)
    ids[:, context:] = MARKER
    targets = rng.integers(FIRST_DATA, FIRST_DATA + n_data, (batch, k)).astype(np.int32)
    for b in range(batch):
        pos = np.sort(rng.choice(context, k, replace=False))
        ids[b, pos] = targets[b]
    return ids, targets


class CopyModel(nn.Module):
    def __init__(self, vocab, d_model=32, d_state=8, layers=2):
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = [nn.MambaBlock(d_model, d_state=d_state) for _ in range(layers)]
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h))


def make_loss(k):
    def loss_fn(model, ids, targets):
        logits = model(ids)                                   # [B, L, vocab]
        out = logits[:, -k:, :]                               # the marker positions
        vocab = out.shape[-1]
        flat, labels = tc.reshape(out, (-1, vocab)), tc.reshape(targets, (-1,))
        loss = tc.cross_entropy(flat, labels)
        acc = tc.mean(tc.cast(tc.equal(tc.argmax(flat, axis=-1), labels), "float32"))
        return loss, {"accuracy": acc}
    return loss_fn


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=16)
    ap.add_argument("--k", type=int, default=3, help="data tokens to copy")
    ap.add_argument("--data-tokens", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--accumulate-calls", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    nn.manual_seed(args.seed)
    vocab = FIRST_DATA + args.data_tokens
    model = CopyModel(vocab)
    length = args.context + args.k
    t0 = time.time()
    step = tc.compile_train_step(
        make_loss(args.k), model, tc.optim.AdamW(args.lr, weight_decay=0.0),
        tc.spec((args.batch, length), "int32"), tc.spec((args.batch, args.k), "int32"),
        accumulate_calls=args.accumulate_calls, clip_norm=1.0)
    print(f"compiled the training step in {time.time() - t0:.1f} s "
          f"({sum(v.size for v in model.parameters().values())} parameters, sequence length {length})")
    t0, window = time.time(), []
    for i in range(1, args.steps * args.accumulate_calls + 1):
        ids, targets = make_batch(rng, args.batch, args.context, args.k, args.data_tokens)
        loss, metrics = step(ids, targets)
        window.append((loss, metrics["accuracy"]))
        if i % (50 * args.accumulate_calls) == 0:
            l, a = np.mean(window, axis=0)
            print(f"call {i:5d}  update {step.steps:4d}  loss {l:.3f}  accuracy {a:.2f}  "
                  f"({(time.time() - t0) / i * 1e3:.0f} ms/call)")
            window = []
    step.sync_to(model)

    exe = tc.compile(model, tc.spec(("B", length), "int32"))       # ternary-packed inference
    ids, targets = make_batch(np.random.default_rng(args.seed + 1), 512, args.context, args.k,
                              args.data_tokens)
    pred = np.argmax(exe(ids)[:, -args.k:, :], axis=-1)
    acc = float(np.mean(pred == targets))
    chance = 1.0 / args.data_tokens
    print(f"held-out accuracy {acc:.3f} per token, {np.mean(np.all(pred == targets, 1)):.3f} per "
          f"sequence (chance {chance:.2f} per token)")
    return acc


if __name__ == "__main__":
    main()
