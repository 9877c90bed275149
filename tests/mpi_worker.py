"""One rank of the data-parallel tests (tests/test_distributed.py runs it under
`mpiexec -n 2`). Every rank writes the lines that the test reads to OUT_DIR/rank-R.log.

    mpiexec -n 2 python tests/mpi_worker.py train OUT_DIR   # steps, checkpoint, NaN, failure
    mpiexec -n 2 python tests/mpi_worker.py hang OUT_DIR    # rank 1 stops calling the step
    mpiexec -n 2 python tests/mpi_worker.py crash OUT_DIR   # rank 1 dies of an exception
    mpiexec -n 2 python tests/mpi_worker.py accumulate OUT_DIR   # accumulate_calls=2
    mpiexec -n 2 python tests/mpi_worker.py rank-only OUT_DIR    # no size in the environment
"""
import os
import sys
import time
import warnings

import numpy as np

import tercomp as tc
from tercomp import nn

STEPS, BATCH, D_IN, HIDDEN, CLASSES = 4, 16, 12, 16, 4


# Linear, not BitLinear: a float-rounding difference can flip a ternary weight at its
# threshold, and the test compares the two ways of computing the step to 1e-5.
class MLP(nn.Module):
    def __init__(self):
        self.fc1 = nn.Linear(D_IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x):
        return self.fc2(tc.relu(self.fc1(x)))


def loss_fn(model, x, y):
    logits = model(x)
    acc = tc.mean(tc.cast(tc.equal(tc.argmax(logits, axis=-1), y), "float32"))
    return tc.cross_entropy(logits, y), {"accuracy": acc}


def batches(n=STEPS):
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((BATCH, D_IN)).astype(np.float32),
             rng.integers(0, CLASSES, BATCH).astype(np.int32)) for _ in range(n)]


def make_step(seed=0, data_parallel=False, **kw):
    nn.manual_seed(seed)
    x, y = batches(1)[0]
    shard = BATCH // tc.distributed.world_size() if data_parallel is True else BATCH
    return tc.compile_train_step(loss_fn, MLP(), tc.optim.AdamW(3e-2, weight_decay=0.01),
                                 x[:shard], y[:shard], clip_norm=0.05, accumulate=2,
                                 data_parallel=data_parallel, **kw)


def shard(x, y):
    r, n = tc.distributed.rank(), tc.distributed.world_size()
    h = len(x) // n
    return x[r * h:(r + 1) * h], y[r * h:(r + 1) * h]


def say(out, msg):
    # a file per rank: mpiexec merges the ranks' stdout in chunks, not lines
    with open(os.path.join(out, f"rank-{tc.distributed.rank()}.log"), "a") as f:
        f.write(f"{msg}\n")


def nan_on_rank_1(out, step, x, y):
    """One step whose batch holds a NaN on rank 1 only; logs the error every rank gets."""
    if tc.distributed.rank() == 1:
        x = x.copy()
        x[0, 0] = np.nan
    try:
        step(x, y)
    except tc.TercompError as e:
        say(out, f"nan error: {e.message}")


def train(out):
    tc.distributed.init(timeout=60)
    # rank 1 starts from other weights: the step must broadcast rank 0's
    step = make_step(seed=tc.distributed.rank(), data_parallel=True, threads=1)
    for x, y in batches():
        loss, metrics = step(*shard(x, y))
        say(out, f"loss {loss!r} accuracy {metrics['accuracy']!r}")
    np.savez(os.path.join(out, f"params-{tc.distributed.rank()}.npz"), **step.params())
    tc.save_checkpoint(os.path.join(out, f"ckpt-{tc.distributed.rank()}.safetensors"), step)

    x, y = shard(*batches(1)[0])
    nan_on_rank_1(out, step, x, y)
    if tc.distributed.rank() == 1:
        x = x[:, :-1]                 # a wrong shape on rank 1 only
    try:
        step(x, y)
    except tc.TercompError as e:
        say(out, f"failure error: {type(e).__name__}: {e.message}")
    say(out, f"steps {step.steps}")


def accumulate(out):
    tc.distributed.init(timeout=60)
    step = make_step(seed=tc.distributed.rank(), data_parallel=True, threads=1,
                     accumulate_calls=2)
    for x, y in batches():            # 4 calls, 2 updates
        loss, _ = step(*shard(x, y))
        say(out, f"loss {loss!r}")
    np.savez(os.path.join(out, f"params-{tc.distributed.rank()}.npz"), **step.params())
    x, y = shard(*batches(1)[0])
    step(x, y)                        # the first call of an accumulation
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tc.save_checkpoint(os.path.join(out, "ckpt.safetensors"), step)
    say(out, f"warnings {[str(w.message) for w in caught]!r}")
    nan_on_rank_1(out, step, x, y)    # in the second call of the accumulation
    say(out, f"steps {step.steps}")


def rank_only(out):
    # as under a PMIx launcher that gives each rank its rank and not the job's size
    # (MPICH's own ranks need PMI_SIZE, so tercomp is the one that does not see it)
    tc.distributed._SIZE_VARS = ()
    tc.distributed.init(timeout=60)
    say(out, f"size {tc.distributed.world_size()}")


def hang(out):
    tc.distributed.init(timeout=60)
    step = make_step(data_parallel=True, threads=1)   # 2 ranks on 2 cores
    tc.distributed.init(timeout=3)    # after the compile, which rank 1 waits for
    x, y = shard(*batches(1)[0])
    if tc.distributed.rank() == 1:
        time.sleep(120)               # stops calling the step; rank 0 must not wait forever
    step(x, y)


def crash(out):
    tc.distributed.init(timeout=60)
    step = make_step(data_parallel=True, threads=1)   # 2 ranks on 2 cores
    x, y = shard(*batches(1)[0])
    if tc.distributed.rank() == 1:
        raise RuntimeError("rank 1 fails outside the step")
    step(x, y)


if __name__ == "__main__":
    {"train": train, "hang": hang, "crash": crash, "accumulate": accumulate,
     "rank-only": rank_only}[sys.argv[1]](sys.argv[2])
