"""A bounded first pass over a GGUF file, before gguf-py reads it.

gguf-py's reader believes a file's counts: one array key declaring 2^62 (or 10^7)
elements makes it loop until memory runs out, and it accepts tensors whose data overlap,
are unaligned or lie past the end. `scan(path)` walks the header over a read-only map
of the file with every count checked against the bytes that remain and a limit per
kind, and checks the tensor table (known types, whole blocks, aligned, inside the data
section, no two overlapping). Any violation is a GGUFError naming the file and the key
or tensor; a file that passes is handed to gguf-py.

    >>> scan("model.gguf")          # GGUFError: model.gguf: key 'tokenizer.ggml.tokens': ...
"""
from __future__ import annotations

import bisect
import mmap
import struct

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..errors import ModelFileError

#: the most elements one array key may hold (a tokenizer's vocabulary or merges is
#: ~10^5..10^6), the longest key, the most tensors and dims
MAX_ARRAY = 1 << 22
MAX_KEY = 1 << 16
MAX_TENSORS = 1 << 20
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32

# value type -> struct format of a scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}
_STRING, _ARRAY = 8, 9

#: bitnet.cpp's I2_S (its llama.cpp fork's GGML_TYPE_I2_S = 36; not in gguf-py's enum)
I2_S = 36
#: the types gguf-py does not know: id -> (name, weights per block of a row, bytes of n
#: weights). I2_S (the fork's ggml_nbytes): the packed codes, n / 4 bytes, then 32 bytes
#: whose first 4 are the float32 tensor scale; the x86 layout's blocks are 128 weights
EXTRA_TYPES = {I2_S: ("I2_S", 128, lambda n: n // 4 + 32)}


class GGUFError(ModelFileError):
    """A GGUF file tercomp cannot read as a model; names the file and the key or tensor."""


_U64 = struct.Struct("<Q")


class _Reader:
    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def fail(self, where, msg):
        return GGUFError(f"{self.path}: {where}: {msg}",
                             hint="the file is damaged or not a GGUF model")

    def take(self, fmt, where):
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise self.fail(where, f"ends at byte {len(self.buf)}, inside a value")
        (v,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return v

    def string(self, where, limit=None):
        n = self.take("Q", where)
        left = len(self.buf) - self.pos
        if n > left or (limit is not None and n > limit):
            raise self.fail(where, f"a string of {n} bytes, with {left} bytes left")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(where, "a string that is not UTF-8") from None

    def value(self, vtype, where, depth=0):
        """Skip (and bound) one value of `vtype`; returns scalars and strings."""
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype], where)
        if vtype == _STRING:
            return self.string(where)
        if vtype != _ARRAY or depth > 0:
            raise self.fail(where, f"value type {vtype} is not a GGUF type"
                            if vtype != _ARRAY else "an array of arrays")
        etype = self.take("I", where)
        count = self.take("Q", where)
        left = len(self.buf) - self.pos
        least = struct.calcsize("<" + _SCALARS[etype]) if etype in _SCALARS else 8
        if count > MAX_ARRAY or count * least > left:
            raise self.fail(where, f"an array of {count} elements, with {left} bytes left "
                                   f"(at most {MAX_ARRAY} elements are read)")
        if etype in _SCALARS:
            self.pos += count * least
            return None
        if etype == _STRING:
            self._strings(count, where)
            return None
        for _ in range(count):
            self.value(etype, where, depth + 1)
        return None

    def _strings(self, count, where):
        """Skip `count` strings (each checked for its length and UTF-8), as `string` would
        one at a time, in one loop of locals: a 128k-token vocabulary is most of a scan."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = _U64.unpack_from
        try:
            for _ in range(count):
                if pos + 8 > end:
                    raise self.fail(where, f"ends at byte {end}, inside a value")
                (n,) = unpack(buf, pos)
                pos += 8
                if n > end - pos:
                    raise self.fail(where, f"a string of {n} bytes, with {end - pos} bytes left")
                str(buf[pos:pos + n], "utf-8")
                pos += n
        except UnicodeDecodeError:
            raise self.fail(where, "a string that is not UTF-8") from None
        self.pos = pos


def scan(path) -> dict:
    """Check `path`'s header and tensor table; returns {key: value} of its scalar and
    string keys (arrays are checked and skipped)."""
    path = str(path)
    try:
        with open(path, "rb") as fh:
            if fh.seek(0, 2) == 0:
                raise GGUFError(f"{path}: an empty file is not GGUF")
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read it ({e.strerror or e})") from None
    try:
        return _scan(_Reader(memoryview(buf), path))
    finally:
        try:
            buf.close()
        except BufferError:        # a view still exported (an error's traceback): left to GC
            pass


def _scan(r: _Reader) -> dict:
    if bytes(r.buf[:4]) != b"GGUF":
        raise r.fail("magic", f"{bytes(r.buf[:4])!r}, not b'GGUF'")
    r.pos = 4
    version = r.take("I", "version")
    if version not in (2, 3):
        raise r.fail("version", f"{version}; GGUF versions 2 and 3 are read")
    n_tensors = r.take("Q", "tensor count")
    n_kv = r.take("Q", "key count")
    if n_tensors > MAX_TENSORS or n_kv > len(r.buf):
        raise r.fail("header", f"{n_tensors} tensors and {n_kv} keys in a file of "
                               f"{len(r.buf)} bytes")
    keys = {}
    for i in range(n_kv):
        key = r.string(f"key #{i}", MAX_KEY)
        vtype = r.take("I", f"key {key!r}")
        v = r.value(vtype, f"key {key!r}")
        if v is not None:
            keys[key] = v
    align = keys.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise r.fail("key 'general.alignment'", f"{align!r} is not a power of two")
    infos = []
    for i in range(n_tensors):
        name = r.string(f"tensor #{i}", MAX_KEY)
        n_dims = r.take("I", f"tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise r.fail(f"tensor {name!r}", f"{n_dims} dims (1 to {MAX_DIMS})")
        dims = [r.take("Q", f"tensor {name!r}") for _ in range(n_dims)]
        ttype = r.take("I", f"tensor {name!r}")
        offset = r.take("Q", f"tensor {name!r}")
        infos.append((name, dims, ttype, offset))
    data_start = -(-r.pos // align) * align
    _check_tensors(r, infos, align, data_start)
    return keys


def _check_tensors(r: _Reader, infos, align, data_start):
    spans, names = [], set()
    starts = sorted(data_start + off for *_, off in infos)
    for name, dims, ttype, offset in infos:
        where = f"tensor {name!r}"
        if name in names:
            raise r.fail(where, "defined twice")
        names.add(name)
        block, size_of = _type_size(r, where, ttype)
        if any(d == 0 for d in dims) or dims[0] % block:
            extra = ""
            if ttype == I2_S and dims[0] % 64 == 0:
                extra = (" (bitnet.cpp's ARM builds quantize I2_S in blocks of 64, a layout "
                         "tercomp does not read; re-quantize the model on x86)")
            raise r.fail(where, f"dims {dims} are not whole blocks of {block}{extra}")
        n = 1
        for d in dims:
            n *= d
            if n > len(r.buf) * 8:
                raise r.fail(where, f"dims {dims} hold more values than the file has bits")
        nbytes = size_of(n)
        if offset % align:
            raise r.fail(where, f"data offset {offset} is not aligned to {align}")
        start = data_start + offset
        if ttype == I2_S:
            _check_i2_s(r, where, starts, start, n)
        if start + nbytes > len(r.buf):
            raise r.fail(where, f"data [{start}, {start + nbytes}) lies past the end of the "
                                f"file ({len(r.buf)} bytes)")
        spans.append((start, start + nbytes, name))
    spans.sort()
    for (s0, e0, a), (s1, _, b) in zip(spans, spans[1:]):
        if s1 < e0:
            raise r.fail(f"tensor {b!r}", f"its data overlaps tensor {a!r}'s")
        # writers pack the data, each tensor padded to the alignment: a larger gap means
        # a tensor's type or dims no longer describe its bytes
        if s1 > -(-e0 // align) * align:
            raise r.fail(f"tensor {a!r}", f"its type and dims cover {e0 - s0} bytes, but "
                                          f"{s1 - s0} lie before the next tensor {b!r}")


def _type_size(r: _Reader, where, ttype):
    """(weights per block, bytes of n weights) of GGML type id `ttype`."""
    if ttype in EXTRA_TYPES:
        return EXTRA_TYPES[ttype][1:]
    try:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        raise r.fail(where, f"type {ttype} is not a GGML type") from None
    return block, lambda n: n // block * size


def _check_i2_s(r: _Reader, where, starts, start, n):
    """An I2_S tensor's bytes reach to the next tensor (`starts`: every tensor's start,
    sorted) or the end of the file: at least its n / 4 code bytes and the float32 scale
    after them, named apart from the generic overlap / past-the-end errors because a
    writer that leaves the scale out is the likely cause."""
    i = bisect.bisect_right(starts, start)
    room = (starts[i] if i < len(starts) else len(r.buf)) - start
    if room < n // 4 + 4:
        raise r.fail(where, f"I2_S data of {n} weights is {n // 4} code bytes, then the "
                            f"float32 tensor scale (padded to 32 bytes); only {room} bytes "
                            f"are there, so its tensor scale is missing or its size does "
                            f"not match its shape")
