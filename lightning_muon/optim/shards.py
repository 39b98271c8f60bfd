"""Where a matrix's rows live: the row sharding of FSDP2 (DTensor ``Shard(0)``) parameters, read from metadata.

FSDP2 splits a parameter's rows like ``torch.chunk``: with ``c = ceil(m / W)`` rank ``r`` holds rows
``[r·c, min(m, (r+1)·c))``, so the last ranks may hold fewer rows or none. Nothing here communicates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["RowShard", "assign_owners", "bucket_indices", "local", "mesh_group", "row_shard"]


@dataclass(frozen=True)
class RowShard:
    """How one matrix (or stack of matrices) of global ``shape`` is split along dim 0 over ``world`` ranks."""

    shape: tuple[int, ...]
    world: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None

    @property
    def chunk(self) -> int:
        return -(-self.shape[0] // self.world)

    def rows(self, rank: int) -> tuple[int, int]:
        """Rows ``[start, end)`` held by ``rank``."""
        start = min(self.shape[0], rank * self.chunk)
        return start, min(self.shape[0], start + self.chunk)

    @property
    def row_numel(self) -> int:
        """Elements of one index of dim 0 (a row; an expert's matrix)."""
        return math.prod(self.shape[1:])

    def numel(self, rank: int) -> int:
        start, end = self.rows(rank)
        return (end - start) * self.row_numel

    @property
    def sharded(self) -> bool:
        return self.world > 1


def row_shard(param: Tensor) -> RowShard:
    """The row sharding of a parameter: DTensor ``Shard(0)`` on one mesh dimension (``Replicate`` elsewhere, as
    FSDP2 / HSDP make), or a plain tensor.

    Raises:
        ValueError: for other placements (tensor parallelism, sharding along columns).
    """
    if not isinstance(param, DTensor):
        return RowShard(tuple(param.shape))
    placements = param.placements
    shard_dims = [i for i, pl in enumerate(placements) if pl.is_shard()]
    supported = all(pl.is_replicate() or (pl.is_shard() and pl.dim == 0) for pl in placements)
    if not supported or len(shard_dims) > 1:
        raise ValueError(
            f"PeriodicRowwiseMuon supports FSDP2/HSDP parameters (Shard(0) on one mesh dimension, Replicate on the "
            f"others), got placements {placements} for a {tuple(param.shape)} parameter. Tensor-parallel or "
            "column-sharded matrices are not supported: shard the model with fully_shard only."
        )
    if not shard_dims:
        return RowShard(tuple(param.shape))
    mesh = param.device_mesh
    shard = RowShard(
        tuple(param.shape), mesh.size(shard_dims[0]), mesh.get_local_rank(shard_dims[0]), mesh.get_group(shard_dims[0])
    )
    local_rows = param.to_local().shape[0]
    if local_rows != shard.rows(shard.rank)[1] - shard.rows(shard.rank)[0]:
        raise ValueError(
            f"Unexpected row split of a {tuple(param.shape)} parameter: {local_rows} local rows on "
            f"rank {shard.rank} of {shard.world}; expected torch.chunk rows as FSDP2 makes."
        )
    return shard


def local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (a view: in-place ops update the DTensor), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def mesh_group(p: Tensor) -> dist.ProcessGroup | None:
    """The process group a DTensor parameter is sharded over (None for plain or replicated tensors)."""
    if not isinstance(p, DTensor):
        return None
    dims = [i for i, placement in enumerate(p.placements) if placement.is_shard()]
    return p.device_mesh.get_group(dims[0]) if dims else None


def bucket_indices(shards: Sequence[RowShard], dtypes: Sequence[torch.dtype], bucket_bytes: int) -> list[list[int]]:
    """Consecutive index groups of one NS dtype whose full (padded) size reaches ``bucket_bytes`` at most once."""
    buckets, current, size = [], [], 0
    for i, (s, dtype) in enumerate(zip(shards, dtypes)):
        if current and dtype != dtypes[current[0]]:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += s.world * s.chunk * s.row_numel * dtype.itemsize
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def assign_owners(costs: Sequence[int], world: int) -> list[int]:
    """Owner rank of each matrix: largest NS5 cost first onto the least-loaded rank (deterministic on all ranks;
    the busiest rank exceeds the mean by at most one matrix)."""
    load = [0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owners[i] = min(range(world), key=lambda r: (load[r], r))
        load[owners[i]] += costs[i]
    return owners
