"""`tercomp serve`: serve a language model over OpenAI's HTTP API.

    tercomp serve MODEL [--host 127.0.0.1] [--port 8000] [--max-batch 8] [--max-seq N]
                  [--api-key KEY] [--threads N] [--max-queue N] [--max-body BYTES]
                  [--read-timeout S] [--keep-alive S] [--max-connections N] [--drain S]
                  [--max-request-tokens N] [--step-tokens N] [--embeddings]
                  [--no-prefix-cache] [--speculative K]
                  [--tool-call-parser {hermes,llama3_json,mistral}]
                  [--logprobs-mode {raw_logprobs,processed_logprobs}] [--chat-template FILE]

MODEL is a .gguf file, a Hugging Face directory (compiled with max_batch slots), or an
LM artifact (.tcm, served as it was compiled: `tercomp generate ... --save` or
`gen.save()`). Binds 127.0.0.1 unless --host says otherwise. The API key may also come
from the TERCOMP_API_KEY environment variable (a command line is visible to other
users of the machine). `--embeddings` (a .gguf or Hugging Face directory) also compiles
the model as an encoder (tc.compile_embed, the model file's pooling) for /v1/embeddings.
"""
from __future__ import annotations

import argparse
import os
import sys

from ..errors import MissingDependency
from ..runtime.sampling import LOGPROBS_MODES
from .base import UsageError, positive_int
from .model import open_model, open_model_and_encoder

DEFAULT_MAX_BATCH = 8


def _step_tokens(text: str) -> int:
    """--step-tokens: a non-negative int (0: no budget)."""
    if text != "0":
        return positive_int(text)
    return 0

def add_parser(sub):
    """Add the `serve` command to the subparsers `sub`."""
    s = sub.add_parser("serve", help="serve a language model over OpenAI's HTTP API",
                       description="Serve MODEL (.gguf, Hugging Face directory, or an LM "
                                   "artifact .tcm) at /v1/completions, /v1/chat/completions, "
                                   "/v1/models, /v1/embeddings (with --embeddings), /tokenize, "
                                   "/detokenize, /health and /metrics.")
    s.add_argument("model", metavar="MODEL")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    s.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    s.add_argument("--max-batch", type=positive_int, metavar="N",
                   help="concurrent sequences (cache slots) when compiling (default 8)")
    s.add_argument("--max-seq", type=positive_int, help="context length (prompt and generated "
                   "tokens) when compiling (default: the model's, at most 2048)")
    s.add_argument("--api-key", metavar="KEY", default=os.environ.get("TERCOMP_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1 (default: $TERCOMP_API_KEY)")
    s.add_argument("--threads", type=positive_int, help="local-task thread count")
    s.add_argument("--max-queue", type=positive_int, default=256, metavar="N",
                   help="requests waiting for a slot beyond which new ones get 429 (default 256)")
    s.add_argument("--max-body", type=positive_int, default=1 << 20, metavar="BYTES",
                   help="largest request body accepted (default 1 MiB)")
    s.add_argument("--read-timeout", type=_seconds, default=10.0, metavar="S",
                   help="seconds a request's head, and then its body, may take to arrive "
                        "(default 10)")
    s.add_argument("--keep-alive", type=positive_int, default=5, metavar="S",
                   help="seconds an idle keep-alive connection stays open (default 5)")
    s.add_argument("--max-connections", type=positive_int, default=512, metavar="N",
                   help="open connections beyond which new ones get a 503 (default 512)")
    s.add_argument("--drain", type=_seconds, default=10.0, metavar="S",
                   help="on SIGTERM, seconds the running requests have to finish (default 10)")
    s.add_argument("--max-request-tokens", type=positive_int, default=1 << 15, metavar="N",
                   help="tokens one request may generate over its prompts and choices, "
                        "or embed over its inputs (default 32768)")
    s.add_argument("--no-prefix-cache", action="store_true",
                   help="prefill every prompt in full (default: a prompt sharing a prefix with "
                        "a finished sequence in a free slot reuses its KV rows, as "
                        "llama-server's cache_prompt, and one sharing it with a running "
                        "sequence copies them)")
    s.add_argument("--speculative", type=_draft, default=0, metavar="K",
                   help="a greedy request running alone drafts up to K tokens by prompt "
                        "lookup and verifies them in one step (same tokens; default 0: off)")
    s.add_argument("--step-tokens", type=_step_tokens, metavar="N",
                   help="while requests generate, tokens per engine step in all (theirs "
                        "included): a new prompt is prefilled in chunks of what is left, so "
                        "it does not stall their next tokens (default: twice the slots; 0: "
                        "no budget, a new prompt's 128-token chunks on top of theirs)")
    s.add_argument("--tool-call-parser", metavar="NAME",
                   help="parse (and, for tool_choice required or a named function, force) "
                        "tool calls in this syntax, vLLM's parser names: hermes "
                        "(<tool_call> blocks), llama3_json (Llama 3.1/3.2's JSON), mistral "
                        "([TOOL_CALLS]) (default: the one the chat template writes, "
                        "hermes where it writes none)")
    s.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template file to use instead of the model's (vLLM's "
                        "--chat-template, llama-server's --chat-template-file), with the "
                        "model's bos and eos tokens: e.g. one that writes tools")
    s.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="raw_logprobs",
                   help="what a generated token's logprobs are of (vLLM's option): "
                        "raw_logprobs, log_softmax of the model's logits (the default, as "
                        "OpenAI's and vLLM's: temperature, penalties and logit_bias do not "
                        "change them); processed_logprobs, the distribution the token was "
                        "sampled from (after logit_bias, penalties, a grammar, temperature, "
                        "min_p, top_k and top_p)")
    s.add_argument("--embeddings", action="store_true",
                   help="also compile MODEL (.gguf or Hugging Face directory) as an embedding "
                        "encoder and answer /v1/embeddings (pooling as the model file says)")
    s.add_argument("--name", help="the model name clients pass (default: MODEL's file name "
                                  "without its extension)")
    s.add_argument("--kv-dtype", choices=["float16", "float32"],
                   help="KV cache element type when compiling (default float16)")
    s.add_argument("--device", help="local-task, local-sync, vulkan or cuda")
    s.add_argument("--no-cache", action="store_true", help="do not use the compile cache")
    s.set_defaults(run=run, target=None, vulkan_target=None, cuda_target=None)
    return s


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 < v < 1e6:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return v


def _draft(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 64:
        raise argparse.ArgumentTypeError(f"expected a number of draft tokens from 0 to 64, "
                                         f"got {text!r}")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 1 to 65535, got {text!r}")
    return int(text)


def model_name(path: str) -> str:
    """'models/bitnet-2b.gguf' -> 'bitnet-2b'; a directory -> its name."""
    base = os.path.basename(os.path.normpath(path))
    stem, ext = os.path.splitext(base)
    return stem if ext in (".gguf", ".tcm") else base


def run(args) -> int:
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api-key is empty")
    try:    # the serve extra, imported here: the other commands run without it
        from ..serve.app import create_app
        from ..serve.http import serve
        from ..serve.tools import SYNTAXES
    except ImportError as e:
        raise MissingDependency(f"tercomp serve needs {e.name or e}, which is not installed",
                                hint="pip install 'tercomp[serve]' (or: pip install fastapi uvicorn "
                                     "prometheus-client)") from None
    from ..runtime.chat import ChatTemplate
    from ..runtime.scheduler import STEP_TOKENS_PER_SLOT, Engine

    if args.tool_call_parser is not None and args.tool_call_parser not in SYNTAXES:
        raise UsageError(f"--tool-call-parser {args.tool_call_parser!r} is not one of "
                         f"{', '.join(SYNTAXES)}")

    template = None
    if args.chat_template is not None:      # read and compiled before the model loads
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--chat-template {args.chat_template}: cannot read it ({e})") from None
        ChatTemplate(template, origin=args.chat_template)

    asked = {"max_batch": args.max_batch, "max_seq": args.max_seq}
    if args.max_batch is None:
        args.max_batch = DEFAULT_MAX_BATCH
    if args.embeddings:
        gen, embedder = open_model_and_encoder(args)
    else:
        gen, embedder = open_model(args), None
    batch = getattr(gen, "max_batch", 1)
    # a .tcm is served as it was compiled: say so when the flags asked for another shape
    for flag, have in (("max_batch", batch), ("max_seq", gen.max_seq)):
        if asked[flag] is not None and asked[flag] != have:
            print(f"note: {args.model} was compiled with {flag} {have}; --{flag.replace('_', '-')} "
                  f"{asked[flag]} applies when compiling a .gguf or Hugging Face model",
                  file=sys.stderr)
    if batch == 1:
        print(f"note: {args.model} has one cache slot: requests run one at a time (compile "
              f"with max_batch, e.g. tercomp serve MODEL.gguf --max-batch 8)", file=sys.stderr)
    # the step budget: twice the slots unless told (measured against llama-server's p99
    # inter-token latency at 1-16 clients, bench/RESULTS.md); 0 turns it off
    budget = STEP_TOKENS_PER_SLOT * batch if args.step_tokens is None else args.step_tokens or None
    engine = Engine(gen, max_queue=args.max_queue, prefix_cache=not args.no_prefix_cache,
                    num_draft=args.speculative, step_tokens=budget,
                    logprobs_mode=args.logprobs_mode)
    name = args.name or model_name(args.model)
    app = create_app(engine, name, api_key=args.api_key, max_body=args.max_body,
                     read_timeout=args.read_timeout, max_request_tokens=args.max_request_tokens,
                     embedder=embedder, tool_call_parser=args.tool_call_parser,
                     chat_template=template, template_origin=args.chat_template or "")
    print(f"serving {name} ({batch} slots of {gen.max_seq} tokens) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    try:
        serve(app, engine, host=args.host, port=args.port, read_timeout=args.read_timeout,
              max_connections=args.max_connections, keep_alive=args.keep_alive,
              drain=args.drain)
    finally:
        engine.close()
    return 0
