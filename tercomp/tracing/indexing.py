"""x[...] on traced tensors: ints, static slices (positive steps), None, Ellipsis, and an
integer tensor on one axis (a gather, tern.take)."""
from __future__ import annotations

from ..errors import TraceError
from ..ir import is_static
from .tracer import Tracer, apply, user_location


def getitem(x: Tracer, idx):
    if not isinstance(idx, tuple):
        idx = (idx,)
    n_real = sum(1 for i in idx if i is not None and i is not Ellipsis)
    if sum(1 for i in idx if i is Ellipsis) > 1:
        raise TraceError("an index can only have one Ellipsis", loc=user_location())
    if Ellipsis in [i for i in idx if not isinstance(i, Tracer)]:
        k = [j for j, i in enumerate(idx) if i is Ellipsis][0]
        idx = idx[:k] + (slice(None),) * (x.ndim - n_real) + idx[k + 1:]
    if n_real > x.ndim:
        raise TraceError(f"too many indices ({n_real}) for a tensor of rank {x.ndim} {x.shape}",
                         loc=user_location())
    idx = idx + (slice(None),) * (x.ndim - n_real)

    starts, stops, steps, squeeze_axes, new_axes, gathers = [], [], [], [], [], []
    axis = 0
    out_pos = 0
    for i in idx:
        if i is None:
            new_axes.append(out_pos)
            out_pos += 1
            continue
        d = x.shape[axis]
        if isinstance(i, Tracer):
            gathers.append((axis, i))
            starts.append(0), stops.append(d if is_static(d) else str(d)), steps.append(1)
            out_pos += 1
        elif isinstance(i, slice):
            step = 1 if i.step is None else i.step
            if step <= 0:
                raise TraceError("slices with a negative or zero step are not supported",
                                 loc=user_location(), hint="reverse with a gather (tc.take) instead")
            if not is_static(d):
                if i.start not in (None, 0) or i.stop is not None:
                    raise TraceError(f"axis {axis} has the symbolic size {d}: it can only be taken whole",
                                     loc=user_location())
                starts.append(0), stops.append(str(d)), steps.append(step)
            else:
                s, e, st = slice(i.start, i.stop, step).indices(d)
                starts.append(s), stops.append(max(e, s)), steps.append(st)
            out_pos += 1
        elif isinstance(i, int):
            if not is_static(d):
                raise TraceError(f"cannot index axis {axis} of symbolic size {d} with an int",
                                 loc=user_location())
            if not -d <= i < d:
                raise TraceError(f"index {i} is out of bounds for axis {axis} of size {d}",
                                 loc=user_location())
            i %= d
            starts.append(i), stops.append(i + 1), steps.append(1)
            squeeze_axes.append(axis)
        else:
            raise TraceError(f"unsupported index {i!r}", loc=user_location(),
                             hint="use ints, slices, None, ... or an integer tensor")
        axis += 1
    full = all(s == 0 and st == 1 and (e == x.shape[a] or e == str(x.shape[a]))
               for a, (s, e, st) in enumerate(zip(starts, stops, steps)))
    out = x if full else apply("slice", x, starts=starts, stops=stops, steps=steps)
    if len(gathers) > 1:
        raise TraceError("only one integer-tensor index is supported", loc=user_location())
    for a, t in gathers:
        out = apply("take", out, t, axis=a)
    if squeeze_axes:
        out = apply("squeeze", out, axes=squeeze_axes)
    for pos in new_axes:
        out = apply("expand_dims", out, axis=pos)
    return out
