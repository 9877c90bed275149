"""Which rank of an MPI job this process is, and the few collectives data-parallel
training needs (tercomp.training.data_parallel), through mpi4py.

tercomp writes no communication of its own: MPI does it, started by `mpiexec -n N` or
Slurm's `srun`. `pip install -e '.[distributed]'` installs mpi4py and the `mpich` wheel,
whose `mpiexec` lands next to the Python interpreter (`launcher()` finds it there when
it is not on PATH):

    mpiexec -n 2 python train.py            # in train.py:
    step = tc.compile_train_step(loss, model, opt, xb, yb, data_parallel=True)
    if tc.distributed.is_main():
        print(loss); tc.save_checkpoint("ckpt.safetensors", step)

Outside a launcher, or with mpi4py not installed, this process is rank 0 of 1. A job
must not hang on a rank that fails: in a job of several ranks `init` makes an uncaught
exception abort every rank (as `python -m mpi4py` does; otherwise the failed rank
waits in MPI_Finalize and the others in their next collective), and every collective
is watched by a timer that aborts the job when the other ranks have not answered
within `timeout` seconds (a rank that hangs or died without the launcher noticing).
This module imports NumPy and tercomp's errors only; mpi4py's MPI (which initializes
MPI) is imported by `init`, so `import tercomp` never starts MPI.
"""
from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import threading
import time

import numpy as np

from .errors import ConfigError, MissingDependency

try:       # optional: the `distributed` extra
    import mpi4py
except ImportError:
    mpi4py = None

EXTRA = "pip install -e '.[distributed]' (mpi4py and the mpich wheel)"
DEFAULT_TIMEOUT = 600.0      # torch.distributed's default collective timeout too

# What launchers set in each rank's environment (MPICH's hydra and Slurm's PMI-2: PMI_*,
# Open MPI: OMPI_COMM_WORLD_*, PMIx: PMIX_RANK with the size in the job's info).
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def _given_size() -> int | None:
    """The job's size as a launcher's variable gives it (None when none does)."""
    for var in _SIZE_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return None


def launched_size() -> int | None:
    """The number of ranks the launcher that started this process says the job has
    (None when no launcher's variables are set; 1 when only a rank is, as PMIx does)."""
    size = _given_size()
    if size is not None:
        return size
    return 1 if any(v in os.environ for v in _RANK_VARS) else None


def launcher() -> str | None:
    """The path of `mpiexec`: the one the MPI wheel installed beside this Python (it
    matches the MPI library mpi4py loads), else the first on PATH; None without one."""
    for folder in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        path = os.path.join(folder, "mpiexec")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return shutil.which("mpiexec")


class World:
    """The ranks of this job: `rank`, `size`, and the collectives of a data-parallel
    step, each one MPI call on one contiguous buffer, watched by the timeout."""

    def __init__(self, comm=None, sum_op=None, timeout: float = DEFAULT_TIMEOUT):
        self.comm = comm
        self.sum_op = sum_op
        self.rank = comm.Get_rank() if comm is not None else 0
        self.size = comm.Get_size() if comm is not None else 1
        self.timeout = timeout
        self._watch = _Watchdog(self) if self.size > 1 else None

    def allreduce(self, send: np.ndarray, what: str) -> np.ndarray:
        """The element-wise sum of every rank's `send` (a new array; `send` is kept)."""
        if self.size == 1:
            return send
        recv = np.empty_like(send)
        with self._watch.watching(what):
            self.comm.Allreduce(send, recv, op=self.sum_op)
        return recv

    def broadcast(self, buf: np.ndarray, what: str, root: int = 0) -> np.ndarray:
        """`buf` of rank `root` on every rank (in place)."""
        if self.size > 1:
            with self._watch.watching(what):
                self.comm.Bcast(buf, root=root)
        return buf

    def ranks_where(self, flag: bool, what: str) -> list:
        """The ranks whose `flag` is true (every rank must call this together)."""
        mine = np.zeros(self.size, np.int32)
        mine[self.rank] = bool(flag)
        return [int(r) for r in np.flatnonzero(self.allreduce(mine, what))]

    def abort(self, message: str) -> None:
        """Print `message` as a TercompError and end every rank of the job."""
        sys.stderr.write(f"\ntercomp.TercompError: rank {self.rank}: {message}\n")
        sys.stderr.flush()
        if self.comm is not None:
            # MPICH's launcher kills every rank on Abort, and its proxies may stop before
            # they have forwarded what this rank just wrote: give them a moment to drain
            time.sleep(0.5)
            self.comm.Abort(1)
        os._exit(1)


class _Watchdog:
    """A thread that aborts the job when a collective has waited longer than the
    world's timeout (MPI has no timeout of its own; a blocked Allreduce never returns)."""

    def __init__(self, world: World):
        self.world = world
        self.cond = threading.Condition()
        self.deadline = None
        self.what = ""
        threading.Thread(target=self._run, name="tercomp-mpi-watchdog", daemon=True).start()

    def watching(self, what: str):
        return _Watched(self, what)

    def _run(self):
        with self.cond:
            while True:
                if self.deadline is None:
                    self.cond.wait()
                    continue
                left = self.deadline - time.monotonic()
                if left > 0:
                    self.cond.wait(left)
                    continue
                self.world.abort(
                    f"{self.what}: the other ranks did not answer within {self.world.timeout:g} s "
                    f"(a rank died, hangs, or stopped calling the step); aborting every rank. "
                    f"Raise the limit with tc.distributed.init(timeout=...) if a step or a "
                    f"compile is slower than that")


class _Watched:
    def __init__(self, watch: _Watchdog, what: str):
        self.watch, self.what = watch, what

    def __enter__(self):
        with self.watch.cond:
            self.watch.deadline = time.monotonic() + self.watch.world.timeout
            self.watch.what = self.what
            self.watch.cond.notify()

    def __exit__(self, *exc):
        with self.watch.cond:
            self.watch.deadline = None
        return False


_world: World | None = None


def init(timeout: float | None = None) -> World:
    """Join the MPI job this process was started in (`mpiexec -n N`, `srun`); called by
    `compile_train_step(..., data_parallel=True)` and the functions below, so calling it
    is needed only to set `timeout` (seconds a collective may wait for the other ranks
    before every rank is aborted; default 600). Without a launcher this process is rank
    0 of 1; under one without mpi4py it is an error naming the pip extra.

    >>> tc.distributed.init(timeout=120)
    >>> tc.distributed.rank(), tc.distributed.world_size()
    (0, 2)
    """
    global _world
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ConfigError(f"tc.distributed.init: timeout must be a positive number of seconds, "
                          f"got {timeout!r}")
    if _world is None:
        _world = _join()
    if timeout is not None:
        _world.timeout = float(timeout)
    return _world


def _join() -> World:
    launched = launched_size()
    if mpi4py is None:
        if launched not in (None, 1):
            raise MissingDependency(f"this process was started as one of {launched} MPI ranks, but "
                                    "mpi4py is not installed: data-parallel training needs it",
                                    hint=EXTRA)
        return World()
    # mpi4py's MPI initializes MPI on import (thread level MULTIPLE, which the watchdog's
    # Abort from its own thread needs): imported here, when a step asks for the job.
    from mpi4py import MPI
    world = World(MPI.COMM_WORLD, MPI.SUM)
    # a size the launcher gave must be MPI's (a PMIx launcher may give only the rank)
    if _given_size() not in (None, world.size):
        raise ConfigError(f"the launcher started {_given_size()} ranks but MPI sees {world.size}: "
                          "mpiexec belongs to another MPI than the one mpi4py loaded",
                          hint=f"use the mpiexec beside this Python ({launcher()}), or build "
                               "mpi4py against the system MPI")
    if world.size > 1:
        _abort_on_uncaught_exceptions(world)
    return world


def _abort_on_uncaught_exceptions(world: World) -> None:
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        world.abort(f"an uncaught {kind.__name__} ended this rank; aborting every rank")
    sys.excepthook = hook


def rank() -> int:
    """This process's rank in the job (0 outside MPI)."""
    return init().rank


def world_size() -> int:
    """The number of ranks in the job (1 outside MPI)."""
    return init().size


def is_main() -> bool:
    """Whether this is rank 0: the rank that logs and writes checkpoints."""
    return init().rank == 0
