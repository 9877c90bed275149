"""`tercomp perplexity`: a language model's perplexity on a text, as llama.cpp's
`llama-perplexity` computes it (runtime/scoring.py has the rule).

    tercomp perplexity MODEL --text FILE [--ctx N] [--bos ID | --no-bos] [--kv-dtype ...]
                       [--target T] [--threads N] [--device D]

MODEL is a .gguf file, a Hugging Face directory (compiled with a cache of --ctx
positions) or an LM artifact (.tcm) whose cache holds at least --ctx. Without --ctx,
chunks are 512 tokens, or the model's cache length if that is smaller. The text is
tokenized with the model's tokenizer; the BOS that starts each chunk is the one
llama.cpp adds for the model: a GGUF's `tokenizer.ggml.add_bos_token` and bos id (or
llama.cpp's default for its vocabulary type), else the tokenizer's own special tokens;
`--bos ID` / `--no-bos` override it. The text is checked against the model (a tokenizer,
at least 2 * ctx tokens) before anything is compiled. Prints the chunks scored to stderr
and `PPL = x +/- e` to stdout.
"""
from __future__ import annotations

import sys

import numpy as np

from ..errors import ConfigError, InputError, UnsupportedError
from ..runtime.files import read_regular
from ..runtime.scoring import perplexity
from .base import UsageError, check_text, is_artifact, positive_int, spinner
from .model import open_model

#: llama-perplexity's usual context for published figures (wikitext-2 at -c 512)
DEFAULT_CTX = 512


def add_parser(sub):
    """Add the `perplexity` command to the subparsers `sub`."""
    p = sub.add_parser("perplexity", help="a language model's perplexity on a text file",
                       description="Perplexity of MODEL (.gguf, Hugging Face directory, LM "
                                   ".tcm) on FILE as llama.cpp's llama-perplexity computes it: "
                                   "chunks of --ctx tokens, the second half of each scored.")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text file to score")
    p.add_argument("--ctx", type=positive_int, metavar="N",
                   help=f"tokens per chunk (default {DEFAULT_CTX}, or the model's cache if "
                        f"smaller); the text needs 2N tokens")
    bos = p.add_mutually_exclusive_group()
    bos.add_argument("--bos", type=int, metavar="ID", help="the token that starts each chunk")
    bos.add_argument("--no-bos", action="store_true", help="keep each chunk's first token")
    p.add_argument("--kv-dtype", choices=["float16", "float32"],
                   help="KV cache element type when compiling (default float16)")
    p.add_argument("--target", action="append", metavar="T",
                   help="llvm-cpu (default), llvm-cpu-generic, vulkan, cuda")
    p.add_argument("--vulkan-target", metavar="NAME", help="Vulkan target")
    p.add_argument("--cuda-target", metavar="NAME", help="CUDA target, default sm_80")
    p.add_argument("--threads", type=positive_int, help="local-task thread count")
    p.add_argument("--device", help="local-task, local-sync, vulkan or cuda")
    p.add_argument("--no-cache", action="store_true", help="do not use the compile cache")
    p.set_defaults(run=run)
    return p


def _text(path: str) -> str:
    try:
        return read_regular(path, "text", InputError).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"--text {path}: not UTF-8 text ({e.reason} at byte "
                         f"{e.start})") from None


def _bos(args, tokenizer, text: str):
    """(the BOS id each chunk starts with or None, the text's tokens as llama.cpp's
    common_tokenize with special tokens gives them: BOS first when there is one)."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if args.no_bos:
        return None, ids
    if args.bos is not None:
        return args.bos, [args.bos] + ids
    if args.model.endswith(".gguf"):
        # loaded on first use, as cli.model loads models: the GGUF's scalar keys only
        from ..models.gguf_scan import scan
        from ..models.tokenizer import gguf_bos
        bos = gguf_bos(scan(args.model), args.model)
    else:                   # the tokenizer's post-processor (tokenizer.json) adds its BOS
        head = tokenizer.encode(text[:64], add_special_tokens=True).ids
        plain = tokenizer.encode(text[:64], add_special_tokens=False).ids
        bos = head[0] if head and head[1:len(plain) + 1] == plain and len(head) > len(plain) \
            else None
    return bos, ([bos] if bos is not None else []) + ids


def run(args) -> int:
    if args.ctx is not None and args.ctx < 2:
        raise UsageError(f"--ctx must be at least 2, got {args.ctx}")
    if args.bos is not None and args.bos < 0:
        raise UsageError(f"--bos must be a token id (>= 0), got {args.bos}")
    check_text(args.model, "MODEL")
    check_text(args.text, "--text")
    text = _text(args.text)
    made = {}

    def check(tokenizer, template, vocab, max_seq, compiled):
        """The text against the model, before a compile: a tokenizer, a BOS in the
        vocabulary, --ctx within the cache and 2 * ctx tokens."""
        if tokenizer is None:
            raise UnsupportedError(f"{args.model} has no tokenizer, so it cannot read --text",
                                   hint="a GGUF with a tokenizer.ggml vocabulary, or a Hugging Face "
                                        "directory with tokenizer.json")
        ctx = args.ctx or min(DEFAULT_CTX, max_seq)
        if ctx > max_seq:
            raise ConfigError(f"--ctx {ctx} is more than {args.model}'s cache of {max_seq} "
                              f"positions", hint=f"pass --ctx {max_seq} or less")
        bos, tokens = _bos(args, tokenizer, text)
        if bos is not None and not 0 <= bos < vocab:
            raise ConfigError(f"the BOS id {bos} is out of range for a vocabulary of {vocab}")
        if len(tokens) < 2 * ctx:
            raise InputError(f"--text {args.text} is {len(tokens)} tokens; a context of {ctx} "
                             f"needs at least {2 * ctx} (llama-perplexity's rule)",
                             hint="give a longer text or a smaller --ctx")
        if not compiled:
            args.max_seq = ctx          # the cache the chunks need, no more
        made.update(ctx=ctx, bos=bos, tokens=tokens)

    # compiled with a cache of --ctx positions (the model's default cache without it)
    args.max_seq = None if is_artifact(args.model) else args.ctx
    gen = open_model(args, check, max_seq_flag="--ctx")
    ctx, bos, tokens = made["ctx"], made["bos"], made["tokens"]
    with spinner(f"scoring {len(tokens)} tokens in chunks of {ctx}"):
        r = perplexity(gen, np.array(tokens, np.int64), ctx, bos)
    print(f"{r['chunks']} chunks of {r['n_ctx']} tokens, {r['count']} scored, BOS "
          f"{bos if bos is not None else 'none'}", file=sys.stderr)
    print(f"PPL = {r['ppl']:.4f} +/- {r['ppl_error']:.5f}")
    return 0
