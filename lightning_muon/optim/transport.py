"""Everything that talks to the process group: the row-statistics all-reduce and the two refresh transports.

- RowNorm of a tall matrix (m > n) normalizes columns that span ranks: each rank contributes partial column sums of
  squares, and every such vector of the step (with the adaptive schedule's drift sums and the non-finite flag)
  travels in ONE flat all-reduce (:func:`start_all_reduce`).
- A refresh needs full matrices; every sharded refresh of a step runs as one bucketed pass that hands each bucket's
  local orthogonalized rows back to the caller as soon as they exist (a generator: the caller writes them with
  :func:`~lightning_muon.optim.refresh.write_refresh` and asks for the next):

  - ``gather`` (the paper): the look-ahead momentum of bucket i+1 is all-gathered while NS5 runs on bucket i; every
    rank orthogonalizes every matrix and keeps its rows.
  - ``scatter`` (dion / torchtitan style): each matrix has one owner rank (largest NS5 cost first onto the least
    loaded rank, over all matrices of the step at once); per bucket one all-to-all sends shards to owners ("to
    owners") and one sends orthogonalized rows back ("to holders"), both asynchronous: bucket i+1 travels to its
    owners and bucket i-1's rows travel back while owners run NS5 on bucket i.

At exit, gloo needs a moment (:func:`release_gloo_workers_at_exit`): its worker threads free the finished collectives
and with them the last references to our buffers, Python tensors, which takes the GIL; a thread that asks for the GIL
once the interpreter is finalizing is ended by Python, unwinding through a ``noexcept`` C++ destructor —
``std::terminate``: "terminate called without an active exception", SIGABRT after a finished run.

Momentum travels in the NS5 dtype: NS5 casts its input to that dtype first, so the result is the same as gathering
fp32 and casting, for half the bytes in bf16. A non-finite flag (0, or NaN: this rank saw a non-finite gradient) may
ride the first bucket; the verdict is then known before the first write, and with ``raise_nonfinite`` every rank
raises :class:`~lightning_muon.optim.nonfinite.NonFiniteGradient` at the same point, collectives drained.
"""

from __future__ import annotations

import atexit
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

import lightning_muon.compat as compat
from lightning_muon.optim.nonfinite import NonFiniteGradient, flags_ok
from lightning_muon.optim.refresh import RefreshItem, buckets, measure, orthogonalize_items
from lightning_muon.optim.shards import assign_owners

__all__ = [
    "CommStats",
    "gather_refresh",
    "note_gloo_collectives",
    "release_gloo_workers_at_exit",
    "scatter_refresh",
    "start_all_reduce",
]

BRANCHES = ("refresh", "rownorm")
#: what a refresh transport yields per bucket: the items, their new momenta, their local orthogonalized rows, the
#: step's verdict (None: unchecked), and the γ candidates of the items that measure them (else None)
Bucket = tuple[list[RefreshItem], list[Tensor], list[Tensor], Tensor | None, list[Tensor | None]]
SCALES = 2  # elements of refresh_scales


#: seconds the exit hook holds the GIL released (a gloo worker needs microseconds once it has the GIL, but on a loaded
#: machine it may wait to be scheduled: 0.05 s once let a 2-rank run abort at exit with both CPU cores busy)
GLOO_EXIT_GRACE = 0.5


_carried_gloo = False


def note_gloo_collectives(group: dist.ProcessGroup | None = None) -> None:
    """Record that this package runs collectives on ``group`` (default: the world); on a gloo group (alone or in a
    mixed ``"cpu:gloo,cuda:nccl"`` one) the exit hook gives gloo's workers their grace even when the script destroyed
    the group itself — its Python objects (device meshes, works) and worker threads outlive ``destroy_process_group``
    until the interpreter finalizes."""
    global _carried_gloo
    if not _carried_gloo and dist.is_available() and dist.is_initialized():
        _carried_gloo = "gloo" in str(dist.get_backend(group))


def release_gloo_workers_at_exit() -> None:
    """An ``atexit`` hook (it runs before the interpreter finalizes): when a gloo process group is alive, or one
    carried this package's collectives (:func:`note_gloo_collectives`, whoever destroyed it since), give the GIL away
    for a moment, so gloo worker threads still waiting for it finish destroying their finished works — the backtrace
    of the abort it prevents: ``ProcessGroupGloo::runLoop`` → ``~AsyncBarrierWork`` →
    ``~AsyncAllgatherCoalescedWork`` → ``TensorImpl::decref_pyobject`` → ``gil_scoped_acquire`` → ``take_gil`` →
    ``PyThread_exit_thread`` during ``Py_FinalizeEx`` → ``std::terminate``. Registered when this module is imported,
    so a process whose only collectives are a metric's sync is covered too (seen: a 3-rank reference-cache test)."""
    alive = dist.is_available() and dist.is_initialized() and "gloo" in str(dist.get_backend())
    if alive or _carried_gloo:
        time.sleep(GLOO_EXIT_GRACE)


atexit.register(release_gloo_workers_at_exit)


class CommStats:
    """Bytes and collectives of this rank per branch, counted where each collective is issued.

    An all-reduce counts its buffer as sent and as received; an all-gather sends the local block and receives the
    blocks of the other ranks; an all-to-all sends and receives what crosses to or from other ranks. The per-step
    all-reduce counts under ``"rownorm"`` when any matrix took RowNorm, else under ``"refresh"``.
    """

    def __init__(self) -> None:
        self._stats = self._empty()

    @staticmethod
    def _empty() -> dict[str, dict[str, int]]:
        return {b: {"bytes_sent": 0, "bytes_received": 0, "collectives": 0} for b in BRANCHES}

    def add(self, branch: str, sent: int, received: int) -> None:
        note_gloo_collectives()
        entry = self._stats[branch]
        entry["bytes_sent"] += int(sent)
        entry["bytes_received"] += int(received)
        entry["collectives"] += 1

    def pop(self) -> dict[str, dict[str, int]]:
        """The counts since the last call."""
        out, self._stats = self._stats, self._empty()
        return out


@dataclass
class PendingReduce:
    """An all-reduce in flight over the concatenation of ``tensors`` and ``extra`` (float32)."""

    tensors: list[Tensor]
    flat: Tensor
    work: dist.Work
    extra: int

    def wait(self) -> Tensor:
        """Write the sums back into ``tensors``; returns the summed ``extra`` elements."""
        self.work.wait()
        n = self.flat.numel() - self.extra
        for t, reduced in zip(self.tensors, self.flat[:n].split([t.numel() for t in self.tensors])):
            t.copy_(reduced.view_as(t))
        return self.flat[n:]


def start_all_reduce(
    tensors: list[Tensor], extra: list[Tensor], group: dist.ProcessGroup, stats: CommStats, branch: str
) -> PendingReduce:
    """Launch one sum all-reduce of every tensor (and the ``extra`` elements) as a flat float32 vector."""
    flat = torch.cat([t.reshape(-1).float() for t in tensors] + [e.reshape(-1).float() for e in extra])
    work = dist.all_reduce(flat, group=group, async_op=True)
    stats.add(branch, flat.numel() * flat.element_size(), flat.numel() * flat.element_size())
    return PendingReduce(tensors, flat, work, sum(e.numel() for e in extra))


def _check(ok: Tensor, raise_nonfinite: bool, in_flight: dist.Work | None) -> None:
    """With ``raise_nonfinite``, raise on a False verdict (one host synchronization) after draining the collective in
    flight: every rank raises at the same point, so no rank is left inside a collective."""
    if raise_nonfinite and not bool(ok):
        if in_flight is not None:
            in_flight.wait()
        raise NonFiniteGradient("Non-finite (NaN or inf) or overflowing gradient on some rank.")


def gather_refresh(
    items: Sequence[RefreshItem],
    bucket_bytes: int,
    stats: CommStats,
    ok: Tensor | None,
    flag: Tensor | None = None,
    raise_nonfinite: bool = False,
) -> Iterator[Bucket]:
    """Paper mode: per bucket, all-gather the look-ahead shards (padded to ``chunk`` rows), NS5 on full matrices on
    every rank while the next bucket is in flight, yield this rank's rows. A ``flag`` (this rank's 0 or NaN) rides
    the first bucket: every rank then holds every rank's flag and the same verdict."""
    group, world = items[0].shard.group, items[0].shard.world

    def launch(index: list[int], with_flag: bool):
        bucket = [items[i] for i in index]
        dtype, device = bucket[0].dtype, bucket[0].weight.device
        looks = [it.lookahead() for it in bucket]
        sizes = [it.shard.chunk * it.shard.row_numel for it in bucket]
        send = torch.zeros(sum(sizes) + with_flag, dtype=dtype, device=device)
        offset = 0
        for (_, n), size in zip(looks, sizes):
            send[offset : offset + n.numel()].copy_(n.reshape(-1))
            offset += size
        if with_flag:
            send[-1] = flag
        recv = torch.empty(world * send.numel(), dtype=dtype, device=device)
        work = compat.all_gather_single(recv, send, group=group, async_op=True)
        stats.add("refresh", send.numel() * dtype.itemsize, (world - 1) * send.numel() * dtype.itemsize)
        return work, recv.view(world, -1), sizes, [m for m, _ in looks]

    index_of = buckets(items, bucket_bytes)
    pending = launch(index_of[0], flag is not None)
    for b, index in enumerate(index_of):
        work, recv, sizes, m_news = pending
        if b + 1 < len(index_of):
            pending = launch(index_of[b + 1], False)  # next bucket in flight during this bucket's NS5
        work.wait()
        if b == 0 and flag is not None:
            ok = flags_ok(recv[:, -1])
            _check(ok, raise_nonfinite, pending[0] if b + 1 < len(index_of) else None)
        bucket = [items[i] for i in index]
        full, offset = [], 0
        for it, size in zip(bucket, sizes):
            m, *rest = it.shard.shape
            full.append(recv[:, offset : offset + size].reshape(world * it.shard.chunk, *rest)[:m])
            offset += size
        orthos = orthogonalize_items(bucket, full)
        rows = [o[slice(*it.shard.rows(it.shard.rank))] for it, o in zip(bucket, orthos)]
        yield bucket, m_news, rows, ok, measure(bucket, full, orthos)
        del full, orthos, recv  # no full matrix outlives its bucket


def scatter_refresh(
    items: Sequence[RefreshItem],
    bucket_bytes: int,
    stats: CommStats,
    ok: Tensor | None,
    flag: Tensor | None = None,
    raise_nonfinite: bool = False,
) -> Iterator[Bucket]:
    """Owner mode, bucketed and overlapped: per bucket an async all-to-all sends shards to their owners, owners run
    NS5 once per matrix, a second async all-to-all returns each rank its rows; bucket i+1 travels to its owners and
    bucket i-1's rows travel back while bucket i is orthogonalized. A ``flag`` rides the first all-to-all (one
    element to every rank). NS5 FLOPs of this rank: :func:`owned_flops`."""
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

    def to_owners(index: list[int], with_flag: bool) -> dict:
        bucket = [items[i] for i in index]
        dtype, device = bucket[0].dtype, bucket[0].weight.device
        owned_by = defaultdict(list)
        for j, i in enumerate(index):
            owned_by[owner_of[i]].append(j)
        looks = [it.lookahead() for it in bucket]
        extra = [flag.reshape(1)] if with_flag else []
        send = [[looks[j][1] for j in owned_by[d]] + extra for d in range(world)]
        recv_sizes = [sum(bucket[j].shard.numel(src) for j in owned_by[rank]) + with_flag for src in range(world)]
        work, recv, recv_sizes = exchange(send, recv_sizes, dtype, device)
        return dict(work=work, recv=recv, sizes=recv_sizes, bucket=bucket, owned_by=owned_by,
                    m_news=[m for m, _ in looks], with_flag=with_flag)  # fmt: skip

    def to_holders(sent: dict) -> dict:
        """NS5 on the matrices this rank owns, and their rows sent back to the ranks holding them."""
        bucket, owned_by, with_flag = sent["bucket"], sent["owned_by"], sent["with_flag"]
        mine = owned_by[rank]
        blocks = [blk[: len(blk) - with_flag] for blk in sent["recv"].split(sent["sizes"])]
        pieces = [list(blk.split([bucket[j].shard.numel(src) for j in mine])) for src, blk in enumerate(blocks)]
        full = [
            torch.cat([pieces[src][k] for src in range(world)]).view(bucket[j].shard.shape) for k, j in enumerate(mine)
        ]
        orthos = orthogonalize_items([bucket[j] for j in mine], full) if full else []
        scales = [s for s in measure([bucket[j] for j in mine], full, orthos) if s is not None]
        if ok is not None:
            orthos = [torch.where(ok, o, 0) for o in orthos]  # finite whatever the inputs: nothing NaN travels
            scales = [torch.where(ok, s, 0) for s in scales]
        dtype = sent["recv"].dtype
        scales = [s.view(dtype) for s in scales]  # float32 bits in the wire dtype's elements: exact
        back = [[o[slice(*bucket[j].shard.rows(dst))] for j, o in zip(mine, orthos)] + scales for dst in range(world)]
        sizes = [
            sum(bucket[j].shard.numel(rank) + _wire(dtype) * (bucket[j].scales is not None) for j in owned_by[src])
            for src in range(world)
        ]
        work, recv, recv_sizes = exchange(back, sizes, dtype, sent["recv"].device)
        return dict(sent, work=work, recv=recv, sizes=recv_sizes)

    def received(back: dict) -> Bucket:
        back["work"].wait()
        bucket, owned_by = back["bucket"], back["owned_by"]
        orthos: list[Tensor | None] = [None] * len(bucket)
        scales: list[Tensor | None] = [None] * len(bucket)
        for src, block in enumerate(back["recv"].split(back["sizes"])):
            js = owned_by[src]
            measured = [j for j in js if bucket[j].scales is not None]
            pieces = block.split([bucket[j].shard.numel(rank) for j in js] + [_wire(block.dtype)] * len(measured))
            for j, piece in zip(js, pieces):
                start, end = bucket[j].shard.rows(rank)
                orthos[j] = piece.view(end - start, *bucket[j].shard.shape[1:])
            for j, piece in zip(measured, pieces[len(js) :]):
                scales[j] = piece.clone().view(torch.float32)  # a fresh, aligned buffer
        return bucket, back["m_news"], orthos, ok, scales

    index_of = buckets(items, bucket_bytes)
    sent = to_owners(index_of[0], flag is not None)
    returning = None
    for b in range(len(index_of)):
        following = to_owners(index_of[b + 1], False) if b + 1 < len(index_of) else None
        sent["work"].wait()
        if b == 0 and flag is not None:
            ok = flags_ok(torch.stack([block[-1] for block in sent["recv"].split(sent["sizes"])]))  # views: no copy
            _check(ok, raise_nonfinite, following["work"] if following is not None else None)
        back = to_holders(sent)  # rows of bucket b travel back while bucket b-1 is written and b+1 arrives
        if returning is not None:
            yield received(returning)
        returning, sent = back, following
    yield received(returning)


def _wire(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` that carry the float32 γ candidates of one matrix bit for bit."""
    return SCALES * 4 // dtype.itemsize


def owned_flops(items: Sequence[RefreshItem], world: int, rank: int) -> int:
    """NS5 FLOPs a rank runs in :func:`scatter_refresh` over ``items`` (the matrices it owns)."""
    owner_of = assign_owners([it.flops for it in items], world)
    return sum(it.flops for it, owner in zip(items, owner_of) if owner == rank)
