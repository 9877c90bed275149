"""Data-parallel training steps over MPI: `compile_train_step(..., data_parallel=True)`.

The single-process step is one compiled function; averaging gradients over ranks needs
the host in the middle, so a data-parallel step is two, in one shared device:

    grads(params, buffers, examples, *shard) -> packed   # forward + backward (+ accumulate)
    MPI Allreduce(packed, SUM)                      # ONE call, one contiguous f32 buffer
    apply(params, opt_state, summed) -> (new_params, new_state, norm)   # clip + update

`packed` is every gradient flattened (in the params' pytree order), then the model's
buffers as the rank's forward left them, the loss, the metrics, the rank's number of
examples and a failure flag, each but the last two multiplied by the number of examples.
`apply` divides by the summed count: gradients, loss and metrics are means over every
example of every rank (with equal shards, the mean over ranks), so N ranks with shards
of a batch compute the step one process does on the whole batch. Every rank runs `apply`
on the same bytes, so parameters stay identical; they start identical because rank 0's
are broadcast when the step is built.

Buffers (BatchNorm's running statistics) are averaged the same way, on the host, by
every rank from the same summed bytes, so they stay identical too: with BatchNorm, each
rank normalizes by its own shard's statistics (as PyTorch's DDP) and the running mean
becomes the mean over the global batch (exactly the single process's), the running
variance the mean of the ranks' (unbiased) shard variances. DDP instead broadcasts rank
0's buffers before each forward; the average uses every rank's examples and costs no
collective of its own.

SyncBatchNorm (nn/syncbn.py) needs the global batch's statistics in the middle of the
forward, and their gradient in the middle of the backward; the compiled step has no
collective inside, so the grads function is written so that repeating it converges:

    grads(params, buffers, examples, totals, cotangents, *shard) -> packed

runs the forward with every SyncBatchNorm normalizing by the statistics of `totals`
(per layer: sum, shifted sum of squares, count) and returns, besides the gradients, the
rank's own sums (`sums`) and the gradient of J = examples * loss + <cotangents, sums>
with respect to `totals` (`cot`). The host Allreduces [cot, sums] and calls it again with
totals = the summed sums, cotangents = the summed cot. A layer's sums depend only on the
statistics of the layers before it, so the totals are exact after L rounds (L layers,
starting from the running statistics), and the cotangents (the adjoint of the global
loss with respect to each layer's totals, which depends only on the layers after it)
L rounds after that; a round whose inputs come back unchanged (at most 2L + 1) had exact
inputs, and its gradients, those of J with the totals held fixed, summed over the ranks
are the gradient of the global batch's loss: the rank's direct part with the totals
fixed, plus, through <cotangents, sums>, the part through every layer's statistics,
which is what SyncBatchNorm's backward Allreduce gives. Then the usual one Allreduce
and apply. The price is up to 2L + 1 forward-and-backward passes a step, with one small
Allreduce each; the running statistics come out of the forward with the global
statistics, as one process's on the whole batch.

A rank whose step fails (a bad batch, an IREE error) still joins the Allreduce with its
failure flag set, and every rank raises; a NaN or Inf on any rank reaches every rank
through the sum, the update is skipped everywhere, and a second, small Allreduce names
the rank(s) it came from. A rank that dies or hangs is tercomp.distributed's timeout.
"""
from __future__ import annotations

import os

import numpy as np

from .. import distributed, pytree
from ..compiler import compile as tc_compile
from ..errors import ConfigError, ExecutionError
from ..tracing import api as _t
from ..nn.syncbn import sums_size
from .packing import KEY
from .step import TrainStep

F32 = np.dtype(np.float32)


class Layout:
    """Where each part sits in the packed buffer: the gradients (the packed gradient
    vector of training.packing when the parameters are packed, else one slice per
    parameter in pytree order), then SyncBatchNorm's `cot` and `sums` (`stats` values
    each, none without SyncBatchNorm), the buffers, loss, metrics, examples, failed."""

    def __init__(self, params, packing=None, buffers=None, stats: int = 0):
        leaves, _, self.treedef = pytree.flatten(params)
        self.packing = packing
        self.shapes = [tuple(np.shape(x)) for x in leaves]
        self.dtypes = [np.asarray(x).dtype for x in leaves]
        self.offsets = np.cumsum([0] + [int(np.prod(s)) for s in self.shapes]).tolist()
        self.stats = stats
        self.cot = packing.size if packing is not None else self.offsets[-1]
        self.sums = self.cot + stats
        self.buffers = self.sums + stats
        self.buffer_shapes = {k: np.shape(v) for k, v in (buffers or {}).items()}
        self.buffer_dtypes = {k: np.asarray(v).dtype for k, v in (buffers or {}).items()}
        self.loss = self.buffers + sum(int(np.prod(s)) for s in self.buffer_shapes.values())
        self.metrics = []         # names, set when the grads function is traced

    @property
    def examples(self) -> int:
        return self.loss + 1 + len(self.metrics)

    @property
    def size(self) -> int:
        return self.examples + 2

    def pack(self, loss, aux, grads, examples, buffers, sums=None, cot=None):
        """The grads function's result: one f32 vector. `grads` are means over the rank's
        examples, or, with SyncBatchNorm's `sums` and `cot`, already sums."""
        self.metrics = list(aux)
        scale = examples if sums is None else 1.0
        if self.packing is not None:
            parts = [self.packing.concatenate(grads)[KEY] * scale]
        else:
            parts = []
            for g, dtype in zip(pytree.flatten(grads)[0], self.dtypes):
                g = g if dtype == F32 else _t.astype(g, "float32")
                parts.append(_t.reshape(g, (-1,)) * scale)
        if sums is not None:
            parts += [cot, sums]
        for k in self.buffer_shapes:
            b = buffers[k] if self.buffer_dtypes[k] == F32 else _t.astype(buffers[k], "float32")
            parts.append(_t.reshape(b, (-1,)) * examples)
        parts += [_t.reshape(v * examples, (1,)) for v in [loss, *aux.values()]]
        parts += [_t.reshape(examples, (1,)), np.zeros(1, np.float32)]    # failed: 0
        return _t.concatenate(parts)

    def unpack_grads(self, summed):
        """The mean gradients, as a pytree like params (or the packed gradient), from the
        summed buffer."""
        inv = 1.0 / summed[self.examples]
        if self.packing is not None:
            return {KEY: summed[:self.cot] * inv}, summed[self.loss] * inv
        leaves = []
        for i, (shape, dtype) in enumerate(zip(self.shapes, self.dtypes)):
            g = _t.reshape(summed[self.offsets[i]:self.offsets[i + 1]] * inv, shape)
            leaves.append(g if dtype == F32 else _t.astype(g, dtype.name))
        return pytree.unflatten(self.treedef, leaves), summed[self.loss] * inv

    def unpack_buffers(self, summed, at: int = 0) -> dict:
        """The buffers averaged over the examples summed in `summed` (on the host): a
        packed buffer, or its tail from packed index `at` on."""
        inv = 1.0 / summed[self.examples - at]
        out, i = {}, self.buffers - at
        for k, shape in self.buffer_shapes.items():
            n = int(np.prod(shape))
            out[k] = (summed[i:i + n] * inv).reshape(shape).astype(self.buffer_dtypes[k])
            i += n
        return out


def compile_data_parallel(rank_grads, update, model, optimizer, params, state, buffers,
                          example_batch, *, on_nan, accumulate, clip_norm,
                          compile_opts: dict, packing=None, sync=()) -> "DataParallelStep":
    """The two compiled functions of a data-parallel step (see the module docstring),
    built from compile_train_step's `rank_grads(params, buffers, examples, totals,
    cotangents, *batch) -> (loss, aux, grads, new_buffers, sums, cot)` and `update`.
    `params` and `state` are as the functions take them: packed when `packing` is given
    (training.packing). `sync`: the model's SyncBatchNorm layers in training mode, as
    (name, layer) pairs."""
    world = distributed.init()
    stats = sums_size([layer for _, layer in sync])
    layout = Layout(params if packing is None else packing.unpack_tree(params), packing,
                    buffers, stats)

    def grads(params, buffers, examples, *rest):
        totals, cot, batch = (rest[0], rest[1], rest[2:]) if stats else (None, None, rest)
        loss, aux, g, new_buffers, sums, cot = rank_grads(
            params if packing is None else packing.slices(params), buffers, examples,
            totals, cot, *batch)
        return layout.pack(loss, aux, g, examples, new_buffers, sums, cot)

    def apply(params, opt_state, summed):
        g, loss = layout.unpack_grads(summed)
        return update(params, opt_state, loss, g)

    def opts(name):        # each function's stages in a folder of its own
        dump = compile_opts.get("dump_dir")
        return {**compile_opts, "dump_dir": dump and os.path.join(dump, name), "name": name}

    def build():
        sync_args = (np.ones(stats, np.float32), np.zeros(stats, np.float32)) if stats else ()
        grads_exe = tc_compile(grads, params, buffers, np.float32(1), *sync_args,
                               *example_batch, **opts("train_grads"))
        apply_exe = tc_compile(apply, params, state, np.zeros(layout.size, np.float32),
                               **opts("train_apply"))
        return grads_exe, apply_exe
    grads_exe, apply_exe = _rank0_first(world, build, compile_opts.get("cache", True))
    (params, buffers), state = _from_rank0(world, (params, buffers), state)
    return DataParallelStep(grads_exe, apply_exe, world, layout, model, optimizer, params,
                            state, len(example_batch), False, on_nan, accumulate, clip_norm,
                            packing=packing, buffers=buffers, sync=sync)


def _rank0_first(world, build, cache: bool):
    """build() on rank 0, then on the other ranks, which find its modules in the compile
    cache instead of compiling N copies at once; with cache=False all at once. A failure
    on rank 0 stops every rank."""
    if world.size == 1 or not cache:
        return build()
    result = error = None
    if world.rank == 0:
        try:
            result = build()
        except Exception as e:          # the others must hear of it, then it is raised
            error = e
    failed = world.broadcast(np.array([error is not None], np.int32), "compiling the step")
    if error is not None:
        raise error
    if failed[0]:
        raise ExecutionError("rank 0 failed to compile the data-parallel training step (its "
                             "error says why); every rank stops")
    return result if world.rank == 0 else build()


def _from_rank0(world, params, state):
    """Rank 0's params and optimizer state on every rank (one broadcast of their bytes):
    a model initialized with another seed on another rank starts from rank 0's. `params`
    may be any pytree (the parameters and the buffers)."""
    if world.size == 1:
        return params, state
    trees = [pytree.flatten(t) for t in (params, state)]
    # np.array, not np.ascontiguousarray, which turns 0-d arrays into shape (1,).
    leaves = [np.array(x, order="C") for leaves, _, _ in trees for x in leaves]
    buf = world.broadcast(np.concatenate([x.reshape(-1).view(np.uint8) for x in leaves]),
                          "broadcasting rank 0's parameters")
    out, at = [], 0
    for x in leaves:
        out.append(buf[at:at + x.nbytes].view(x.dtype).reshape(x.shape).copy())
        at += x.nbytes
    n = len(trees[0][0])
    return pytree.unflatten(trees[0][2], out[:n]), pytree.unflatten(trees[1][2], out[n:])


def _examples(leaves) -> np.float32:
    """A shard's weight in the means: the leading dim of its first batch array with one."""
    for x in leaves:
        if np.ndim(x) >= 1:
            return np.float32(np.shape(x)[0])
    return np.float32(1)


class DataParallelStep(TrainStep):
    """A TrainStep whose gradients are averaged over the ranks of an MPI job; see
    compile_train_step(data_parallel=True). `exe` is the gradient function, `apply_exe`
    the update; `world` is tercomp.distributed's view of the job (`rank`, `size`)."""

    data_parallel = True

    def __init__(self, grads_exe, apply_exe, world, layout, model, optimizer, params, state,
                 n_batch, has_aux, on_nan, accumulate, clip_norm, packing=None, buffers=None,
                 sync=()):
        n_args = 5 if layout.stats else 3         # params, buffers, examples(, totals, cot)
        n_before = len(pytree.flatten(params)[0]) + len(pytree.flatten(buffers or {})[0]) + \
            n_args - 2
        super().__init__(grads_exe, model, optimizer, params, state, n_batch, has_aux, on_nan,
                         accumulate, clip_norm, n_before=n_before, n_args=n_args,
                         packing=packing, buffers=buffers)
        self.apply_exe = apply_exe
        self.world = world
        self.layout = layout
        self.sync = list(sync)       # (name, SyncBatchNorm) of the model
        self.sync_rounds = 0         # grads calls of the last step (SyncBatchNorm: up to 2L + 1)
        self._failed = np.zeros(layout.size, np.float32)
        self._failed[-1] = 1.0
        self._sum = None             # this rank's sum over the calls of an accumulation

    @property
    def is_main(self) -> bool:
        return self.world.rank == 0

    def __call__(self, *batch):
        """Run one step on this rank's shard; returns the loss over every rank's examples
        (and the metrics), the same on every rank. With accumulate_calls=k, the update
        (and the gradient Allreduce) is on every k-th call."""
        if self.stopped:
            nan = float("nan")
            return (nan, {}) if self.has_aux else nan
        n = self.steps + 1
        failure = None
        try:
            self._check_batch(batch)
        except Exception as e:        # joins the Allreduce with its flag set, then raised
            failure = e
        packed, failure = self._grads(n, batch, failure)
        if self.accumulate_calls > 1:
            return self._accumulate(n, packed, failure)
        summed = self.world.allreduce(packed, f"training step {n}: the gradient Allreduce")
        self._raise_failures(n, summed[-1], failure)
        params, state, norm = self.apply_exe(self._params, self._state, summed,
                                             keep_on_device=True)
        loss, metrics = self._means(summed)
        norm = float(np.asarray(norm))
        where = ""
        if not (np.isfinite(loss) and np.isfinite(norm)):
            bad = self.world.ranks_where(not np.isfinite(packed).all(),
                                         f"training step {n}: non-finite ranks")
            where = f" (from rank(s) {_names(bad)} of {self.world.size})"
        else:                         # the same average on every rank (the step's ok)
            self._buffers = self.layout.unpack_buffers(summed)
        return self._finish(params, state, loss, norm, metrics, where=where)

    def _grads(self, n, batch, failure):
        """(packed, failure): this rank's packed buffer for the step's batch (the failure
        buffer when the batch or the call failed). With SyncBatchNorm, the rounds of the
        module docstring, each with a small Allreduce of [cot, sums, failed], until a
        round's inputs come back unchanged (every rank stops at the same round: they
        compare the same summed bytes) or a rank failed."""
        lay = self.layout
        examples = _examples(pytree.flatten(batch)[0])
        totals, cot = self._initial_totals(), np.zeros(lay.stats, np.float32)
        rounds = 2 * len(self.sync) + 1 if lay.stats else 1
        packed = self._failed
        for i in range(rounds):
            self.sync_rounds = i + 1
            if failure is None:
                try:
                    args = (totals, cot) if lay.stats else ()
                    packed = np.asarray(self.exe(self._params, self._buffers, examples, *args,
                                                 *batch))
                except Exception as e:
                    failure, packed = e, self._failed
            if i == rounds - 1:
                break
            part = np.concatenate([packed[lay.cot:lay.buffers], packed[-1:]])
            part = self.world.allreduce(part, f"training step {n}: SyncBatchNorm's statistics "
                                              f"(round {i + 1})")
            new_cot, new_totals = part[:lay.stats], part[lay.stats:-1]
            if part[-1] > 0 or (np.array_equal(new_totals, totals) and
                                np.array_equal(new_cot, cot)):
                break
            totals, cot = new_totals, new_cot
        return packed, failure

    def _initial_totals(self) -> np.ndarray:
        """Totals whose statistics are the running ones (a count of 1): the first round's
        guess, finite so that no NaN enters the rounds."""
        parts = []
        for name, _ in self.sync:
            pre = f"{name}." if name else ""
            mean, var = (np.asarray(self._buffers[pre + k], np.float32).reshape(-1)
                         for k in ("running_mean", "running_var"))
            parts += [mean, var, np.ones(1, np.float32)]  # sum of squares about the mean
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def _accumulate(self, n, packed, failure):
        """One call of an accumulation of accumulate_calls: a small Allreduce of this
        call's loss, metrics, examples, failure and non-finite flags (the loss returned,
        and every rank stops together); the call's packed gradients are added to this
        rank's sum unless some rank's are not finite (then nothing changes, as on one
        process); on the k-th call, ONE Allreduce of the sums and the update."""
        lay = self.layout
        bad = failure is None and not np.isfinite(packed).all()
        head = np.concatenate([packed[lay.buffers:], np.float32([bad])])
        head = self.world.allreduce(head, f"training step {n}: the loss Allreduce")
        self._raise_failures(n, head[-2], failure)
        loss, metrics = self._means(head, at=lay.buffers)
        if head[-1] == 0 and np.isfinite(loss):   # each call's forward updates the buffers
            self._buffers = lay.unpack_buffers(head, at=lay.buffers)
        if head[-1] > 0:
            ranks = self.world.ranks_where(bad, f"training step {n}: non-finite ranks")
            where = f" (from rank(s) {_names(ranks)} of {self.world.size})"
            return self._finish(self._params, self._state, loss, float("nan"), metrics,
                                where=where)
        self._sum = packed.copy() if self._sum is None else self._sum + packed
        if self._calls < self.accumulate_calls - 1:
            return self._finish(self._params, self._state, loss, None, metrics)
        summed = self.world.allreduce(self._sum, f"training step {n}: the gradient Allreduce")
        self._sum = None
        params, state, norm = self.apply_exe(self._params, self._state, summed,
                                             keep_on_device=True)
        return self._finish(params, state, loss, float(np.asarray(norm)), metrics)

    def _raise_failures(self, n, failed, failure):
        if failed > 0:
            ranks = self.world.ranks_where(failure is not None, f"training step {n}: failed ranks")
            if failure is not None:
                raise failure
            raise ExecutionError(f"training step {n}: rank(s) {_names(ranks)} failed (their "
                                 "error says why); every rank stops",
                                 hint="fix the failing rank's batch or error and restart the job")

    def _means(self, summed, at=0):
        """(loss, metrics) as means over the examples summed in `summed` (a packed buffer,
        or its tail from packed index `at` on)."""
        lay = self.layout
        base = lay.loss - at
        total = summed[base + 1 + len(lay.metrics)]
        loss = float(summed[base] / total)
        return loss, {k: float(summed[base + 1 + i] / total) for i, k in enumerate(lay.metrics)}

    def __repr__(self):
        return (f"DataParallelStep({type(self.model).__name__}, {self.optimizer!r}, "
                f"rank {self.world.rank} of {self.world.size}, steps={self.steps}, "
                f"accumulate={self.accumulate}, clip_norm={self.clip_norm}, on_nan={self.on_nan!r})")


def _names(ranks) -> str:
    return ", ".join(str(r) for r in ranks) or "?"


def check_options(data_parallel) -> None:
    if not isinstance(data_parallel, bool):
        raise ConfigError(f"compile_train_step: data_parallel must be True or False, got "
                          f"{data_parallel!r}")
