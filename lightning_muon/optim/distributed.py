"""Matrix-branch execution on FSDP2-sharded (DTensor ``Shard(0)``) parameters, with communication accounting.

FSDP2 splits a parameter's rows like ``torch.chunk``: with ``c = ceil(m / W)`` rank ``r`` holds rows
``[r·c, min(m, (r+1)·c))``, so the last ranks may hold fewer rows or none. Elementwise work runs on local shards.

- RowNorm of a tall matrix (m > n) normalizes columns that span ranks: each rank contributes partial column sums of
  squares, and all such vectors travel in one flat all-reduce (see ``PeriodicRowwiseMuon``).
- A refresh needs full matrices. Every refresh of a step — all groups together — runs as ONE bucketed pass, and each
  bucket's update is written as soon as its NS5 is done, so the extra memory is a few buckets whatever the model size:

  - ``gather`` (the paper): the look-ahead momentum of bucket i+1 is all-gathered while NS5 runs on bucket i; every
    rank orthogonalizes every matrix and keeps its rows.
  - ``scatter`` (dion / torchtitan style): each matrix has one owner rank (largest NS5 cost first onto the least
    loaded rank, over all matrices of the step at once); per bucket one all-to-all sends shards to owners and one sends
    orthogonalized rows back, both asynchronous: bucket i+1 travels to its owners and bucket i-1's rows travel back
    while owners run NS5 on bucket i.

Momentum travels in the NS5 dtype: NS5 casts its input to that dtype first, so the result is the same as gathering
fp32 and casting, for half the bytes in bf16. Nothing is written before the step's non-finite verdict is known: the
look-ahead is computed out of place, and a verdict that rides the refresh (one flag element per rank in the first
bucket) is read before the first write.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_muon.optim.kernels import Orthogonalizer, scale_

__all__ = [
    "CommStats",
    "RefreshItem",
    "RowShard",
    "apply_refresh",
    "assign_owners",
    "bucket_indices",
    "flag_ok",
    "gather_refresh",
    "local_refresh",
    "row_shard",
    "scatter_refresh",
]

Orthogonalize = Callable[[list[Tensor], list["RefreshItem"]], list[Tensor]]
Verdict = Callable[[Tensor], None]  # may raise (nonfinite="raise"); in-flight collectives are drained first
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


@dataclass
class RefreshItem:
    """One matrix to refresh: its local shard views and how its update is written,
    ``M ← β M + (1-β) G``, ``W ← decay·W + scale·NS5(N)``."""

    shard: RowShard
    weight: Tensor
    momentum: Tensor
    grad: Tensor
    beta: float
    nesterov: bool
    decay: float | Tensor
    scale: float | Tensor
    ortho: Orthogonalizer  # matrices with equal orthogonalizers and shapes are batched

    @property
    def dtype(self) -> torch.dtype:
        return self.ortho.dtype

    @property
    def flops(self) -> int:
        return self.ortho.flops(self.shard.shape)

    def lookahead(self) -> tuple[Tensor, Tensor]:
        """``(M_new, N)`` out of place, op for op as torch.optim.Muon; nothing is written."""
        m_new = torch.lerp(self.momentum, self.grad, 1 - self.beta)
        return m_new, torch.lerp(self.grad, m_new, self.beta) if self.nesterov else m_new


def apply_refresh(
    items: Sequence[RefreshItem], m_news: Sequence[Tensor], orthos: Sequence[Tensor], ok: Tensor | None
) -> None:
    """Write momentum and weights of ``items`` from their local orthogonalized rows; with a device verdict ``ok``
    (False: a non-finite gradient somewhere) every write is the identity, without a host synchronization."""
    if ok is not None:
        m_news = [torch.where(ok, m, it.momentum) for it, m in zip(items, m_news)]
        orthos = [torch.where(ok, o, 0) for o in orthos]
    torch._foreach_copy_([it.momentum for it in items], list(m_news))
    by_scalars: dict[tuple, list[int]] = defaultdict(list)
    for j, it in enumerate(items):
        if isinstance(it.decay, Tensor) or isinstance(it.scale, Tensor):
            by_scalars[("tensor", j)].append(j)
        else:
            by_scalars[(it.decay, it.scale)].append(j)
    for index in by_scalars.values():
        decay, scale = items[index[0]].decay, items[index[0]].scale
        weights = [items[j].weight for j in index]
        if isinstance(decay, Tensor) or decay != 1.0:
            scale_(weights, decay, ok)
        if isinstance(scale, Tensor):
            torch._foreach_add_(weights, [orthos[j].float() * scale for j in index])
        else:  # the multi-tensor add casts bf16 -> fp32 on the fly (a plain mixed-dtype add_ is ~6x slower)
            torch._foreach_add_(weights, [orthos[j] for j in index], alpha=scale)


def bucket_indices(shards: Sequence[RowShard], dtypes: Sequence[torch.dtype], bucket_bytes: int) -> list[list[int]]:
    """Consecutive index groups of one NS dtype whose full (padded) size reaches ``bucket_bytes`` at most once."""
    buckets, current, size = [], [], 0
    for i, (s, dtype) in enumerate(zip(shards, dtypes)):
        if current and dtype != dtypes[current[0]]:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += s.world * s.chunk * s.shape[1] * dtype.itemsize
        if size >= bucket_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def _buckets(items: Sequence[RefreshItem], bucket_bytes: int) -> list[list[int]]:
    return bucket_indices([it.shard for it in items], [it.dtype for it in items], bucket_bytes)


def local_refresh(
    items: Sequence[RefreshItem], orthogonalize: Orthogonalize, bucket_bytes: int, ok: Tensor | None
) -> int:
    """Unsharded matrices: bucket by bucket, look-ahead, NS5, write. Returns the NS5 FLOPs."""
    for index in _buckets(items, bucket_bytes):
        bucket = [items[i] for i in index]
        m_news, ns = zip(*(it.lookahead() for it in bucket))
        orthos = orthogonalize(list(ns), bucket)
        apply_refresh(bucket, m_news, orthos, ok)
    return sum(it.flops for it in items)


def flag_ok(flags: Tensor) -> Tensor:
    """The verdict from every rank's flag (0 finite, NaN not): a 0-d bool tensor on the device, no host sync."""
    return flags.isfinite().all()


def _verdict(on_verdict: Verdict | None, ok: Tensor, in_flight: dist.Work | None) -> None:
    """Hand the verdict to ``on_verdict``; if it raises, wait for the collective in flight first (every rank raises
    at the same point, so no rank is left inside a collective)."""
    if on_verdict is None:
        return
    try:
        on_verdict(ok)
    except BaseException:
        if in_flight is not None:
            in_flight.wait()
        raise


def gather_refresh(
    items: Sequence[RefreshItem],
    orthogonalize: Orthogonalize,
    bucket_bytes: int,
    stats: CommStats,
    ok: Tensor | None,
    flag: Tensor | None = None,
    on_verdict: Verdict | None = None,
) -> tuple[Tensor | None, int]:
    """Paper mode: per bucket, all-gather the look-ahead shards (padded to ``chunk`` rows), NS5 on full matrices on
    every rank while the next bucket is in flight, write this rank's rows at once. A ``flag`` (this rank's 0 or NaN)
    rides the first bucket: every rank then holds every rank's flag and the same verdict. Returns the verdict and
    the NS5 FLOPs of this rank."""
    group, world = items[0].shard.group, items[0].shard.world

    def launch(index: list[int], with_flag: bool):
        bucket = [items[i] for i in index]
        dtype, device = bucket[0].dtype, bucket[0].weight.device
        looks = [it.lookahead() for it in bucket]
        sizes = [it.shard.chunk * it.shard.shape[1] for it in bucket]
        send = torch.zeros(sum(sizes) + with_flag, dtype=dtype, device=device)
        offset = 0
        for (_, n), size in zip(looks, sizes):
            send[offset : offset + n.numel()].copy_(n.reshape(-1))
            offset += size
        if with_flag:
            send[-1] = flag
        recv = torch.empty(world * send.numel(), dtype=dtype, device=device)
        work = dist.all_gather_into_tensor(recv, send, group=group, async_op=True)
        stats.add("refresh", send.numel() * dtype.itemsize, (world - 1) * send.numel() * dtype.itemsize)
        return work, recv.view(world, -1), sizes, [m for m, _ in looks]

    buckets = _buckets(items, bucket_bytes)
    pending = launch(buckets[0], flag is not None)
    for b, index in enumerate(buckets):
        work, recv, sizes, m_news = pending
        if b + 1 < len(buckets):
            pending = launch(buckets[b + 1], False)  # next bucket in flight during this bucket's NS5
        work.wait()
        if b == 0 and flag is not None:
            ok = flag_ok(recv[:, -1])
            _verdict(on_verdict, ok, pending[0] if b + 1 < len(buckets) else None)
        bucket = [items[i] for i in index]
        full, offset = [], 0
        for it, size in zip(bucket, sizes):
            m, n = it.shard.shape
            full.append(recv[:, offset : offset + size].reshape(world * it.shard.chunk, n)[:m])
            offset += size
        orthos = [o[slice(*it.shard.rows(it.shard.rank))] for it, o in zip(bucket, orthogonalize(full, bucket))]
        apply_refresh(bucket, m_news, orthos, ok)  # written now: no full matrix outlives its bucket
        del full, orthos, recv
    return ok, sum(it.flops for it in items)


def assign_owners(costs: Sequence[int], world: int) -> list[int]:
    """Owner rank of each matrix: largest NS5 cost first onto the least-loaded rank (deterministic on all ranks;
    the busiest rank exceeds the mean by at most one matrix)."""
    load = [0] * world
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owners[i] = min(range(world), key=lambda r: (load[r], r))
        load[owners[i]] += costs[i]
    return owners


def scatter_refresh(
    items: Sequence[RefreshItem],
    orthogonalize: Orthogonalize,
    bucket_bytes: int,
    stats: CommStats,
    ok: Tensor | None,
    flag: Tensor | None = None,
    on_verdict: Verdict | None = None,
) -> tuple[Tensor | None, int]:
    """Owner mode, bucketed and overlapped: per bucket an async all-to-all sends shards to their owners, owners run
    NS5 once per matrix, a second async all-to-all returns each rank its rows; bucket i+1 travels to its owners and
    bucket i-1's rows travel back while bucket i is orthogonalized. Owners are balanced by NS5 FLOPs over all the
    matrices of the step at once. A ``flag`` rides the first all-to-all (one element to every rank).
    Returns the verdict and the NS5 FLOPs of this rank."""
    group, world, rank = items[0].shard.group, items[0].shard.world, items[0].shard.rank
    owner_of = assign_owners([it.flops for it in items], world)  # over the whole step

    def exchange(send_parts: list[list[Tensor]], recv_sizes: list[int], dtype, device):
        send_sizes = [sum(t.numel() for t in parts) for parts in send_parts]
        flat = [t.reshape(-1).to(dtype) for parts in send_parts for t in parts]
        send = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(recv_sizes), dtype=dtype, device=device)
        work = dist.all_to_all_single(recv, send, recv_sizes, send_sizes, group=group, async_op=True)
        stats.add(
            "refresh",
            (sum(send_sizes) - send_sizes[rank]) * dtype.itemsize,
            (sum(recv_sizes) - recv_sizes[rank]) * dtype.itemsize,
        )
        return work, recv, recv_sizes

    def forward(index: list[int], with_flag: bool):
        bucket = [items[i] for i in index]
        dtype, device = bucket[0].dtype, bucket[0].weight.device
        owned_by = defaultdict(list)
        for j, i in enumerate(index):
            owned_by[owner_of[i]].append(j)
        looks = [it.lookahead() for it in bucket]
        extra = [flag.reshape(1)] if with_flag else []
        send = [[looks[j][1] for j in owned_by[d]] + extra for d in range(world)]
        recv_sizes = [sum(bucket[j].shard.numel(src) for j in owned_by[rank]) + with_flag for src in range(world)]
        return exchange(send, recv_sizes, dtype, device), bucket, owned_by, [m for m, _ in looks], with_flag

    def backward(fwd):
        (_, recv, recv_sizes), bucket, owned_by, m_news, with_flag = fwd
        mine = owned_by[rank]
        blocks = [blk[: len(blk) - with_flag] for blk in recv.split(recv_sizes)]
        pieces = [list(blk.split([bucket[j].shard.numel(src) for j in mine])) for src, blk in enumerate(blocks)]
        full = [
            torch.cat([pieces[src][k] for src in range(world)]).view(bucket[j].shard.shape) for k, j in enumerate(mine)
        ]
        orthos = orthogonalize(full, [bucket[j] for j in mine]) if full else []
        if ok is not None:
            orthos = [torch.where(ok, o, 0) for o in orthos]  # finite whatever the inputs: nothing NaN travels
        back = [[o[slice(*bucket[j].shard.rows(dst))] for j, o in zip(mine, orthos)] for dst in range(world)]
        sizes = [sum(bucket[j].shard.numel(rank) for j in owned_by[src]) for src in range(world)]
        flops = sum(bucket[j].flops for j in mine)
        return exchange(back, sizes, recv.dtype, recv.device), bucket, owned_by, m_news, flops

    def finish(bwd) -> int:
        (work, recv, recv_sizes), bucket, owned_by, m_news, flops = bwd
        work.wait()
        orthos: list[Tensor | None] = [None] * len(bucket)
        for src, block in enumerate(recv.split(recv_sizes)):
            js = owned_by[src]
            for j, piece in zip(js, block.split([bucket[j].shard.numel(rank) for j in js])):
                start, end = bucket[j].shard.rows(rank)
                orthos[j] = piece.view(end - start, bucket[j].shard.shape[1])
        apply_refresh(bucket, m_news, orthos, ok)
        return flops

    buckets = _buckets(items, bucket_bytes)
    mine_flops = 0
    fwd = forward(buckets[0], flag is not None)
    in_flight_back = None
    for b in range(len(buckets)):
        nxt = forward(buckets[b + 1], False) if b + 1 < len(buckets) else None
        fwd[0][0].wait()
        if b == 0 and flag is not None:
            recv, recv_sizes = fwd[0][1], fwd[0][2]
            ends = torch.tensor(recv_sizes, device=recv.device).cumsum(0) - 1
            ok = flag_ok(recv[ends])
            _verdict(on_verdict, ok, nxt[0][0] if nxt is not None else None)
        bwd = backward(fwd)  # rows of bucket b travel back while bucket b-1 is written and b+1 arrives
        if in_flight_back is not None:
            mine_flops += finish(in_flight_back)
        in_flight_back, fwd = bwd, nxt
    mine_flops += finish(in_flight_back)
    return ok, mine_flops
