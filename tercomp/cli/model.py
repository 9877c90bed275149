"""The model the language-model commands (generate, serve, perplexity) work on.

MODEL is an LM artifact (.tcm), loaded through the runtime alone, or a .gguf file or
Hugging Face directory, loaded and compiled with tc.compile_lm (the compiler side is
imported then, not before): a process serving a saved model never loads the compiler.
`tercomp serve --embeddings` compiles the model's embedding encoder beside it
(open_model_and_encoder).
"""
from __future__ import annotations

import sys

from ..errors import ConfigError, MissingDependency
from ..runtime.loader import load
from .base import UsageError, is_artifact, spinner


def open_model(args, check=None, max_seq_flag="--max-seq"):
    """The generator for args.model (see _open)."""
    return _open(args, check, max_seq_flag)[0]


def open_model_and_encoder(args):
    """(the generator, the embedding encoder) of args.model, a .gguf file or Hugging
    Face directory: the encoder is tc.compile_embed's, over as many tokens as the
    generator's context, pooled as the model file says (`tercomp serve --embeddings`).
    A .tcm holds no encoder: a usage error, before anything is loaded."""
    if is_artifact(args.model):
        raise UsageError(f"--embeddings needs the model file: {args.model} is a saved "
                         f"generator and holds no embedding encoder (serve the .gguf or "
                         f"Hugging Face directory it was compiled from with --embeddings)")
    return _open(args, None, "--max-seq", embeddings=True)


def _open(args, check=None, max_seq_flag="--max-seq", embeddings=False):
    """The generator for args.model (`tercomp generate`'s, `serve`'s and `perplexity`'s
    flags): a .tcm is loaded, anything else loaded and compiled (with args.max_batch
    where the command has one). `check(tokenizer, chat template, vocab size, max_seq,
    compiled)` runs before the compile (after loading a .tcm). `max_seq_flag` is the
    flag that set args.max_seq, for the error when it exceeds the model's context.
    Returns (generator, encoder): the encoder (tc.compile_embed's) with `embeddings`,
    else None."""
    if is_artifact(args.model):
        gen = load(args.model, device=args.device, threads=args.threads)
        if not hasattr(gen, "generate"):
            raise ConfigError(f"{args.model} is an artifact of a function, not a language model",
                              hint="compile a model with `tercomp generate MODEL.gguf --save OUT.tcm`")
        template = gen.chat_template
        if template is not None and getattr(args, "chat", None) is not None:
            from ..runtime.chat import ChatTemplate
            template = ChatTemplate.from_dict(template)
        if check is not None:
            check(gen.tokenizer, template, gen.vocab_size, gen.max_seq, True)
        return gen, None
    try:
        import tercomp as tc
        from .. import models
        from ..generate import DEFAULT_MAX_SEQ
        compile_lm = tc.compile_lm
    except (AttributeError, ImportError):
        raise MissingDependency("compiling a model needs iree-base-compiler",
                                hint="pip install iree-base-compiler, or pass a saved .tcm") from None
    _check_build(args)
    with spinner(f"loading {args.model}"):
        lm = models.load(args.model)
    tok = getattr(lm, "tokenizer", None)
    ctx = lm.config.max_position_embeddings
    if args.max_seq is not None and args.max_seq > ctx:
        raise ConfigError(f"{max_seq_flag} {args.max_seq} is more than {args.model}'s context of "
                          f"{ctx} positions (max_position_embeddings)",
                          hint=f"pass {max_seq_flag} {ctx} or less")
    if check is not None:       # may set args.max_seq (the cache it needs), within ctx
        check(tok, getattr(tok, "chat_template", None), lm.config.vocab_size,
              args.max_seq or min(DEFAULT_MAX_SEQ, ctx), False)
    with spinner(f"compiling {args.model}"):
        gen = compile_lm(lm, max_seq=args.max_seq, kv_dtype=args.kv_dtype, device=args.device,
                         threads=args.threads, cache=not args.no_cache,
                         target=args.target or "llvm-cpu", vulkan_target=args.vulkan_target,
                         cuda_target=args.cuda_target, max_batch=getattr(args, "max_batch", None))
    if gen.exe.meta.get("cache_hit"):
        print("(compiled module from the compile cache)", file=sys.stderr)
    if not embeddings:
        return gen, None
    # its modules compile on first use, one per padded length (tc.compile_embed)
    enc = tc.compile_embed(lm, max_seq=gen.max_seq, pooling=None, device=args.device,
                           threads=args.threads, cache=not args.no_cache,
                           target=args.target or "llvm-cpu", vulkan_target=args.vulkan_target,
                           cuda_target=args.cuda_target)
    return gen, enc


def _check_build(args):
    """The target, device and threads flags, and --kv-dtype against the target, before
    a compile (compile_lm's own errors name its Python parameters)."""
    from ..build import BuildOptions
    if args.target and len(args.target) > 1:
        raise UsageError(f"--target given {len(args.target)} times: tercomp generate compiles "
                         f"for one target")
    opts = BuildOptions.resolve(args.target or "llvm-cpu", vulkan_target=args.vulkan_target,
                                cuda_target=args.cuda_target, device=args.device, threads=args.threads)
    narrow = [t for t in opts.targets if not t.stores_16bit]
    if narrow and args.kv_dtype == "float16":
        raise UsageError(f"--kv-dtype float16 needs 16-bit storage, which the {narrow[0].name} "
                         f"target {narrow[0].arch!r} does not have: leave --kv-dtype out (float32 "
                         f"there), or pass a --vulkan-target that stores f16")
