"""A 2-layer MLP traced with a symbolic batch, compiled once, run on several batch sizes.

    python samples/mlp.py
"""
import numpy as np

import tercomp as tc
from tercomp import nn


class MLP(nn.Module):
    def __init__(self, d_in=784, d_hidden=256, d_out=10):
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.fc2(tc.relu(self.fc1(x)))


def reference(model, x):
    """The same network in NumPy."""
    h = np.maximum(x @ model.fc1.weight.T + model.fc1.bias, 0)
    return h @ model.fc2.weight.T + model.fc2.bias


def main():
    nn.manual_seed(0)
    model = MLP()
    exe = tc.compile(model, tc.spec(("B", 784), "float32"))
    print(exe.ir("tern"))
    rng = np.random.default_rng(0)
    for batch in (1, 7, 64):
        x = rng.standard_normal((batch, 784)).astype(np.float32)
        y = exe(x)
        err = np.abs(y - reference(model, x)).max()
        print(f"batch {batch:3d}: output {y.shape}, max |tercomp - numpy| = {err:.2e}")
        assert np.allclose(y, reference(model, x), rtol=1e-5, atol=1e-5)
    print("mlp: OK")


if __name__ == "__main__":
    main()
