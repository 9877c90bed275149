"""Training: a compiled step, and checkpoints, in the order a training run uses them.

`tc.compile_train_step` (compile.py) traces forward, backward (tercomp's symbolic
autodiff), gradient clipping and the optimizer update into ONE compiled function and
returns a TrainStep (step.py) that keeps params and optimizer state on the device
between calls; `tc.save_checkpoint` / `tc.load_checkpoint` (checkpoint.py) write and
read them:

    >>> step = tc.compile_train_step(loss_fn, model, tc.optim.AdamW(1e-3), x[:64], y[:64])
    >>> for xb, yb in batches:
    ...     loss = step(xb, yb)                      # a Python float
    >>> step.sync_to(model)                          # weights back into the model
    >>> tc.save_checkpoint("ckpt.safetensors", step)

With `data_parallel=True` (under `mpiexec -n N`), data_parallel.py compiles the step as
two functions around one Allreduce of the gradients and returns a DataParallelStep.
"""
from .checkpoint import load_checkpoint, save_checkpoint
from .compile import compile_train_step
from .data_parallel import DataParallelStep
from .step import TrainStep

__all__ = ["compile_train_step", "TrainStep", "DataParallelStep", "save_checkpoint",
           "load_checkpoint"]
