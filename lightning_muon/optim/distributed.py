"""Matrix-branch execution on FSDP2-sharded (DTensor ``Shard(0)``) parameters, with communication accounting.

FSDP2 splits a parameter's rows like ``torch.chunk``: with ``c = ceil(m / W)`` rank ``r`` holds rows
``[r·c, min(m, (r+1)·c))``, so the last ranks may hold fewer rows or none. Elementwise work runs on local shards.

- RowNorm of a tall matrix (m > n) normalizes columns that span ranks: each rank contributes partial column sums of
  squares, and all such vectors travel in one flat all-reduce (see ``PeriodicRowwiseMuon``).
- A refresh needs full matrices. ``gather`` (the paper): buckets of momentum shards are all-gathered, bucket i+1 in
  flight while NS5 runs on bucket i, every rank orthogonalizes every matrix and keeps its rows. ``scatter`` (dion /
  torchtitan style): each matrix has one owner rank (balanced by NS5 FLOPs); shards travel to owners in one
  all-to-all, owners run NS5 once, rows travel back in a second all-to-all.

Momentum travels in the NS5 dtype: NS5 casts its input to that dtype first, so the result is the same as gathering
fp32 and casting, for half the bytes in bf16.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_muon.optim.kernels import ns_flops

__all__ = ["CommStats", "RowShard", "assign_owners", "gather_orthogonalize", "row_shard", "scatter_orthogonalize"]

Orthogonalize = Callable[[list[Tensor]], list[Tensor]]
BRANCHES = ("refresh", "rownorm")


@dataclass(frozen=True)
class RowShard:
    """How one matrix of global ``shape`` is split by rows over a process group of ``world`` ranks."""

    shape: tuple[int, int]
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

    def numel(self, rank: int) -> int:
        start, end = self.rows(rank)
        return (end - start) * self.shape[1]

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
    shard = RowShard(tuple(param.shape), mesh.size(shard_dims[0]), mesh.get_local_rank(shard_dims[0]),
                     mesh.get_group(shard_dims[0]))  # fmt: skip
    local_rows = param.to_local().shape[0]
    if local_rows != shard.rows(shard.rank)[1] - shard.rows(shard.rank)[0]:
        raise ValueError(f"Unexpected row split of a {tuple(param.shape)} parameter: {local_rows} local rows on "
                         f"rank {shard.rank} of {shard.world}; expected torch.chunk rows as FSDP2 makes.")  # fmt: skip
    return shard


class CommStats:
    """Bytes and collectives of this rank per branch, counted where each collective is issued.

    An all-reduce counts its buffer as sent and as received; an all-gather sends the local block and receives the
    blocks of the other ranks; an all-to-all sends and receives what crosses to or from other ranks.
    """

    def __init__(self) -> None:
        self._stats = self._empty()

    @staticmethod
    def _empty() -> dict[str, dict[str, int]]:
        return {b: {"bytes_sent": 0, "bytes_received": 0, "collectives": 0} for b in BRANCHES}

    def add(self, branch: str, sent: int, received: int) -> None:
        entry = self._stats[branch]
        entry["bytes_sent"] += int(sent)
        entry["bytes_received"] += int(received)
        entry["collectives"] += 1

    def pop(self) -> dict[str, dict[str, int]]:
        """The counts since the last call."""
        out, self._stats = self._stats, self._empty()
        return out


def _buckets(shards: Sequence[RowShard], itemsize: int, bucket_bytes: int) -> list[list[int]]:
    """Consecutive index groups whose gathered (padded, full) size reaches ``bucket_bytes`` at most once each."""
    buckets, current, size = [], [], 0
    for i, s in enumerate(shards):
        current.append(i)
        size += s.world * s.chunk * s.shape[1] * itemsize
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def gather_orthogonalize(
    updates: Sequence[Tensor],
    shards: Sequence[RowShard],
    orthogonalize: Orthogonalize,
    dtype: torch.dtype,
    bucket_bytes: int,
    stats: CommStats,
) -> list[Tensor]:
    """Paper mode: all-gather each bucket of local shards (padded to ``chunk`` rows), NS5 on full matrices on every
    rank while the next bucket is in flight; returns this rank's rows of each orthogonalized matrix."""
    group, world = shards[0].group, shards[0].world
    itemsize = torch.empty((), dtype=dtype).element_size()

    def launch(index: list[int]):
        sizes = [shards[i].chunk * shards[i].shape[1] for i in index]
        send = torch.zeros(sum(sizes), dtype=dtype, device=updates[index[0]].device)
        offset = 0
        for i, size in zip(index, sizes):
            send[offset : offset + updates[i].numel()].copy_(updates[i].reshape(-1))
            offset += size
        recv = torch.empty(world * send.numel(), dtype=dtype, device=send.device)
        work = dist.all_gather_into_tensor(recv, send, group=group, async_op=True)
        stats.add("refresh", send.numel() * itemsize, (world - 1) * send.numel() * itemsize)
        return work, recv.view(world, -1), sizes

    buckets = _buckets(shards, itemsize, bucket_bytes)
    results: list[Tensor | None] = [None] * len(updates)
    pending = launch(buckets[0])
    for b, index in enumerate(buckets):
        work, recv, sizes = pending
        if b + 1 < len(buckets):
            pending = launch(buckets[b + 1])  # next bucket in flight during this bucket's NS5
        work.wait()
        full, offset = [], 0
        for i, size in zip(index, sizes):
            m, n = shards[i].shape
            full.append(recv[:, offset : offset + size].reshape(world * shards[i].chunk, n)[:m])
            offset += size
        for i, ortho in zip(index, orthogonalize(full)):
            start, end = shards[i].rows(shards[i].rank)
            results[i] = ortho[start:end]
    return results


def assign_owners(shapes: Sequence[tuple[int, int]], world: int, steps: int = 5) -> list[int]:
    """Owner rank of each matrix: largest NS5 cost first onto the least-loaded rank (deterministic on all ranks)."""
    load = [0] * world
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: (-ns_flops(shapes[i], steps), i)):
        owners[i] = min(range(world), key=lambda r: (load[r], r))
        load[owners[i]] += ns_flops(shapes[i], steps)
    return owners


def scatter_orthogonalize(
    updates: Sequence[Tensor],
    shards: Sequence[RowShard],
    orthogonalize: Orthogonalize,
    dtype: torch.dtype,
    stats: CommStats,
    steps: int = 5,
) -> tuple[list[Tensor], int]:
    """Owner mode: all-to-all shards to owners, NS5 once per matrix, all-to-all rows back.

    Returns this rank's rows of each orthogonalized matrix and the NS5 FLOPs this rank ran.
    """
    group, world, rank = shards[0].group, shards[0].world, shards[0].rank
    device = updates[0].device
    itemsize = torch.empty((), dtype=dtype).element_size()
    owners = assign_owners([s.shape for s in shards], world, steps)
    owned_by = defaultdict(list)
    for i, owner in enumerate(owners):
        owned_by[owner].append(i)
    mine = owned_by[rank]

    def exchange(send_parts: list[list[Tensor]], recv_sizes: list[int]) -> list[Tensor]:
        send_sizes = [sum(t.numel() for t in parts) for parts in send_parts]
        send = torch.cat([t.reshape(-1).to(dtype) for parts in send_parts for t in parts]) if sum(send_sizes) else \
            torch.empty(0, dtype=dtype, device=device)  # fmt: skip
        recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group)
        stats.add("refresh", (sum(send_sizes) - send_sizes[rank]) * itemsize,
                  (sum(recv_sizes) - recv_sizes[rank]) * itemsize)  # fmt: skip
        return list(recv.split(recv_sizes))

    # 1. my shard of every matrix goes to its owner; I receive every rank's shard of the matrices I own
    incoming = exchange([[updates[i] for i in owned_by[d]] for d in range(world)],
                        [sum(shards[i].numel(src) for i in mine) for src in range(world)])  # fmt: skip
    full = []
    pieces = [list(block.split([shards[i].numel(src) for i in mine])) for src, block in enumerate(incoming)]
    for j, i in enumerate(mine):
        full.append(torch.cat([pieces[src][j] for src in range(world)]).view(shards[i].shape))
    ortho = orthogonalize(full) if full else []
    flops = sum(ns_flops(shards[i].shape, steps) for i in mine)
    # 2. owners send each rank its rows back
    back_parts = [[o[slice(*shards[i].rows(dst))] for i, o in zip(mine, ortho)] for dst in range(world)]
    returned = exchange(back_parts, [sum(shards[i].numel(rank) for i in owned_by[src]) for src in range(world)])
    results: list[Tensor | None] = [None] * len(updates)
    for src, block in enumerate(returned):
        for i, piece in zip(owned_by[src], block.split([shards[i].numel(rank) for i in owned_by[src]])):
            start, end = shards[i].rows(rank)
            results[i] = piece.view(end - start, shards[i].shape[1])
    return results, flops
