"""Literal values of tern IR text: `dense<...>` tensor literals and quoted strings, read
by a tokenizer and a small grammar with limits (never `eval`).

    dense   := '"0x' HEX '"'                  raw little-endian bytes (or one splat element)
             | element                        a splat
             | list
    list    := '[' (list | element) (',' (list | element))* ']'     nested at most rank deep
    element := INT | HEXINT | FLOAT | 'true' | 'false' | 'inf' | 'nan'   (optionally signed)

A hex element of a float tensor is the bit pattern of one element (MLIR's spelling of
NaN and infinities: `0x7FC00000` for f32).

>>> read_dense("[[1, 2], [3, 4]]", (2, 2), np.dtype(np.int32)).tolist()
[[1, 2], [3, 4]]
"""
from __future__ import annotations

import math
import re

import numpy as np

# A constant bigger than this is refused: a splat in a few bytes of text could otherwise
# ask for any amount of memory.
MAX_CONSTANT_BYTES = 1 << 30

_ELEM = re.compile(r"""\s*(?:
    (?P<open>\[) | (?P<close>\]) | (?P<comma>,)
  | (?P<hex>[-+]?0[xX][0-9A-Fa-f]+)
  | (?P<float>[-+]?(?:\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|inf|nan))
  | (?P<int>[-+]?\d+)
  | (?P<bool>true|false)
)""", re.VERBOSE)

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


class LiteralError(ValueError):
    """A malformed literal; the parser adds the line and column."""


def _element(kind: str, text: str, dtype: np.dtype):
    if dtype.kind == "b":
        if kind == "bool":
            return text == "true"
        if kind == "int" and text.lstrip("+-") in ("0", "1"):
            return text.lstrip("+-") == "1"
        raise LiteralError(f"{text!r} is not a boolean (true, false, 0 or 1)")
    if kind == "bool":
        raise LiteralError(f"{text!r} in a {dtype.name} tensor")
    if dtype.kind == "f":
        if kind == "hex":
            bits = int(text, 16)
            if text.startswith("-") or bits >> (8 * dtype.itemsize):
                raise LiteralError(f"hex float {text} does not fit {8 * dtype.itemsize} bits")
            return np.array(bits, _UINT[dtype.itemsize]).view(dtype).item()
        return float(text)
    if kind == "float":
        raise LiteralError(f"{text!r} is not an integer")
    v = int(text, 16) if kind == "hex" else int(text)
    info = np.iinfo(dtype)
    # MLIR integers are signless: a value fits if it fits as signed or as unsigned
    if not info.min <= v <= 2 ** (8 * dtype.itemsize) - 1:
        raise LiteralError(f"{text} does not fit in {dtype.name}")
    return v if v <= info.max else v - 2 ** (8 * dtype.itemsize)


def read_dense(body: str, shape: tuple, dtype: np.dtype) -> np.ndarray:
    """Read the text between `dense<` and `>` into an array of `shape` and `dtype`.
    Raises LiteralError."""
    dtype = np.dtype(dtype)
    numel = math.prod(shape)
    if numel * dtype.itemsize > MAX_CONSTANT_BYTES:
        raise LiteralError(f"a constant of shape {list(shape)} ({numel * dtype.itemsize} bytes) is larger "
                           f"than the {MAX_CONSTANT_BYTES >> 20} MiB limit of IR text constants")
    text = body.strip()
    if text.startswith('"'):
        if not re.fullmatch(r'"0x[0-9A-Fa-f]*"', text):
            raise LiteralError('a string dense literal must be hex bytes: "0x..."')
        raw = bytes.fromhex(text[3:-1]) if len(text) % 2 == 0 else None
        if raw is None or len(raw) not in (dtype.itemsize, numel * dtype.itemsize):
            raise LiteralError(f"hex literal of {len(text) - 4} digits for {numel} elements of {dtype.name}")
        arr = np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype)
        return np.full(shape, arr[0], dtype=dtype) if arr.size == 1 and numel != 1 else arr.reshape(shape)
    values, found_shape = _read_nested(text, len(shape), numel, dtype)
    arr = np.array(values, dtype=dtype)
    if found_shape == ():
        return np.full(shape, arr.reshape(()), dtype=dtype)
    if tuple(found_shape) != tuple(shape):
        raise LiteralError(f"literal of shape {list(found_shape)} for a tensor of shape {list(shape)}")
    return arr.reshape(shape)


def _read_nested(text: str, rank: int, numel: int, dtype: np.dtype):
    """Flat values and the shape of a (possibly nested) list literal, without recursion."""
    values, stack, dims, pos = [], [], {}, 0
    expect_value = True
    done = False
    while pos < len(text):
        m = _ELEM.match(text, pos)
        if not m or m.end() == pos:
            if text[pos:].strip() == "":
                break
            raise LiteralError(f"unexpected {text[pos:pos + 12]!r} in a dense literal")
        pos = m.end()
        kind = m.lastgroup
        if done:
            raise LiteralError(f"unexpected {m.group(kind)!r} after the end of the literal")
        if kind == "open":
            if not expect_value:
                raise LiteralError("expected ',' or ']' before '['")
            if len(stack) >= rank:
                raise LiteralError(f"list nested deeper than the tensor's rank {rank}")
            stack.append(0)
        elif kind == "close":
            if not stack or (expect_value and stack[-1] > 0):
                raise LiteralError("unexpected ']'")
            n = stack.pop()
            if dims.setdefault(len(stack), n) != n:
                raise LiteralError(f"ragged list: {n} elements where an earlier list had {dims[len(stack)]}")
            expect_value = False
            done = not stack
            if stack:
                stack[-1] += 1
        elif kind == "comma":
            if expect_value or not stack:
                raise LiteralError("unexpected ','")
            expect_value = True
        else:
            if not expect_value:
                raise LiteralError(f"expected ',' before {m.group(kind)!r}")
            if stack and len(stack) != rank:
                raise LiteralError(f"an element at depth {len(stack)} of a rank-{rank} tensor")
            if len(values) >= max(numel, 1):
                raise LiteralError(f"more than {numel} elements")
            values.append(_element(kind, m.group(kind), dtype))
            expect_value = False
            if stack:
                stack[-1] += 1
            else:
                done = True
    if stack or not done:
        raise LiteralError("unterminated dense literal")
    if not dims:
        return values, ()
    return values, tuple(dims[k] for k in range(len(dims)))


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "t": "\t"}


def unescape(body: str) -> str:
    """The value of a quoted MLIR string's body: \\\\ \\" \\n \\t and \\XX (two hex digits)."""
    out, i = [], 0
    while i < len(body):
        c = body[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        nxt = body[i + 1:i + 2]
        if nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
            i += 2
        elif re.fullmatch(r"[0-9A-Fa-f]{2}", body[i + 1:i + 3]):
            out.append(chr(int(body[i + 1:i + 3], 16)))
            i += 3
        else:
            raise LiteralError(f"unknown escape {body[i:i + 2]!r} in a string")
    return "".join(out)
