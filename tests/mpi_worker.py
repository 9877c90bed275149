"""One rank of the data-parallel tests (tests/test_distributed.py runs it under
`mpiexec -n 2`). Every rank writes the lines that the test reads to OUT_DIR/rank-R.log.

    mpiexec -n 2 python tests/mpi_worker.py train OUT_DIR   # steps, checkpoint, NaN, failure
    mpiexec -n 2 python tests/mpi_worker.py hang OUT_DIR    # rank 1 stops calling the step
    mpiexec -n 2 python tests/mpi_worker.py crash OUT_DIR   # rank 1 dies of an exception
    mpiexec -n 2 python tests/mpi_worker.py accumulate OUT_DIR   # accumulate_calls=2
    mpiexec -n 2 python tests/mpi_worker.py rank-only OUT_DIR    # no size in the environment
    mpiexec -n 2 python tests/mpi_worker.py batchnorm OUT_DIR    # a CNN with BatchNorm
    mpiexec -n 2 python tests/mpi_worker.py syncbn OUT_DIR       # the CNN with SyncBatchNorm
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


class CNN(nn.Module):
    """BitConv2d + BatchNorm2d + pooling, then Linear + BatchNorm1d: two batch norms,
    the second fed by the first (SyncBatchNorm's statistics take rounds to settle).
    Ternary weights, float activations (act_quant=False): with int8 activations a third
    step differed by 0.5% in one conv weight between 2 half batches and the whole batch
    (the ternary weights were the same, and float Conv2d agreed: most likely an int8
    activation that rounds the other way), while
    the test compares the two to 1e-5."""

    def __init__(self):
        self.conv = nn.BitConv2d(3, 6, 3, padding=1, act_quant=False)
        self.bn = nn.BatchNorm2d(6)
        self.pool = nn.MaxPool2d(2)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(6 * 4 * 4, 8)
        self.bn1 = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, CLASSES)

    def forward(self, x):
        h = self.flat(self.pool(tc.relu(self.bn(self.conv(x)))))
        return self.out(tc.relu(self.bn1(self.fc(h))))


def images(n=3):
    rng = np.random.default_rng(2)
    return [((rng.standard_normal((BATCH // 2, 3, 8, 8)) + 0.5).astype(np.float32),
             rng.integers(0, CLASSES, BATCH // 2).astype(np.int32)) for _ in range(n)]


def make_cnn_step(sync=False, data_parallel=False, seed=0, **kw):
    """The CNN's step: a whole batch in one process, a half on each of 2 ranks (with
    SyncBatchNorm when `sync`)."""
    nn.manual_seed(seed)
    model = CNN()
    if sync:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    x, y = images(1)[0]
    shard = len(x) // tc.distributed.world_size() if data_parallel is True else len(x)
    return tc.compile_train_step(loss_fn, model, tc.optim.SGD(0.1, momentum=0.9), x[:shard],
                                 y[:shard], data_parallel=data_parallel, **kw)


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


def batchnorm(out, sync=False):
    """Steps of the CNN on half batches; after each, every rank saves its parameters and
    buffers (and the step's SyncBatchNorm rounds)."""
    tc.distributed.init(timeout=120)
    step = make_cnn_step(sync=sync, data_parallel=True, seed=tc.distributed.rank(), threads=1)
    r = tc.distributed.rank()
    for i, (x, y) in enumerate(images()):
        loss, _ = step(*shard(x, y))
        say(out, f"loss {loss!r} norm {step.grad_norm!r} rounds {step.sync_rounds}")
        np.savez(os.path.join(out, f"step{i}-{r}.npz"),
                 **{f"params/{k}": v for k, v in step.params().items()},
                 **{f"buffers/{k}": v for k, v in step.buffers().items()})


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
     "rank-only": rank_only, "batchnorm": batchnorm,
     "syncbn": lambda out: batchnorm(out, sync=True)}[sys.argv[1]](sys.argv[2])
