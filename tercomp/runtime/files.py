"""Reading and writing tercomp's files (artifacts, checkpoints, cache entries) safely.

- Reading takes regular files only, up to a size limit: a device (`/dev/zero`) would be
  read until memory runs out and a FIFO would block forever.
- Writing is atomic (a temp file beside the target, then `os.replace`), gives the file
  the mode a plain `open()` would (0o666 less the umask, or the mode of the file it
  replaces), writes through a symlink to its target instead of replacing the link,
  refuses to replace a device, FIFO or directory, and does not create missing parent
  directories unless asked (the compile cache asks).

>>> write_atomic("out/model.tcm", data)          # ArtifactError: no directory out/
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile

from ..errors import ArtifactError


def cache_dir() -> str:
    """tercomp's cache directory: $TERCOMP_CACHE_DIR, or ~/.cache/tercomp (the compile
    cache, runtime.compile_cache, and the artifacts' verified-once stamps, runtime.artifact)."""
    return os.environ.get("TERCOMP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tercomp")

# The largest file tercomp reads whole (an artifact of a 2B-parameter model with f16
# embeddings is ~1 GiB); override with $TERCOMP_MAX_FILE_BYTES.
DEFAULT_MAX_BYTES = 16 << 30


def max_bytes() -> int:
    try:
        return int(os.environ.get("TERCOMP_MAX_FILE_BYTES", DEFAULT_MAX_BYTES))
    except ValueError:
        return DEFAULT_MAX_BYTES


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular(path, what: str, error=ArtifactError) -> int:
    """The size of `path` if it is a regular file within the size limit; else `error`."""
    path = os.fspath(path)
    if "\0" in path:
        raise error(f"the {what} path {path!r} contains a NUL character")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"no {what} at {path} (no such file)") from None
    except OSError as e:
        raise error(f"cannot read the {what} {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path} is {_kind(st.st_mode)}, not a {what} file",
                    hint=f"give the path of a {what} file")
    if st.st_size > max_bytes():
        raise error(f"{path} is {st.st_size} bytes, more than the {max_bytes()} bytes a {what} may have",
                    hint="raise the limit with $TERCOMP_MAX_FILE_BYTES if the file is trusted")
    return st.st_size


def read_regular(path, what: str, error=ArtifactError) -> bytes:
    """The bytes of a regular file (see check_regular)."""
    size = check_regular(path, what, error)
    try:
        # O_NONBLOCK: should the path become a FIFO after the check, open does not block
        fd = os.open(os.fspath(path), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(fd, "rb") as f:
            data = f.read(size + 1)
    except OSError as e:
        raise error(f"cannot read the {what} {path}: {e.strerror or e}") from None
    if len(data) > size:
        raise error(f"{path} changed while it was read")
    return data


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path, data: bytes, what: str = "file", error=ArtifactError, make_dirs: bool = False) -> str:
    """Write `data` to `path` so that readers see the old file or the whole new one.
    Returns the path written (a symlink's target)."""
    with atomic_target(path, what, error, make_dirs) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return os.path.realpath(os.fspath(path))


@contextlib.contextmanager
def atomic_target(path, what: str = "file", error=ArtifactError, make_dirs: bool = False,
                  durable: bool = True):
    """A temporary path beside `path` (through a symlink, beside its target) for a
    writer to fill; on leaving the block without an error it is synced (unless not
    `durable`) and moved over `path` (keeping the mode of a file it replaces, else 0o666
    less the umask), else removed and `path` is left as it was. Devices, FIFOs and
    directories are refused."""
    if "\0" in os.fspath(path):
        raise error(f"the {what} path {os.fspath(path)!r} contains a NUL character")
    path = os.path.realpath(os.fspath(path))      # through symlinks, to the file they name
    directory = os.path.dirname(path)
    mode = 0o666 & ~_umask()
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise error(f"cannot write the {what} {path}: {e.strerror or e}") from None
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise error(f"will not replace {path}: it is {_kind(st.st_mode)}",
                        hint=f"write the {what} to a regular file path")
        mode = stat.S_IMODE(st.st_mode)
    if not os.path.isdir(directory):
        if not make_dirs:
            raise error(f"cannot write the {what} {path}: the directory {directory} does not exist",
                        hint="create it first")
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise error(f"cannot create the directory {directory}: {e.strerror or e}") from None
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".part")
        os.close(fd)
    except OSError as e:
        raise error(f"cannot write the {what} {path}: {e.strerror or e}") from None
    try:
        yield tmp
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as e:
        raise error(f"cannot write the {what} {path}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
