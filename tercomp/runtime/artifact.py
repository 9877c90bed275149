"""Saved artifacts: one file that holds everything needed to run a compiled module.

The file (conventionally `.tcm`) is a zip archive with these members, stored
uncompressed, each once, and no others:

- `module.vmfb`: the IREE VM bytecode module.
- `signature.json`: UTF-8 JSON with
    - `format`: "tercomp-artifact", `format_version`: 2 (1 did not digest signature.json)
    - `signature`: `function`, `inputs` and `outputs` (each `name`, `shape` with
      symbolic dims as strings such as "B" or "2*B", `dtype` such as "f32"),
      `in_tree` and `out_tree` (pytree structure; see tercomp.pytree)
    - `targets`: tercomp target names ("llvm-cpu", "vulkan", ...) the vmfb contains
    - `drivers`: the runtime drivers that run it, preferred first
    - `flags`: the IREE compiler flags used
    - `tercomp_version`, `iree_version` (of the compiler that built the vmfb)
    - `sha256`: hex digest of every member: `module.vmfb` and `weights.irpa` by their
      bytes, `signature.json` by its content less `sha256` and `content_hash`
      (`signature_digest`: its canonical JSON)
    - `content_hash`: sha256 over those digests, a name for the artifact's content
    - `weights_scope`: parameter scope of `weights.irpa` (when present)
    - `lm` (a compiled language model, tc.compile_lm): `config` (the model's
      hyperparameters), `max_seq`, `kv_dtype`, `entries` (["step"], with "copy_rows"
      where batched), `step_inputs` and `tokenizer` (the tokenizer.json text, or
      null); tc.load then returns an LMGenerator (tercomp.runtime.generator)
- `weights.irpa` (optional): the parameters the module reads, in IREE's archive format,
  stored last and starting at a multiple of ALIGN bytes in the file (its local header
  is padded with an extra field, as Android's zipalign pads), so that tc.load maps the
  file and IREE binds the parameters in place from the page cache: no copy in RAM,
  shared between processes, loaded in the time of a page-table walk. `module.vmfb` starts
  at a multiple of ALIGN too: IREE runs the module over the mapped file (its code and
  inline constants are in RAM once); an artifact written before without the padding is
  copied, as before.

Reading maps the file and checks the zip (no duplicated or unknown member, and no member that inflates
past `MAX_INFLATION` times its stored size or the file size limit: a zip bomb is an
error before anything is inflated), the digests (the weights' once per file: a stamp in the compile cache directory, keyed by
the file's path, size, mtime and inode, records a verified file, so a later load does not
read every byte again), and that the installed iree.runtime
has the major.minor version of the compiler that built the vmfb (IREE's bytecode is
not stable across releases); any failure is an ArtifactError. tc.load then checks
signature.json against the module itself (loader.check_module). Reading imports only
iree.runtime, never the compiler. This module is the file format; tc.load, which turns
a file into a CompiledModule or an LMGenerator, is tercomp.runtime.loader.

    >>> exe.save("mlp.tcm")                           # artifact.save(exe, "mlp.tcm")
    >>> meta, vmfb, weights = artifact.read("mlp.tcm")
"""
from __future__ import annotations

import hashlib
import io
import json
import mmap
import os
import struct
import weakref
import zipfile
import zlib

from iree.runtime.version import VERSION as RUNTIME_VERSION

from .._version import __version__
from ..errors import ArtifactError, InputError
from .files import atomic_target, cache_dir, check_regular, max_bytes, write_atomic
from .signature import Signature

FORMAT = "tercomp-artifact"
FORMAT_VERSION = 2
VMFB, SIGNATURE, WEIGHTS = "module.vmfb", "signature.json", "weights.irpa"
MEMBERS = (SIGNATURE, VMFB, WEIGHTS)
#: The most a compressed member may inflate, relative to its stored size. tercomp
#: stores members uncompressed; an archive re-zipped with deflate inflates a few times
#: (vmfb, JSON), while a zip bomb inflates ~1000x (6.8 MB to 6 GiB).
MAX_INFLATION = 100
_FIXED_DATE = (1980, 1, 1, 0, 0, 0)   # identical modules give identical files
#: weights.irpa's data starts at a multiple of this in the file (a page)
ALIGN = 4096
_PAD_ID = 0xD935                      # the extra-field id zipalign's padding uses
_LOCAL_HEADER = 30                    # bytes of a zip local file header before its name
_CHUNK = 64 << 20                     # bytes written per call
# what zipfile raises for a damaged archive: a flipped byte can name an unknown
# compression method (NotImplementedError) or an encrypted member (RuntimeError)
_ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, NotImplementedError,
               RuntimeError, struct.error)


def _major_minor(version: str) -> tuple:
    parts = version.split(".")
    return tuple(parts[:2])


def _digest(data) -> str:
    h = hashlib.sha256()
    for chunk in _chunks(data):
        h.update(chunk)
    return h.hexdigest()


def _chunks(data):
    """`data` (bytes-like) in pieces of _CHUNK bytes. When `data` is a whole mapped file
    (a module's weights fresh from the compiler), each piece's pages leave this process's
    map once used: writing or hashing gigabytes of weights does not make them resident
    (the page cache keeps them for the next reader)."""
    view = memoryview(data).cast("B")
    whole_map = isinstance(view.obj, mmap.mmap) and len(view.obj) == view.nbytes
    for i in range(0, view.nbytes, _CHUNK):
        yield view[i:i + _CHUNK]
        if whole_map and hasattr(mmap, "MADV_DONTNEED"):
            view.obj.madvise(mmap.MADV_DONTNEED, i, min(_CHUNK, view.nbytes - i))


def content_hash(digests: dict) -> str:
    return _digest("".join(f"{k}={digests[k]}\n" for k in sorted(digests)).encode())


def signature_digest(meta: dict) -> str:
    """The digest of signature.json: sha256 of its canonical JSON (sorted keys, no
    spaces, ASCII) without the `sha256` and `content_hash` entries, which hold it."""
    body = {k: v for k, v in meta.items() if k not in ("sha256", "content_hash")}
    return _digest(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                              allow_nan=False).encode())


def seal(meta: dict) -> dict:
    """`meta` with `sha256[signature.json]` and `content_hash` set for its content (the
    other members' digests must be in `meta["sha256"]` already)."""
    digests = {**meta["sha256"], SIGNATURE: signature_digest(meta)}
    return {**meta, "sha256": digests, "content_hash": content_hash(digests)}


def _members_and_meta(exe) -> tuple[dict, bytes]:
    """({member: bytes or memoryview} for module.vmfb and weights.irpa, the
    signature.json bytes) of CompiledModule `exe`."""
    members = {VMFB: exe.vmfb_view}
    if exe.weights_view is not None:
        members[WEIGHTS] = exe.weights_view
    digests = {name: _digest(data) for name, data in members.items()}
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "signature": exe.signature.to_json(),
        "targets": list(exe.targets),
        "drivers": list(exe.meta.get("drivers", [])),
        "flags": list(exe.meta.get("flags", [])),
        "tercomp_version": __version__,
        "iree_version": exe.meta.get("iree_version") or RUNTIME_VERSION,
        "sha256": digests,
    }
    for k in ("cache_key", "numerics", "ternary"):
        if exe.meta.get(k):
            meta[k] = exe.meta[k]
    if exe.weights_view is not None:
        meta["weights_scope"] = exe.weights_scope
    if exe.meta.get("lm") is not None:
        meta["lm"] = exe.meta["lm"]
    return members, json.dumps(seal(meta), indent=1, sort_keys=True).encode()


def write_to(exe, f) -> None:
    """Write the artifact file of CompiledModule `exe` into the seekable binary file `f`
    (at its start): the members are written from the module's own buffers, one pass,
    no copy of the weights in memory."""
    members, signature = _members_and_meta(exe)
    members = {SIGNATURE: memoryview(signature), **members}
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in MEMBERS:
            if name not in members:
                continue
            data = members[name].cast("B")
            info = zipfile.ZipInfo(name, date_time=_FIXED_DATE)
            info.file_size = data.nbytes
            if name in (VMFB, WEIGHTS):      # mapped at load time (CompiledModule)
                info.extra = _padding(f.tell(), name, data.nbytes)
            with zf.open(info, "w", force_zip64=data.nbytes * 1.05 > zipfile.ZIP64_LIMIT) as out:
                for chunk in _chunks(data):
                    out.write(chunk)


def to_bytes(exe) -> bytes:
    """The artifact file of CompiledModule `exe`, as bytes."""
    buf = io.BytesIO()
    write_to(exe, buf)
    return buf.getvalue()


def _padding(offset: int, name: str, size: int) -> bytes:
    """The extra field that makes the data of a member whose local header starts at
    `offset` start at a multiple of ALIGN (zipfile adds a 20-byte zip64 field to the
    header of a member of more than ~2 GiB: counted here)."""
    zip64 = 20 if size * 1.05 > zipfile.ZIP64_LIMIT else 0
    start = offset + _LOCAL_HEADER + len(name.encode()) + 4 + zip64
    pad = -start % ALIGN
    return struct.pack("<HH", _PAD_ID, pad) + bytes(pad)


def save(exe, path: str) -> None:
    """Write CompiledModule `exe` to `path` as one artifact file (format: module doc).
    The write is atomic, respects the umask and writes through symlinks (runtime.files)."""
    write(exe, path, "artifact", ArtifactError)


def write(exe, path: str, what: str = "artifact", error=ArtifactError, durable: bool = True,
          make_dirs: bool = False) -> None:
    """`save`, streamed into a temporary file beside `path` and moved over it
    (runtime.files.atomic_target); `durable=False` skips the fsync (a compile-cache entry,
    which a damaged copy after a crash only turns into a miss)."""
    with atomic_target(path, what, error, make_dirs=make_dirs, durable=durable) as tmp:
        with open(tmp, "wb") as f:
            write_to(exe, f)


def read_bytes(data, name: str = "<artifact>", verified=None) -> tuple:
    """Check and unpack an artifact (bytes, or an mmap of its file): returns (meta dict,
    vmfb bytes, weights or None). From an mmap, the weights are a memoryview of it
    where they are stored aligned (else bytes); `verified(digest)` says whether the
    weights with that digest were checked before (their bytes are then not hashed)."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data) if not isinstance(data, mmap.mmap) else _MapReader(data))
    except _ZIP_ERRORS:
        raise ArtifactError(f"{name} is not a tercomp artifact (not a zip archive, or truncated)",
                            hint="artifacts are written by exe.save() or `tercomp compile -o`") from None
    with zf:
        members = _read_members(zf, name, data if isinstance(data, mmap.mmap) else None)
    try:
        meta = json.loads(members[SIGNATURE].decode("utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("not an object")
    except (UnicodeDecodeError, ValueError) as e:
        raise ArtifactError(f"{name}: {SIGNATURE} is not valid JSON ({e})") from None
    except RecursionError:      # json's parser recurses once per nested array / object
        raise ArtifactError(f"{name}: {SIGNATURE} is nested too deeply to be a signature",
                            hint="the artifact is damaged or not written by tercomp") from None
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{name} is not a tercomp artifact ({SIGNATURE} has format "
                            f"{meta.get('format')!r})")
    if meta.get("format_version") == 1:
        raise ArtifactError(f"{name} was written by an older tercomp (artifact format 1, whose "
                            f"digests do not cover {SIGNATURE}); this tercomp ({__version__}) reads "
                            f"format {FORMAT_VERSION}", hint="compile or save the model again")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{name} has artifact format version {meta.get('format_version')!r}; "
                            f"this tercomp ({__version__}) reads version {FORMAT_VERSION}",
                            hint="recompile the model with this tercomp")
    digests = meta.get("sha256")
    if not isinstance(digests, dict) or VMFB not in digests or SIGNATURE not in digests:
        raise ArtifactError(f"{name}: {SIGNATURE} has no sha256 digests")
    if (WEIGHTS in digests) != (WEIGHTS in members):
        raise ArtifactError(f"{name}: {WEIGHTS} is {'missing' if WEIGHTS in digests else 'unexpected'}",
                            hint="the file is damaged or was modified")
    for member, want in digests.items():
        if member not in members:
            raise ArtifactError(f"{name}: {SIGNATURE} has a digest of {member!r}, which is no member",
                                hint="the file is damaged or was modified")
        try:
            if member == WEIGHTS and verified is not None and verified(want):
                have = want         # checked when first loaded (a stamp says so)
            else:
                have = signature_digest(meta) if member == SIGNATURE else _digest(members[member])
        except ValueError:          # NaN or Infinity in the JSON
            have = None
        if have != want:
            raise ArtifactError(f"{name}: the sha256 of {member} does not match its signature "
                                "(the file was modified or damaged)",
                                hint="save or compile the artifact again")
    if meta.get("content_hash") != content_hash(digests):
        raise ArtifactError(f"{name}: the content_hash in {SIGNATURE} is not that of its digests "
                            "(the file was modified)", hint="save or compile the artifact again")
    built, have = str(meta.get("iree_version", "unknown")), RUNTIME_VERSION
    if _major_minor(built) != _major_minor(have):
        raise ArtifactError(f"{name} was compiled by IREE {built}, but iree.runtime here is {have}; "
                            "IREE bytecode only loads on the same major.minor release",
                            hint=f"install iree-base-runtime=={'.'.join(_major_minor(built))}.* "
                                 "or recompile the model")
    try:
        Signature.from_json(meta["signature"])
    except (KeyError, TypeError, AttributeError) as e:
        raise ArtifactError(f"{name}: the signature in {SIGNATURE} is malformed ({e})") from None
    except InputError as e:
        raise ArtifactError(f"{name}: the signature in {SIGNATURE} is malformed: {e.message}") from None
    return meta, members[VMFB], members.get(WEIGHTS)


def _read_members(zf: zipfile.ZipFile, name: str, mapped=None) -> dict:
    """The members of an open artifact zip by name, each read at most to its declared
    size after checking the declarations: known names, each once, no member inflating
    more than MAX_INFLATION times or past the file size limit. With `mapped` (an mmap of
    the file), a stored module or weights starting at a multiple of ALIGN are a view of it."""
    infos = zf.infolist()
    seen = set()
    for info in infos:
        if info.filename in seen:
            raise ArtifactError(f"{name} has two members named {info.filename!r}",
                                hint="the file was modified or damaged; save the artifact again")
        seen.add(info.filename)
        if info.filename not in MEMBERS:
            raise ArtifactError(f"{name} has an unexpected member {info.filename!r} (an artifact "
                                f"holds {', '.join(MEMBERS)})", hint="the file was modified")
    for member in (SIGNATURE, VMFB):
        if member not in seen:
            raise ArtifactError(f"{name} is missing {member}",
                                hint="the file is damaged or not a tercomp artifact")
    total, limit = 0, max_bytes()
    for info in infos:
        total += info.file_size
        stored = info.compress_type == zipfile.ZIP_STORED
        if (stored and info.file_size != info.compress_size) or \
                info.file_size > MAX_INFLATION * max(info.compress_size, 1) or total > limit:
            why = ("its stored size differs" if stored and info.file_size != info.compress_size
                   else f"more than {MAX_INFLATION} times its {info.compress_size} compressed bytes"
                   if total <= limit else f"past the {limit} bytes an artifact may hold")
            raise ArtifactError(f"{name}: {info.filename} would inflate to {info.file_size} bytes, "
                                f"{why}; refusing to unpack it (a damaged file or a zip bomb)",
                                hint="artifacts are written by exe.save(), uncompressed; raise "
                                     "$TERCOMP_MAX_FILE_BYTES only for a large file you trust")
    members = {}
    try:
        for info in infos:
            view = _aligned_view(mapped, info) if info.filename in (VMFB, WEIGHTS) else None
            if view is not None:
                members[info.filename] = view
                continue
            with zf.open(info) as f:            # reads no more than the declared size
                members[info.filename] = f.read(info.file_size)
    except _ZIP_ERRORS as e:
        raise ArtifactError(f"{name} is corrupt: {e}",
                            hint="the file was truncated or modified; save it again") from None
    except MemoryError:
        raise ArtifactError(f"{name}: not enough memory to unpack its {total} bytes",
                            hint="free memory, or load it on a larger machine") from None
    return members


def _aligned_view(mapped, info: zipfile.ZipInfo):
    """A memoryview of a stored member's data in `mapped` if it starts at a multiple of
    ALIGN (an artifact this tercomp wrote), else None. Its digest is checked instead
    of the zip's CRC."""
    if mapped is None or info.compress_type != zipfile.ZIP_STORED:
        return None
    at = info.header_offset
    header = mapped[at:at + _LOCAL_HEADER]
    if len(header) < _LOCAL_HEADER or header[:4] != b"PK\x03\x04":
        return None
    n, extra = struct.unpack("<HH", header[26:30])
    start = at + _LOCAL_HEADER + n + extra
    if start % ALIGN or start + info.file_size > len(mapped):
        return None
    return memoryview(mapped)[start:start + info.file_size]


class _MapReader(io.RawIOBase):
    """A seekable read-only file over an mmap (zipfile reads the small members and the
    directory through it; io.BytesIO would copy the whole file)."""

    def __init__(self, mm: mmap.mmap):
        self._mm, self._pos = mm, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._mm)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b):
        data = self._mm[self._pos:self._pos + len(b)]
        b[:len(data)] = data
        self._pos += len(data)
        return len(data)


# The read-only maps of artifact files that read() made: their pages can leave this
# process's map at any time and come back from the page cache as they were (an anonymous
# map's could not: madvise(MADV_DONTNEED) zeroes those).
FILE_MAPS = weakref.WeakSet()


def release_pages(data) -> None:
    """Drop the pages of the artifact file that `data` views (a map read() made) from
    this process's map; they come back from the page cache when next read. Anything
    else is left alone."""
    obj = data.obj if isinstance(data, memoryview) else data
    if obj in FILE_MAPS and hasattr(mmap, "MADV_DONTNEED") and not obj.closed:
        obj.madvise(mmap.MADV_DONTNEED)


def read(path: str) -> tuple:
    """read_bytes() of the file at `path` (a regular file within the size limit), mapped
    read-only: the weights stay in the page cache, bound in place by IREE."""
    name = os.fspath(path)
    size = check_regular(path, "artifact", ArtifactError)
    try:
        fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        try:
            st = os.fstat(fd)
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if size else b""
        finally:
            os.close(fd)
    except (OSError, ValueError) as e:
        raise ArtifactError(f"cannot read the artifact {name}: {getattr(e, 'strerror', None) or e}") \
            from None
    if st.st_size != size:
        raise ArtifactError(f"{name} changed while it was read")
    stamp = _stamp_path(name, st)
    meta, vmfb, weights = read_bytes(mapped, name, verified=lambda d: _stamped(stamp, d))
    if isinstance(mapped, mmap.mmap):
        # Checking the digests touched every page: drop them from this process's map
        # (the page cache keeps them), so that what stays resident is what the module
        # reads, not all of the file (bench/artifact_memory.py)
        FILE_MAPS.add(mapped)
        release_pages(mapped)
    if weights is not None and stamp is not None:
        _write_stamp(stamp, meta["sha256"][WEIGHTS])
    return meta, vmfb, weights


def mark_verified(path: str) -> None:
    """Stamp the artifact this process has just written, durably, at `path` (from the
    module's own buffers, synced before it was moved into place) as verified, so that its
    first read does not hash its weights again. Only for a durable write: a file that
    could be damaged by a crash must keep being checked."""
    try:
        st = os.stat(path)
        with zipfile.ZipFile(path) as zf:
            digests = json.loads(zf.read(SIGNATURE).decode("utf-8")).get("sha256", {})
    except (OSError, UnicodeDecodeError, *_ZIP_ERRORS):
        return
    if isinstance(digests, dict) and isinstance(digests.get(WEIGHTS), str):
        _write_stamp(_stamp_path(path, st), digests[WEIGHTS])


def _stamp_path(name: str, st) -> str | None:
    """Where the verified-once stamp of this file (path, size, mtime, inode) lives."""
    key = f"{os.path.realpath(name)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{st.st_dev}"
    return os.path.join(cache_dir(), "verified", _digest(key.encode()))


def _stamped(stamp: str, digest: str) -> bool:
    try:
        with open(stamp, encoding="ascii") as f:
            return f.read() == digest
    except (OSError, UnicodeDecodeError):
        return False


def _write_stamp(stamp: str, digest: str) -> None:
    if _stamped(stamp, digest):
        return
    try:
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        write_atomic(stamp, digest.encode("ascii"), "stamp", ArtifactError)
    except (OSError, ArtifactError):
        pass            # a read-only cache: the file is checked again next time
