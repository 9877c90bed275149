"""Calling a function of IREE's "async-external" execution model ("coarse-fences": its
last two arguments are a wait fence and a signal fence, and the call returns once the
work is queued), as iree.runtime's FunctionInvoker calls a synchronous one: NumPy arrays,
DeviceArrays and Python ints in, a DeviceArray (or a tuple of them) out, after the work
is done.

Why: a synchronous function waits inside IREE (`hal.fence.await`), and on a machine
with as many cores as workers that wait costs the host thread CPU while the workers
run: measured at the 700M decode step, 2 threads on a 2-core Zen 5, the host thread
used 0.9-1.2 ms of CPU a 7.6 ms call and preempted a worker about every other call.
Here the host sleeps instead: for most of the call's expected time (the last call of
the same argument shapes), then in short steps until the signal fence is reached. The same step, 6 rounds in turns: 6.90 against 7.63 ms a token (medians, with a first
sleep of 90% of the expected time), the host's CPU 0.43 ms a call (bench/RESULTS.md,
2026-11-28 14:30).
"""
from __future__ import annotations

import time

import iree.runtime as rt
import numpy as np

#: The first sleep: this share of the expected time, less MARGIN seconds. A call's time
#: varies by 10% and more from one to the next (a 1 s prefill of the 8B shape: 1.0-1.2 s),
#: and a sleep past the end is lost.
FIRST = 0.8
MARGIN = 400e-6
#: The shortest and the longest sleep between two looks at the signal fence after the
#: first: a 100th of the call's expected time within them (at most 1% of a long call
#: is lost past its end; a 7 ms decode step looks every 70 us).
POLL = 50e-6
MAX_POLL = 1e-3

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
            time.sleep(max(0.0, FIRST * expected - MARGIN))
            while not signal.wait(timeout=0):
                # then a look every 100th of the expected time (of the time so far, for
                # a shape not seen yet), POLL to MAX_POLL apart
                step = (expected or time.perf_counter() - start) / 100
                time.sleep(min(MAX_POLL, max(POLL, step)))
        except Exception:
            # a failed submission or execution leaves the timeline failed or ahead of
            # its fences: the next call starts on a fresh one
            self._semaphore, self._value = self._device.create_semaphore(0), 0
            raise
        self._expected[key] = time.perf_counter() - start
        outs = tuple(rt.DeviceArray(self._device, results.get_as_object(i, rt.HalBufferView))
                     for i in range(len(results)))
        return outs[0] if len(outs) == 1 else outs
