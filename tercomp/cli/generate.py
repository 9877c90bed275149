"""`tercomp generate`: compile (or load) a language model and stream generated tokens.

    tercomp generate MODEL (--prompt TEXT | --prompt-ids 1,2,3 | --chat TEXT) [-n 64] [--temperature T]
                     [--top-k K] [--top-p P] [--seed S] [--eos 2,3] [--max-seq N]
                     [--speculative [--num-draft K]]
                     [--kv-dtype f16|f32] [--threads N] [--device D] [--save OUT.tcm]

MODEL is a .gguf file, a Hugging Face directory, or an LM artifact (.tcm, written by
`--save` or gen.save()). Tokens go to stdout as they are generated (text with a
tokenizer, ids without); the prefill and decode rates go to stderr at the end.
`--speculative` decodes greedily with prompt-lookup drafts (runtime.speculative): the
same tokens, fewer model calls when the text repeats its context.

Every flag is checked before the model is compiled: malformed ones (`--prompt-ids '1 2'`,
an empty `--eos`, `--save ''`, a negative temperature, text that is not UTF-8) are usage
errors (status 2) naming the flag, before the model is even read; a prompt without a
tokenizer, ids outside the vocabulary or a prompt that does not fit `--max-seq` are
errors after reading the model and before compiling it.
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np

from ..errors import ConfigError, InputError, UnsupportedError
from .base import UsageError, check_text, int_list, is_artifact, positive_int
from .model import open_model


def add_parser(sub):
    """Add the `generate` command to the subparsers `sub`."""
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
    g.add_argument("--speculative", action="store_true",
                   help="greedy decoding with prompt-lookup (n-gram) drafts verified in one "
                        "step: the same tokens, faster on text that repeats its context")
    g.add_argument("--num-draft", type=positive_int, default=8, metavar="K",
                   help="with --speculative: tokens drafted per step (default 8, at most 64)")
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


#: flags that only apply when MODEL is compiled (not to a saved .tcm)
COMPILE_FLAGS = (("max_seq", "--max-seq"), ("kv_dtype", "--kv-dtype"), ("target", "--target"),
                 ("vulkan_target", "--vulkan-target"), ("cuda_target", "--cuda-target"),
                 ("no_cache", "--no-cache"))


def check_args(args) -> tuple:
    """Every flag that needs no model, before anything is loaded or compiled:
    returns (prompt ids or None, eos set or None)."""
    eos = set(int_list(args.eos, "--eos")) if args.eos is not None else None
    ids = int_list(args.prompt_ids, "--prompt-ids") if args.prompt_ids is not None else None
    check_text(args.prompt, "--prompt")
    check_text(args.chat, "--chat")
    check_text(args.model, "MODEL")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise UsageError(f"--temperature must be a number >= 0 (0 is greedy), got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be a number in (0, 1], got {args.top_p}")
    if args.speculative and args.temperature != 0:
        raise UsageError(f"--speculative verifies drafts against greedy decoding; --temperature "
                         f"{args.temperature} samples (drop one of them)")
    if args.num_draft > 64:
        raise UsageError(f"--num-draft must be from 1 to 64, got {args.num_draft}")
    if args.seed < 0:
        raise UsageError(f"--seed must be a non-negative integer, got {args.seed}")
    if args.save is not None:
        check_text(args.save, "--save")
        if not args.save.strip():
            raise UsageError("--save needs a file path, like --save model.tcm")
        if os.path.isdir(args.save):
            raise UsageError(f"--save {args.save}: that is a directory; give a file path like "
                             f"{os.path.join(args.save, 'model.tcm')}")
        parent = os.path.dirname(os.path.abspath(args.save))
        if not os.path.isdir(parent):
            raise UsageError(f"--save {args.save}: the directory {parent} does not exist")
    if is_artifact(args.model):
        given = [flag for attr, flag in COMPILE_FLAGS if getattr(args, attr)]
        if given:
            raise UsageError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} when "
                             f"compiling a model; {args.model} is a compiled artifact")
    return ids, eos


def _open(args, ids, eos):
    """(an LMGenerator for args.model, prompt ids, chat eos or None): a .tcm is loaded,
    anything else compiled; the prompt is made and checked against the model before
    the compile."""
    made = {}

    def check(tokenizer, template, vocab, max_seq, compiled):
        made["prompt"], made["eos"] = _prompt(args, tokenizer, template, ids)
        _check_fits(args, made["prompt"], eos, vocab, max_seq, compiled=compiled)
    gen = open_model(args, check)
    return gen, made["prompt"], made["eos"]


def _prompt(args, tokenizer, template, ids):
    """(prompt ids, {eos id} or None) from --prompt-ids, --prompt or --chat (one user
    message in the model's chat template, a runtime.chat.ChatTemplate)."""
    if ids is not None:
        return np.array(ids, np.int64), None
    flag = "--chat" if args.chat is not None else "--prompt"
    if tokenizer is None:
        raise UnsupportedError(f"{flag} needs the model's tokenizer, and {args.model} has no tokenizer",
                               hint="pass token ids with --prompt-ids 1,2,3")
    if args.chat is None:
        return np.array(tokenizer.encode(args.prompt).ids, np.int64), None
    if template is None:
        raise UnsupportedError(f"--chat needs the model's chat template, and {args.model} carries none",
                               hint="pass --prompt TEXT instead")
    rendered = template.render([{"role": "user", "content": args.chat}], add_generation_prompt=True)
    ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    eos = tokenizer.token_to_id(template.eos_token) if template.eos_token else None
    return np.array(ids, np.int64), ({eos} if eos is not None else None)


def _check_fits(args, prompt, eos, vocab: int, max_seq: int, compiled: bool) -> None:
    """The prompt, --eos and -n against the model's vocabulary and the cache length."""
    flag = "--prompt-ids" if args.prompt_ids is not None else "--chat" if args.chat is not None \
        else "--prompt"
    if prompt.size == 0:
        raise InputError(f"{flag} gives no tokens", hint="give a longer prompt")
    for what, values in ((flag, prompt.tolist()), ("--eos", sorted(eos or ()))):
        bad = [i for i in values if i >= vocab]
        if bad:
            raise InputError(f"{what}: token id {bad[0]} is out of range for the model's "
                             f"vocabulary of {vocab}", hint=f"ids must be in [0, {vocab - 1}]")
    need = prompt.size + args.max_new_tokens - 1
    if need > max_seq:
        fix = (f"ask for fewer tokens with -n, or compile the model file again with a larger "
               f"--max-seq" if compiled else f"pass a larger --max-seq, or fewer tokens with -n")
        raise ConfigError(f"{prompt.size} prompt tokens and -n {args.max_new_tokens} need {need} "
                          f"cache positions; the {'artifact' if compiled else 'cache'} holds "
                          f"{max_seq}", hint=fix)


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


def run(args) -> int:
    ids, eos = check_args(args)
    gen, prompt, chat_eos = _open(args, ids, eos)
    if args.save:
        gen.save(args.save)
        print(f"wrote {args.save}", file=sys.stderr)
    if eos is None:
        eos = chat_eos
    if gen.tokenizer is not None and args.prompt is not None:
        sys.stdout.write(args.prompt)
    gen.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                 top_k=args.top_k, top_p=args.top_p, seed=args.seed, eos=eos,
                 on_token=_Stream(gen), speculative="prompt_lookup" if args.speculative else None,
                 num_draft=args.num_draft)
    sys.stdout.write("\n")
    sys.stdout.flush()
    s = gen.stats
    rate = (lambda n, t: f"{n / t:.1f} tokens/s" if t > 0 and n else "n/a")
    print(f"prefill: {s['prefill_tokens']} tokens in {s['prefill_s']:.3f} s, "
          f"{rate(s['prefill_tokens'], s['prefill_s'])}; decode: {s['decode_tokens']} tokens in "
          f"{s['decode_s']:.3f} s, {rate(s['decode_tokens'], s['decode_s'])}", file=sys.stderr)
    if args.speculative:
        print(f"speculative: {s['accepted']} of {s['drafted']} drafted tokens accepted, "
              f"{s['steps']} decode steps", file=sys.stderr)
    return 0
