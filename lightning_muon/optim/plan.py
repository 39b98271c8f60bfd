"""One optimizer step's plan for a param group: which parameters have gradients, their local (shard) views, states
and row shardings, which matrices refresh this step and which take the RowNorm step — and the refresh items built
from it. Read by :class:`~lightning_muon.optim.muon.PeriodicRowwiseMuon`'s ``step``; nothing here communicates."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_muon.optim.adamw import init_adamw_state
from lightning_muon.optim.config import orthogonalizer, param_name
from lightning_muon.optim.kernels import shape_factor
from lightning_muon.optim.matrices import MatrixLayout
from lightning_muon.optim.refresh import RefreshItem, refresh_scales_of
from lightning_muon.optim.schedules import FixedSchedule
from lightning_muon.optim.shards import RowShard, local, row_shard

__all__ = ["RowNormItem", "Work", "plan_group", "refresh_items", "step_scales"]


@dataclass
class RowNormItem:
    """One matrix taking RowNorm this step: its row statistics Σ N² (``split``: partial until all-reduced, its
    oriented rows span ranks) and, under a drift-measuring schedule, the drift's sums and the drift."""

    index: int
    dim: int  # the stored axis its sums run over
    split: bool
    crosses_ranks: bool  # some of its sums are partial over ranks
    sumsq: Tensor | None = None
    drift_sums: list[Tensor] = field(default_factory=list)
    drift: Tensor | None = None

    def partials(self) -> list[Tensor]:
        return ([self.sumsq] if self.split else []) + (self.drift_sums if self.crosses_ranks else [])


@dataclass
class Work:
    """One group's step: params with gradients, their local views, states and row shardings, and the plan."""

    group: dict[str, Any]
    schedule: FixedSchedule | None
    layout: MatrixLayout  # the logical matrices of the group's parameters
    params: list[Tensor] = field(default_factory=list)
    indices: list[int] = field(default_factory=list)  # in the group
    weights: list[Tensor] = field(default_factory=list)
    grads: list[Tensor] = field(default_factory=list)
    states: list[dict[str, Any]] = field(default_factory=list)
    shards: list[RowShard] = field(default_factory=list)
    refresh: list[int] = field(default_factory=list)
    rownorm: list[RowNormItem] = field(default_factory=list)


def plan_group(
    group: dict[str, Any], states: dict[Tensor, dict[str, Any]], schedules: dict[str, FixedSchedule]
) -> Work:
    """Params with gradients, their local views and state (created as zeros), and which branch each takes."""
    schedule = schedules[group["schedule"]] if group["use_muon"] else None
    work = Work(group, schedule, MatrixLayout.of(group))
    for i, p in enumerate(group["params"]):
        if p.grad is None:
            continue
        if p.grad.is_sparse or torch.is_complex(p):
            kind = "has a sparse gradient" if p.grad.is_sparse else "is complex"
            raise RuntimeError(f"{param_name(group, i)} {kind}; PeriodicRowwiseMuon needs dense real tensors.")
        state = states[p]
        if not state and schedule is not None:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            schedule.init_state(state, p)
        elif not state:
            init_adamw_state(state, p)
        work.params.append(p)
        work.indices.append(i)
        work.weights.append(local(p))
        work.grads.append(local(p.grad))
        work.states.append(state)
        work.shards.append(row_shard(p) if schedule is not None else RowShard(tuple(p.shape)))
    if schedule is not None and work.params:
        due = schedule.plan(group, work.states)
        work.refresh = [i for i, d in enumerate(due) if d]
        for i in (i for i, d in enumerate(due) if not d):
            shard = work.shards[i]
            dim = work.layout.reduce_dim(shard.shape)
            split = dim == -len(shard.shape) and shard.sharded  # it sums over dim 0, the sharded one
            work.rownorm.append(RowNormItem(i, dim, split, split or (schedule.measures_drift and shard.sharded)))
    return work


def refresh_items(work: Work, measure_scales: bool) -> list[RefreshItem]:
    """The refresh items of a group's matrices due this step (``measure_scales``: also measure γ candidates)."""
    if not work.refresh:
        return []
    group = work.group
    ortho = orthogonalizer(group, work.weights[0].device)
    measured = measure_scales or isinstance(group["rownorm_scale"], str)
    items = []
    for i in work.refresh:
        decay, scale = step_scales(group, work.layout, work.shards[i].shape)
        buf, state = local(work.states[i]["momentum_buffer"]), work.states[i]
        scales = refresh_scales_of(state, work.weights[i]) if measured else None
        items.append(RefreshItem(work.shards[i], work.weights[i], buf, work.grads[i], group["momentum"],
                                 group["nesterov"], decay, scale, ortho, scales, work.layout))  # fmt: skip
    return items


def step_scales(
    group: dict[str, Any], layout: MatrixLayout, shape: tuple[int, ...]
) -> tuple[float | Tensor, float | Tensor]:
    """``(decay, -lr·s(m,n))`` of a parameter, s of its logical matrices: floats, or 0-d tensors with a tensor lr."""
    lr = group["lr"]
    return 1 - lr * group["weight_decay"], -lr * shape_factor(layout.matrix_shape(shape), group["adjust_lr"])
