"""A pre-norm transformer block: causal self-attention, RMSNorm and an MLP.

    python samples/transformer_block.py
"""
import numpy as np

import tercomp as tc
from tercomp import nn


class Block(nn.Module):
    def __init__(self, dim=64, heads=4, seq=16, hidden=256):
        self.dim, self.heads, self.seq = dim, heads, seq
        self.norm1 = nn.RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def attention(self, x):
        T, H, D = self.seq, self.heads, self.dim // self.heads
        qkv = self.qkv(x).reshape(-1, T, 3, H, D)
        q = qkv[:, :, 0].transpose((0, 2, 1, 3))            # [B, H, T, D]
        k = qkv[:, :, 1].transpose((0, 2, 1, 3))
        v = qkv[:, :, 2].transpose((0, 2, 1, 3))
        scores = (q @ k.transpose((0, 1, 3, 2))) * (1.0 / np.sqrt(D))
        causal = np.tril(np.ones((T, T), dtype=bool))
        scores = tc.where(causal, scores, -1e9)
        out = tc.softmax(scores, axis=-1) @ v                # [B, H, T, D]
        return self.proj(out.transpose((0, 2, 1, 3)).reshape(-1, T, self.dim))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.down(tc.gelu(self.up(self.norm2(x))))


def reference(m, x):
    """The same block in NumPy."""
    def rms(x, w, eps=1e-6):
        return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    B, T, C = x.shape
    H, D = m.heads, C // m.heads
    qkv = (rms(x, m.norm1.weight) @ m.qkv.weight.T).reshape(B, T, 3, H, D)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -1e9)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    a = (p @ v).transpose(0, 2, 1, 3).reshape(B, T, C) @ m.proj.weight.T
    x = x + a
    h = gelu(rms(x, m.norm2.weight) @ m.up.weight.T + m.up.bias)
    return x + h @ m.down.weight.T + m.down.bias


def main():
    nn.manual_seed(0)
    block = Block()
    exe = tc.compile(block, tc.spec(("B", block.seq, block.dim), "float32"))
    rng = np.random.default_rng(0)
    for batch in (1, 3):
        x = rng.standard_normal((batch, block.seq, block.dim)).astype(np.float32)
        y = exe(x)
        ref = reference(block, x)
        print(f"batch {batch}: max |tercomp - numpy| = {np.abs(y - ref).max():.2e}")
        assert np.allclose(y, ref, rtol=1e-4, atol=1e-4)
    print("transformer_block: OK")


if __name__ == "__main__":
    main()
