"""Pre-encoded latent shards, streamed: each rank reads only the rows of its share of each global batch.

A latent directory holds ``*.safetensors`` shards (``latents`` (N, C, h, w) plus per-sample conditions: ``labels``
or ``caption_embeds`` / ``caption_mask``) and a ``manifest.json`` written *last* (by
``python -m lightning_muon.recipes.encode_latents`` or :func:`write_manifest`): a directory without a complete
manifest is refused, so a killed encode is never trained on.

Reading: the safetensors header gives every tensor's byte offsets, so a batch is read with one ``seek`` + ``read``
per row and tensor: resident memory is one batch (plus an int64 index of the dataset), whatever the dataset size.

Order: epoch e visits a permutation of all samples (seeded by ``seed + e``); global step s takes the next
``world_size × batch_size`` positions and rank r the r-th slice of them. The last step of an epoch also takes the
remainder (``N mod global batch``), split as evenly as possible, so every sample is seen exactly once per epoch and
every rank runs the same number of steps. The position is one integer, ``consumed`` (global samples of this epoch),
independent of the world size: a run resumed on another number of ranks continues with exactly the unseen samples.
The sampler's state is checkpointed by ``torchdata``'s ``StatefulDataLoader``, which Lightning saves and restores.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler

from lightning_muon.checkpoint import atomic_write

__all__ = [
    "MANIFEST",
    "GlobalBatchSampler",
    "LatentShards",
    "read_safetensors_header",
    "write_latent_shard",
    "write_manifest",
]

MANIFEST = "manifest.json"
FORMAT = "lightning-muon-latents/1"
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def write_latent_shard(path: str | os.PathLike, latents: Tensor, **conditions: Tensor) -> None:
    """Write one safetensors shard: ``latents`` (N, C, h, w) and per-sample conditions (``labels`` or
    ``caption_embeds`` / ``caption_mask``). Written to a temporary name, then renamed: a shard either exists whole or
    not at all."""
    from safetensors.torch import save_file

    path = Path(path)
    tensors = {"latents": latents, **conditions}
    if any(len(t) != len(latents) for t in tensors.values()):
        rows = {k: len(v) for k, v in tensors.items()}
        raise ValueError(f"Every tensor of a shard needs one row per sample, got {rows}.")
    atomic_write(path, lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp)))


def read_safetensors_header(path: str | os.PathLike) -> tuple[int, dict[str, dict[str, Any]]]:
    """``(data_start, {name: {"dtype", "shape", "data_offsets"}})`` of a safetensors file (its 8-byte length and
    JSON header; no tensor data is read)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size < 100 * 2**20:
            raise ValueError(f"{path} is not a safetensors file (header length {size}).")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return 8 + size, header


def _schema(header: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-sample shape and dtype of every tensor; all tensors must share the row count."""
    return {k: {"dtype": v["dtype"], "shape": v["shape"][1:]} for k, v in sorted(header.items())}


def write_manifest(root: str | os.PathLike, shards: Sequence[str | os.PathLike] | None = None) -> Path:
    """Check every shard and write ``manifest.json`` (atomically): the shard files, their row counts and the common
    per-sample schema. Call it after the last shard is complete; training refuses a directory without it."""
    root = Path(root)
    files = sorted(Path(s) for s in shards) if shards is not None else sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors shards in {root} to list in a manifest.")
    entries, schema = [], None
    for path in files:
        _, header = read_safetensors_header(path)
        rows = {len(v["shape"]) and v["shape"][0] for v in header.values()}
        if len(rows) != 1 or "latents" not in header:
            raise ValueError(
                f"Shard {path} needs a 'latents' tensor and the same row count in every tensor, got "
                f"{ ({k: v['shape'] for k, v in header.items()}) }."
            )
        if schema is None:
            schema = _schema(header)
        elif _schema(header) != schema:
            raise ValueError(f"Shard {path} has schema {_schema(header)}, the first shard {schema}.")
        entries.append({"file": path.name, "num_samples": rows.pop()})
    manifest = {
        "format": FORMAT,
        "num_samples": sum(e["num_samples"] for e in entries),
        "schema": schema,
        "shards": entries,
    }
    atomic_write(root / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))
    return root / MANIFEST


class LatentShards(Dataset):
    """The samples of a latent directory, read row by row from the shard files listed in its manifest.

    ``dataset[ids]`` (a list of global sample indices) returns the batch ``{name: (len(ids), ...)}``; floating
    tensors (e.g. bf16 caption embeddings) are returned as float32. Construction checks the manifest against every
    shard header (names, per-sample shapes, dtypes, row counts) and raises before any training step.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        manifest_path = self.root / MANIFEST
        if not manifest_path.is_file():
            found = len(list(self.root.glob("*.safetensors"))) if self.root.is_dir() else 0
            raise FileNotFoundError(
                f"{self.root} has no {MANIFEST} ({found} shard file(s) found): the latent set is incomplete (an encode "
                "still running or killed). Rerun `python -m lightning_muon.recipes.encode_latents` with the same "
                "arguments (it skips finished shards and writes the manifest last), or call "
                "lightning_muon.recipes.data.write_manifest(root) for shards written by hand."
            )
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("format") != FORMAT:
            raise ValueError(f"{manifest_path} is not a {FORMAT} manifest (format {manifest.get('format')!r}).")
        self.schema: dict[str, dict[str, Any]] = manifest["schema"]
        self.files = [self.root / e["file"] for e in manifest["shards"]]
        self.headers = []
        for entry, path in zip(manifest["shards"], self.files):
            if not path.is_file():
                raise FileNotFoundError(f"Shard {path} listed in {manifest_path} is missing.")
            start, header = read_safetensors_header(path)
            if _schema(header) != self.schema or any(v["shape"][0] != entry["num_samples"] for v in header.values()):
                raise ValueError(
                    f"Shard {path} does not match {manifest_path}: it has "
                    f"{ ({k: (v['dtype'], v['shape']) for k, v in header.items()}) }, the manifest "
                    f"{entry['num_samples']} rows of {self.schema}. Re-encode it (delete it and rerun encode_latents)."
                )
            self.headers.append((start, header))
        self.offsets = torch.tensor([0] + [e["num_samples"] for e in manifest["shards"]]).cumsum(0)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def _rows(self, shard: int, rows: Tensor, name: str) -> Tensor:
        start, header = self.headers[shard]
        entry = header[name]
        dtype = _DTYPES[entry["dtype"]]
        row_shape = entry["shape"][1:]
        row_bytes = math.prod(row_shape) * torch.empty((), dtype=dtype).element_size()
        buffer = bytearray(row_bytes * len(rows))
        with open(self.files[shard], "rb", buffering=0) as f:
            for i, row in enumerate(rows.tolist()):
                f.seek(start + entry["data_offsets"][0] + row * row_bytes)
                f.readinto(memoryview(buffer)[i * row_bytes : (i + 1) * row_bytes])
        return torch.frombuffer(buffer, dtype=dtype).view(len(rows), *row_shape)

    def __getitem__(self, ids: Sequence[int] | Tensor) -> dict[str, Tensor]:
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self)):
            raise IndexError(f"Sample ids must be in [0, {len(self)}).")
        shard_of = torch.searchsorted(self.offsets, ids, right=True) - 1
        out = {}
        for name in self.schema:
            parts = torch.empty(len(ids), *self.schema[name]["shape"], dtype=_DTYPES[self.schema[name]["dtype"]])
            for shard in shard_of.unique().tolist():
                where = (shard_of == shard).nonzero().squeeze(1)
                parts[where] = self._rows(shard, ids[where] - self.offsets[shard], name)
            out[name] = parts.float() if parts.is_floating_point() else parts
        return out


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _step_sizes(remaining: int, global_batch: int) -> Iterator[int]:
    """Samples per global step: ``global_batch`` each, the last step also taking the remainder."""
    while remaining >= global_batch:
        take = remaining if remaining < 2 * global_batch else global_batch
        yield take
        remaining -= take


class GlobalBatchSampler(DistributedSampler):
    """Yields, per optimizer step, this rank's list of sample ids (use with ``batch_size=None``).

    It is a ``DistributedSampler`` so that Lightning keeps it (it re-creates the loader for any other sampler) and
    calls :meth:`set_epoch`; rank and world size are read from ``torch.distributed`` when an epoch starts.

    Args:
        ids: the global sample ids this split draws from (e.g. the training part of a latent directory).
        batch_size: samples per rank and step.
        shuffle: a permutation per epoch (seeded by ``seed + epoch``), else the order of ``ids``.
        seed: base seed of the permutations.
    """

    def __init__(self, ids: Tensor, batch_size: int, shuffle: bool = True, seed: int = 0) -> None:
        super().__init__(range(len(ids)), num_replicas=1, rank=0, shuffle=shuffle, seed=seed)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.ids, self.batch_size = torch.as_tensor(ids, dtype=torch.long), batch_size
        self.consumed = 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0

    def __len__(self) -> int:
        return len(self.ids) // (self.batch_size * _world()[1])

    def order(self) -> Tensor:
        """The epoch's sample order (global ids)."""
        if not self.shuffle:
            return self.ids
        return self.ids[torch.randperm(len(self.ids), generator=torch.Generator().manual_seed(self.seed + self.epoch))]

    def __iter__(self) -> Iterator[list[int]]:
        rank, world = _world()
        global_batch = self.batch_size * world
        if len(self.ids) < global_batch:
            raise ValueError(
                f"{len(self.ids)} samples are fewer than one global batch ({world} ranks x "
                f"{self.batch_size}): lower batch_size or add data."
            )
        order = self.order()
        for take in _step_sizes(len(self.ids) - self.consumed, global_batch):
            chunk = order[self.consumed : self.consumed + take]
            self.consumed += take  # before the yield: a checkpoint after this step resumes after it
            yield torch.tensor_split(chunk, world)[rank].tolist()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
