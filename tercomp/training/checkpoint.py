"""Checkpoints: a model's parameters and an optimizer state in one safetensors file.

Tensors are `params/<name>`, `buffers/<name>` (BatchNorm's running statistics, when the
model has buffers) and `opt_state/<i>` (the state's pytree leaves in order); the
metadata holds the format tag, the parameter and buffer names and the state's tree
structure.
"""
from __future__ import annotations

import json
import os
import warnings

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save as safetensors_save

from .. import pytree
from ..errors import ConfigError, ArtifactError
from ..runtime.files import check_regular, write_atomic
from .step import TrainStep

_FORMAT = "tercomp-checkpoint-1"


def save_checkpoint(path: str, model, opt_state=None) -> None:
    """Save a model's parameters (and an optimizer state) to a safetensors file.
    `model` is an nn.Module or a TrainStep (whose device weights and optimizer state are
    saved). Written atomically. A data-parallel step's checkpoint is written by rank 0
    only (every rank holds the same weights); the other ranks return without writing.

    >>> tc.save_checkpoint("ckpt.safetensors", model, step.opt_state())
    >>> opt_state = tc.load_checkpoint("ckpt.safetensors", model)
    """
    if isinstance(model, TrainStep):
        if not model.is_main:
            return
        if model.data_parallel and model._calls:
            warnings.warn(f"save_checkpoint: the data-parallel step is {model._calls} call(s) into "
                          f"an accumulation of {model.accumulate_calls}; the ranks' sums of those "
                          "calls' gradients are not saved (a resumed job starts a new "
                          "accumulation); save after an update to keep every call",
                          RuntimeWarning, stacklevel=2)
        params = model.params()
        buffers = model.buffers()
        opt_state = model.opt_state() if opt_state is None else opt_state
    elif callable(getattr(model, "state_dict", None)):
        params = model.state_dict()
        buffers = {k: np.asarray(v) for k, v in model.buffers().items()} \
            if callable(getattr(model, "buffers", None)) else {}
    else:
        raise ConfigError(f"save_checkpoint: model must be an nn.Module or a TrainStep, got "
                          f"{type(model).__name__}")
    # np.array, not np.ascontiguousarray, which turns 0-d arrays into shape (1,).
    tensors = {f"params/{k}": np.array(v, order="C") for k, v in params.items()}
    meta = {"format": _FORMAT, "params": json.dumps(list(params))}
    if buffers:
        tensors.update({f"buffers/{k}": np.array(v, order="C") for k, v in buffers.items()})
        meta["buffers"] = json.dumps(list(buffers))
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
        raise ArtifactError(f"load_checkpoint: {path} is not a readable safetensors file: {e}") from None
    if meta.get("format") != _FORMAT:
        raise ArtifactError(f"load_checkpoint: {path} is not a tercomp checkpoint "
                            f"(format {meta.get('format')!r})")
    try:
        names = json.loads(meta["params"])
        params = {k: tensors[f"params/{k}"] for k in names}
        buffers = {k: tensors[f"buffers/{k}"] for k in json.loads(meta.get("buffers", "[]"))}
        opt_state = None
        if "opt_state_tree" in meta:
            treedef = json.loads(meta["opt_state_tree"])
            n = pytree.num_leaves(treedef)
            opt_state = pytree.unflatten(treedef, [tensors[f"opt_state/{i}"] for i in range(n)])
    except (KeyError, ValueError, TypeError, RecursionError) as e:
        raise ArtifactError(f"load_checkpoint: {path} is damaged ({type(e).__name__}: {e})") from None
    if isinstance(model, TrainStep):
        model.set_state(params, opt_state, buffers=buffers or None)
        model.sync_to()
    else:
        model.load_state_dict(params)
        if buffers:
            model.load_buffers(buffers)
    return opt_state
