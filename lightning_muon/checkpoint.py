"""Crash-consistent, pickle-free checkpoint files.

- **Nothing untrusted is unpickled.** A torch.distributed.checkpoint directory is read with
  :class:`SafeFileSystemReader` (its ``.metadata`` through :class:`MetadataUnpickler`, which builds only the
  checkpoint-metadata classes) and :class:`SafeLoadPlanner` (non-tensor entries through
  ``torch.load(weights_only=True)``; torch's own reader and planner use plain ``pickle.load`` and
  ``weights_only=False``). Weight files handed to third-party loaders are checked first by :func:`check_weights_file`.
- **Nothing partial is trusted.** :func:`save_distributed_checkpoint` writes into ``.<name>.partial`` beside the
  target and renames it into place once every rank's shards, the ``.metadata`` and Lightning's ``meta.pt`` are
  written, so a visible ``*.ckpt`` directory is always complete; :func:`remove_checkpoint` renames before deleting.
  :func:`checkpoint_problem` checks a directory without loading it (every shard file referenced by the metadata
  present and long enough) and :func:`newest_checkpoint` picks the newest one that passes.
- :func:`atomic_write`: single files (``torch.save``, CSV, JSON) written under a temporary name and renamed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

__all__ = [  # what users call; the rest (the safe unpickler, the planner, rank-0 helpers) serves these
    "AtomicCheckpointIO",
    "StorageError",
    "atomic_save",
    "atomic_write",
    "checkpoint_problem",
    "is_distributed_checkpoint",
    "load_distributed",
    "newest_checkpoint",
    "read_metadata",
    "resolve_checkpoint",
    "save_distributed_checkpoint",
]

#: Lightning's non-tensor part of a distributed checkpoint (loops, callbacks, hyper-parameters), written by rank 0.
META_FILE = "meta.pt"
DCP_METADATA = ".metadata"
_PARTIAL, _OLD = ".partial", ".old"

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(("pathlib", n) for n in ("Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath")),
}


class UntrustedCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asked to build something a checkpoint never contains (code execution attempt or damage)."""


class MetadataUnpickler(pickle.Unpickler):
    """Builds only what torch.distributed.checkpoint metadata holds: its dataclasses and enums, ``torch.Size``,
    dtypes, layouts, memory formats, paths. Anything else (``os.system``, ``builtins.exec``, …) is refused before it
    is called."""

    def find_class(self, module: str, name: str) -> Any:
        obj = None
        if (module, name) in _ALLOWED:
            obj = super().find_class(module, name)
        elif module in _DCP_MODULES and "." not in name:
            candidate = super().find_class(module, name)
            obj = candidate if isinstance(candidate, type) and candidate.__module__ == module else None
        elif module == "torch" and "." not in name:
            candidate = getattr(torch, name, None)
            obj = candidate if isinstance(candidate, (torch.dtype, torch.layout, torch.memory_format)) else None
        if obj is None:
            raise UntrustedCheckpointError(
                f"refused to load {module}.{name}: a checkpoint's metadata holds only torch.distributed.checkpoint "
                "classes. The file is damaged or was crafted to run code; do not use this checkpoint."
            )
        return obj


def read_metadata(path: str | os.PathLike) -> Any:
    """The torch.distributed.checkpoint ``Metadata`` of a checkpoint directory, read by :class:`MetadataUnpickler`."""
    with open(Path(path) / DCP_METADATA, "rb") as f:
        return MetadataUnpickler(f).load()


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` with its metadata read by :class:`MetadataUnpickler` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            metadata = MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's default load planner with non-tensor entries (optimizer hyper-parameters, …) read by
    ``torch.load(weights_only=True)`` instead of ``weights_only=False``."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        from lightning_muon.compat import dcp_set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            dcp_set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def is_distributed_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / DCP_METADATA).is_file()


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why a checkpoint cannot be trusted (``None`` when it can): for a distributed checkpoint, unreadable or
    untrusted metadata, a missing ``meta.pt``, a shard file referenced by the metadata missing or shorter than the
    bytes it should hold, or a non-tensor entry that is not plain data; for a single file, a file that
    ``torch.load(weights_only=True)`` refuses. Tensor bytes are not read."""
    path = Path(path)
    try:
        if not is_distributed_checkpoint(path):
            if not path.exists():
                return "no such file or directory"
            if not path.is_file():
                return "neither a checkpoint file nor a distributed-checkpoint directory (with .metadata)"
            torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            return None
        metadata = read_metadata(path)
        if not (path / META_FILE).is_file():
            return f"{META_FILE} is missing"
        torch.load(path / META_FILE, map_location="cpu", weights_only=True)
        needed: dict[str, int] = {}
        for info in (metadata.storage_data or {}).values():
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, size in sorted(needed.items()):
            file = path / name
            if not file.is_file() or file.stat().st_size < size:
                return f"shard {name} is missing or truncated (needs {size} bytes)"
        _check_byte_entries(path, metadata)
    except Exception as err:  # noqa: BLE001 - any failure to read means "do not trust"
        first = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else ""
        return f"{type(err).__name__}: {first}"
    return None


def _check_byte_entries(path: Path, metadata: Any) -> None:
    """Read every non-tensor entry (small: optimizer hyper-parameters, …) with ``torch.load(weights_only=True)``."""
    import io

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    byte_keys = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    for index, info in (metadata.storage_data or {}).items():
        if index.fqn in byte_keys and not info.transform_descriptors:
            with open(path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                torch.load(io.BytesIO(f.read(info.length)), weights_only=True)


def newest_checkpoint(root: str | os.PathLike) -> tuple[Path, int] | None:
    """The complete checkpoint under ``root`` (searched recursively) with the highest global step (ties: the newest
    file), and its step; ``None`` when there is none.

    A checkpoint whose replacement was interrupted between its two renames is first restored from its
    ``.<name>.old`` copy."""
    root = Path(root)
    for old in root.rglob(f".*.ckpt{_OLD}"):
        target = old.with_name(old.name[1 : -len(_OLD)])
        if not target.exists() and checkpoint_problem(old) is None:
            try:
                os.rename(old, target)
            except FileNotFoundError:  # another rank restored it first
                pass
    best: tuple[int, float, Path] | None = None
    for path in root.rglob("*.ckpt"):
        if any(part.startswith(".") for part in path.relative_to(root).parts) or checkpoint_problem(path):
            continue
        meta = path / META_FILE if path.is_dir() else path
        step = int(torch.load(meta, map_location="cpu", weights_only=True, mmap=True).get("global_step", 0))
        key = (step, path.stat().st_mtime, path)
        best = key if best is None or key[:2] > best[:2] else best
    return None if best is None else (best[2], best[0])


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself, or for a directory that is not a checkpoint, the newest complete checkpoint under it
    (:func:`newest_checkpoint`), announced on rank 0.

    Raises:
        FileNotFoundError: the directory holds no complete checkpoint.
    """
    path = Path(path)
    if not path.is_dir() or is_distributed_checkpoint(path):
        return path
    found = newest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"No complete checkpoint (*.ckpt) under {path}: nothing to resume from.")
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    rank_zero_info(f"Resuming from {found[0]} (global step {found[1]}): the newest complete checkpoint under {path}.")
    return found[0]


def load_distributed(state: dict[str, Any], path: str | os.PathLike) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` (in place) with :class:`SafeFileSystemReader` and
    :class:`SafeLoadPlanner`.

    Raises:
        ValueError: naming the checkpoint and the first rank's error (torch raises a ``BaseException``, which
            ``except Exception`` would not catch).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner())
    except CheckpointException as err:
        rank, failure = next(iter(err.failures.items()))
        if isinstance(failure, tuple):  # (exception, traceback) in some torch versions
            failure = failure[0]
        raise ValueError(
            f"Cannot load checkpoint {path} (rank {rank}): {type(failure).__name__}: "
            f"{str(failure).splitlines()[0] if str(failure) else ''}"
        ) from failure


def save_distributed_checkpoint(
    state: dict[str, Any], meta: dict[str, Any], path: str | os.PathLike, rank: int, broadcast: Callable[[Any], Any]
) -> None:
    """Write ``state`` with torch.distributed.checkpoint and ``meta`` as ``meta.pt`` (rank 0) into
    ``.<name>.partial``, then rename it to ``path``. Every rank calls it with the same ``path``; ``broadcast(obj)``
    returns rank 0's ``obj`` on every rank (a collective, also the barrier).

    An existing ``path`` is first renamed to ``.<name>.old`` and deleted after the new one is in place, so at every
    instant ``path`` is either the old complete checkpoint, the new complete one, or (between the two renames)
    absent with the old one restorable (:func:`newest_checkpoint` does it). A failure on any rank (a full disk: a
    :class:`StorageError` naming the bytes needed) is raised on every rank, and the partial directory removed.

    Raises:
        StorageError: the disk filled or the directory is not writable (on every rank).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = Path(path)
    partial, old = path.with_name(f".{path.name}{_PARTIAL}"), path.with_name(f".{path.name}{_OLD}")

    def start() -> None:
        shutil.rmtree(partial, ignore_errors=True)  # what a killed save left
        partial.mkdir(parents=True)

    def finish() -> None:
        try:
            atomic_save(meta, partial / META_FILE)
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        if path.is_file():
            path.unlink()
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            os.rename(path, old)
        os.rename(partial, path)
        _fsync(path.parent)
        shutil.rmtree(old, ignore_errors=True)

    on_rank_zero(start, rank, broadcast)
    try:
        dcp.save(state, checkpoint_id=partial)  # every rank's shards, then the coordinator's .metadata
    except CheckpointException as err:  # raised on every rank, with every rank's failure
        failures = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
        full = any(_disk_filled(f, partial) for f in failures)
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        if full:
            raise disk_full(path, payload_bytes(state)) from None
        raise
    on_rank_zero(finish, rank, broadcast)  # when any rank returns, the checkpoint is in place


def _disk_filled(error: BaseException, directory: Path) -> bool:
    """Whether a write failed because the disk filled: ``ENOSPC`` / ``EDQUOT`` in the exception chain, or (torch's
    zip writer reports a failed write as a bare ``RuntimeError``) less than 1 MiB left on the directory's disk."""
    seen: BaseException | None = error
    while seen is not None:
        if getattr(seen, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return directory.exists() and shutil.disk_usage(directory).free < 2**20


def on_rank_zero(step: Callable[[], None], rank: int, broadcast: Callable[[Any], Any]) -> None:
    """``step()`` (a write) on rank 0 only; an ``OSError`` it raises is raised on every rank, as a
    :class:`StorageError` (the other ranks would otherwise wait for rank 0 at their next collective until the
    timeout). ``broadcast(obj)`` returns rank 0's ``obj`` on every rank."""
    error = None
    if rank == 0:
        try:
            step()
        except OSError as err:
            error = err if isinstance(err, StorageError) else StorageError(err.errno, f"{err}")
    failure = broadcast(None if error is None else (error.errno, error.strerror))
    if failure is not None:
        raise error if error is not None else StorageError(*failure)


def remove_checkpoint(path: str | os.PathLike) -> None:
    """Delete a checkpoint file or directory; a directory is renamed away first, so no half-deleted checkpoint is
    ever visible under its name."""
    path = Path(path)
    if path.is_dir():
        trash = path.with_name(f".{path.name}.deleting")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


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
        _fsync(tmp)
        os.replace(tmp, path)
        _fsync(path.parent)
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


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with crash-consistent saves: :func:`atomic_save` (written beside the target,
    fsynced, renamed) instead of Lightning's, which writes the whole file into the system's temporary directory and
    moves it — across filesystems a second copy, a truncated file under the final name when the disk fills, and a
    large checkpoint passing through a node's small ``/tmp``. A full disk is one :class:`StorageError` line.

    ``lightning-muon`` and ``muon_fsdp`` use it; give it to your own Trainer with
    ``Trainer(plugins=[AtomicCheckpointIO()])``."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options, got {storage_options!r}.")
        atomic_save(checkpoint, path)

    def remove_checkpoint(self, path: Any) -> None:
        remove_checkpoint(path)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync(path: Path) -> None:
    """Flush a file's (or a directory's entries') data to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_weights_file(path: str | os.PathLike, what: str) -> None:
    """Refuse a weight file that is not plain tensors (``torch.load(weights_only=True)`` or safetensors) before a
    third-party loader that unpickles it (torch-fidelity's Inception, …) sees it.

    Raises:
        ValueError: naming ``what`` and the file.
    """
    path = Path(path)
    if path.suffix == ".safetensors":
        return
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # noqa: BLE001
        raise ValueError(
            f"{what} file {str(path)!r} is not a plain tensor file: torch.load(weights_only=True) refused it "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). It was not loaded, since "
            "unpickling it could run code; use the original weights file."
        ) from err
