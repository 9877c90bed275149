"""A compiled training step, and checkpoints.

`tc.compile_train_step` traces forward, backward (tercomp's symbolic autodiff), gradient
clipping and the optimizer update into ONE compiled function

    (params, opt_state, *batch) -> (new_params, new_opt_state, loss, grad_norm, metrics)

and returns a TrainStep that keeps params and optimizer state on the device between
calls (the device arrays one call returns are the next call's inputs; the weights never
cross to the host until `step.params()` / `step.sync_to(model)`):

    >>> step = tc.compile_train_step(loss_fn, model, tc.optim.AdamW(1e-3), x[:64], y[:64])
    >>> for xb, yb in batches:
    ...     loss = step(xb, yb)                      # a Python float
    >>> step.sync_to(model)                          # weights back into the model
    >>> tc.save_checkpoint("ckpt.safetensors", step)
"""
from __future__ import annotations

import json
import math
import numbers
import os
import warnings

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save as safetensors_save

from . import optim
from .errors import InputError, TercompError, check_number
from .runtime.files import check_regular, write_atomic
from .runtime.signature import Signature
from .trace import api as _t
from . import pytree
from .pytree import tree_map
from .trace.tracer import Tracer

__all__ = ["compile_train_step", "TrainStep", "save_checkpoint", "load_checkpoint"]

ON_NAN = ("raise", "stop")


def _host_leaf(x):
    return np.array(x) if not isinstance(x, Tracer) else x


# -- the compiled step -------------------------------------------------------------------
def compile_train_step(loss_fn, model, optimizer, *example_batch, accumulate: int = 1,
                       accumulate_calls: int = 1, clip_norm=None, on_nan: str = "raise", has_aux=None, opt_state=None,
                       target="llvm-cpu", device=None, threads=None, dump_dir=None,
                       cache: bool = True, isolate: bool = False,
                       check_numerics: bool | None = None) -> "TrainStep":
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

    >>> def loss_fn(m, x, y): return tc.cross_entropy(m(x), y)
    >>> step = tc.compile_train_step(loss_fn, model, tc.optim.SGD(0.1, momentum=0.9),
    ...                              tc.spec(("B", 64)), tc.spec(("B",), "int32"))
    >>> loss = step(x, y)
    """
    from .compiler import compile as tc_compile
    from .nn.module import Module
    from .autodiff import value_and_grad

    if not isinstance(model, Module):
        raise TercompError(f"compile_train_step: model must be an nn.Module, got {type(model).__name__}")
    if not callable(loss_fn):
        raise TercompError("compile_train_step: loss_fn must be a function loss_fn(model, *batch)")
    if not (callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))):
        raise TercompError(f"compile_train_step: optimizer must have init(params) and "
                           f"update(grads, state, params), got {type(optimizer).__name__}",
                           hint="use tc.optim.SGD(...) or tc.optim.AdamW(...)")
    if on_nan not in ON_NAN:
        raise TercompError(f"compile_train_step: on_nan must be 'raise' or 'stop', got {on_nan!r}")
    if isinstance(accumulate, bool) or not isinstance(accumulate, numbers.Integral) or accumulate < 1:
        raise TercompError(f"compile_train_step: accumulate must be a positive integer, got {accumulate!r}")
    if isinstance(accumulate_calls, bool) or not isinstance(accumulate_calls, numbers.Integral) \
            or accumulate_calls < 1:
        raise TercompError(f"compile_train_step: accumulate_calls must be a positive integer, "
                           f"got {accumulate_calls!r}")
    if clip_norm is not None:
        clip_norm = check_number("compile_train_step", "clip_norm", clip_norm,
                                        lo=0.0, lo_open=True)
    if has_aux not in (None, True, False):
        raise TercompError(f"compile_train_step: has_aux must be None, True or False, got {has_aux!r}")
    if not example_batch:
        raise TercompError("compile_train_step: give an example batch (arrays or tc.spec) after "
                           "the optimizer", hint="compile_train_step(loss_fn, model, opt, x, y)")
    params = model.state_dict()
    if not params:
        raise TercompError(f"compile_train_step: {type(model).__name__} has no parameters to train")
    state = optimizer.init(params) if opt_state is None else opt_state
    state = pytree.unflatten(pytree.flatten(state)[2], [_host_leaf(x) for x in pytree.flatten(state)[0]])
    if accumulate_calls > 1 and not (isinstance(state, dict) and set(state) == {"opt", "accum"}):
        state = {"opt": state, "accum": {"grads": {k: np.zeros_like(v) for k, v in params.items()},
                                         "calls": np.zeros((), np.float32)}}
    state_treedef = pytree.jsonable(pytree.flatten(state["opt"] if accumulate_calls > 1 else state)[2])
    detected = {}

    def loss_of(p, *batch):
        model._load_params(p)
        out = loss_fn(model, *batch)
        aux_given = isinstance(out, (tuple, list)) and len(out) == 2 and isinstance(out[1], dict)
        if has_aux is True and not aux_given:
            raise TercompError("compile_train_step(has_aux=True): loss_fn must return (loss, metrics_dict)")
        if has_aux is False and aux_given:
            raise TercompError("compile_train_step(has_aux=False): loss_fn returned a tuple",
                               hint="return the scalar loss only, or pass has_aux=True")
        loss, aux = (out[0], dict(out[1])) if aux_given else (out, {})
        if not isinstance(loss, Tracer) or tuple(loss.shape) != ():
            shape = tuple(getattr(loss, "shape", np.shape(loss)))
            raise TercompError(f"compile_train_step: loss_fn must return a scalar that depends "
                               f"on the model, got {type(loss).__name__} of shape {shape}",
                               hint="reduce the loss, e.g. tc.mean(...) or "
                                    "tc.cross_entropy(logits, labels)")
        for k, v in aux.items():
            if tuple(getattr(v, "shape", np.shape(v))) != ():
                raise TercompError(f"compile_train_step: metric {k!r} must be a scalar, got shape "
                                   f"{tuple(getattr(v, 'shape', np.shape(v)))}")
        detected["has_aux"] = aux_given
        # Metrics are reported, not differentiated.
        aux = {k: _t.stop_gradient(v) if isinstance(v, Tracer) else np.float32(v) for k, v in aux.items()}
        return loss, aux

    def train_step(params, opt_state, *batch):
        saved = model.parameters()
        try:
            vg = optim.accumulate_gradients(value_and_grad(loss_of, has_aux=True), accumulate)
            (loss, aux), grads = vg(params, *batch)
        finally:
            model._load_params(saved)
        if accumulate_calls > 1:
            return _accumulating_update(params, opt_state, loss, aux, grads)
        grads, norm = _clipped(grads)
        new_params, new_state = optimizer.update(grads, opt_state, params)
        if pytree.jsonable(pytree.flatten(new_state)[2]) != state_treedef:
            raise TercompError(f"{type(optimizer).__name__}.update returned a state whose structure "
                               "differs from init(params)'s; the compiled step feeds it back in")
        # NaN or Inf anywhere in loss or grads: keep the old values (checked on the host).
        ok = _t.abs(loss + norm) <= optim.F32_MAX
        new_params = tree_map(lambda n, o: _t.where(ok, n, o), new_params, params)
        new_state = tree_map(lambda n, o: _t.where(ok, n, o), new_state, opt_state)
        return new_params, new_state, loss, norm, aux

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
        mean, norm = _clipped(mean)
        new_params, new_opt = optimizer.update(mean, state["opt"], params)
        if pytree.jsonable(pytree.flatten(new_opt)[2]) != state_treedef:
            raise TercompError(f"{type(optimizer).__name__}.update returned a state whose structure "
                               "differs from init(params)'s; the compiled step feeds it back in")
        ok = _t.abs(loss + norm) <= optim.F32_MAX
        reset = calls >= accumulate_calls - 0.5          # the k-th call: update, then reset
        new_params = tree_map(lambda n, o: _t.where(ok, _t.where(reset, n, o), o), new_params, params)
        new_opt = tree_map(lambda n, o: _t.where(ok, _t.where(reset, n, o), o), new_opt, state["opt"])
        acc_grads = tree_map(lambda s, a: _t.where(ok, _t.where(reset, s * 0.0, s), a), summed, acc["grads"])
        acc_calls = _t.where(ok, _t.where(reset, calls * 0.0, calls), acc["calls"])
        new_state = {"opt": new_opt, "accum": {"grads": acc_grads, "calls": acc_calls}}
        return new_params, new_state, loss, norm, aux

    exe = tc_compile(train_step, params, state, *example_batch,
                     target=target, device=device, threads=threads, dump_dir=dump_dir,
                     cache=cache, ternary="off", name="train_step", isolate=isolate,
                     check_numerics=check_numerics)
    step = TrainStep(exe, model, optimizer, params, state, len(example_batch),
                     detected.get("has_aux", False), on_nan, accumulate, clip_norm)
    step.accumulate_calls = int(accumulate_calls)
    step._name_batch(loss_fn)
    return step


class TrainStep:
    """A compiled training step; see compile_train_step. Attributes: `exe` (the
    CompiledModule), `steps` (calls that updated the weights), `stopped`, `grad_norm`
    (the last step's global gradient norm, before clipping), `on_nan`."""

    def __init__(self, exe, model, optimizer, params, opt_state, n_batch,
                 has_aux, on_nan, accumulate, clip_norm):
        self.exe = exe
        self.model = model
        self.optimizer = optimizer
        self.has_aux = has_aux
        self.on_nan = on_nan
        self.accumulate = accumulate
        self.clip_norm = clip_norm
        self.stopped = False
        self.steps = 0
        self.accumulate_calls = 1
        self._calls = 0              # calls since the last update (accumulate_calls > 1)
        self.grad_norm = float("nan")
        self._p_treedef = pytree.flatten(params)[2]
        self._s_treedef = pytree.flatten(opt_state)[2]
        n_state = len(pytree.flatten(params)[0]) + len(pytree.flatten(opt_state)[0])
        sig = exe.signature
        batch_tree = ["tuple", sig.in_tree[1][2:]] if sig.in_tree else None   # after params, state
        self._batch_sig = Signature(sig.function, sig.inputs[n_state:], [], in_tree=batch_tree)
        self._n_batch = n_batch
        # Device-resident state: host arrays before the first call, then the DeviceArrays
        # each call returns.
        self._params = params
        self._state = opt_state

    def _name_batch(self, loss_fn):
        # Errors name batch arrays after loss_fn's parameters (x, y), not the step's inputs.
        import dataclasses
        import inspect
        try:
            names = [p.name for p in inspect.signature(loss_fn).parameters.values()
                     if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
        except (TypeError, ValueError):
            names = []
        if len(names) != self._n_batch or len(self._batch_sig.inputs) != self._n_batch:
            names = [f"batch[{i}]" for i in range(len(self._batch_sig.inputs))]
        self._batch_sig.inputs = [dataclasses.replace(s, name=n)
                                  for s, n in zip(self._batch_sig.inputs, names)]

    # -- running -------------------------------------------------------------------------
    def _check_batch(self, batch):
        if len(batch) != self._n_batch:
            raise InputError(f"the training step was compiled for a batch of {self._n_batch} "
                             f"arrays, got {len(batch)}")
        try:
            leaves = self._batch_sig.leaves(tuple(batch))
        except InputError as e:
            raise InputError(f"training step: {e.message}", hint=e.hint) from None
        empty = [s.name for s, x in zip(self._batch_sig.inputs, leaves) if np.size(x) == 0]
        if empty:
            raise InputError(f"training step: the batch is empty (no elements in {', '.join(empty)})",
                             hint="a loss over no examples is undefined; skip empty batches")

    def __call__(self, *batch):
        """Run one step on `batch`; returns the loss as a float (and the metrics dict
        when loss_fn returns metrics)."""
        if self.stopped:
            nan = float("nan")
            return (nan, {}) if self.has_aux else nan
        self._check_batch(batch)
        params, state, loss, norm, aux = self.exe(self._params, self._state, *batch,
                                                  keep_on_device=True)
        loss, norm = float(np.asarray(loss)), float(np.asarray(norm))
        self.grad_norm = norm
        metrics = {k: float(np.asarray(v)) for k, v in aux.items()}
        if not (math.isfinite(loss) and math.isfinite(norm)):
            # The compiled step kept the old params/state; keep using them.
            self._params, self._state = params, state
            what = "loss" if not math.isfinite(loss) else "gradient norm"
            msg = (f"training step {self.steps + 1}: the {what} is "
                   f"{loss if what == 'loss' else norm}; the update was skipped, the "
                   "weights are those of the last finite step")
            hint = "lower the learning rate, clip gradients (clip_norm=), or check the data"
            if self.on_nan == "raise":
                raise TercompError(msg, hint=hint)
            self.stopped = True
            warnings.warn(f"{msg}; training stopped ({hint})", RuntimeWarning, stacklevel=2)
            return (loss, metrics) if self.has_aux else loss
        self._params, self._state = params, state
        self._calls = (self._calls + 1) % self.accumulate_calls
        self.steps += self._calls == 0
        return (loss, metrics) if self.has_aux else loss

    # -- host copies ------------------------------------------------------------------
    def params(self) -> dict:
        """The current parameters, copied to the host (name -> NumPy array)."""
        return {k: np.asarray(v) for k, v in self._params.items()}

    def opt_state(self):
        """The current optimizer state, copied to the host."""
        leaves = [np.asarray(x) for x in pytree.flatten(self._state)[0]]
        return pytree.unflatten(self._s_treedef, leaves)

    def sync_to(self, model=None):
        """Copy the trained weights into `model` (default: the model compiled from)."""
        (model or self.model).load_state_dict(self.params())
        return model or self.model

    def set_state(self, params=None, opt_state=None):
        """Replace the parameters and/or optimizer state (e.g. from a checkpoint). Both are
        checked before either is changed: on an error nothing changes."""
        new_params = new_state = None
        if params is not None:
            own = self.params()
            if set(params) != set(own):
                raise TercompError(f"set_state: parameter names differ: missing "
                                   f"{sorted(set(own) - set(params))}, unexpected "
                                   f"{sorted(set(params) - set(own))}")
            for k, v in params.items():
                if np.shape(v) != own[k].shape:
                    raise TercompError(f"set_state: parameter {k} has shape {np.shape(v)}, "
                                       f"the model {own[k].shape}")
            new_params = {k: np.asarray(params[k], own[k].dtype) for k in own}
        if opt_state is not None:
            leaves, _, treedef = pytree.flatten(opt_state)
            if pytree.jsonable(treedef) != pytree.jsonable(self._s_treedef):
                raise TercompError("set_state: the optimizer state has a different structure "
                                   f"than {type(self.optimizer).__name__}.init(params)'s")
            own = pytree.flatten(self.opt_state())[0]
            for x, o in zip(leaves, own):
                if np.shape(x) != o.shape:
                    raise TercompError(f"set_state: an optimizer state array has shape "
                                       f"{np.shape(x)}, expected {o.shape}")
            new_state = pytree.unflatten(
                self._s_treedef, [np.asarray(x, o.dtype) for x, o in zip(leaves, own)])
        if new_params is not None:
            self._params = new_params
        if new_state is not None:
            self._state = new_state
        self.stopped = False

    def __repr__(self):
        return (f"TrainStep({type(self.model).__name__}, {self.optimizer!r}, steps={self.steps}, "
                f"accumulate={self.accumulate}, clip_norm={self.clip_norm}, on_nan={self.on_nan!r})")


# -- checkpoints -------------------------------------------------------------------------
_FORMAT = "tercomp-checkpoint-1"


def save_checkpoint(path: str, model, opt_state=None) -> None:
    """Save a model's parameters (and an optimizer state) to a safetensors file.
    `model` is an nn.Module or a TrainStep (whose device weights and optimizer state are
    saved). Written atomically.

    >>> tc.save_checkpoint("ckpt.safetensors", model, step.opt_state())
    >>> opt_state = tc.load_checkpoint("ckpt.safetensors", model)
    """
    if isinstance(model, TrainStep):
        params = model.params()
        opt_state = model.opt_state() if opt_state is None else opt_state
    elif callable(getattr(model, "state_dict", None)):
        params = model.state_dict()
    else:
        raise TercompError(f"save_checkpoint: model must be an nn.Module or a TrainStep, got "
                           f"{type(model).__name__}")
    # np.array, not np.ascontiguousarray, which turns 0-d arrays into shape (1,).
    tensors = {f"params/{k}": np.array(v, order="C") for k, v in params.items()}
    meta = {"format": _FORMAT, "params": json.dumps(list(params))}
    if opt_state is not None:
        leaves, paths, treedef = pytree.flatten(opt_state)
        for i, x in enumerate(leaves):
            tensors[f"opt_state/{i}"] = np.array(x, order="C")
        meta["opt_state_tree"] = json.dumps(pytree.jsonable(treedef))
    write_atomic(path, safetensors_save(tensors, metadata=meta), "checkpoint")


def load_checkpoint(path: str, model):
    """Load parameters saved by save_checkpoint into `model` (an nn.Module, or a
    TrainStep: then its device weights and optimizer state too). Returns the saved
    optimizer state (None if there was none)."""
    check_regular(path, "checkpoint")
    try:
        with safe_open(os.fspath(path), framework="np") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        raise TercompError(f"load_checkpoint: {path} is not a readable safetensors file: {e}") from None
    if meta.get("format") != _FORMAT:
        raise TercompError(f"load_checkpoint: {path} is not a tercomp checkpoint "
                           f"(format {meta.get('format')!r})")
    try:
        names = json.loads(meta["params"])
        params = {k: tensors[f"params/{k}"] for k in names}
        opt_state = None
        if "opt_state_tree" in meta:
            treedef = json.loads(meta["opt_state_tree"])
            n = pytree.num_leaves(treedef)
            opt_state = pytree.unflatten(treedef, [tensors[f"opt_state/{i}"] for i in range(n)])
    except (KeyError, ValueError, TypeError) as e:
        raise TercompError(f"load_checkpoint: {path} is damaged ({type(e).__name__}: {e})") from None
    if isinstance(model, TrainStep):
        model.set_state(params, opt_state)
        model.sync_to()
    else:
        model.load_state_dict(params)
    return opt_state
