"""Fine-tune a stored ternary language model on a text, save it, and generate from it.

    python samples/tiny_lm.py --out tiny.gguf          # a model to start from
    python samples/finetune_lm.py tiny.gguf --out tuned.gguf   # ~11 s on a 2-vCPU Xeon VM
    python samples/finetune_lm.py model.gguf --text notes.txt --freeze embed_tokens \\
        --out tuned.gguf --hf-out tuned_hf
    tercomp generate tuned.gguf --prompt "def "

MODEL is any file `models.load` reads: a `bitnet` or llama-architecture 1.58-bit GGUF
(the one tiny_lm.py saves, BitNet b1.58 2B4T, Falcon3-*-1.58bit) or a Hugging Face
directory. `models.load(MODEL, trainable=True, freeze=...)` gives float latent weights
that quantize back to exactly the stored ternary codes and scales, so training starts
from the stored model's function; `tc.compile_train_step` trains them through the
straight-through estimators (with the embedding and norms, less what `--freeze`
names); `step.sync_to(lm)` writes them back; `models.save_gguf` (and `models.save_hf`)
store the result as ternary again. The text (default: the standard library's `json`
package) is tokenized with the model's tokenizer (one token per byte for a 256-token
model without one); its last tenth is held out, and its loss is shown before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import tercomp as tc
from tercomp import models


def default_text() -> str:
    """The standard library's json package: Python, but not what tiny_lm.py trained on."""
    root = os.path.dirname(json.__file__)
    parts = []
    for name in ("__init__.py", "decoder.py", "encoder.py", "scanner.py"):
        with open(os.path.join(root, name), encoding="utf-8") as fh:
            parts.append(fh.read())
    return "\n".join(parts)


def tokenize(lm, text: str) -> np.ndarray:
    if lm.tokenizer is not None:
        return np.array(lm.tokenizer.encode(text).ids, np.int32)
    if lm.config.vocab_size == 256:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
    raise SystemExit("the model has no tokenizer and is not byte-level (256 tokens)")


def loss_fn(lm, x, y):
    logits = lm(x)
    return tc.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def windows(ids, seq, n):
    """`n` (x, y) windows of `seq` tokens, evenly spread over `ids`."""
    starts = np.linspace(0, len(ids) - seq - 1, n).astype(int)
    chunk = ids[starts[:, None] + np.arange(seq + 1)[None, :]]
    return chunk[:, :-1], chunk[:, 1:]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a .gguf file or a Hugging Face directory")
    ap.add_argument("--text", help="a UTF-8 text file (default: the stdlib's json package)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seconds", type=float, default=60.0, help="stop training after N s")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128, help="window (at most the model's context)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--freeze", action="append", default=[], metavar="PATTERN",
                    help="keep parameters matching PATTERN fixed (repeatable): "
                         "embed_tokens, layers.0, '*norm*', ...")
    ap.add_argument("--out", default="tuned.gguf", help="GGUF to write")
    ap.add_argument("--hf-out", help="also write a Hugging Face directory here")
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--tokens", type=int, default=60, help="tokens to generate")
    ap.add_argument("--temperature", type=float, default=0.6, help="0: greedy")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    lm = models.load(args.model, trainable=True, freeze=args.freeze or None)
    cfg = lm.config
    seq = min(args.seq, cfg.max_position_embeddings)
    if args.text:
        with open(args.text, encoding="utf-8") as fh:
            text = fh.read()
    else:
        text = default_text()
    ids = tokenize(lm, text)
    split = int(0.9 * len(ids))
    train, held = ids[:split], ids[split:]
    if len(held) < seq + 1:
        raise SystemExit(f"the text is too short: {len(ids)} tokens, the held-out tenth needs "
                         f"more than {seq}")
    print(f"{args.model}: {cfg.family}, {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, vocab {cfg.vocab_size}; {len(lm.parameters())} trainable "
          f"arrays ({sum(np.size(v) for v in lm.parameters().values()) / 1e6:.2f} M values)")
    print(f"text: {len(ids)} tokens, the last {len(held)} held out")

    # the held-out loss: one compiled function taking the model as an argument, so its
    # weights are inputs and the same module scores the model before and after training
    hx, hy = windows(held, seq, max(1, min(8, len(held) // seq)))
    evaluate = tc.compile(loss_fn, lm, hx, hy)
    before = float(evaluate(lm, hx, hy))
    print(f"held-out loss before: {before:.3f} nats/token")

    rng = np.random.default_rng(args.seed)
    opt = tc.optim.AdamW(lr=tc.optim.cosine(args.lr, total_steps=args.steps,
                                            warmup_steps=min(10, args.steps // 10)),
                         weight_decay=0.0)
    x0, y0 = windows(train, seq, args.batch)
    t0 = time.perf_counter()
    step = tc.compile_train_step(loss_fn, lm, opt, x0, y0, clip_norm=1.0)
    print(f"compiled the training step in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    for i in range(args.steps):
        start = rng.integers(0, len(train) - seq - 1, size=args.batch)
        chunk = train[start[:, None] + np.arange(seq + 1)[None, :]]
        loss = step(chunk[:, :-1], chunk[:, 1:])
        if i % 10 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {loss:.3f}  ({time.perf_counter() - t0:.0f} s)")
        if time.perf_counter() - t0 > args.seconds:
            print(f"stopping after {i + 1} steps: the --seconds budget is spent")
            break
    step.sync_to(lm)
    after = float(evaluate(lm, hx, hy))
    print(f"held-out loss after:  {after:.3f} nats/token (before {before:.3f})")

    models.save_gguf(lm, args.out)
    print(f"saved {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB)")
    if args.hf_out:
        models.save_hf(lm, args.hf_out)
        print(f"saved {args.hf_out}/")

    back = models.load(args.out)
    gen = tc.compile_lm(back, max_seq=seq)
    prompt = tokenize(back, args.prompt)
    new = gen.generate(prompt, min(args.tokens, seq - len(prompt)),
                       temperature=args.temperature, seed=args.seed)
    print(f"--- {args.out} continues {args.prompt!r} (temperature {args.temperature}) ---")
    out = gen.decode_text(new) if back.tokenizer is not None else \
        bytes(int(t) for t in new).decode("utf-8", errors="replace")
    print(args.prompt + out)
    return before, after


if __name__ == "__main__":
    main(sys.argv[1:])
