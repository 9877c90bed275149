"""Prefix caching and speculative decoding (issue #35), in process, on a random ternary
GGUF of the given shape (bench/lm.py's `write_model`; default the bitnet_b1_58-large
shape, hidden 1536, 24 layers):

    python bench/prefix_spec.py                      # both parts, 700M shape
    python bench/prefix_spec.py --layers 4 --part chat --rounds 1   # a quick check
    python bench/prefix_spec.py --part shared --gguf /tmp/me/lm700.gguf --clients 4 8

`chat`: a 10-turn chat through runtime.Engine (a BatchedLMGenerator of --slots slots),
each turn's prompt the whole history (a --system-token system prompt, every message of
--message tokens and every greedy answer of --answer tokens) and a new message; the
time to first token of each turn with the prefix cache and without it (the engines
taking turns over --rounds rounds; the tokens of both must be equal).

`shared`: --clients requests (each count in turn) arriving together, every prompt a
--shared-system-token system prompt (new random tokens each run, so no earlier run's
rows are in any slot) and its own --message tokens, --answer greedy tokens each, through
an Engine of --slots slots (at least the clients); time to first token of each with
the prefix cache on (a running sequence's prefix rows copied into the others' slots by
copy_rows) and off (every prompt prefilled in full), in turns over --rounds rounds (the
tokens of both must be equal). Also the time of one copy_prefix of the system prompt's
rows between two slots and a one-token step, against the step alone (the copy returns
before the device has run it).

`spec`: single-stream greedy decoding of --gen tokens with `speculative="prompt_lookup"`
(num_draft 2, 4 and 8) against plain decoding, on a repetitive prompt (a block of code
tokens pasted 3 times, as a document being edited) and on a random one; decode
tokens/s, drafted and accepted tokens, model calls. Also the time of one verify call
of k + 1 tokens against one decode call: with `a` drafts accepted per call on average
speculative decoding runs (a + 1) x decode-time / verify-time faster, whatever the
model. A random model's greedy text repeats itself, so its acceptance is not a real
model's; the per-call costs are.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import machine  # noqa: E402  (bench/machine.py)
from lm import write_model  # noqa: E402  (bench/lm.py)


def chat(gen, a) -> None:
    from tercomp.runtime.scheduler import Engine
    rng = np.random.default_rng(1)
    system = rng.integers(3, a.vocab, a.system)
    messages = [rng.integers(3, a.vocab, a.message) for _ in range(a.turns)]
    ttft = {True: [], False: []}
    with Engine(gen, prefix_cache=False) as engine:        # warm-up: first calls load more
        engine.generate(system, max_tokens=2)
    answers = {}
    for rnd in range(a.rounds):
        for cached in ((True, False) if rnd % 2 == 0 else (False, True)):
            history, times, outs = system, [], []
            with Engine(gen, prefix_cache=cached) as engine:
                for msg in messages:
                    prompt = np.concatenate([history, msg]).astype(np.int32)
                    r = engine.submit(prompt, max_tokens=a.answer)
                    toks = r.result(600)
                    times.append(r.first_token - r.submitted)
                    outs.append(toks)
                    history = np.concatenate([prompt, toks])
                stats = engine.stats()
            ttft[cached].append(times)
            answers.setdefault(cached, outs)
            print(f"  round {rnd} prefix cache {'on ' if cached else 'off'}: TTFT per turn (ms) "
                  f"{' '.join(f'{t * 1e3:.0f}' for t in times)}; prompt tokens "
                  f"{stats['prompt_tokens_total']}, reused {stats['prompt_tokens_cached_total']}",
                  flush=True)
    same = all(np.array_equal(x, y) for x, y in zip(answers[True], answers[False]))
    print(f"final prompt {history.size - a.answer} tokens; greedy answers equal: {same}")
    for turn in range(a.turns):
        on = statistics.median(r[turn] for r in ttft[True])
        off = statistics.median(r[turn] for r in ttft[False])
        print(f"  turn {turn + 1:2d}: TTFT median on {on * 1e3:7.1f} ms, off {off * 1e3:7.1f} ms, "
              f"{off / on:5.1f}x")
    tot_on = statistics.median(sum(r) for r in ttft[True])
    tot_off = statistics.median(sum(r) for r in ttft[False])
    print(f"  all turns: on {tot_on:.3f} s, off {tot_off:.3f} s ({tot_off / tot_on:.1f}x)")


def shared(gen, a) -> None:
    from tercomp.runtime.scheduler import Engine
    rng = np.random.default_rng(3)
    with Engine(gen, prefix_cache=False) as engine:        # warm-up: first calls load more
        engine.generate(rng.integers(3, a.vocab, 8), max_tokens=2)
    # copy_rows returns before the device has run it (no result to wait for): timed
    # with the one-token step after it, against that step alone
    gen.prefill(rng.integers(3, a.vocab, a.shared_system), slot=0)
    gen.prefill(rng.integers(3, a.vocab, 8), slot=2)
    times = {"copy": [], "step": []}
    for i in range(20):
        what = "copy" if i % 2 else "step"
        gen.rollback(2, 8)
        t0 = time.perf_counter()
        if what == "copy":
            gen.copy_prefix(0, 1, a.shared_system)
        gen.decode(5, slot=2)
        times[what].append(time.perf_counter() - t0)
    copy, step = (statistics.median(times[k]) for k in ("copy", "step"))
    print(f"  copy_prefix of {a.shared_system} rows then a one-token step: median "
          f"{copy * 1e3:.1f} ms; the step alone {step * 1e3:.1f} ms", flush=True)
    for clients in a.clients:
        ttft = {True: [], False: []}
        for rnd in range(a.rounds):
            system = rng.integers(3, a.vocab, a.shared_system)
            prompts = [np.concatenate([system, rng.integers(3, a.vocab, a.message)]).astype(np.int32)
                       for _ in range(clients)]
            outs = {}
            for on in ((True, False) if rnd % 2 == 0 else (False, True)):
                with Engine(gen, prefix_cache=on, start=False) as engine:
                    reqs = [engine.submit(p, max_tokens=a.answer) for p in prompts]
                    engine.start()                     # all arrive together
                    outs[on] = [r.result(600) for r in reqs]
                    stats = engine.stats()
                t = sorted(r.first_token - r.submitted for r in reqs)
                ttft[on].append(t)
                print(f"  {clients} clients, round {rnd}, sharing {'on ' if on else 'off'}: TTFT "
                      f"(ms) {' '.join(f'{x * 1e3:.0f}' for x in t)}; prompt tokens "
                      f"{stats['prompt_tokens_total']}, copied {stats['prompt_tokens_copied_total']}"
                      f", cached {stats['prompt_tokens_cached_total']}; {stats['steps_total']} steps",
                      flush=True)
            same = all(np.array_equal(x, y) for x, y in zip(outs[True], outs[False]))
            print(f"  greedy answers equal with and without: {same}", flush=True)
        for what, f in (("median", statistics.median), ("last", max)):
            on = statistics.median(f(t) for t in ttft[True])
            off = statistics.median(f(t) for t in ttft[False])
            print(f"  {clients} clients: {what} TTFT on {on * 1e3:.0f} ms, off {off * 1e3:.0f} ms "
                  f"({off / on:.1f}x)", flush=True)


def spec(gen, a) -> None:
    rng = np.random.default_rng(2)
    block = rng.integers(3, a.vocab, 64)
    prompts = {"repetitive": np.concatenate([block, rng.integers(3, a.vocab, 8), block,
                                             rng.integers(3, a.vocab, 8), block[:40]]),
               "random": rng.integers(3, a.vocab, 200)}
    # the cost of one call: 1 token (decode) against k + 1 (a verify)
    gen.prefill(prompts["random"])
    start = gen.position
    for k in (0, 1, 2, 4, 8):
        times = []
        for _ in range(20):
            t0 = time.perf_counter()
            gen.extend(np.full(k + 1, 5, np.int32), start)
            times.append(time.perf_counter() - t0)
        print(f"  one call of {k + 1} tokens at position {start}: median "
              f"{statistics.median(times) * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms")
    for name, p in prompts.items():
        runs = {}
        for rnd in range(a.rounds):
            for mode in (None, 2, 4, 8):
                kw = {} if mode is None else {"speculative": "prompt_lookup", "num_draft": mode}
                out = gen.generate(p, max_new_tokens=a.gen, **kw)
                s = gen.stats
                runs.setdefault(mode, []).append((s["decode_tokens"] / s["decode_s"], s, out))
        base = statistics.median(r[0] for r in runs[None])
        for mode, rs in runs.items():
            rate = statistics.median(r[0] for r in rs)
            s, out = rs[-1][1], rs[-1][2]
            same = np.array_equal(out, runs[None][0][2])
            extra = "" if mode is None else (f", k={mode}: {s['accepted']}/{s['drafted']} "
                                             f"drafts accepted, {s['steps']} calls")
            print(f"  {name:10s} {'plain' if mode is None else 'lookup':6s} {rate:7.1f} tokens/s "
                  f"({rate / base:.2f}x){extra}; tokens equal to plain: {same}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["chat", "spec", "shared", "both"], default="both")
    p.add_argument("--gguf", help="a GGUF to load instead of a random one of the shape below")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1536)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32002)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--max-seq", type=int, default=1024)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system", type=int, default=128, help="system prompt tokens")
    p.add_argument("--message", type=int, default=40, help="tokens of each user message")
    p.add_argument("--answer", type=int, default=32, help="greedy tokens of each answer")
    p.add_argument("--clients", type=int, nargs="+", default=[4, 8],
                   help="concurrent requests in `shared`")
    p.add_argument("--shared-system", type=int, default=256,
                   help="system prompt tokens in `shared`")
    p.add_argument("--gen", type=int, default=128, help="tokens generated in `spec`")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    a.arch, a.kv_heads = "bitnet", 0
    import tercomp as tc
    from tercomp import models
    print(f"{machine.cpu()}; {machine.load()}; layers {a.layers}, hidden {a.hidden}, "
          f"threads {a.threads}", flush=True)
    with tempfile.TemporaryDirectory() as d:
        path = a.gguf or os.path.join(d, "lm.gguf")
        if not a.gguf:
            write_model(path, a)
        lm = models.load(path)
        a.vocab = lm.config.vocab_size
        if a.gguf:
            c = lm.config
            print(f"{a.gguf}: layers {c.num_hidden_layers}, hidden {c.hidden_size}, vocab "
                  f"{c.vocab_size}", flush=True)
        if a.part == "shared":
            slots = max(a.slots, *a.clients)
            print(f"shared: {', '.join(map(str, a.clients))} clients, system {a.shared_system}, "
                  f"messages {a.message}, answers {a.answer} tokens, {slots} slots", flush=True)
            shared(tc.compile_lm(lm, max_seq=a.max_seq, max_batch=slots, threads=a.threads), a)
        if a.part in ("chat", "both"):
            print(f"chat: {a.turns} turns, system {a.system}, messages {a.message}, answers "
                  f"{a.answer} tokens, {a.slots} slots", flush=True)
            chat(tc.compile_lm(lm, max_seq=a.max_seq, max_batch=a.slots, threads=a.threads), a)
        if a.part in ("spec", "both"):
            print(f"spec: {a.gen} greedy tokens", flush=True)
            spec(tc.compile_lm(lm, max_seq=a.max_seq, threads=a.threads), a)
    print(machine.load())
    return 0


if __name__ == "__main__":
    sys.exit(main())
