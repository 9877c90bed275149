"""The runtime half of check_numerics (tercomp/passes/check_numerics.py has the compile half):
read a module's `__numerics` output and name the first op that produced a NaN or Inf."""
from __future__ import annotations

import numpy as np

from ..errors import NumericsError


def report(values: np.ndarray, described: list):
    """Raise NumericsError for the first described value that produced a NaN or an Inf:
    a NaN where no computed operand had one (a NaN weight is reported where it is first
    used), an Inf where every operand was finite (an Inf that only flows on, like a -inf
    mask, is not reported), or an out-of-range label.
    `values` holds two numbers per described value: the count of NaNs (or of bad
    labels) and sum(v - v), NaN iff v is not all finite."""
    values = np.asarray(values, np.float32).reshape(-1)
    nan, bad = values[0::2] > 0, np.isnan(values[1::2])

    def flags(src):
        if isinstance(src, (list, tuple)):          # ("const", has_nan, has_nonfinite)
            return bool(src[1]), bool(src[2]), True
        return nan[src], bad[src], False

    for i, d in enumerate(described):
        if not (nan[i] or bad[i]):
            continue
        if d["op"] == "labels":
            text = d["what"]
        elif d["op"] is None:                        # a graph input
            text = f"{d['what']} {'a NaN' if nan[i] else 'an Inf'}"
        else:
            srcs = [flags(s) for s in d["operands"]]
            if nan[i] and not any(n for n, _, const in srcs if not const):
                text = f"{d['what']} a NaN"
                if any(n for n, _, const in srcs if const):
                    text += " from a constant operand that holds NaN"
            elif bad[i] and not nan[i] and not any(f for _, f, _ in srcs):
                text = f"{d['what']} an Inf"
            else:
                continue                             # it only passed a NaN/Inf on
        where = f"{d['loc']}: " if d["loc"] else ""
        value = f" (value %{d['value']})" if d["op"] is not None else ""
        raise NumericsError(f"{where}{text}{value}",
                            hint="checks run in program order and the first failing one is "
                                 "reported: look at the inputs of that op")
