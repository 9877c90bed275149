"""`tercomp generate`: compile (or load) a language model and stream generated tokens.

    tercomp generate MODEL (--prompt TEXT | --prompt-ids 1,2,3 | --chat TEXT) [-n 64] [--temperature T]
                     [--top-k K] [--top-p P] [--seed S] [--eos 2,3] [--max-seq N]
                     [--kv-dtype f16|f32] [--threads N] [--device D] [--save OUT.tcm]

MODEL is a .gguf file, a Hugging Face directory, or an LM artifact (.tcm, written by
`--save` or gen.save()). Tokens go to stdout as they are generated (text with a
tokenizer, ids without); the prefill and decode rates go to stderr at the end.
"""
from __future__ import annotations

import os
import sys

import numpy as np

from .errors import TercompError


def add_parser(sub, positive_int, run):
    """Add the `generate` command to the subparsers `sub`; `run(args)` executes it."""
    g = sub.add_parser("generate", help="generate tokens with a language model",
                       description="Compile MODEL (.gguf, Hugging Face directory) or load an LM "
                                   "artifact (.tcm) and stream the generated tokens.")
    g.add_argument("model", metavar="MODEL")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="prompt text (needs the model's tokenizer)")
    src.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, comma-separated")
    src.add_argument("--chat", metavar="TEXT", help="a user message, rendered with the model's "
                                                    "chat template (stops at its eos token)")
    g.add_argument("-n", "--max-new-tokens", type=positive_int, default=64, metavar="N",
                   help="tokens to generate (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    g.add_argument("--top-k", type=positive_int, help="sample among the K most likely tokens")
    g.add_argument("--top-p", type=float, help="sample from the smallest set with mass >= P")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    g.add_argument("--eos", metavar="IDS", help="stop after any of these token ids (comma-separated)")
    g.add_argument("--max-seq", type=positive_int, help="KV cache length when compiling "
                   "(default: the model's context, at most 2048)")
    g.add_argument("--kv-dtype", choices=["float16", "float32"],
                   help="KV cache element type when compiling (default float16; float32 for "
                        "the default Vulkan target, which has no 16-bit storage)")
    g.add_argument("--target", action="append", metavar="T",
                   help="llvm-cpu (default), llvm-cpu-generic, vulkan, cuda; repeat for several")
    g.add_argument("--vulkan-target", metavar="NAME", help="Vulkan target, default vp_android_baseline_2022")
    g.add_argument("--cuda-target", metavar="NAME", help="CUDA target, default sm_80")
    g.add_argument("--threads", type=positive_int, help="local-task thread count")
    g.add_argument("--device", help="local-task, local-sync, vulkan or cuda (default: the first "
                                    "present one the targets run on)")
    g.add_argument("--no-cache", action="store_true", help="do not use the compile cache")
    g.add_argument("--save", metavar="OUT.tcm", help="also save the compiled model")
    g.set_defaults(run=run)
    return g


def _int_list(text: str, what: str, usage_error) -> list:
    try:
        out = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise usage_error(f"{what} must be comma-separated integers, got {text!r}") from None
    if not out:
        raise usage_error(f"{what} is empty")
    return out


def _open(args, spinner):
    """An LMGenerator for args.model: a .tcm is loaded, anything else compiled."""
    from .runtime.loader import load
    if os.path.isfile(args.model) and not args.model.endswith(".gguf"):
        gen = load(args.model, device=args.device, threads=args.threads)
        if not hasattr(gen, "generate"):
            raise TercompError(f"{args.model} is an artifact of a function, not a language model",
                               hint="compile a model with `tercomp generate MODEL.gguf --save OUT.tcm`")
        return gen
    try:
        import tercomp as tc
        from . import models
        compile_lm = tc.compile_lm
    except (AttributeError, ImportError):
        raise TercompError("compiling a model needs iree-base-compiler",
                           hint="pip install iree-base-compiler, or pass a saved .tcm") from None
    with spinner(f"loading {args.model}"):
        lm = models.load(args.model)
    with spinner(f"compiling {args.model}"):
        gen = compile_lm(lm, max_seq=args.max_seq, kv_dtype=args.kv_dtype, device=args.device,
                         threads=args.threads, cache=not args.no_cache,
                         target=args.target or "llvm-cpu", vulkan_target=args.vulkan_target,
                         cuda_target=args.cuda_target, max_batch=getattr(args, "max_batch", None))
    if gen.exe.meta.get("cache_hit"):
        print("(compiled module from the compile cache)", file=sys.stderr)
    return gen


def _chat_prompt(gen, text: str):
    """(prompt ids, {eos id} or None) of one user message in the model's chat template."""
    if gen.tokenizer is None or gen.chat_template is None:
        raise TercompError("--chat needs the model's tokenizer and chat template, and this "
                           "model's files carry none", hint="pass --prompt TEXT instead")
    from .models.chat import ChatTemplate
    template = ChatTemplate.from_dict(gen.chat_template)
    rendered = template.render([{"role": "user", "content": text}], add_generation_prompt=True)
    ids = gen.tokenizer.encode(rendered, add_special_tokens=False).ids
    eos = gen.tokenizer.token_to_id(template.eos_token) if template.eos_token else None
    return np.array(ids, np.int64), ({eos} if eos is not None else None)


class _Stream:
    """Writes each new token as it comes: the new text of the decoded sequence (so
    multi-byte characters split over tokens print whole), or the id."""

    def __init__(self, gen):
        self.gen, self.ids, self.text = gen, [], ""

    def __call__(self, tok: int):
        self.ids.append(tok)
        if self.gen.tokenizer is None:
            sys.stdout.write(f"{tok} ")
        else:
            text = self.gen.decode_text(self.ids)
            if not text.endswith("\ufffd"):          # wait for the rest of a character
                sys.stdout.write(text[len(self.text):])
                self.text = text
        sys.stdout.flush()


def run(args, spinner, usage_error) -> int:
    eos = set(_int_list(args.eos, "--eos", usage_error)) if args.eos else None
    ids = _int_list(args.prompt_ids, "--prompt-ids", usage_error) if args.prompt_ids else None
    gen = _open(args, spinner)
    if args.save:
        gen.save(args.save)
        print(f"wrote {args.save}", file=sys.stderr)
    if args.chat is not None:
        prompt, chat_eos = _chat_prompt(gen, args.chat)
        eos = eos if eos is not None else chat_eos
    else:
        prompt = np.array(ids, np.int64) if ids is not None else gen.encode(args.prompt)
    if gen.tokenizer is not None and args.prompt is not None:
        sys.stdout.write(args.prompt)
    gen.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                 top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos=eos,
                 on_token=_Stream(gen))
    sys.stdout.write("\n")
    sys.stdout.flush()
    s = gen.stats
    rate = (lambda n, t: f"{n / t:.1f} tokens/s" if t > 0 and n else "n/a")
    print(f"prefill: {s['prefill_tokens']} tokens in {s['prefill_s']:.3f} s, "
          f"{rate(s['prefill_tokens'], s['prefill_s'])}; decode: {s['decode_tokens']} tokens in "
          f"{s['decode_s']:.3f} s, {rate(s['decode_tokens'], s['decode_s'])}", file=sys.stderr)
    return 0
