"""Data-parallel training steps over MPI: `compile_train_step(..., data_parallel=True)`.

The single-process step is one compiled function; averaging gradients over ranks needs
the host in the middle, so a data-parallel step is two, in one shared device:

    grads(params, examples, *shard) -> packed       # forward + backward (+ accumulate)
    MPI Allreduce(packed, SUM)                      # ONE call, one contiguous f32 buffer
    apply(params, opt_state, summed) -> (new_params, new_state, norm)   # clip + update

`packed` is every gradient flattened (in the params' pytree order), then the loss, the
metrics, the rank's number of examples and a failure flag, each but the last two
multiplied by the number of examples. `apply` divides by the summed count: gradients,
loss and metrics are means over every example of every rank (with equal shards, the
mean over ranks), so N ranks with shards of a batch compute the step one process does on
the whole batch. Every rank runs `apply` on the same bytes, so parameters stay identical;
they start identical because rank 0's are broadcast when the step is built.

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
from .packing import KEY
from .step import TrainStep

F32 = np.dtype(np.float32)


class Layout:
    """Where each part sits in the packed buffer: the gradients (the packed gradient
    vector of training.packing when the parameters are packed, else one slice per
    parameter in pytree order), then loss, metrics, examples, failed."""

    def __init__(self, params, packing=None):
        leaves, _, self.treedef = pytree.flatten(params)
        self.packing = packing
        self.shapes = [tuple(np.shape(x)) for x in leaves]
        self.dtypes = [np.asarray(x).dtype for x in leaves]
        self.offsets = np.cumsum([0] + [int(np.prod(s)) for s in self.shapes]).tolist()
        self.loss = packing.size if packing is not None else self.offsets[-1]
        self.metrics = []         # names, set when the grads function is traced

    @property
    def examples(self) -> int:
        return self.loss + 1 + len(self.metrics)

    @property
    def size(self) -> int:
        return self.examples + 2

    def pack(self, loss, aux, grads, examples):
        """The grads function's result: one f32 vector."""
        self.metrics = list(aux)
        if self.packing is not None:
            parts = [self.packing.concatenate(grads)[KEY] * examples]
        else:
            parts = []
            for g, dtype in zip(pytree.flatten(grads)[0], self.dtypes):
                g = g if dtype == F32 else _t.astype(g, "float32")
                parts.append(_t.reshape(g, (-1,)) * examples)
        parts += [_t.reshape(v * examples, (1,)) for v in [loss, *aux.values()]]
        parts += [_t.reshape(examples, (1,)), np.zeros(1, np.float32)]    # failed: 0
        return _t.concatenate(parts)

    def unpack_grads(self, summed):
        """The mean gradients, as a pytree like params (or the packed gradient), from the
        summed buffer."""
        inv = 1.0 / summed[self.examples]
        if self.packing is not None:
            return {KEY: summed[:self.loss] * inv}, summed[self.loss] * inv
        leaves = []
        for i, (shape, dtype) in enumerate(zip(self.shapes, self.dtypes)):
            g = _t.reshape(summed[self.offsets[i]:self.offsets[i + 1]] * inv, shape)
            leaves.append(g if dtype == F32 else _t.astype(g, dtype.name))
        return pytree.unflatten(self.treedef, leaves), summed[self.loss] * inv


def compile_data_parallel(loss_and_grads, update, model, optimizer, params, state,
                          example_batch, *, on_nan, accumulate, clip_norm,
                          compile_opts: dict, packing=None) -> "DataParallelStep":
    """The two compiled functions of a data-parallel step (see the module docstring),
    built from compile_train_step's `loss_and_grads` and `update`. `params` and `state`
    are as the functions take them: packed when `packing` is given (training.packing)."""
    world = distributed.init()
    layout = Layout(params if packing is None else packing.unpack_tree(params), packing)

    def grads(params, examples, *batch):
        loss, aux, g = loss_and_grads(params if packing is None else packing.slices(params),
                                      *batch)
        return layout.pack(loss, aux, g, examples)

    def apply(params, opt_state, summed):
        g, loss = layout.unpack_grads(summed)
        return update(params, opt_state, loss, g)

    def opts(name):        # each function's stages in a folder of its own
        dump = compile_opts.get("dump_dir")
        return {**compile_opts, "dump_dir": dump and os.path.join(dump, name), "name": name}

    def build():
        grads_exe = tc_compile(grads, params, np.float32(1), *example_batch,
                               **opts("train_grads"))
        apply_exe = tc_compile(apply, params, state, np.zeros(layout.size, np.float32),
                               **opts("train_apply"))
        return grads_exe, apply_exe
    grads_exe, apply_exe = _rank0_first(world, build, compile_opts.get("cache", True))
    params, state = _from_rank0(world, params, state)
    return DataParallelStep(grads_exe, apply_exe, world, layout, model, optimizer, params,
                            state, len(example_batch), False, on_nan, accumulate, clip_norm,
                            packing=packing)


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
    a model initialized with another seed on another rank starts from rank 0's."""
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
                 n_batch, has_aux, on_nan, accumulate, clip_norm, packing=None):
        super().__init__(grads_exe, model, optimizer, params, state, n_batch, has_aux, on_nan,
                         accumulate, clip_norm, n_before=len(pytree.flatten(params)[0]) + 1,
                         packing=packing)
        self.apply_exe = apply_exe
        self.world = world
        self.layout = layout
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
            packed = self.exe(self._params, _examples(pytree.flatten(batch)[0]), *batch)
        except Exception as e:        # joins the Allreduce with its flag set, then raised
            failure, packed = e, self._failed
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
        return self._finish(params, state, loss, norm, metrics, where=where)

    def _accumulate(self, n, packed, failure):
        """One call of an accumulation of accumulate_calls: a small Allreduce of this
        call's loss, metrics, examples, failure and non-finite flags (the loss returned,
        and every rank stops together); the call's packed gradients are added to this
        rank's sum unless some rank's are not finite (then nothing changes, as on one
        process); on the k-th call, ONE Allreduce of the sums and the update."""
        lay = self.layout
        bad = failure is None and not np.isfinite(packed).all()
        head = np.concatenate([packed[lay.loss:], np.float32([bad])])
        head = self.world.allreduce(head, f"training step {n}: the loss Allreduce")
        self._raise_failures(n, head[-2], failure)
        loss, metrics = self._means(head, at=0)
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

    def _means(self, summed, at=None):
        """(loss, metrics) as means over the examples summed in `summed` (a packed buffer,
        or its tail from `at` on)."""
        lay = self.layout
        base = lay.loss if at is None else at
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
