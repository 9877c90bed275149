"""Load test of `tercomp serve`, alone or against llama-server on the same weights.

    python bench/serve.py                         # a random model, 200 requests, 16 clients
    python bench/serve.py --hidden 256 --layers 2 --requests 40 --clients 8
    python bench/serve.py --model lm.tcm          # serve a saved LM (compiled with max_batch)
    python bench/serve.py --url http://127.0.0.1:8000/v1 --name lm   # a running server
    python bench/serve.py --ik-llama IK/build/bin --llama-cpp LLAMA/build/bin  # the sweep
    python bench/serve.py --sweep 1,4,8,16       # the sweep, tercomp serve alone

Alone: without --url it starts `tercomp serve` on a free port of 127.0.0.1 (a random
ternary model of the given shape, compiled with --max-batch slots, unless --model is
given), sends every request as a streamed greedy completion of a random prompt (token
ids) from C threads, and stops the server. It prints each request's latency (p50, p99:
submit to last token), time to first token and inter-token latency (p50, p99),
requests/s and generated tokens/s over the wall time, and how many requests failed or
were lost (any is an exit status 1).

The sweep (--sweep, or a peer's binary directory: --ik-llama, --llama-cpp, the
directories holding each build's `llama-server` and `llama-quantize`, as bench/lm.py
takes them): a random ternary GGUF of the 700M shape (bench/lm.py write_model, one
character per token), converted for each peer by its own llama-quantize
(bench/peers.py: IQ2_BN run with -rtr -fa 0 for ik_llama.cpp, the TQ2_0 file as
written for llama.cpp); then each server in turn, bound to 127.0.0.1 with the same
slots and threads (tercomp serve --max-batch 8 --threads 2; llama-server -np 8 -t 2
-tb 2, -c 8 x --max-seq, --cache-reuse where the build has it), warmed up with one
request per slot, and driven at each client count by the same client with the same
prompts: a shared system prompt (--system ids) and a part of its own (--prompt
MIN,MAX), --gen greedy tokens streamed with `ignore_eos` (every server generates as
many; a short request is counted and fails the run) and `cache_prompt` (llama-server's
prompt cache). The table gives aggregate tokens/s, p50/p99 time to first token and
p50/p99 inter-token latency per server and client count, with tercomp's ratios to the
strongest peer at that count. Every request and every client count is bounded by
--timeout; a server's start by --start-timeout.

`load_test()` is what tests/test_serve.py runs at a small size; tests/test_bench_serve.py
checks the pure parts.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import itertools
import json
import math
import os
import socket
import subprocess
import sys
import shutil
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import machine  # noqa: E402  (bench/machine.py)
import peers  # noqa: E402  (bench/peers.py)


def read_stream(lines, clock=time.perf_counter, t0: float | None = None) -> dict:
    """A streamed completion's server-sent events (`lines`, as `iter_lines` gives them) ->
    {"tokens": the generated ids (tercomp's `token_ids`; [] from a server without them),
    "count": tokens generated, "times": [(seconds since t0, tokens)] of every chunk that
    carried any, "ttft": the first of those times (None without any), "finish_reason",
    "usage": the usage chunk's, or None}. A chunk's tokens are its `token_ids` (tercomp),
    else its text's characters: the bench's vocabulary is one character per token
    (bench/peers.py char_tokens), so the text a llama-server streams counts its tokens.
    The usage chunk's `completion_tokens`, where a server sends one, is the count."""
    t0 = clock() if t0 is None else t0
    tokens, times, finish, usage = [], [], None, None
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(chunk["error"].get("message", chunk["error"]))
        usage = chunk.get("usage") or usage
        if "choices" not in chunk and "content" in chunk:
            # llama-server's own format (older builds answer /v1/completions with it):
            # the text as `content`, the last chunk with `stop` and `tokens_predicted`
            own = chunk
            if own.get("stop") and own.get("tokens_predicted") is not None:
                usage = {"completion_tokens": own["tokens_predicted"]}
            chunk = {"choices": [{"text": own["content"], "finish_reason": (
                own.get("stop_type") or "stop") if own.get("stop") else None}]}
        for c in chunk.get("choices") or ():
            ids = c.get("token_ids")
            n = len(ids) if ids is not None else len(c.get("text") or
                                                   (c.get("delta") or {}).get("content") or "")
            if n:
                times.append((clock() - t0, n))
                tokens += ids or []
            finish = c.get("finish_reason") or finish
    count = sum(n for _, n in times)
    if usage and usage.get("completion_tokens") is not None:
        count = int(usage["completion_tokens"])
    return {"tokens": tokens, "count": count, "times": times,
            "ttft": times[0][0] if times else None, "finish_reason": finish, "usage": usage}


def load_test(url: str, model: str, prompts, max_tokens, clients: int = 16,
              api_key: str | None = None, timeout: float = 300.0, extra=None) -> dict:
    """Send one streamed greedy completion per prompt (token ids) with its max_tokens,
    from `clients` threads, each sending its next request when the last one ended.
    `extra`: more body fields (the same for every request). Returns {"results":
    [read_stream's dict plus "latency" (submit to the last event), or None per prompt],
    "errors": [str], "wall": s}. Requests not done after `timeout` seconds in all count
    as errors; every request has that bound too, so a run stops by itself."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout

    def one(i):
        if time.monotonic() > deadline:
            raise RuntimeError(f"request {i}: not sent, the run's {timeout} s are over")
        body = {"model": model, "prompt": [int(t) for t in prompts[i]],
                "max_tokens": int(max_tokens[i]), "temperature": 0, "stream": True,
                **(extra or {})}
        t0 = time.perf_counter()
        with httpx.Client(timeout=max(deadline - time.monotonic(), 1.0)) as client:
            with client.stream("POST", f"{url}/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"request {i}: HTTP {r.status_code}: {r.read()[:200]!r}")
                try:
                    out = read_stream(r.iter_lines(), t0=t0)
                except RuntimeError as e:
                    raise RuntimeError(f"request {i}: {e}") from None
        return {**out, "latency": time.perf_counter() - t0, "wanted": int(max_tokens[i])}

    results, errors = [None] * len(prompts), []
    t0 = time.perf_counter()
    pool = cf.ThreadPoolExecutor(clients)
    futures = {pool.submit(one, i): i for i in range(len(prompts))}
    done, pending = cf.wait(futures, timeout=timeout + 5)
    for f in done:
        try:
            results[futures[f]] = f.result()
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
    for f in pending:
        f.cancel()
        errors.append(f"request {futures[f]}: not done after {timeout} s")
    pool.shutdown(wait=False, cancel_futures=True)
    return {"results": results, "errors": errors, "wall": time.perf_counter() - t0}


def percentile(values, q: float) -> float:
    """NumPy's (linear) percentile; NaN for no values."""
    return float(np.percentile(values, q)) if len(values) else float("nan")


def inter_token_gaps(times) -> list[float]:
    """The seconds between successive chunks that carried tokens, one per gap (as vLLM's
    benchmark_serving counts inter-token latency: a chunk of k tokens after a stall is
    one long gap, not k short ones).

    >>> [round(g, 3) for g in inter_token_gaps([(0.10, 1), (0.12, 1), (0.20, 2)])]
    [0.02, 0.08]
    """
    return [b[0] - a[0] for a, b in itertools.pairwise(times)]


def summary(run: dict) -> dict:
    """The figures of one run: request latency and time to first token (p50, p99),
    inter-token latency (p50, p99 over every gap of every request), requests/s and
    generated tokens/s over the wall time, and `short`: requests that generated fewer
    tokens than their max_tokens asked (none when ignore_eos holds)."""
    ok = [r for r in run["results"] if r is not None]
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    gaps = [g for r in ok for g in inter_token_gaps(r["times"])]
    tokens = sum(r["count"] for r in ok)
    return {"requests": len(run["results"]), "ok": len(ok), "errors": len(run["errors"]),
            "p50_s": percentile(lat, 50), "p99_s": percentile(lat, 99),
            "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "requests_per_s": len(ok) / run["wall"], "tokens_per_s": tokens / run["wall"],
            "tokens": tokens, "wall_s": run["wall"],
            "short": sum(r["count"] < r["wanted"] for r in ok if "wanted" in r)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cmd, port: int, what: str, cwd=ROOT, env=None, log=None, timeout: float = 120.0):
    """Start `cmd` (a server bound to 127.0.0.1:port) and return its process once /health
    answers 200. Its output goes to the file `log` (a pipe nobody reads would fill and
    stall a server that logs every request), else to a pipe read when it fails."""
    import httpx
    with open(log, "w") if log else contextlib.nullcontext(subprocess.PIPE) as out:
        # (the child keeps its own descriptor of the log)
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                text=True, env={**os.environ, **(env or {})})

    def output():
        if log:
            with open(log) as f:
                return f.read()[-3000:]
        return proc.stdout.read()[-3000:] if proc.poll() is not None else ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n{output()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(proc)
    raise RuntimeError(f"{what} did not answer /health in {timeout} s:\n{output()}")


def start_server(model_path: str, port: int, extra=(), env=None, timeout: float = 120.0,
                 log=None):
    """`python -m tercomp serve` on 127.0.0.1:port, once /health answers."""
    return launch([sys.executable, "-m", "tercomp", "serve", model_path, "--port", str(port),
                   *extra], port, "tercomp serve", env={"PYTHONPATH": ROOT, **(env or {})},
                  log=log, timeout=timeout)


def llama_server_command(bin_dir: str, peer, path: str, port: int, threads: int, slots: int,
                         ctx: int, cache_reuse: bool) -> list[str]:
    """A peer's llama-server on 127.0.0.1:port: `slots` parallel sequences of `ctx` tokens
    each (-c is the total, shared by the slots), `threads` for decode and prefill,
    continuous batching (its default), the peer's own settings (bench/peers.py
    `tool_args`: ik_llama.cpp's -rtr -fa 0) and, where the build has it,
    `--cache-reuse` (prefix reuse through KV shifting beside `cache_prompt`)."""
    cmd = [os.path.join(bin_dir, "llama-server"), "-m", path, "--host", "127.0.0.1",
           "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
           "-c", str(slots * ctx), *peer.tool_args]
    return cmd + (["--cache-reuse", "64"] if cache_reuse else [])


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def random_model(path: str, a) -> None:
    sys.path.insert(0, ROOT)
    import tercomp as tc
    from tercomp import models, nn
    nn.manual_seed(0)
    lm = models.BitNetLM(models.BitNetConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers, num_attention_heads=max(a.hidden // 64, 2),
        num_key_value_heads=max(a.hidden // 128, 1), max_position_embeddings=a.max_seq))
    tc.compile_lm(lm, max_seq=a.max_seq, max_batch=a.max_batch, threads=a.threads).save(path)


# ------------------------------------------------------------------ against llama-server
def sweep_prompts(rng, vocab: int, system: int, user: tuple, levels, per_client: int,
                  warmup: int):
    """The prompts of the sweep, the same for every server: one shared "system prompt"
    of `system` token ids, then each request's own part of user[0]..user[1] ids. Returns
    (warm-up prompts, {clients: prompts}): per_client requests per client at each level.
    Ids 0-2 (unk, bos, eos) are left out."""
    head = rng.integers(3, vocab, system).tolist()

    def prompts(n):
        return [head + rng.integers(3, vocab, rng.integers(user[0], user[1] + 1)).tolist()
                for _ in range(n)]
    return prompts(warmup), {c: prompts(per_client * c) for c in levels}


def model_id(url: str) -> str:
    """The id the server at `url` (…/v1) lists first in /v1/models."""
    import httpx
    return httpx.get(f"{url}/models", timeout=10).json()["data"][0]["id"]


def fmt_ms(s: float) -> str:
    return "-" if math.isnan(s) else f"{s * 1e3:.0f}"


def format_sweep(rows: dict) -> str:
    """The sweep's table: for each client count, every server's aggregate generated
    tokens/s, time to first token (p50, p99) and inter-token latency (p50, p99) in ms,
    and the requests that failed or came back short; then each of ours (a name that
    starts with "tercomp") over the strongest peer at that count (the most tokens/s):
    tokens/s (higher is better) and each latency (lower is better). `rows` maps a
    server's name to {clients: summary()}.

    >>> s = dict(tokens_per_s=100.0, ttft_p50_s=0.1, ttft_p99_s=0.2, itl_p50_s=0.01,
    ...          itl_p99_s=0.03, errors=0, short=0, ok=4)
    >>> print(format_sweep({"tercomp serve": {4: s},
    ...                     "ik": {4: {**s, "tokens_per_s": 50.0, "itl_p99_s": 0.06}},
    ...                     "lcpp": {4: {**s, "tokens_per_s": 40.0}}}))
    clients  server                 tok/s  TTFT p50  TTFT p99  ITL p50  ITL p99  ok/short/failed
          4  tercomp serve          100.0       100       200       10       30            4/0/0
          4  ik                      50.0       100       200       10       60            4/0/0
          4  lcpp                    40.0       100       200       10       30            4/0/0
          4  tercomp serve / ik     2.00x     1.00x     1.00x    1.00x    0.50x
    """
    levels = sorted({c for r in rows.values() for c in r})
    ours = [n for n in rows if n.startswith("tercomp")]
    peers_ = [n for n in rows if n not in ours]
    width = max([16] + [len(n) for n in rows] + [len(f"{o} / {p}") for o in ours for p in peers_])
    keys = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")
    lines = [(f"clients  {'server':{width}}  {'tok/s':>6}  TTFT p50  TTFT p99  ITL p50  "
              "ITL p99  ok/short/failed")]
    for c in levels:
        for n, r in rows.items():
            if c not in r:
                continue
            s = r[c]
            lines.append(f"{c:7d}  {n:{width}}  {s['tokens_per_s']:6.1f}  "
                         f"{fmt_ms(s['ttft_p50_s']):>8}  {fmt_ms(s['ttft_p99_s']):>8}  "
                         f"{fmt_ms(s['itl_p50_s']):>7}  {fmt_ms(s['itl_p99_s']):>7}  "
                         f"{str(s['ok']) + '/' + str(s['short']) + '/' + str(s['errors']):>15}")
        have = [p for p in peers_ if c in rows[p] and rows[p][c]["tokens_per_s"] > 0]
        best = max(have, key=lambda p: rows[p][c]["tokens_per_s"]) if have else None
        for n in ours:
            if best is None or c not in rows[n]:
                continue
            o, p = rows[n][c], rows[best][c]

            def ratio(k, w, o=o, p=p):
                return f"{o[k] / p[k]:.2f}x".rjust(w) if p[k] > 0 else "-".rjust(w)
            lines.append(f"{c:7d}  {n + ' / ' + best:{width}}  {ratio('tokens_per_s', 6)}  "
                         + "  ".join(ratio(k, w) for k, w in zip(keys, (8, 8, 7, 7))))
    return "\n".join(lines)


PEER_TOOLS = ("llama-server", "llama-quantize")


def parse_args(argv=None):
    """The bench's options, checked: lists parsed, peer directories holding llama-server
    (and llama-quantize where the peer's file is converted)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server's base URL (…/v1); else one is started")
    p.add_argument("--name", help="the model name (default: the started server's)")
    p.add_argument("--api-key")
    p.add_argument("--model", help="a .tcm to serve (default: a random model of the shape below)")
    p.add_argument("--hidden", type=int, help="default 512; with peers or --sweep 1536")
    p.add_argument("--layers", type=int, help="default 4; with peers or --sweep 24")
    p.add_argument("--vocab", type=int, help="default 1024; with peers or --sweep 32002")
    p.add_argument("--ffn", type=int, help="default 2 x hidden; with peers or --sweep 4096")
    p.add_argument("--heads", type=int, help="default hidden / 64; with peers or --sweep 16")
    p.add_argument("--max-seq", type=int, default=256,
                   help="each slot's context (default 256; llama-server's -c is slots x this)")
    p.add_argument("--max-batch", type=int, default=8, help="slots (llama-server's -np)")
    p.add_argument("--threads", type=int, help="the server's threads (default: tercomp's "
                   "own choice; 2 with peers or --sweep, llama-server's -t and -tb)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--prompt", default="8,64", help="prompt lengths MIN,MAX (default 8,64; "
                   "with --sweep the part after the shared system prompt)")
    p.add_argument("--max-tokens", default="16,64", help="max_tokens MIN,MAX (default 16,64)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="bound on the whole run (s); with --sweep, on each client count")
    p.add_argument("--sweep", metavar="CLIENTS", help="client counts, comma-separated: a "
                   "sweep of tercomp serve and the given peers' llama-server (default with "
                   "a peer: 1,4,8,16)")
    p.add_argument("--system", type=int, default=32,
                   help="--sweep: the shared system prompt's tokens (default 32)")
    p.add_argument("--gen", type=int, default=64,
                   help="--sweep: tokens each request generates, eos ignored (default 64)")
    p.add_argument("--per-client", type=int, default=4,
                   help="--sweep: requests per client at each client count (default 4)")
    for name, peer in peers.PEERS.items():
        p.add_argument(f"--{peer.flag}", metavar="BIN_DIR",
                       help=f"--sweep: {name}'s build (llama-server, llama-quantize), made "
                            f"outside this repository")
    p.add_argument("--no-tercomp", action="store_true", help="--sweep: the peers alone")
    p.add_argument("--step-tokens", default="default", metavar="LIST",
                   help="--sweep: tercomp serve's --step-tokens (0: no budget), comma-separated, "
                        "one tercomp row each; `default`: without the option (default: default)")
    p.add_argument("--dir", help="--sweep: where the GGUFs and logs go (default: a temporary "
                   "directory, removed at the end unless --keep)")
    p.add_argument("--keep", action="store_true", help="--sweep: keep the default directory "
                   "(its files are reused by the next run with --keep)")
    p.add_argument("--start-timeout", type=float, default=1800.0,
                   help="--sweep: seconds a server may take to answer /health (tercomp "
                        "compiles the GGUF the first time; default 1800)")
    a = p.parse_args(argv)

    def pair(opt, text):
        try:
            lo, hi = (int(v) for v in text.split(","))
        except ValueError:
            p.error(f"--{opt}: {text!r} is not MIN,MAX (two integers)")
        if not 0 <= lo <= hi:
            p.error(f"--{opt}: {text!r} needs 0 <= MIN <= MAX")
        return lo, hi
    a.prompt, a.max_tokens = pair("prompt", a.prompt), pair("max-tokens", a.max_tokens)
    a.peers = {}
    for name, peer in peers.PEERS.items():
        bin_dir = getattr(a, peer.flag.replace("-", "_"))
        if bin_dir is None:
            continue
        bin_dir = os.path.abspath(bin_dir)
        need = PEER_TOOLS if peer.quantize_type else PEER_TOOLS[:1]
        missing = [t for t in need if not os.access(os.path.join(bin_dir, t), os.X_OK)]
        if missing:
            p.error(f"--{peer.flag} {bin_dir}: no {', '.join(missing)} there (the directory "
                    f"holding {name}'s built binaries; llama-server needs its build's "
                    f"-DLLAMA_BUILD_SERVER=ON)")
        a.peers[name] = bin_dir
    if a.sweep is None and a.peers:
        a.sweep = "1,4,8,16"
    if a.sweep is not None:
        try:
            a.sweep = [int(c) for c in a.sweep.split(",")]
        except ValueError:
            p.error(f"--sweep: {a.sweep!r} is not a comma-separated list of client counts")
        if not a.sweep or min(a.sweep) < 1:
            p.error(f"--sweep: client counts must be >= 1, got {a.sweep}")
        if a.url or a.model:
            p.error("--sweep starts every server on a GGUF of its own: not with --url or --model")
        if a.no_tercomp and not a.peers:
            p.error("--no-tercomp: give a peer (--ik-llama, --llama-cpp) to run")
        if a.system + a.prompt[1] + a.gen > a.max_seq:
            p.error(f"--max-seq {a.max_seq} holds no system prompt of {a.system}, a user part "
                    f"of up to {a.prompt[1]} and {a.gen} generated tokens")
    try:
        a.step_tokens = [None if t.strip() == "default" else int(t) for t in a.step_tokens.split(",")]
    except ValueError:
        p.error(f"--step-tokens: {a.step_tokens!r} is not a comma-separated list of token "
                f"counts and `default`")
    if any(t is not None and t < 0 for t in a.step_tokens):
        p.error(f"--step-tokens: token counts must be >= 0 (0: no budget), got {a.step_tokens}")
    big = a.sweep is not None
    for k, small, large in (("hidden", 512, 1536), ("layers", 4, 24), ("vocab", 1024, 32002)):
        if getattr(a, k) is None:
            setattr(a, k, large if big else small)
    a.ffn = a.ffn or (4096 if big and a.hidden == 1536 else 2 * a.hidden)
    a.heads = a.heads or (16 if big and a.hidden == 1536 else max(a.hidden // 64, 2))
    if big and a.threads is None:
        a.threads = 2
    return a


def run_sweep(a) -> int:
    """Every server in turn on the same weights: started, warmed up (a request per slot),
    driven at each client count with the same prompts, stopped. Prints the table."""
    import lm  # bench/lm.py: the GGUF writer
    cleanup = None
    if a.dir is None:
        a.dir = os.path.join(tempfile.gettempdir(), "tercomp-bench-serve")
        cleanup = None if a.keep else a.dir
    a.dir = os.path.abspath(a.dir)
    os.makedirs(a.dir, exist_ok=True)
    try:
        return sweep(a, lm)
    finally:
        if cleanup:
            shutil.rmtree(cleanup, ignore_errors=True)


def sweep(a, lm) -> int:
    a.arch, a.kv_heads = "bitnet", 0
    tag = f"L{a.layers}-h{a.hidden}-f{a.ffn}-H{a.heads}-v{a.vocab}"
    a.model = os.path.join(a.dir, f"bitnet-{tag}.gguf")
    if not os.path.exists(a.model):     # token strings single characters (bench/peers.py)
        lm.write_model(a.model + ".part", a, tokens=peers.char_tokens(a.vocab))
        os.replace(a.model + ".part", a.model)
    files = lm.peer_files(a, a.peers, tag)    # each peer's format, by its llama-quantize
    a.model = os.path.join(a.dir, f"bitnet-{tag}.gguf")
    rng = np.random.default_rng(0)
    warm, levels = sweep_prompts(rng, a.vocab, a.system, a.prompt, a.sweep, a.per_client,
                                 a.max_batch)
    # the same body for every server: greedy, eos ignored (vLLM's and llama-server's
    # field) so that every request generates --gen tokens, llama-server's prompt cache
    # on (tercomp ignores the field), the usage chunk asked for
    extra = {"ignore_eos": True, "cache_prompt": True, "stream_options": {"include_usage": True}}
    servers = {}
    for t in [] if a.no_tercomp else a.step_tokens:
        servers["tercomp serve" + ("" if t is None else f" --step-tokens {t}")] = t
    for name, path in files.items():
        servers[f"{name} llama-server"] = (name, path)
    print(f"CPU: {machine.cpu()}; {machine.load()} before the run")
    print(f"model {tag} (random ternary); {a.max_batch} slots of {a.max_seq} tokens, "
          f"{a.threads} threads; prompts: a shared {a.system}-token system prompt + "
          f"{a.prompt[0]}..{a.prompt[1]} tokens; {a.gen} greedy tokens, streamed; "
          f"{a.per_client} requests per client", flush=True)
    rows, failed = {}, False
    for label, peer in servers.items():
        port = free_port()
        log = os.path.join(a.dir, label.replace(" ", "").replace("-", "_") + ".log")
        try:
            if not isinstance(peer, tuple):             # tercomp serve, peer its step_tokens
                proc = start_server(a.model, port, [
                    "--max-batch", str(a.max_batch), "--max-seq", str(a.max_seq),
                    "--threads", str(a.threads), "--max-queue", str(4 * max(a.sweep)),
                    *([] if peer is None else ["--step-tokens", str(peer)])],
                    log=log, timeout=a.start_timeout)
            else:
                name, path = peer
                bin_dir = a.peers[name]
                server = os.path.join(bin_dir, "llama-server")
                helptext = subprocess.run([server, "--help"], capture_output=True, text=True,
                                          timeout=60, check=False).stdout
                cmd = llama_server_command(bin_dir, peers.PEERS[name], path, port, a.threads,
                                           a.max_batch, a.max_seq, "--cache-reuse" in helptext)
                proc = launch(cmd, port, label, cwd=a.dir, log=log, timeout=a.start_timeout)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            print(f"{label}: did not start: {e}", file=sys.stderr)
            failed = True
            continue
        try:
            url = f"http://127.0.0.1:{port}/v1"
            model = model_id(url)
            load_test(url, model, warm, [8] * len(warm), a.max_batch, a.api_key, a.timeout,
                      extra)
            rows[label] = {}
            for c, prompts in levels.items():
                run = load_test(url, model, prompts, [a.gen] * len(prompts), c, a.api_key,
                                a.timeout, extra)
                s = rows[label][c] = summary(run)
                failed |= bool(s["errors"] or s["short"])
                for e in run["errors"][:3]:
                    print(f"{label}, {c} clients: {e}", file=sys.stderr)
                print(f"{label}, {c} clients: {s['tokens_per_s']:.1f} tokens/s, inter-token "
                      f"p99 {fmt_ms(s['itl_p99_s'])} ms; {machine.load()}", flush=True)
        finally:
            stop_server(proc)
    print()
    print(format_sweep(rows))
    print("(ms; a ratio row is tercomp serve over the peer with the most tokens/s at that "
          "client count: tokens/s higher is better, latencies lower)")
    for name, bin_dir in a.peers.items():
        print(f"{name}: {bin_dir} ({' '.join(peers.PEERS[name].tool_args) or 'default flags'})")
    print(f"{machine.load()} after the run")
    return 1 if failed else 0


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.sweep is not None:
        return run_sweep(a)
    rng = np.random.default_rng(0)
    (p0, p1), (m0, m1) = a.prompt, a.max_tokens
    proc, tmp = None, tempfile.TemporaryDirectory()
    try:
        url, name, vocab = a.url, a.name, a.vocab
        if url is None:
            path = a.model or os.path.join(tmp.name, "bench.tcm")
            if a.model is None:
                print(f"compiling a random model: hidden {a.hidden}, {a.layers} layers, vocab "
                      f"{a.vocab}, max_seq {a.max_seq}, max_batch {a.max_batch}", file=sys.stderr)
                random_model(path, a)
            port = free_port()
            extra = ["--max-queue", str(max(a.clients, 1) * 2)]
            extra += ["--threads", str(a.threads)] if a.threads else []
            proc = start_server(path, port, extra)
            url, name = f"http://127.0.0.1:{port}/v1", name or os.path.splitext(os.path.basename(path))[0]
        prompts = [rng.integers(3, vocab, rng.integers(p0, p1 + 1)) for _ in range(a.requests)]
        max_tokens = rng.integers(m0, m1 + 1, a.requests)
        s = summary(load_test(url, name, prompts, max_tokens, a.clients, a.api_key, a.timeout))
    finally:
        if proc is not None:
            stop_server(proc)
        tmp.cleanup()
    print(f"{s['requests']} requests from {a.clients} clients: {s['ok']} ok, {s['errors']} "
          f"failed or lost, {s['wall_s']:.1f} s")
    print(f"latency p50 {s['p50_s'] * 1e3:.0f} ms, p99 {s['p99_s'] * 1e3:.0f} ms; time to first "
          f"token p50 {s['ttft_p50_s'] * 1e3:.0f} ms, p99 {s['ttft_p99_s'] * 1e3:.0f} ms; "
          f"inter-token p50 {s['itl_p50_s'] * 1e3:.0f} ms, p99 {s['itl_p99_s'] * 1e3:.0f} ms")
    print(f"{s['requests_per_s']:.1f} requests/s, {s['tokens_per_s']:.0f} generated tokens/s "
          f"({s['tokens']} tokens)")
    return 1 if s["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
