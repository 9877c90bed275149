"""Calling a function of IREE's "async-external" execution model ("coarse-fences": its
last two arguments are a wait fence and a signal fence, and the call returns once the
work is queued), as iree.runtime's FunctionInvoker calls a synchronous one: NumPy arrays,
DeviceArrays and Python ints in, a DeviceArray (or a tuple of them) out, after the work
is done.

Why: a synchronous function waits inside IREE (`hal.fence.await`), and on a machine
with as many cores as workers that wait costs the host thread CPU while the workers
run: measured at the 700M decode step, 2 threads on a 2-core Zen 5, the host thread
used 0.9-1.2 ms of CPU a 7.6 ms call and preempted a worker about every other call.
Here the host sleeps instead: for the call's expected time (the last call of the same
argument shapes, less a margin), then in steps of POLL seconds until the signal fence
is reached (longer steps the further a call runs past it). The same step, 6 rounds in turns: 6.90 against 7.63 ms a token (medians),
the host's CPU 0.43 ms a call (bench/RESULTS.md, 2026-11-28 14:30).
"""
from __future__ import annotations

import time

import iree.runtime as rt
import numpy as np

#: Seconds between two looks at the signal fence once the expected time has passed.
POLL = 50e-6
#: The longest sleep between two looks: what a call of unknown length (a prompt of a new
#: length) may wait past its end, at most a 20th of its time.
MAX_POLL = 1e-3
#: Seconds the first sleep stops short of the expected time (and a 10th of it).
MARGIN = 400e-6

MODEL = "coarse-fences"


def is_fenced(vm_function) -> bool:
    """Whether an iree.runtime VmFunction takes IREE's wait and signal fences."""
    return dict(vm_function.reflection).get("iree.abi.model") == MODEL


class FencedFunction:
    """`vm_function` of the loaded module `vm_context` on HalDevice `device`, called like
    iree.runtime's FunctionInvoker (see the module doc). Calls are one at a time (the
    callers hold their generator's lock)."""

    def __init__(self, vm_context, device, vm_function):
        self.vm_function = vm_function
        self._context, self._device = vm_context, device
        self._semaphore, self._value = device.create_semaphore(0), 0
        self._expected: dict = {}

    def _argument(self, args: "rt.VmVariantList", x):
        if isinstance(x, (bool, np.bool_)):
            raise TypeError(f"a {type(x).__name__} is not an argument of {self.vm_function.name}")
        if isinstance(x, (int, np.integer)):
            args.push_int(int(x))
        elif isinstance(x, rt.DeviceArray):
            args.push_ref(x._buffer_view)
        else:
            args.push_ref(rt.asdevicearray(self._device, np.ascontiguousarray(x))._buffer_view)

    def __call__(self, *xs):
        args = rt.VmVariantList(len(xs) + 2)
        for x in xs:
            self._argument(args, x)
        wait = rt.HalFence.create_at(self._semaphore, self._value)
        signal = rt.HalFence.create_at(self._semaphore, self._value + 1)
        args.push_ref(wait)
        args.push_ref(signal)
        results = rt.VmVariantList(1)
        key = tuple(getattr(x, "shape", None) for x in xs)
        start = time.perf_counter()
        try:
            self._context.invoke(self.vm_function, args, results)
            self._value += 1
            expected = self._expected.get(key, 0.0)
            time.sleep(max(0.0, 0.9 * expected - MARGIN))
            while not signal.wait(timeout=0):
                # past the expected time (or with none yet: a new shape) the looks thin
                # out with the overrun, a 20th of it, up to MAX_POLL apart
                late = time.perf_counter() - start - expected
                time.sleep(min(MAX_POLL, max(POLL, late / 20)))
        except Exception:
            # a failed submission or execution leaves the timeline failed or ahead of
            # its fences: the next call starts on a fresh one
            self._semaphore, self._value = self._device.create_semaphore(0), 0
            raise
        self._expected[key] = time.perf_counter() - start
        outs = tuple(rt.DeviceArray(self._device, results.get_as_object(i, rt.HalBufferView))
                     for i in range(len(results)))
        return outs[0] if len(outs) == 1 else outs
