"""Sentence embeddings per second: `tc.compile_embed` on the shape of BitNet's
bitnet-embedding-0.6b (a Qwen3-0.6B backbone: hidden 1024, 28 layers, 16 query / 8 K/V
heads of head_dim 128, intermediate 3072, vocabulary 151,936, BitLinear's RMSNorm on
every projection's input, q/k norms, last-token pooling, L2 normalised) at batch 32 x
128 tokens, against the same network in float32 NumPy (the ternary weights as float32
matrices, the same per-token int8 activation quantization, BLAS matmuls).

llama.cpp's `llama-embedding` would be the peer, but no llama.cpp build runs this
architecture (checked 2026-11-27 on a file as bitnet.cpp's embedding converter writes
it): llama.cpp 0c1e570 refuses the per-projection norm tensors ("wrong number of
tensors; expected 52, got 38") and cannot read I2_S; bitnet.cpp 406a5036 has no `qwen3`
architecture; ik_llama.cpp does not know the `*_norm_in` tensors. So the float32 NumPy
network is the baseline, as issue #36 allows.

Random ternary weights (codes uniform in {-1, 0, 1}, scale 1/sqrt(fan-in)), random
token ids. One interleaved run: each round times tercomp once and NumPy once. Also
printed: the cosine between the two embeddings of every sequence (the same network:
>= 0.99 expected; int8 activations round the same way but accumulate in another order).

    python bench/embed.py                        # the 0.6B shape, 3 rounds
    python bench/embed.py --layers 4 --rounds 5  # a quicker look
    python bench/embed.py --rounds 3 --numpy-rounds 1   # NumPy once (a loaded machine)
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tercomp as tc  # noqa: E402
from tercomp import models, nn  # noqa: E402
from tercomp import ternary_pack as tp  # noqa: E402
from tercomp.models.bitnet import rope_tables  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import machine  # noqa: E402

#: bitnet-embedding-0.6b (Qwen3-0.6B's config)
SHAPE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
             rope_theta=1_000_000.0, hidden_act="silu", max_position_embeddings=512,
             sub_norms=False, family="qwen3", proj_norms=True, qk_norm=True, pooling="last")
PROJ = {"attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
        "mlp": ("gate_proj", "up_proj", "down_proj")}


def build(layers: int, seed: int = 0):
    """(the BitNetLM, the float32 reference's weights: per layer a dict of projection ->
    (T^T float32 [in, out], scale), norms)."""
    cfg = models.BitNetConfig(num_hidden_layers=layers, **SHAPE)
    lm = models.BitNetLM(cfg, init=False)
    rng = np.random.default_rng(seed)
    h = cfg.hidden_size
    lm.embed_tokens.weight = rng.standard_normal((cfg.vocab_size, h), np.float32)
    norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    lm.norm.weight = norm(h)
    ref = []
    for layer in lm.layers:
        mine = {}
        for block, projs in PROJ.items():
            owner = getattr(layer, block)
            for p in projs:
                old = getattr(owner, p)
                n, k = old.out_features, old.in_features
                t = (rng.integers(0, 3, (n, k), dtype=np.int8) - np.int8(1))
                s = np.float32(1 / np.sqrt(k))
                setattr(owner, p, nn.StoredBitLinear.from_packed(tp.pack_ternary(t), k, s))
                nm = p.replace("_proj", "_norm_in")
                getattr(owner, nm).weight = norm(k)
                mine[p] = (np.ascontiguousarray(t.T, dtype=np.float32), s,
                           getattr(owner, nm).weight)
        for nm in ("input_layernorm", "post_attention_layernorm"):
            getattr(layer, nm).weight = norm(h)
        layer.attn.q_norm.weight, layer.attn.k_norm.weight = norm(cfg.head_dim), norm(cfg.head_dim)
        mine.update(ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                    qn=layer.attn.q_norm.weight, kn=layer.attn.k_norm.weight)
        ref.append(mine)
    return lm, ref


# ------------------------------------------------------------ the float32 reference
def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps)) * w


def _bitlinear(x, proj, eps):
    wt, s, nw = proj
    xq, qs = tp.act_quant(_rms(x, nw, eps))
    y = xq.reshape(-1, xq.shape[-1]) @ wt        # one 2-D GEMM (a stacked matmul is ~3x slower)
    return y.reshape(*xq.shape[:-1], -1) * (s / qs)


def _rope(x, cos, sin):           # x [B, T, heads, D], NeoX pairs (i, i + D/2)
    d = x.shape[-1] // 2
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x[..., :d], x[..., d:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def reference(lm, ref, ids, lengths):
    """The embeddings [B, hidden] of the network in float32 NumPy."""
    c = lm.config
    eps, hd, nh, kvh = c.rms_norm_eps, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    b, t = ids.shape
    cos, sin = rope_tables(c, np.arange(t))
    x = lm.embed_tokens.weight[ids]
    mask = np.triu(np.full((t, t), -np.inf, np.float32), 1)
    for w in ref:
        n = _rms(x, w["ln1"], eps)
        q = _rms(_bitlinear(n, w["q_proj"], eps).reshape(b, t, nh, hd), w["qn"], eps)
        k = _rms(_bitlinear(n, w["k_proj"], eps).reshape(b, t, kvh, hd), w["kn"], eps)
        v = _bitlinear(n, w["v_proj"], eps).reshape(b, t, kvh, hd)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        g = nh // kvh
        qg = q.reshape(b, t, kvh, g, hd).transpose(0, 2, 3, 1, 4)          # [B, KV, G, T, D]
        kt = k.transpose(0, 2, 3, 1)[:, :, None]                           # [B, KV, 1, D, T]
        sc = (qg @ kt) * np.float32(c.attention_scale) + mask
        sc = np.exp(sc - sc.max(-1, keepdims=True))
        sc /= sc.sum(-1, keepdims=True)
        o = sc @ v.transpose(0, 2, 1, 3)[:, :, None]                       # [B, KV, G, T, D]
        x = x + _bitlinear(o.transpose(0, 3, 1, 2, 4).reshape(b, t, nh * hd), w["o_proj"], eps)
        m = _rms(x, w["ln2"], eps)
        gate = _bitlinear(m, w["gate_proj"], eps)
        y = gate / (1 + np.exp(-gate)) * _bitlinear(m, w["up_proj"], eps)
        x = x + _bitlinear(y, w["down_proj"], eps)
    x = _rms(x, lm.norm.weight, eps)
    e = x[np.arange(b), np.asarray(lengths) - 1]
    return e / np.maximum(np.linalg.norm(e, axis=-1, keepdims=True), np.float32(1e-12))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28, help="decoder layers (28: the 0.6B)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--numpy-rounds", type=int, default=None,
                    help="rounds that also time NumPy (default all)")
    args = ap.parse_args(argv)
    args.numpy_rounds = args.rounds if args.numpy_rounds is None else args.numpy_rounds
    if not 1 <= args.numpy_rounds <= args.rounds:
        ap.error("--numpy-rounds must be from 1 to --rounds")
    print(f"{machine.cpu()}; {machine.load()} at the start")
    t0 = time.perf_counter()
    lm, ref = build(args.layers)
    print(f"built {args.layers} layers in {time.perf_counter() - t0:.1f} s")
    rng = np.random.default_rng(1)
    ids = rng.integers(0, lm.config.vocab_size, (args.batch, args.seq)).astype(np.int32)
    lengths = np.full(args.batch, args.seq, np.int32)
    t0 = time.perf_counter()
    enc = tc.compile_embed(lm, max_seq=args.seq, max_batch=args.batch)
    ours = enc(ids, lengths)                                   # compiles the module
    print(f"compile + first call: {time.perf_counter() - t0:.1f} s", flush=True)
    times = {"tercomp": [], "numpy f32": []}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        times[name].append(time.perf_counter() - t0)
        print(f"  {name}: {times[name][-1]:.2f} s", flush=True)
        return out
    # interleaved: each round times tercomp once and NumPy once (the first NumPy pass
    # also gives the cosine); `--numpy-rounds` can be fewer, NumPy being the slow one
    for r in range(args.rounds):
        timed("tercomp", lambda: enc(ids, lengths))
        if r < args.numpy_rounds:
            theirs = timed("numpy f32", lambda: reference(lm, ref, ids, lengths))
            if r == 0:
                cos = np.sum(ours * theirs, axis=-1)
                print(f"cosine tercomp / NumPy per sequence: min {cos.min():.5f}, mean "
                      f"{cos.mean():.5f}", flush=True)
    print(f"batch {args.batch} x {args.seq} tokens, {args.layers} layers (median / best):")
    for name, ts in times.items():
        med, best = float(np.median(ts)), min(ts)
        print(f"  {name:10s} {med:8.2f} / {best:8.2f} s a batch = "
              f"{args.batch / med:7.2f} / {args.batch / best:7.2f} embeddings/s ({len(ts)} runs)")
    ratio = np.median(times["numpy f32"]) / np.median(times["tercomp"])
    print(f"tercomp is {ratio:.2f}x NumPy's embeddings/s (medians); {machine.load()} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
