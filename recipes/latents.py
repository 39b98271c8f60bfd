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
from torch import Tensor
from torch.utils.data import Dataset, DistributedSampler

from lightning_muon.checkpoint import atomic_write
from lightning_muon.parallelize import rank_and_world

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


#: safetensors' own bound on the JSON header
MAX_HEADER_BYTES = 100 * 2**20


def read_safetensors_header(path: str | os.PathLike) -> tuple[int, dict[str, dict[str, Any]]]:
    """``(data_start, {name: {"dtype", "shape", "data_offsets"}})`` of a safetensors file (its 8-byte length and
    JSON header; no tensor data is read), checked against the file as the ``safetensors`` library checks it before
    trusting a byte: the header length bounded, every dtype from an allowlist, every shape a list of integers >= 0,
    every tensor's span exactly shape × itemsize, spans back to back from the start of the data section without
    overlap or gap, and the file exactly as long as the header says (a truncated or padded shard is refused).

    Raises:
        ValueError: naming the file and the tensor that is wrong.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is not a regular file.")
    file_size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little") if file_size >= 8 else 0
        if not 0 < length <= min(MAX_HEADER_BYTES, file_size - 8):
            raise ValueError(f"{path} is not a safetensors file (header length {length}, file size {file_size}).")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not a safetensors file: its header is not JSON ({err}).") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not a JSON object.")
    header.pop("__metadata__", None)
    spans = sorted((_span(path, name, entry), name) for name, entry in header.items())
    end = 0
    for (begin, stop), name in spans:
        if begin != end:
            problem = "overlaps the tensor before it" if begin < end else "leaves a gap before it"
            raise ValueError(f"{path}: tensor {name!r} at bytes [{begin}, {stop}) {problem}; the file is corrupt.")
        end = stop
    if 8 + length + end != file_size:
        raise ValueError(
            f"{path} holds {file_size - 8 - length} bytes of tensor data, its header describes {end}: the file is "
            "truncated or corrupt. Re-encode it (delete it and rerun encode_latents)."
        )
    return 8 + length, header


def _span(path: Path, name: str, entry: object) -> tuple[int, int]:
    """The checked ``[begin, end)`` byte span of one header entry."""

    def count(x: object) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x >= 0

    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise ValueError(f"{path}: tensor {name!r} needs exactly dtype, shape and data_offsets, got {entry!r:.200}.")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in _DTYPES:
        raise ValueError(f"{path}: tensor {name!r} has dtype {dtype!r:.40}; allowed: {sorted(_DTYPES)}.")
    if not isinstance(shape, list) or not all(count(d) for d in shape):
        raise ValueError(f"{path}: tensor {name!r} has shape {shape!r:.200}; expected a list of integers >= 0.")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(count(o) for o in offsets):
        raise ValueError(f"{path}: tensor {name!r} has data_offsets {offsets!r:.200}; expected [begin, end].")
    nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise ValueError(
            f"{path}: tensor {name!r} spans bytes {offsets}, but {dtype} {shape} needs {nbytes}; the file is corrupt."
        )
    return offsets[0], offsets[1]


def _schema(header: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per-sample shape and dtype of every tensor."""
    return {k: {"dtype": v["dtype"], "shape": v["shape"][1:]} for k, v in sorted(header.items())}


def _row_count(path: Path, header: dict[str, dict[str, Any]]) -> int:
    """The common row count of a checked shard header: a ``latents`` tensor, every tensor with a row dimension."""
    rows = {v["shape"][0] if v["shape"] else None for v in header.values()}
    if "latents" not in header or len(rows) != 1 or None in rows:
        raise ValueError(
            f"Shard {path} needs a 'latents' tensor and the same row count in every tensor, got "
            f"{ ({k: v['shape'] for k, v in header.items()}) }."
        )
    return rows.pop()


def write_manifest(root: str | os.PathLike, shards: Sequence[str | os.PathLike] | None = None) -> Path:
    """Check every shard and write ``manifest.json`` (atomically): the shard files, their row counts and the common
    per-sample schema. Call it after the last shard is complete; training refuses a directory without it."""
    root = Path(root)
    files = sorted(Path(s) for s in shards) if shards is not None else sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors shards in {root} to list in a manifest.")
    entries, schema = [], None
    for path in files:
        if path.parent.resolve() != root.resolve():
            raise ValueError(f"Shard {path} is not in {root}: a manifest lists only files of its own folder.")
        _, header = read_safetensors_header(path)
        rows = _row_count(path, header)
        if schema is None:
            schema = _schema(header)
        elif _schema(header) != schema:
            raise ValueError(f"Shard {path} has schema {_schema(header)}, the first shard {schema}.")
        entries.append({"file": path.name, "num_samples": rows})
    manifest = {
        "format": FORMAT,
        "num_samples": sum(e["num_samples"] for e in entries),
        "schema": schema,
        "shards": entries,
    }
    atomic_write(root / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1)))
    return root / MANIFEST


def _manifest_shards(path: Path, manifest: object) -> list[dict[str, Any]]:
    """The checked shard list of a manifest: plain file names of this folder, integer row counts."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"{path} is not a {FORMAT} manifest (format {found!r:.80}).")
    shards = manifest.get("shards")
    for entry in shards if isinstance(shards, list) else [None]:
        name = entry.get("file") if isinstance(entry, dict) else None
        rows = entry.get("num_samples") if isinstance(entry, dict) else None
        if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name or "\\" in name:
            raise ValueError(f"{path} lists {entry!r:.200}: each shard must be a file name inside {path.parent}.")
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0:
            raise ValueError(f"{path} lists {entry!r:.200}: num_samples must be an integer >= 0.")
    return shards


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
        try:
            manifest = json.loads(manifest_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{manifest_path} is not JSON ({err}); rewrite it with write_manifest().") from None
        shards = _manifest_shards(manifest_path, manifest)
        self.schema: dict[str, dict[str, Any]] = manifest["schema"]
        self.files = [self.root / e["file"] for e in shards]
        self.headers = []
        for entry, path in zip(shards, self.files):
            if not path.is_file():
                raise FileNotFoundError(f"Shard {path} listed in {manifest_path} is missing.")
            start, header = read_safetensors_header(path)
            if _schema(header) != self.schema or _row_count(path, header) != entry["num_samples"]:
                raise ValueError(
                    f"Shard {path} does not match {manifest_path}: it has "
                    f"{ ({k: (v['dtype'], v['shape']) for k, v in header.items()}) }, the manifest "
                    f"{entry['num_samples']} rows of {self.schema}. Re-encode it (delete it and rerun encode_latents)."
                )
            self.headers.append((start, header))
        self.offsets = torch.tensor([0] + [e["num_samples"] for e in shards]).cumsum(0)

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
                if f.readinto(memoryview(buffer)[i * row_bytes : (i + 1) * row_bytes]) != row_bytes:
                    raise OSError(
                        f"Shard {self.files[shard]} ended inside row {row} of {name!r}: it was truncated after it was "
                        "checked. Re-encode it (delete it and rerun encode_latents)."
                    )
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
        return len(self.ids) // (self.batch_size * rank_and_world()[1])

    def order(self) -> Tensor:
        """The epoch's sample order (global ids)."""
        if not self.shuffle:
            return self.ids
        return self.ids[torch.randperm(len(self.ids), generator=torch.Generator().manual_seed(self.seed + self.epoch))]

    def __iter__(self) -> Iterator[list[int]]:
        rank, world = rank_and_world()
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
