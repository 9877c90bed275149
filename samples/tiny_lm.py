"""Train a tiny byte-level BitNet b1.58 language model on Python's own source code.

    python samples/tiny_lm.py --out tiny.gguf    # ~17 s on a 2-vCPU Xeon VM
    python samples/tiny_lm.py --steps 600 --seconds 300 --plot loss.png --out tiny.gguf
    tercomp generate tiny.gguf --prompt "def " -n 60 --temperature 0.6

The text is a handful of modules of the standard library (no download). The model is a
`models.BitNetLM` (llama.cpp's `bitnet` graph: ternary BitLinear projections, sub-norms,
RoPE, GQA) over a byte vocabulary (token i is byte i; see `byte_tokenizer`), trained with
`tc.compile_train_step`. It is saved with `models.save_gguf` (TQ2_0) together with its
byte-level tokenizer (a GGUF "gpt2" vocabulary), so the file takes text prompts, in
tercomp and in llama.cpp; it is loaded back with `models.load` and continues a prompt through
`tc.compile_lm` (the KV-cache generator). `samples/finetune_lm.py` fine-tunes the file.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

import tercomp as tc
from tercomp import models, nn
from tercomp.models.tokenizer import Tokenizer

VOCAB = 257     # the 256 bytes and the one merge of byte_tokenizer
FILES = ("textwrap.py", "string.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py",
         "heapq.py", "colorsys.py", "keyword.py", "operator.py", "functools.py")


def load_text() -> bytes:
    """Some standard-library modules, concatenated, as bytes (the tokens are bytes)."""
    root = os.path.dirname(os.__file__)
    parts = []
    for name in FILES:
        path = os.path.join(root, name)
        if os.path.isfile(path):
            with open(path, "rb") as fh:
                parts.append(fh.read())
    if not parts:
        raise SystemExit(f"no standard-library sources found under {root}")
    return b"\n".join(parts)


def config(args) -> models.BitNetConfig:
    return models.BitNetConfig(vocab_size=VOCAB, hidden_size=args.hidden,
                               intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                               num_attention_heads=4, num_key_value_heads=2,
                               rope_theta=10000.0, hidden_act="silu",
                               max_position_embeddings=args.seq, tie_word_embeddings=True)


def loss_fn(lm, x, y):
    logits = lm(x)                                   # [B, T, VOCAB]
    return tc.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def batches(data, batch, seq, rng):
    while True:
        start = rng.integers(0, len(data) - seq - 1, size=batch)
        idx = start[:, None] + np.arange(seq + 1)[None, :]
        chunk = data[idx]
        yield chunk[:, :-1].astype(np.int32), chunk[:, 1:].astype(np.int32)


def byte_tokenizer() -> Tokenizer:
    """Token i is byte i (i < 256): a byte-level BPE whose vocabulary lists GPT-2's
    printable stand-ins of the 256 bytes in byte order, written to the GGUF as a "gpt2"
    vocabulary. llama.cpp refuses such a vocabulary without merges, so it has one, of
    two NUL bytes (token 256, which text never produces)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models as tm, pre_tokenizers
    printable = [b for r in ((33, 127), (161, 173), (174, 256)) for b in range(*r)]
    char = {b: chr(b) for b in printable}
    char.update({b: chr(256 + i) for i, b in enumerate(x for x in range(256) if x not in char)})
    vocab = {char[b]: b for b in range(256)}
    vocab[char[0] * 2] = 256
    tok = HFTokenizer(tm.BPE(vocab, [(char[0], char[0])]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return Tokenizer(tok)


def plot(losses, path) -> bool:
    """Write the loss curve to `path`; False (and a message) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed (pip install -e '.[samples]'): no loss curve "
              f"written to {path}")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(np.arange(1, len(losses) + 1), losses, lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title("tiny BitNet b1.58 LM on Python's standard library")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=220)
    ap.add_argument("--seconds", type=float, default=65.0, help="stop training after N s")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128, help="training window = context length")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=4e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", default="tiny_lm_loss.png", help="loss curve PNG")
    ap.add_argument("--out", default=None, help="GGUF path (default: a temporary file)")
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--tokens", type=int, default=120, help="bytes to generate")
    ap.add_argument("--temperature", type=float, default=0.6, help="0: greedy")
    args = ap.parse_args(argv)

    data = np.frombuffer(load_text(), dtype=np.uint8)
    split = int(0.95 * len(data))
    train, val = data[:split], data[split:]
    print(f"text: {len(data)} bytes from {len(FILES)} standard-library modules")

    nn.manual_seed(args.seed)
    lm = models.BitNetLM(config(args))
    opt = tc.optim.AdamW(lr=tc.optim.cosine(args.lr, total_steps=args.steps,
                                            warmup_steps=min(30, args.steps // 10)),
                         weight_decay=0.01)
    rng = np.random.default_rng(args.seed)
    it = batches(train, args.batch, args.seq, rng)
    x0, y0 = next(it)
    t0 = time.perf_counter()
    step = tc.compile_train_step(loss_fn, lm, opt, x0, y0, clip_norm=1.0)
    print(f"compiled the training step in {time.perf_counter() - t0:.1f} s")

    losses, t0 = [], time.perf_counter()
    for i in range(args.steps):
        x, y = next(it)
        losses.append(float(step(x, y)))
        if i % 25 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {losses[-1]:.3f}  ({time.perf_counter() - t0:.0f} s)")
        if time.perf_counter() - t0 > args.seconds:
            print(f"stopping after {i + 1} steps: the --seconds budget is spent")
            break
    step.sync_to(lm)
    print(f"loss: {np.mean(losses[:10]):.3f} (first 10 steps) -> {np.mean(losses[-10:]):.3f} "
          f"(last 10); a uniform guess is {np.log(VOCAB):.3f}")
    if args.plot and plot(losses, args.plot):
        print(f"loss curve written to {args.plot}")

    lm.tokenizer = byte_tokenizer()
    out = args.out or os.path.join(tempfile.mkdtemp(prefix="tiny_lm_"), "tiny_lm.gguf")
    models.save_gguf(lm, out)
    back = models.load(out)
    print(f"saved {out} ({os.path.getsize(out) / 1024:.0f} KiB, TQ2_0, with its byte-level "
          f"tokenizer) and loaded it back")

    gen = tc.compile_lm(back, max_seq=args.seq)
    xv = val[: args.seq].astype(np.int32)
    val_loss = next_byte_loss(gen.prefill(xv), xv)
    print(f"held-out loss of the loaded ternary model: {val_loss:.3f} nats/byte")
    prompt = back.tokenizer.encode(args.prompt).ids
    gen.reset()
    new = gen.generate(np.array(prompt, np.int32), min(args.tokens, args.seq - len(prompt)),
                       temperature=args.temperature, seed=args.seed)
    print(f"--- continuation of {args.prompt!r} (temperature {args.temperature}) ---")
    print(args.prompt + gen.decode_text(new))
    return losses, val_loss


def next_byte_loss(logits, ids) -> float:
    """Mean cross-entropy (nats) of ids[1:] under logits[:-1] ([T, vocab])."""
    logits = np.asarray(logits, np.float64)[:-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(ids) - 1), ids[1:]].mean())


if __name__ == "__main__":
    main(sys.argv[1:])
