"""Load test of `tercomp serve`: R requests from C client threads, bounded in time.

    python bench/serve.py                         # a random model, 200 requests, 16 clients
    python bench/serve.py --hidden 256 --layers 2 --requests 40 --clients 8
    python bench/serve.py --model lm.tcm          # serve a saved LM (compiled with max_batch)
    python bench/serve.py --url http://127.0.0.1:8000/v1 --name lm   # a running server

Without --url it starts `tercomp serve` on a free port of 127.0.0.1 (a random ternary
model of the given shape, compiled with --max-batch slots, unless --model is given),
sends every request as a streamed greedy completion of a random prompt (token ids) from
C threads, and stops the server. It prints each request's latency (p50, p99: submit to
last token), time to first token (p50, p99), requests/s and generated tokens/s over the
wall time, and how many requests failed or were lost (any is an exit status 1).

`load_test()` is what tests/test_serve.py runs at a small size.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def load_test(url: str, model: str, prompts, max_tokens, clients: int = 16,
              api_key: str | None = None, timeout: float = 300.0) -> dict:
    """Send one streamed greedy completion per prompt (token ids) with its max_tokens,
    from `clients` threads. Returns {"results": [{"tokens", "finish_reason", "latency",
    "ttft"} or None per prompt], "errors": [str], "wall": s}. Requests not done after
    `timeout` seconds in all count as errors."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def one(i):
        body = {"model": model, "prompt": [int(t) for t in prompts[i]],
                "max_tokens": int(max_tokens[i]), "temperature": 0, "stream": True}
        t0 = time.perf_counter()
        ttft, tokens, finish = None, [], None
        with httpx.Client(timeout=timeout) as client:
            with client.stream("POST", f"{url}/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"request {i}: HTTP {r.status_code}: {r.read()[:200]!r}")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise RuntimeError(f"request {i}: {chunk['error']['message']}")
                    c = chunk["choices"][0]
                    if c.get("token_ids"):
                        ttft = ttft if ttft is not None else time.perf_counter() - t0
                        tokens += c["token_ids"]
                    finish = c["finish_reason"] or finish
        return {"tokens": tokens, "finish_reason": finish, "latency": time.perf_counter() - t0,
                "ttft": ttft}

    results, errors = [None] * len(prompts), []
    t0 = time.perf_counter()
    pool = cf.ThreadPoolExecutor(clients)
    futures = {pool.submit(one, i): i for i in range(len(prompts))}
    done, pending = cf.wait(futures, timeout=timeout)
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


def summary(run: dict) -> dict:
    ok = [r for r in run["results"] if r is not None]
    lat = np.array([r["latency"] for r in ok]) if ok else np.zeros(1)
    ttft = np.array([r["ttft"] for r in ok if r["ttft"] is not None] or [0.0])
    tokens = sum(len(r["tokens"]) for r in ok)
    return {"requests": len(run["results"]), "ok": len(ok), "errors": len(run["errors"]),
            "p50_s": float(np.percentile(lat, 50)), "p99_s": float(np.percentile(lat, 99)),
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "requests_per_s": len(ok) / run["wall"], "tokens_per_s": tokens / run["wall"],
            "tokens": tokens, "wall_s": run["wall"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_path: str, port: int, extra=(), env=None, timeout: float = 120.0):
    """`python -m tercomp serve` on 127.0.0.1:port, once /health answers."""
    import httpx
    proc = subprocess.Popen([sys.executable, "-m", "tercomp", "serve", model_path, "--port",
                             str(port), *extra], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tercomp serve exited ({proc.returncode}):\n{proc.stdout.read()}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop_server(proc)
    raise RuntimeError(f"tercomp serve did not answer /health in {timeout} s")


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server's base URL (…/v1); else one is started")
    p.add_argument("--name", help="the model name (default: the started server's)")
    p.add_argument("--api-key")
    p.add_argument("--model", help="a .tcm to serve (default: a random model of the shape below)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--max-seq", type=int, default=256)
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--threads", type=int, help="the server's local-task threads")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--prompt", default="8,64", help="prompt lengths MIN,MAX (default 8,64)")
    p.add_argument("--max-tokens", default="16,64", help="max_tokens MIN,MAX (default 16,64)")
    p.add_argument("--timeout", type=float, default=600.0, help="bound on the whole run (s)")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    (p0, p1), (m0, m1) = (map(int, s.split(",")) for s in (a.prompt, a.max_tokens))
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
          f"token p50 {s['ttft_p50_s'] * 1e3:.0f} ms, p99 {s['ttft_p99_s'] * 1e3:.0f} ms")
    print(f"{s['requests_per_s']:.1f} requests/s, {s['tokens_per_s']:.0f} generated tokens/s "
          f"({s['tokens']} tokens)")
    return 1 if s["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
