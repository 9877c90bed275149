"""Compile time of a training step: tc.compile_train_step against jax.jit's first call.

The model is the one of issue #24: a 3-layer `models.BitNetLM` with the relu2 feed-forward
(hidden 256, intermediate 512, 4 query / 2 K/V heads, sub-norms, tied embedding, a byte
vocabulary of 257), a batch of 6 x 96 tokens, mean cross-entropy, gradient clipping to
norm 1 and AdamW. The JAX step is the same network written in JAX: BitLinear with absmean
ternary weights and per-token absmax int8 activations (both straight-through), RMSNorm,
neox RoPE, causal GQA attention, relu2 FFN, tied head, the same AdamW and clipping, and
the same skip-the-update-on-NaN guard.

Each measurement runs in a fresh process: tercomp with an empty compile cache
($TERCOMP_CACHE_DIR a new temporary directory) timed from `compile_train_step` through
the first step's loss, JAX timed from `jax.jit(step)` through its first call's loss
(trace + compile + run; JAX keeps no compile cache unless told to). Imports are not
counted (reported apart). The engines take turns over `--rounds`; the table gives the
median and the best of each (wall clock, and the process's CPU time, which a busy machine
disturbs less) and their ratios, then each one's step time after warm-up.
Both start from the same weights (written once by this process), so their first losses
must agree; the bench checks that.

    python bench/compile_time.py                   # 3 rounds
    python bench/compile_time.py --rounds 5 --hidden 512
    python bench/compile_time.py --profile out/    # cProfile of tercomp's compile + its MLIR

JAX is optional (`pip install -e '.[peer]'`): without it the tercomp column alone is
printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, BATCH, SEQ, LAYERS = 257, 6, 96, 3
LR, WD, BETAS, EPS, CLIP = 1e-3, 0.01, (0.9, 0.999), 1e-8, 1.0


def config(hidden: int):
    from tercomp import models
    return models.BitNetConfig(vocab_size=VOCAB, hidden_size=hidden,
                               intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
                               num_attention_heads=4, num_key_value_heads=2,
                               rope_theta=10000.0, hidden_act="relu2",
                               max_position_embeddings=SEQ, tie_word_embeddings=True)


# -- tercomp ----------------------------------------------------------------------------
def run_tercomp(data: dict, hidden: int, warm_steps: int, profile: str | None) -> dict:
    t0 = time.perf_counter()
    import tercomp as tc
    from tercomp import models
    t_import = time.perf_counter() - t0
    lm = models.BitNetLM(config(hidden))
    lm.load_state_dict({k: v for k, v in data.items() if k not in ("x", "y")})
    x, y = data["x"], data["y"]

    def loss_fn(lm, x, y):
        return tc.cross_entropy(lm(x).reshape(-1, VOCAB), y.reshape(-1))

    opt = tc.optim.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    prof = None
    if profile:
        import cProfile
        prof = cProfile.Profile()
        prof.enable()
    t0, c0 = time.perf_counter(), time.process_time()
    step = tc.compile_train_step(loss_fn, lm, opt, x, y, clip_norm=CLIP,
                                 dump_dir=profile or None)
    t_compile = time.perf_counter() - t0
    loss = float(step(x, y))
    t_first, c_first = time.perf_counter() - t0, time.process_time() - c0
    if prof is not None:
        prof.disable()
        prof.dump_stats(os.path.join(profile, "tercomp.prof"))
    return {"import": t_import, "compile": t_compile, "first": t_first, "cpu": c_first,
            "loss": loss, "step": _step_time(lambda: float(step(x, y)), warm_steps)}


# -- JAX ----------------------------------------------------------------------------------
def run_jax(data: dict, hidden: int, warm_steps: int) -> dict:
    t0 = time.perf_counter()
    import jax
    import jax.numpy as jnp
    t_import = time.perf_counter() - t0
    sg = jax.lax.stop_gradient
    h_q, h_kv = 4, 2
    d = hidden // h_q
    g = h_q // h_kv
    eps_norm = 1e-5
    pos = np.arange(SEQ, dtype=np.float64)[:, None]
    ang = pos * (10000.0 ** (-np.arange(0, d, 2, dtype=np.float64) / d))[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    causal = np.tril(np.ones((SEQ, SEQ), bool))

    def straight_through(x, q):
        return x - sg(x) + sg(q)          # the value of q, the gradient of x

    def ternarize(w):
        s = jnp.maximum(jnp.mean(jnp.abs(w)), 1e-5)
        r = w / s
        t = jnp.where(r > 0.5, 1.0, jnp.where(r < -0.5, -1.0, 0.0))
        return straight_through(w, t * s)

    def act_quant(x):
        amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
        s = 127.0 / jnp.maximum(amax, 1e-5)
        return straight_through(x, jnp.clip(jnp.round(x * s), -127.0, 127.0) / s)

    def bitlinear(x, w):
        return act_quant(x) @ ternarize(w).T

    def rms_norm(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps_norm) * w

    def rope(x):                                     # x [B, T, H, D], neox pairs (i, i + D/2)
        c, s = cos[:, None, :], sin[:, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)

    def layer(p, pre, x):
        n = rms_norm(x, p[pre + "input_layernorm.weight"])
        b = x.shape[0]
        q = rope(bitlinear(n, p[pre + "attn.q_proj.weight"]).reshape(b, SEQ, h_q, d))
        k = rope(bitlinear(n, p[pre + "attn.k_proj.weight"]).reshape(b, SEQ, h_kv, d))
        v = bitlinear(n, p[pre + "attn.v_proj.weight"]).reshape(b, SEQ, h_kv, d)
        q = q.reshape(b, SEQ, h_kv, g, d)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k) * np.float32(1.0 / np.sqrt(d))
        scores = jnp.where(causal, scores, np.float32(-1e30))
        out = jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(scores, axis=-1), v)
        out = rms_norm(out.reshape(b, SEQ, hidden), p[pre + "attn.attn_sub_norm.weight"])
        h = x + bitlinear(out, p[pre + "attn.o_proj.weight"])
        m = rms_norm(h, p[pre + "post_attention_layernorm.weight"])
        gate = jnp.maximum(bitlinear(m, p[pre + "mlp.gate_proj.weight"]), 0.0)
        y = gate * gate * bitlinear(m, p[pre + "mlp.up_proj.weight"])
        y = rms_norm(y, p[pre + "mlp.ffn_sub_norm.weight"])
        return h + bitlinear(y, p[pre + "mlp.down_proj.weight"])

    def loss_fn(p, ids, labels):
        emb = p["embed_tokens.weight"]
        x = emb[ids]
        for i in range(LAYERS):
            x = layer(p, f"layers.{i}.", x)
        logits = rms_norm(x, p["norm.weight"]) @ emb.T
        logits = logits.reshape(-1, VOCAB)
        lse = jax.nn.logsumexp(logits, axis=-1)
        return jnp.mean(lse - jnp.take_along_axis(logits, labels.reshape(-1, 1), axis=-1)[:, 0])

    def train_step(p, state, ids, labels):
        loss, grads = jax.value_and_grad(loss_fn)(p, ids, labels)
        norm = jnp.sqrt(sum(jnp.sum(gr * gr) for gr in jax.tree_util.tree_leaves(grads)))
        scale = CLIP / jnp.maximum(norm, CLIP)
        grads = jax.tree_util.tree_map(lambda gr: gr * scale, grads)
        b1, b2 = BETAS
        c1 = (1.0 - b1) + b1 * state["corr1"]
        c2 = (1.0 - b2) + b2 * state["corr2"]
        mu = jax.tree_util.tree_map(lambda m, gr: b1 * m + (1.0 - b1) * gr, state["mu"], grads)
        nu = jax.tree_util.tree_map(lambda v, gr: b2 * v + (1.0 - b2) * (gr * gr), state["nu"], grads)

        def upd(w, m, v):
            w = w - (LR * WD) * w
            return w - LR * (m / c1) / (jnp.sqrt(v / c2) + EPS)
        new_p = jax.tree_util.tree_map(upd, p, mu, nu)
        new_s = {"step": state["step"] + 1.0, "corr1": c1, "corr2": c2, "mu": mu, "nu": nu}
        ok = jnp.abs(loss + norm) <= np.finfo(np.float32).max
        keep = lambda n, o: jnp.where(ok, n, o)           # noqa: E731
        return (jax.tree_util.tree_map(keep, new_p, p), jax.tree_util.tree_map(keep, new_s, state),
                loss, norm)

    params = {k: jnp.asarray(v) for k, v in data.items() if k not in ("x", "y")}
    state = {k: jnp.zeros((), jnp.float32) for k in ("step", "corr1", "corr2")}
    state.update({
             "mu": {k: jnp.zeros_like(v) for k, v in params.items()},
             "nu": {k: jnp.zeros_like(v) for k, v in params.items()}})
    x, y = jnp.asarray(data["x"]), jnp.asarray(data["y"])
    jax.block_until_ready((params, state, x, y))
    t0, c0 = time.perf_counter(), time.process_time()
    step = jax.jit(train_step, donate_argnums=(0, 1))
    params, state, loss, _ = step(params, state, x, y)
    loss = float(loss)
    t_first, c_first = time.perf_counter() - t0, time.process_time() - c0
    box = [params, state]

    def one():
        box[0], box[1], l, _ = step(box[0], box[1], x, y)
        return float(l)
    return {"import": t_import, "compile": t_first, "first": t_first, "cpu": c_first,
            "loss": loss, "step": _step_time(one, warm_steps), "jax": jax.__version__}


def _step_time(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


# -- driver ---------------------------------------------------------------------------------
def write_data(path: str, hidden: int):
    """The model's initial weights (tercomp's init, seed 0) and one batch, as an .npz."""
    sys.path.insert(0, ROOT)
    from tercomp import models, nn
    nn.manual_seed(0)
    lm = models.BitNetLM(config(hidden))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
    np.savez(path, x=ids[:, :-1], y=ids[:, 1:], **lm.state_dict())


def child(args):
    data = dict(np.load(args.data))
    if args.engine == "tercomp":
        sys.path.insert(0, ROOT)
        out = run_tercomp(data, args.hidden, args.steps, args.profile)
    else:
        out = run_jax(data, args.hidden, args.steps)
    print("RESULT " + json.dumps(out))


def measure(engine: str, args, data: str) -> dict:
    env = dict(os.environ, TERCOMP_CACHE_DIR=tempfile.mkdtemp(prefix="tercomp_ct_cache_"),
               JAX_PLATFORMS="cpu")
    env.pop("TERCOMP_DUMP", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", engine, "--data", data,
           "--hidden", str(args.hidden), "--steps", str(args.steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"{engine} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def has_jax() -> bool:
    try:
        import jax  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20, help="timed steps after warm-up")
    ap.add_argument("--profile", default=None,
                    help="a directory: one tercomp compile under cProfile (tercomp.prof) with "
                         "its stages dumped there; no comparison")
    ap.add_argument("--child", choices=("tercomp", "jax"), help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        args.engine = args.child
        return child(args)
    tmp = tempfile.mkdtemp(prefix="tercomp_ct_")
    data = os.path.join(tmp, "data.npz")
    write_data(data, args.hidden)
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
        env = dict(os.environ, TERCOMP_CACHE_DIR=tempfile.mkdtemp(prefix="tercomp_ct_cache_"))
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "tercomp",
                        "--data", data, "--hidden", str(args.hidden), "--steps", "3",
                        "--profile", os.path.abspath(args.profile)], env=env, check=True)
        print(f"profile in {args.profile}/tercomp.prof, stages beside it")
        return
    engines = ["tercomp"] + (["jax"] if has_jax() else [])
    runs = {e: [] for e in engines}
    for r in range(args.rounds):
        for e in engines:
            runs[e].append(measure(e, args, data))
            print(f"round {r + 1}: {e:8s} compile+first step {runs[e][-1]['first']:6.2f} s",
                  flush=True)
    cpu = _cpu_name()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n3-layer relu2 BitNetLM, hidden {args.hidden}, batch {BATCH} x {SEQ}, AdamW, "
          f"clip 1.0; {cpu}, {os.cpu_count()} CPUs (load average {load:.1f}); "
          f"{args.rounds} rounds, fresh processes")
    print(f"  {'':10s} {'wall median':>11s} {'best':>7s}   {'CPU median':>10s} {'best':>7s}"
          f"   {'step (warm)':>11s}  {'import':>6s}  first loss")
    stat = {e: {k: (statistics.median(r[k] for r in runs[e]), min(r[k] for r in runs[e]))
                for k in ("first", "cpu", "step", "import", "compile")} for e in engines}
    for e in engines:
        st = stat[e]
        print(f"  {e:10s} {st['first'][0]:10.2f}s {st['first'][1]:6.2f}s   {st['cpu'][0]:9.2f}s "
              f"{st['cpu'][1]:6.2f}s   {st['step'][0] * 1e3:8.1f} ms  {st['import'][0]:5.2f}s  "
              f"{runs[e][0]['loss']:.5f}")
    if "jax" in runs:
        t, j = stat["tercomp"], stat["jax"]
        print(f"  tercomp / JAX (jax {runs['jax'][0]['jax']}): wall {t['first'][0] / j['first'][0]:.2f}x "
              f"median, {t['first'][1] / j['first'][1]:.2f}x best; CPU time "
              f"{t['cpu'][0] / j['cpu'][0]:.2f}x median")
        lt, lj = runs["tercomp"][0]["loss"], runs["jax"][0]["loss"]
        agree = abs(lt - lj) <= 1e-3 * max(1.0, abs(lj))
        print(f"  first losses {'agree' if agree else 'DIFFER'}: {lt:.5f} vs {lj:.5f}")
    else:
        print("  jax: skipped (not installed; pip install -e '.[peer]')")
    print(f"  tercomp compile alone (before the first step): {stat['tercomp']['compile'][0]:.2f}s "
          f"median")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main(sys.argv[1:])
