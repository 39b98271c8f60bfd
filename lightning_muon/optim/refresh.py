r"""The refresh branch: one matrix's refresh, its write, and the single-device pass.

For each matrix ``M ← β M + (1-β) G`` and ``W ← decay·W + scale·NS5(N)``. Every refresh of a step — all groups
together — runs bucket by bucket, and each bucket is written as soon as it is orthogonalized, so the extra memory is
a few buckets whatever the model size. Sharded matrices take the same steps through
:mod:`~lightning_muon.optim.transport`, which hands each bucket's rows back for :func:`write_refresh`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_muon.optim.kernels import (
    AUTO_SCALES,
    Orthogonalizer,
    lookahead,
    orthogonalize_batched,
    refresh_scales,
    scale_,
)
from lightning_muon.optim.matrices import MatrixLayout
from lightning_muon.optim.shards import RowShard, bucket_indices

__all__ = [
    "RefreshItem",
    "buckets",
    "local_refresh",
    "measure",
    "orthogonalize_items",
    "refresh_scales_of",
    "rownorm_gamma",
    "write_refresh",
]


@dataclass
class RefreshItem:
    """One matrix to refresh: its row sharding, local views and the scalars of its write."""

    shard: RowShard
    weight: Tensor
    momentum: Tensor
    grad: Tensor
    beta: float
    nesterov: bool
    decay: float | Tensor
    scale: float | Tensor
    ortho: Orthogonalizer  # matrices with equal orthogonalizers and shapes are batched
    scales: Tensor | None = None  # where this refresh's γ candidates go (refresh_scales), None: not measured
    layout: MatrixLayout = MatrixLayout()  # the logical matrices the parameter holds

    @property
    def dtype(self) -> torch.dtype:
        return self.ortho.dtype

    @property
    def flops(self) -> int:
        shape = self.shard.shape
        return self.layout.count(shape) * self.ortho.flops(self.layout.matrix_shape(shape))

    def lookahead(self) -> tuple[Tensor, Tensor]:
        """``(M_t, N_t)`` out of place, op for op as torch.optim.Muon; nothing is written."""
        m_new = torch.lerp(self.momentum, self.grad, 1 - self.beta)
        return m_new, lookahead(m_new, self.grad, self.beta, self.nesterov, updated=True)


def refresh_scales_of(state: dict, weight: Tensor) -> Tensor:
    """A matrix's γ candidates measured at its last refresh (``state["refresh_scales"]``, float32 ``(2,)``); zeros
    before any (a RowNorm step under ``rownorm_scale="auto"`` then moves nothing: every schedule refreshes first)."""
    if "refresh_scales" not in state:
        state["refresh_scales"] = torch.zeros(2, dtype=torch.float32, device=weight.device)
    return state["refresh_scales"]


def rownorm_gamma(group: dict, state: dict, weight: Tensor) -> float | Tensor:
    """The γ of a matrix's RowNorm step: the group's number, or its calibrated γ (a 0-d device tensor)."""
    gamma = group["rownorm_scale"]
    if isinstance(gamma, str):
        calibrated, multiplier = refresh_scales_of(state, weight)[AUTO_SCALES[gamma]], group["auto_scale_multiplier"]
        return calibrated if multiplier == 1.0 else calibrated * multiplier
    return gamma


def buckets(items: Sequence[RefreshItem], bucket_bytes: int) -> list[list[int]]:
    return bucket_indices([it.shard for it in items], [it.dtype for it in items], bucket_bytes)


def write_refresh(
    items: Sequence[RefreshItem],
    m_news: Sequence[Tensor],
    orthos: Sequence[Tensor],
    ok: Tensor | None,
    scales: Sequence[Tensor | None] = (),
) -> None:
    """Write momentum and weights of ``items`` from their local orthogonalized rows, and the measured γ candidates
    of those that measure them; with a device verdict ``ok`` (False: a non-finite gradient somewhere) every write is
    the identity, without a host synchronization."""
    for it, value in zip(items, scales):
        if it.scales is not None:
            it.scales.copy_(value if ok is None else torch.where(ok, value, it.scales))
    # in the weights' dtype: torch's multi-tensor kernels take their fast path on CUDA only for same-dtype lists
    orthos = [o.to(it.weight.dtype) for it, o in zip(items, orthos)]
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
            torch._foreach_add_(weights, [orthos[j] * scale for j in index])
        else:
            torch._foreach_add_(weights, [orthos[j] for j in index], alpha=scale)


def orthogonalize_items(items: Sequence[RefreshItem], fulls: Sequence[Tensor]) -> list[Tensor]:
    """NS5 of each item's full look-ahead, one logical matrix at a time (experts, pieces, a stored transpose:
    :class:`~lightning_muon.optim.matrices.MatrixLayout`), same-shape matrices batched across items; the results have
    the stored shapes."""
    matrices = [it.layout.matrices(x) for it, x in zip(items, fulls)]
    flat = orthogonalize_batched(
        [m for ms in matrices for m in ms.unbind(0)], [it.ortho for it, ms in zip(items, matrices) for _ in ms]
    )
    out, start = [], 0
    for it, ms, x in zip(items, matrices, fulls):
        pieces = flat[start : start + len(ms)]
        start += len(ms)
        if len(pieces) == 1 and not it.layout.transposed:
            out.append(pieces[0].view(x.shape))  # the plain matrix: no copy
        else:
            out.append(it.layout.restore(torch.stack(pieces), x.shape))
    return out


def measure(items: Sequence[RefreshItem], ns: Sequence[Tensor], orthos: Sequence[Tensor]) -> list[Tensor | None]:
    """:func:`refresh_scales` of the full matrices whose item measures them (N in the NS dtype, as it travels)."""
    return [
        refresh_scales(it.layout.matrices(n.to(it.dtype)), it.layout.matrices(o), it.ortho.eps)
        if it.scales is not None
        else None
        for it, n, o in zip(items, ns, orthos)
    ]


def local_refresh(items: Sequence[RefreshItem], bucket_bytes: int, ok: Tensor | None) -> int:
    """Unsharded matrices: bucket by bucket, look-ahead, NS5, write. Returns the NS5 FLOPs."""
    for index in buckets(items, bucket_bytes):
        bucket = [items[i] for i in index]
        m_news, ns = zip(*(it.lookahead() for it in bucket))
        orthos = orthogonalize_items(bucket, ns)
        write_refresh(bucket, m_news, orthos, ok, measure(bucket, ns, orthos))
    return sum(it.flops for it in items)
