"""Single files written crash-consistently, and the storage errors of every write.

:func:`atomic_write` writes beside the target, fsyncs and renames, so readers never see a half-written file; a full
disk or a read-only directory is a :class:`StorageError`: one line naming the place and what to do, raised before the
write when the size is known, with nothing partial left under the target's name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "StorageError",
    "atomic_save",
    "atomic_write",
    "check_writable",
    "disk_filled",
    "disk_full",
    "exit_on_storage_error",
    "fsync",
    "not_writable",
    "payload_bytes",
]


def disk_filled(error: BaseException, directory: Path) -> bool:
    """Whether a write failed because the disk filled: ``ENOSPC`` / ``EDQUOT`` in the exception chain, or (torch's
    zip writer reports a failed write as a bare ``RuntimeError``) less than 1 MiB left on the directory's disk."""
    seen: BaseException | None = error
    while seen is not None:
        if getattr(seen, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return directory.exists() and shutil.disk_usage(directory).free < 2**20


class StorageError(OSError):
    """A write that cannot happen — the disk is full, the directory is not writable — as one line naming the
    place and what to do. Nothing partial is left under the target's name."""


def check_writable(directory: str | os.PathLike) -> None:
    """Create ``directory`` and a file in it (removed again), or raise :class:`StorageError` naming it: a read-only
    output directory is found before any work, not at the first checkpoint."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write-probe.{socket.gethostname()}-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise not_writable(directory, err) from None


@contextlib.contextmanager
def exit_on_storage_error() -> Iterator[None]:
    """A :class:`StorageError` ends the command with its one line on stderr (exit code 1), not a traceback."""
    try:
        yield
    except StorageError as err:
        sys.stderr.write(f"error: {err.strerror}\n")
        raise SystemExit(1) from None


def disk_full(path: Path, needed: int | None, err: OSError | None = None, written: int = 0) -> StorageError:
    """The error for a full disk (``ENOSPC`` / ``EDQUOT``) while writing ``path``: the directory, the bytes needed
    (more than ``written`` when the disk filled after that many), the bytes free."""
    free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
    if written and written >= (needed or 0):
        need = f"needs more than {_size(written)}"
    else:
        need = f"needs {_size(needed)}" if needed else "does not fit"
    return StorageError(
        getattr(err, "errno", errno.ENOSPC),
        f"No space left in {path.parent}: {path.name} {need}, {_size(free)} free. Nothing partial was left"
        f"{f' (the existing {path.name} is intact)' if path.exists() else ''}; free space or write elsewhere.",
    )


def not_writable(directory: Path, err: OSError) -> StorageError:
    return StorageError(err.errno, f"Cannot write to {directory} ({err.strerror or err}): choose a writable directory.")


def _size(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} bytes"


def payload_bytes(obj: object) -> int:
    """Bytes of the tensors in a nested container (a checkpoint's size, within its pickled structure)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(payload_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_bytes(v) for v in obj)
    return 0


class _ErrorKeepingFile:
    """A binary file whose write errors are kept: ``torch.save`` reports a failed write (a full disk) as a bare
    ``RuntimeError`` from its zip writer, without the ``OSError``."""

    def __init__(self, file: Any) -> None:
        self.file, self.error = file, None

    def write(self, data: Any) -> int:
        try:
            return self.file.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.file.flush()


def _torch_save(obj: object, path: Path) -> None:
    with open(path, "wb") as f:
        sink = _ErrorKeepingFile(f)
        try:
            torch.save(obj, sink)
        except RuntimeError:
            if sink.error is not None:
                raise sink.error from None
            raise


def atomic_save(obj: object, path: str | os.PathLike) -> None:
    """``torch.save`` through :func:`atomic_write`: readers never see a half-written file; a full disk is a
    :class:`StorageError` naming the bytes needed (the tensors' bytes) — checked before writing, when known."""
    atomic_write(path, lambda tmp: _torch_save(obj, tmp), needed=payload_bytes(obj))


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any], needed: int | None = None) -> None:
    """``write(tmp)`` to a temporary file beside ``path`` (same directory, same filesystem), fsync it, rename it over
    ``path``, fsync the directory: readers never see a half-written file, and after a crash ``path`` is the old file
    or the new one. The temporary name holds host and pid, so concurrent writers never share one, and the
    temporaries of killed writers on this host are removed by the next write.

    Raises:
        StorageError: the disk is full (also before writing, when ``needed`` bytes are more than are free) or the
            directory is not writable; the temporary is removed and ``path`` untouched.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise not_writable(path.parent, err) from None
    host = socket.gethostname()
    for stale in path.parent.glob(f".{path.name}.{host}-*.tmp"):
        pid = stale.name[len(f".{path.name}.{host}-") : -len(".tmp")]
        if pid.isdigit() and not _pid_alive(int(pid)):
            stale.unlink(missing_ok=True)
    if needed and shutil.disk_usage(path.parent).free < needed:
        raise disk_full(path, needed)
    tmp = path.with_name(f".{path.name}.{host}-{os.getpid()}.tmp")
    try:
        write(tmp)
        fsync(tmp)
        os.replace(tmp, path)
        fsync(path.parent)
    except OSError as err:
        written = tmp.stat().st_size if tmp.exists() else 0
        tmp.unlink(missing_ok=True)
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full(path, needed, err, written) from None
        if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise not_writable(path.parent, err) from None
        raise
    finally:
        tmp.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
