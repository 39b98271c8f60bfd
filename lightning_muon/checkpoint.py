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
- Single files (``torch.save``, CSV, JSON) are written under a temporary name and renamed
  (:func:`~lightning_muon.storage.atomic_write`, re-exported here with :func:`atomic_save` and :class:`StorageError`).
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

from lightning_muon.compat import dcp_set_element
from lightning_muon.storage import (
    StorageError,
    atomic_save,
    atomic_write,
    disk_filled,
    disk_full,
    fsync,
    payload_bytes,
)

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

    rank_zero_info(f"Resuming from {found[0]} (global step {found[1]}): the newest complete checkpoint under {path}.")
    return found[0]


def load_distributed(state: dict[str, Any], path: str | os.PathLike) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` (in place) with :class:`SafeFileSystemReader` and
    :class:`SafeLoadPlanner`.

    Raises:
        ValueError: naming the checkpoint and the first rank's error (torch raises a ``BaseException``, which
            ``except Exception`` would not catch).
    """
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
        fsync(path.parent)
        shutil.rmtree(old, ignore_errors=True)

    on_rank_zero(start, rank, broadcast)
    try:
        dcp.save(state, checkpoint_id=partial)  # every rank's shards, then the coordinator's .metadata
    except CheckpointException as err:  # raised on every rank, with every rank's failure
        failures = [f[0] if isinstance(f, tuple) else f for f in err.failures.values()]
        full = any(disk_filled(f, partial) for f in failures)
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        if full:
            raise disk_full(path, payload_bytes(state)) from None
        raise
    on_rank_zero(finish, rank, broadcast)  # when any rank returns, the checkpoint is in place


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
