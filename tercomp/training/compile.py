"""compile_train_step: forward, backward, clipping and the optimizer update of a model,
traced into ONE compiled function

    (params, opt_state, buffers, *batch)
        -> (new_params, new_opt_state, new_buffers, loss, grad_norm, metrics)

that tercomp.training.step.TrainStep runs with the weights kept on the device (packed
in one vector, with the optimizer state shaped like them, when the optimizer's update
is elementwise: packing.py).
"""
from __future__ import annotations

import numbers

import numpy as np

from .. import optim, pytree
from ..build import BuildOptions, build
from ..compiler import pipeline
from ..errors import TraceError, ConfigError, UnsupportedError, check_number
from ..nn.module import Module, buffer_updates
from ..nn.syncbn import SyncStatistics, sync_layers
from ..passes import Dumper
from ..pytree import tree_map
from ..tracing import api as _t
from ..tracing import trace
from ..tracing.tracer import Tracer
from ..autodiff import value_and_grad
from .data_parallel import check_options as check_data_parallel, compile_data_parallel
from .packing import Packing
from .step import TrainStep

ON_NAN = ("raise", "stop")


def _keep(cond, new, old):
    """`new` where the traced boolean `cond` holds, else `old` (pytrees of one structure)."""
    return tree_map(lambda n, o: _t.where(cond, n, o), new, old)


def _own_transients(graph, opts) -> bool:
    """Does the step keep its transient buffers (lowering.lower_graph's `transients`)? On
    CPU targets: the step is called again and again, and local-task's queue pool would
    map and fault in its hundreds of MB of activations and gradients on every call
    (bench/RESULTS.md: 0.7-0.75x the step's time on bench/conv.py's ResNet). The step
    holds that memory while it lives."""
    return all(t.startswith("llvm-cpu") for t in opts.names)


def _host_leaf(x):
    return np.array(x) if not isinstance(x, Tracer) else x


def compile_train_step(loss_fn, model, optimizer, *example_batch, accumulate: int = 1,
                       accumulate_calls: int = 1, clip_norm=None, on_nan: str = "raise", has_aux=None, opt_state=None,
                       target="llvm-cpu", device=None, threads=None, dump_dir=None,
                       cache: bool = True, isolate: bool | None = None,
                       check_numerics: bool | None = None, data_parallel: bool = False) -> TrainStep:
    """Compile forward + backward + update of `model` into one IREE function.

    `loss_fn(model, *batch)` returns a scalar loss, or `(loss, metrics)` with a dict of
    scalar metrics (`has_aux=None` detects which; True/False insists). `example_batch`
    are arrays or `tc.spec(...)` giving the shapes and dtypes of every later batch (a
    symbolic batch dim serves any size, except with `accumulate`). `accumulate=k` splits
    each batch into k micro-batches along axis 0 and averages their gradients (and
    losses): one call, one update. `accumulate_calls=k` sums the gradients of k
    successive calls on the device and applies their mean on the k-th call (the calls
    before it leave the weights unchanged; `step.steps` counts updates); the
    accumulator is part of the optimizer state (`{"opt": ..., "accum": ...}`), so
    checkpoints keep a partial accumulation. `clip_norm` clips the (accumulated)
    gradients to that global norm before the update. On a NaN or Inf loss or gradient the update is skipped inside the
    compiled step (params keep their last finite values) and then, with
    on_nan="raise", a TercompError is raised, with on_nan="stop" a warning is issued,
    `step.stopped` becomes True and later calls return NaN without running.

    On a CPU target the step keeps the buffers that live only within a call
    (activations, gradients) in one storage allocated at its first call (grown for a
    larger batch) and held while the step lives, instead of mapping them afresh every
    call.

    >>> def loss_fn(m, x, y): return tc.cross_entropy(m(x), y)
    >>> step = tc.compile_train_step(loss_fn, model, tc.optim.SGD(0.1, momentum=0.9),
    ...                              tc.spec(("B", 64)), tc.spec(("B",), "int32"))
    >>> loss = step(x, y)

    `data_parallel=True`, in each rank of `mpiexec -n N python train.py` (or `srun`),
    trains one model on N shards: every rank calls the step with its shard of the batch,
    the gradients (after `accumulate`, before clipping) are averaged over the ranks with
    one Allreduce, weighted by each shard's number of examples (the leading dim of its
    first batch array), and every rank applies the same update, so parameters stay
    identical (rank 0's initial ones are broadcast first); the loss and metrics returned
    are those of the whole global batch. A rank that fails or meets a NaN makes every rank
    raise (or stop, with on_nan="stop"); see tercomp.distributed for ranks, the timeout and
    the `distributed` pip extra. Without MPI it runs as a job of one rank. With
    `accumulate_calls=k` each rank sums k calls' gradients on the host and the ranks
    exchange them once, on the k-th call (each call still exchanges its loss and a
    failure flag, a few bytes); the sums of an unfinished accumulation are not part of
    a checkpoint. BatchNorm normalizes by each rank's shard and its running statistics
    are averaged over the ranks after each call; `nn.SyncBatchNorm` normalizes by the
    global batch (see training/data_parallel.py and the README).

    >>> step = tc.compile_train_step(loss_fn, model, opt, xb, yb, data_parallel=True)
    >>> r, n = tc.distributed.rank(), tc.distributed.world_size()
    >>> loss = step(x[r::n], y[r::n])                  # this rank's shard
    """
    if not isinstance(model, Module):
        raise ConfigError(f"compile_train_step: model must be an nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise ConfigError("compile_train_step: loss_fn must be a function loss_fn(model, *batch)")
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise ConfigError(f"compile_train_step: optimizer must have init(params) and "
                          f"update(grads, state, params), got {type(optimizer).__name__}",
                          hint="use tc.optim.SGD(...) or tc.optim.AdamW(...)")
    if on_nan not in ON_NAN:
        raise ConfigError(f"compile_train_step: on_nan must be 'raise' or 'stop', got {on_nan!r}")
    if isinstance(accumulate, bool) or not isinstance(accumulate, numbers.Integral) or accumulate < 1:
        raise ConfigError(f"compile_train_step: accumulate must be a positive integer, got {accumulate!r}")
    if isinstance(accumulate_calls, bool) or not isinstance(accumulate_calls, numbers.Integral) \
            or accumulate_calls < 1:
        raise ConfigError(f"compile_train_step: accumulate_calls must be a positive integer, "
                          f"got {accumulate_calls!r}")
    if clip_norm is not None:
        clip_norm = check_number("compile_train_step", "clip_norm", clip_norm,
                                        lo=0.0, lo_open=True)
    check_data_parallel(data_parallel)
    if has_aux not in (None, True, False):
        raise ConfigError(f"compile_train_step: has_aux must be None, True or False, got {has_aux!r}")
    if not example_batch:
        raise ConfigError("compile_train_step: give an example batch (arrays or tc.spec) after "
                          "the optimizer", hint="compile_train_step(loss_fn, model, opt, x, y)")
    params = model.state_dict()
    if not params:
        raise ConfigError(f"compile_train_step: {type(model).__name__} has no parameters to train")
    # the model's buffers (BatchNorm's running statistics) are inputs of the step, and their
    # values after the forward are outputs, kept on the device like the weights
    buffers = {k: np.array(v) for k, v in model.buffers().items()}
    sync = sync_layers(model) if data_parallel else []
    if sync and accumulate > 1:
        raise ConfigError(f"compile_train_step(data_parallel=True, accumulate={accumulate}): "
                           f"SyncBatchNorm ({', '.join(n or 'the model' for n, _ in sync)}) "
                           "synchronizes whole shards, not micro-batches",
                           hint="use accumulate_calls= (each call one synchronized batch), or "
                                "BatchNorm instead of SyncBatchNorm")
    state = optimizer.init(params) if opt_state is None else opt_state
    state = pytree.unflatten(pytree.flatten(state)[2], [_host_leaf(x) for x in pytree.flatten(state)[0]])
    # A data-parallel step accumulates on the host (DataParallelStep), its state is the optimizer's.
    accumulate_on_device = accumulate_calls > 1 and not data_parallel
    if accumulate_on_device and not (isinstance(state, dict) and set(state) == {"opt", "accum"}):
        state = {"opt": state, "accum": {"grads": {k: np.zeros_like(v) for k, v in params.items()},
                                         "calls": np.zeros((), np.float32)}}
    # Parameters and the state trees shaped like them, each one vector on the device
    # (packing.py), when the optimizer's update is elementwise.
    packing = Packing.of(params, optimizer)
    run_params, run_state = (params, state) if packing is None else \
        (packing.pack_tree(params), packing.pack_tree(state))
    state_treedef = pytree.jsonable(pytree.flatten(run_state["opt"] if accumulate_on_device
                                                   else run_state)[2])
    detected = {}

    def loss_of(p, *batch):
        model._load_params(p)
        out = loss_fn(model, *batch)
        aux_given = isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], dict)
        if has_aux is True and not aux_given:
            raise TraceError("compile_train_step(has_aux=True): loss_fn must return (loss, metrics_dict)")
        if has_aux is False and aux_given:
            raise TraceError("compile_train_step(has_aux=False): loss_fn returned a tuple",
                             hint="return the scalar loss only, or pass has_aux=True")
        loss, aux = (out[0], dict(out[1])) if aux_given else (out, {})
        if not isinstance(loss, Tracer) or tuple(loss.shape) != ():
            shape = tuple(getattr(loss, "shape", np.shape(loss)))
            raise TraceError(f"compile_train_step: loss_fn must return a scalar that depends "
                             f"on the model, got {type(loss).__name__} of shape {shape}",
                             hint="reduce the loss, e.g. tc.mean(...) or "
                                  "tc.cross_entropy(logits, labels)")
        for k, v in aux.items():
            if tuple(getattr(v, "shape", np.shape(v))) != ():
                raise TraceError(f"compile_train_step: metric {k!r} must be a scalar, got shape "
                                 f"{tuple(getattr(v, 'shape', np.shape(v)))}")
        detected["has_aux"] = aux_given
        # Metrics are reported, not differentiated.
        aux = {k: _t.stop_gradient(v) if isinstance(v, Tracer) else np.float32(v) for k, v in aux.items()}
        return loss, aux

    def loss_and_grads(params, *batch):
        """(loss, metrics, grads) of one call's batch, after `accumulate`."""
        saved = model.parameters()
        try:
            vg = optim.accumulate_gradients(value_and_grad(loss_of, has_aux=True), accumulate)
            (loss, aux), grads = vg(params, *batch)
        finally:
            model._load_params(saved)
        return loss, aux, grads

    def rank_grads(params, buffers, examples, totals, cotangents, *batch):
        """A data-parallel step's forward and backward on this rank's shard: (loss, aux,
        grads, new_buffers, sums, cot). Without SyncBatchNorm, grads are means over the
        shard and sums, cot None; with it (data_parallel.py's rounds), grads and cot are
        the gradients of examples * loss + <cotangents, sums> with respect to params and
        `totals`, the global sums each SyncBatchNorm normalizes by, and `sums` the shard's."""
        saved = model.buffers()
        model._load_params(buffers)
        try:
            with buffer_updates():
                if not sync:
                    loss, aux, grads = loss_and_grads(params, *batch)
                    sums = cot = None
                else:
                    loss, aux, grads, sums, cot = synced_grads(params, examples, totals,
                                                               cotangents, *batch)
            new_buffers = model.buffers()
        finally:
            model._load_params(saved)
        return loss, aux, grads, new_buffers, sums, cot

    def synced_grads(params, examples, totals, cotangents, *batch):
        def surrogate(p, t):
            with SyncStatistics([layer for _, layer in sync], t) as stats:
                loss, aux = loss_of(p, *batch)
            sums = stats.local()
            return loss * examples + _t.sum(cotangents * sums), (loss, aux, sums)
        saved = model.parameters()
        try:
            (_, (loss, aux, sums)), (grads, cot) = value_and_grad(
                surrogate, argnums=(0, 1), has_aux=True)(params, totals)
        finally:
            model._load_params(saved)
        return loss, aux, grads, _t.stop_gradient(sums), cot

    def optimizer_step(grads, opt_state, params, loss):
        """(new_params, new_state, norm, ok): clip, then the optimizer's update, whose state
        must keep init's structure (the compiled step feeds it back in); `ok`: the loss and
        the gradients are finite (the host checks loss and norm too)."""
        grads, norm = _clipped(grads)
        new_params, new_state = optimizer.update(grads, opt_state, params)
        if pytree.jsonable(pytree.flatten(new_state)[2]) != state_treedef:
            raise TraceError(f"{type(optimizer).__name__}.update returned a state whose structure "
                             "differs from init(params)'s; the compiled step feeds it back in")
        return new_params, new_state, norm, _t.abs(loss + norm) <= optim.F32_MAX

    def update(params, opt_state, loss, grads):
        """(new_params, new_state, norm): the optimizer's step, or the old values where a
        NaN or Inf is anywhere in loss or grads."""
        new_params, new_state, norm, ok = optimizer_step(grads, opt_state, params, loss)
        return _keep(ok, new_params, params), _keep(ok, new_state, opt_state), norm

    def train_step(params, opt_state, buffers, *batch):
        saved = model.buffers()
        model._load_params(buffers)          # the forward reads the step's inputs
        try:
            with buffer_updates():           # and a training-mode forward replaces them
                if packing is None:
                    loss, aux, grads = loss_and_grads(params, *batch)
                else:
                    loss, aux, grads = loss_and_grads(packing.slices(params), *batch)
                    grads = packing.concatenate(grads)
            new_buffers = model.buffers()
        finally:
            model._load_params(saved)
        if accumulate_on_device:
            new_params, new_state, loss, norm, aux = _accumulating_update(params, opt_state, loss,
                                                                          aux, grads)
        else:
            new_params, new_state, norm = update(params, opt_state, loss, grads)
        ok = _t.abs(loss + norm) <= optim.F32_MAX
        new_buffers = {k: v if v is buffers[k] else _t.where(ok, v, buffers[k])
                       for k, v in new_buffers.items()}
        return new_params, new_state, new_buffers, loss, norm, aux

    def _clipped(grads):
        """(grads clipped to the global norm clip_norm when one is set, their norm)."""
        if clip_norm is None:
            return grads, optim.global_norm(grads)
        return optim.clip_by_global_norm(grads, clip_norm)

    def _accumulating_update(params, state, loss, aux, grads):
        """Add this call's grads to the accumulator; on the k-th call update the weights
        with the clipped mean and reset it. A NaN or Inf leaves everything unchanged."""
        acc = state["accum"]
        summed = tree_map(lambda a, g: a + g, acc["grads"], grads)
        calls = acc["calls"] + 1.0
        mean = tree_map(lambda g: g * (1.0 / accumulate_calls), summed)
        new_params, new_opt, norm, ok = optimizer_step(mean, state["opt"], params, loss)
        reset = calls >= accumulate_calls - 0.5          # the k-th call: update, then reset
        new_params = tree_map(lambda n, o: _t.where(ok, _t.where(reset, n, o), o), new_params, params)
        new_opt = tree_map(lambda n, o: _t.where(ok, _t.where(reset, n, o), o), new_opt, state["opt"])
        acc_grads = tree_map(lambda s, a: _t.where(ok, _t.where(reset, s * 0.0, s), a), summed, acc["grads"])
        acc_calls = _t.where(ok, _t.where(reset, calls * 0.0, calls), acc["calls"])
        new_state = {"opt": new_opt, "accum": {"grads": acc_grads, "calls": acc_calls}}
        return new_params, new_state, loss, norm, aux

    compile_opts = dict(target=target, device=device, threads=threads, dump_dir=dump_dir,
                        cache=cache, ternary="auto", isolate=isolate, check_numerics=check_numerics)
    if data_parallel:
        step = compile_data_parallel(rank_grads, update, model, optimizer, run_params,
                                     run_state, buffers, example_batch, on_nan=on_nan,
                                     accumulate=accumulate, clip_norm=clip_norm,
                                     compile_opts=compile_opts, packing=packing, sync=sync)
        step.accumulate_calls = int(accumulate_calls)
        step.has_aux = detected.get("has_aux", False)      # known once traced
        step._name_batch(loss_fn)
        return step
    # the one compiled function: tc.compile's pipeline. The latent float weights train
    # (ternarize's straight-through estimator is in the graph); the ternary pass gives a
    # forward matmul on their ternarized values a kernel of the host, which packs them
    # every call (passes/ternary.py), where one takes it
    opts = BuildOptions.resolve(target, device=device, threads=threads, ternary="auto",
                                isolate=isolate)
    dumper = Dumper(dump_dir)
    graph = trace(train_step, run_params, run_state, buffers, *example_batch, name="train_step")
    exe = build(pipeline(opts, ternary="auto", check_numerics=check_numerics,
                         driver="compile_train_step", transients=_own_transients(graph, opts)),
                graph, opts, dumper=dumper, cache=cache)
    step = TrainStep(exe, model, optimizer, run_params, run_state, len(example_batch),
                     detected.get("has_aux", False), on_nan, accumulate, clip_norm,
                     packing=packing, buffers=buffers)
    step.accumulate_calls = int(accumulate_calls)
    step._name_batch(loss_fn)
    return step
