"""Saved artifacts: one file that holds everything needed to run a compiled module.

The file (conventionally `.tcm`) is a zip archive with these members, stored
uncompressed:

- `module.vmfb`: the IREE VM bytecode module.
- `signature.json`: UTF-8 JSON with
    - `format`: "tercomp-artifact", `format_version`: 1
    - `signature`: `function`, `inputs` and `outputs` (each `name`, `shape` with
      symbolic dims as strings such as "B" or "2*B", `dtype` such as "f32"),
      `in_tree` and `out_tree` (pytree structure; see tercomp.pytree)
    - `targets`: tercomp target names ("llvm-cpu", "vulkan", ...) the vmfb contains
    - `drivers`: the runtime drivers that run it, preferred first
    - `flags`: the IREE compiler flags used
    - `tercomp_version`, `iree_version` (of the compiler that built the vmfb)
    - `sha256`: hex digest of each other member (`module.vmfb`, `weights.irpa`)
    - `content_hash`: sha256 over those digests, a name for the artifact's content
    - `weights_scope`: parameter scope of `weights.irpa` (when present)
    - `lm` (a compiled language model, tc.compile_lm): `config` (the model's
      hyperparameters), `max_seq`, `kv_dtype`, `entries` (["step"]), `step_inputs` and
      `tokenizer` (the tokenizer.json text, or null); tc.load then returns an
      LMGenerator (tercomp.runtime.generator)
- `weights.irpa` (optional): the parameters the module reads, in IREE's archive format.

Reading checks the zip, the members, the digests and that the installed iree.runtime
has the major.minor version of the compiler that built the vmfb (IREE's bytecode is
not stable across releases); any failure is an ArtifactError. Reading imports only
iree.runtime, never the compiler. This module is the file format; tc.load, which turns
a file into a CompiledModule or an LMGenerator, is tercomp.runtime.loader.

    >>> exe.save("mlp.tcm")                           # artifact.save(exe, "mlp.tcm")
    >>> meta, vmfb, weights = artifact.read("mlp.tcm")
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import zipfile
import zlib

from iree.runtime.version import VERSION as RUNTIME_VERSION

from .. import __version__     # set by tercomp/__init__ before it imports the runtime
from ..errors import ArtifactError, InputError
from .files import read_regular, write_atomic
from .signature import Signature

FORMAT = "tercomp-artifact"
FORMAT_VERSION = 1
VMFB, SIGNATURE, WEIGHTS = "module.vmfb", "signature.json", "weights.irpa"
_FIXED_DATE = (1980, 1, 1, 0, 0, 0)   # identical modules give identical files
# what zipfile raises for a damaged archive: a flipped byte can name an unknown
# compression method (NotImplementedError) or an encrypted member (RuntimeError)
_ZIP_ERRORS = (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, NotImplementedError,
               RuntimeError, struct.error)


def _major_minor(version: str) -> tuple:
    parts = version.split(".")
    return tuple(parts[:2])


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def content_hash(digests: dict) -> str:
    return _digest("".join(f"{k}={digests[k]}\n" for k in sorted(digests)).encode())


def to_bytes(exe) -> bytes:
    """The artifact file of CompiledModule `exe`, as bytes."""
    members = {VMFB: bytes(exe.vmfb)}
    if exe.weights is not None:
        members[WEIGHTS] = bytes(exe.weights)
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
        "content_hash": content_hash(digests),
    }
    for k in ("cache_key", "numerics", "ternary"):
        if exe.meta.get(k):
            meta[k] = exe.meta[k]
    if exe.weights is not None:
        meta["weights_scope"] = exe.weights_scope
    if exe.meta.get("lm") is not None:
        meta["lm"] = exe.meta["lm"]
    members[SIGNATURE] = json.dumps(meta, indent=1, sort_keys=True).encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name in (SIGNATURE, VMFB, WEIGHTS):
            if name in members:
                zf.writestr(zipfile.ZipInfo(name, date_time=_FIXED_DATE), members[name])
    return buf.getvalue()


def save(exe, path: str) -> None:
    """Write CompiledModule `exe` to `path` as one artifact file (format: module doc).
    The write is atomic, respects the umask and writes through symlinks (runtime.files)."""
    write_atomic(path, to_bytes(exe), "artifact", ArtifactError)


def read_bytes(data: bytes, name: str = "<artifact>") -> tuple:
    """Check and unpack an artifact: returns (meta dict, vmfb bytes, weights or None)."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except _ZIP_ERRORS:
        raise ArtifactError(f"{name} is not a tercomp artifact (not a zip archive, or truncated)",
                            hint="artifacts are written by exe.save() or `tercomp compile -o`") from None
    with zf:
        present = set(zf.namelist())
        for member in (SIGNATURE, VMFB):
            if member not in present:
                raise ArtifactError(f"{name} is missing {member}",
                                    hint="the file is damaged or not a tercomp artifact")
        try:
            members = {m: zf.read(m) for m in (SIGNATURE, VMFB, WEIGHTS) if m in present}
        except _ZIP_ERRORS as e:
            raise ArtifactError(f"{name} is corrupt: {e}",
                                hint="the file was truncated or modified; save it again") from None
    try:
        meta = json.loads(members[SIGNATURE].decode("utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("not an object")
    except (UnicodeDecodeError, ValueError) as e:
        raise ArtifactError(f"{name}: {SIGNATURE} is not valid JSON ({e})") from None
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"{name} is not a tercomp artifact ({SIGNATURE} has format "
                            f"{meta.get('format')!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(f"{name} has artifact format version {meta.get('format_version')!r}; "
                            f"this tercomp ({__version__}) reads version {FORMAT_VERSION}",
                            hint="recompile the model with this tercomp")
    digests = meta.get("sha256")
    if not isinstance(digests, dict) or VMFB not in digests:
        raise ArtifactError(f"{name}: {SIGNATURE} has no sha256 digests")
    if (WEIGHTS in digests) != (WEIGHTS in members):
        raise ArtifactError(f"{name}: {WEIGHTS} is {'missing' if WEIGHTS in digests else 'unexpected'}",
                            hint="the file is damaged or was modified")
    for member, want in digests.items():
        if member not in members or _digest(members[member]) != want:
            raise ArtifactError(f"{name}: the sha256 of {member} does not match its signature "
                                "(the file was modified or damaged)",
                                hint="save or compile the artifact again")
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


def read(path: str) -> tuple:
    """read_bytes() of the file at `path` (a regular file within the size limit)."""
    return read_bytes(read_regular(path, "artifact", ArtifactError), os.fspath(path))
