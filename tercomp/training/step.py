"""TrainStep: a compiled training step (tercomp.training.compile) at run time. It keeps
params and optimizer state on the device between calls (the device arrays one call
returns are the next call's inputs; the weights never cross to the host until
`step.params()` / `step.sync_to(model)`), checks each batch before IREE sees it, and
skips the update of a step whose loss or gradient is NaN or Inf.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import warnings

import numpy as np

from .. import pytree
from ..errors import InputError, NumericsError
from ..runtime.signature import Signature


class TrainStep:
    """A compiled training step; see compile_train_step. Attributes: `exe` (the
    CompiledModule), `steps` (calls that updated the weights), `stopped`, `grad_norm`
    (the last step's global gradient norm, before clipping), `on_nan`."""

    data_parallel = False
    is_main = True           # the rank that writes checkpoints (see DataParallelStep)

    def __init__(self, exe, model, optimizer, params, opt_state, n_batch,
                 has_aux, on_nan, accumulate, clip_norm, n_before=None, packing=None,
                 buffers=None, n_args=3):
        self.exe = exe
        # params and opt_state as the compiled step takes them: packed when `packing`
        # (training.packing) is given, converted to the usual trees for the user.
        self.packing = packing
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
        self._run_s_treedef = pytree.flatten(opt_state)[2]
        self._s_treedef = pytree.flatten(self._unpacked(opt_state))[2]
        # The batch comes after n_args arguments, params, state and the model's buffers
        # (n_before arrays): a data-parallel step's grads function takes others (n_before
        # and n_args given).
        if n_before is None:
            n_before = len(pytree.flatten(params)[0]) + len(pytree.flatten(opt_state)[0]) + \
                len(pytree.flatten(buffers or {})[0])
        sig = exe.signature
        batch_tree = ["tuple", sig.in_tree[1][n_args:]] if sig.in_tree else None
        self._batch_sig = Signature(sig.function, sig.inputs[n_before:], [], in_tree=batch_tree)
        self._n_batch = n_batch
        # Device-resident state: host arrays before the first call, then the DeviceArrays
        # each call returns.
        self._params = params
        self._state = opt_state
        # the model's buffers (BatchNorm's running statistics), updated by each call
        self._buffers = dict(buffers or {})

    def _name_batch(self, loss_fn):
        # Errors name batch arrays after loss_fn's parameters (x, y), not the step's inputs.
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
        params, state, buffers, loss, norm, aux = self.exe(self._params, self._state, self._buffers,
                                                           *batch, keep_on_device=True)
        self._buffers = buffers            # the step kept the old ones on a NaN
        metrics = {k: float(np.asarray(v)) for k, v in aux.items()}
        return self._finish(params, state, float(np.asarray(loss)), float(np.asarray(norm)),
                            metrics)

    def _finish(self, params, state, loss, norm, metrics, where=""):
        """Keep the step's results; on a NaN or Inf loss or norm (the compiled step kept
        the old params/state) raise or stop as on_nan says. `where` adds to the message.
        `norm` None: a call that computed no norm (one before the last of an accumulation
        on the host); grad_norm keeps the last one."""
        if norm is not None:
            self.grad_norm = norm
        self._params, self._state = params, state
        if not (math.isfinite(loss) and (norm is None or math.isfinite(norm))):
            what = "loss" if not math.isfinite(loss) else "gradient norm"
            msg = (f"training step {self.steps + 1}: the {what} is "
                   f"{loss if what == 'loss' else norm}{where}; the update was skipped, the "
                   "weights are those of the last finite step")
            hint = "lower the learning rate, clip gradients (clip_norm=), or check the data"
            if self.on_nan == "raise":
                raise NumericsError(msg, hint=hint)
            self.stopped = True
            warnings.warn(f"{msg}; training stopped ({hint})", RuntimeWarning, stacklevel=3)
            return (loss, metrics) if self.has_aux else loss
        self._calls = (self._calls + 1) % self.accumulate_calls
        self.steps += self._calls == 0
        return (loss, metrics) if self.has_aux else loss

    # -- host copies ------------------------------------------------------------------
    def _unpacked(self, tree):
        return tree if self.packing is None else self.packing.unpack_tree(tree)

    def _packed(self, tree):
        return tree if self.packing is None else self.packing.pack_tree(tree)

    def params(self) -> dict:
        """The current parameters, copied to the host (name -> NumPy array)."""
        return self._unpacked({k: np.asarray(v) for k, v in self._params.items()})

    def opt_state(self):
        """The current optimizer state, copied to the host."""
        leaves = [np.asarray(x) for x in pytree.flatten(self._state)[0]]
        return self._unpacked(pytree.unflatten(self._run_s_treedef, leaves))

    def buffers(self) -> dict:
        """The model's buffers as the steps left them (BatchNorm's running statistics),
        copied to the host (name -> NumPy array)."""
        return {k: np.asarray(v) for k, v in self._buffers.items()}

    def sync_to(self, model=None):
        """Copy the trained weights (and buffers) into `model` (default: the model
        compiled from)."""
        model = model or self.model
        model.load_state_dict(self.params())
        if self._buffers:
            model.load_buffers(self.buffers())
        return model

    def set_state(self, params=None, opt_state=None, buffers=None):
        """Replace the parameters, optimizer state and/or the model's buffers (e.g. from a
        checkpoint). All are checked before any is changed: on an error nothing changes."""
        new_params = new_state = new_buffers = None
        if buffers is not None:
            own = self.buffers()
            if set(buffers) != set(own) or any(np.shape(buffers[k]) != own[k].shape for k in own):
                raise InputError(f"set_state: the buffers {sorted(buffers)} do not match the "
                                 f"model's {sorted(own)} (names and shapes)")
            new_buffers = {k: np.asarray(buffers[k], own[k].dtype) for k in own}
        if params is not None:
            own = self.params()
            if set(params) != set(own):
                raise InputError(f"set_state: parameter names differ: missing "
                                 f"{sorted(set(own) - set(params))}, unexpected "
                                 f"{sorted(set(params) - set(own))}")
            for k, v in params.items():
                if np.shape(v) != own[k].shape:
                    raise InputError(f"set_state: parameter {k} has shape {np.shape(v)}, "
                                     f"the model {own[k].shape}")
            new_params = {k: np.asarray(params[k], own[k].dtype) for k in own}
        if opt_state is not None:
            leaves, _, treedef = pytree.flatten(opt_state)
            if pytree.jsonable(treedef) != pytree.jsonable(self._s_treedef):
                raise InputError("set_state: the optimizer state has a different structure "
                                 f"than {type(self.optimizer).__name__}.init(params)'s")
            own = pytree.flatten(self.opt_state())[0]
            for x, o in zip(leaves, own):
                if np.shape(x) != o.shape:
                    raise InputError(f"set_state: an optimizer state array has shape "
                                     f"{np.shape(x)}, expected {o.shape}")
            new_state = pytree.unflatten(
                self._s_treedef, [np.asarray(x, o.dtype) for x, o in zip(leaves, own)])
        if new_params is not None:
            self._params = self._packed(new_params)
        if new_state is not None:
            self._state = self._packed(new_state)
        if new_buffers is not None:
            self._buffers = new_buffers
        self.stopped = False

    def __repr__(self):
        return (f"TrainStep({type(self.model).__name__}, {self.optimizer!r}, steps={self.steps}, "
                f"accumulate={self.accumulate}, clip_norm={self.clip_norm}, on_nan={self.on_nan!r})")
