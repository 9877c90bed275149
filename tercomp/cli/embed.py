"""`tercomp embed`: sentence embeddings of texts or token ids with an embedding model.

    tercomp embed MODEL (--text TEXT | --ids 1,2,3)... [--pooling last|mean|cls]
                  [--no-normalize] [--cosine] [--max-seq N] [--threads N] [--device D]
                  [-o OUT.npy]

MODEL is a .gguf file or a Hugging Face directory (BitNet's embedding models:
bitnet-embedding-0.6b, -270m). Each input's embedding goes to stdout as one JSON array
a line, in the order given; `--cosine` prints the matrix of their cosine similarities
instead. The pooling is the model file's unless `--pooling` says otherwise.
"""
from __future__ import annotations

import json

import numpy as np

from .base import UsageError, check_text, int_list, positive_int, spinner


def add_parser(sub):
    """Add the `embed` command to the subparsers `sub`."""
    e = sub.add_parser("embed", help="embed texts or token ids with an embedding model",
                       description="Compile MODEL (.gguf, Hugging Face directory) as an encoder "
                                   "and print each input's embedding.")
    e.add_argument("model", metavar="MODEL")
    e.add_argument("--text", action="append", default=[], metavar="TEXT",
                   help="a text to embed (needs the model's tokenizer); repeat for several")
    e.add_argument("--ids", action="append", default=[], metavar="IDS",
                   help="token ids to embed, comma-separated; repeat for several")
    e.add_argument("--pooling", choices=["last", "mean", "cls"],
                   help="how token states become one vector (default: the model file's, else last)")
    e.add_argument("--no-normalize", action="store_true", help="do not L2-normalise")
    e.add_argument("--cosine", action="store_true",
                   help="print the inputs' cosine similarity matrix instead of the embeddings")
    e.add_argument("--max-seq", type=positive_int, help="longest input in tokens "
                   "(default: the model's context, at most 2048)")
    e.add_argument("--threads", type=positive_int, help="local-task thread count")
    e.add_argument("--device", help="local-task, local-sync, vulkan or cuda")
    e.add_argument("--no-cache", action="store_true", help="do not use the compile cache")
    e.add_argument("-o", "--output", metavar="OUT.npy", help="also save the embeddings [N, hidden]")
    e.set_defaults(run=run)
    return e


def run(args) -> int:
    if not args.text and not args.ids:
        raise UsageError("give at least one --text or --ids to embed")
    for t in args.text:
        check_text(t, "--text")
    inputs = list(args.text) + [int_list(x, "--ids") for x in args.ids]
    import tercomp as tc            # the compiler side, loaded on first use
    from tercomp import models
    with spinner(f"loading {args.model}"):
        lm = models.load(args.model)
    enc = tc.compile_embed(lm, max_seq=args.max_seq, pooling=args.pooling,
                           normalize=not args.no_normalize, threads=args.threads,
                           device=args.device, cache=not args.no_cache)
    seqs = enc.sequences(inputs)    # checked (tokens, vocabulary, length) before compiling
    with spinner(f"compiling {args.model}"):    # only the padded lengths the inputs need
        out = enc.embed(seqs)
    if args.output:
        np.save(args.output, out)
    if args.cosine:
        unit = out / np.maximum(np.linalg.norm(out, axis=-1, keepdims=True), 1e-12)
        for row in unit @ unit.T:
            print(" ".join(f"{v:.6f}" for v in row))
    else:
        for row in out:
            print(json.dumps([float(f"{v:.7g}") for v in row]))
    return 0
