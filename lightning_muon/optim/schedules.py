r"""Refresh schedules: which matrices of a Muon group take the NS5 refresh this step.

One interface (:class:`FixedSchedule`, :class:`AdaptiveSchedule`):

- ``plan(group, states)``: per matrix, whether it refreshes this step (host values: never a device synchronization);
- ``statistics(group, state, momentum, grad, dim)``: a RowNorm matrix's row sums of squares of the look-ahead N,
  plus the sums the schedule needs reduced across ranks with them (they ride the statistics all-reduce);
- ``drift(sums, sumsq, rows)``: the measure those sums give once reduced (``rows``: vectors RowNorm normalizes);
- ``advance(group, refreshed, measured, ok)``: update the schedule's state after the step.

``measures_drift`` says whether RowNorm matrices carry the drift sums (then they cross ranks when sharded).

Layer-wise K and γ need no schedule of their own: groups carry their own ``period`` / ``rownorm_scale``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

import lightning_muon.device as device
from lightning_muon.device import HostCopy
from lightning_muon.optim.fused import compiled_rownorm_kernels
from lightning_muon.optim.kernels import drift_sums, lookahead, rownorm_sumsq
from lightning_muon.optim.shards import local

__all__ = ["AdaptiveSchedule", "FixedSchedule", "refresh_counts"]

#: adaptive-schedule state the host reads every step (kept on the host when a state dict is loaded)
HOST_STATE = ("refresh_age", "refresh_drift", "refreshes")


def warming_up(group: dict[str, Any]) -> bool:
    """Whether this step is in the group's refresh warm-up: its first ``refresh_warmup`` steps refresh every matrix
    (K = 1), the momentum's early directions changing too fast for RowNorm steps to follow them."""
    return group["step"] < group["refresh_warmup"]


class FixedSchedule:
    """All matrices of a group refresh together: on steps with ``t <= t_w`` (the refresh warm-up) or
    ``(t - 1) mod K == 0`` (t: the group's counter, t_w: ``refresh_warmup``)."""

    measures_drift = False

    def init_state(self, state: dict[str, Any], param: Tensor) -> None:
        pass

    def plan(self, group: dict[str, Any], states: list[dict[str, Any]]) -> list[bool]:
        return [warming_up(group) or group["step"] % group["period"] == 0] * len(states)

    def statistics(
        self, group: dict[str, Any], state: dict[str, Any], momentum: Tensor, grad: Tensor, dim: int, fused: bool
    ) -> tuple[Tensor, list[Tensor]]:
        sumsq_fn = compiled_rownorm_kernels()[0] if fused else rownorm_sumsq
        return sumsq_fn(momentum, grad, group["momentum"], group["nesterov"], dim), []

    def drift(self, sums: list[Tensor], sumsq: Tensor, rows: int) -> Tensor | None:
        return None

    def advance(self, group, refreshed, measured, ok) -> None:
        pass


class AdaptiveSchedule(FixedSchedule):
    r"""Each matrix refreshes on its own: in the refresh warm-up, when never refreshed, after ``max_period`` steps, or
    after at least ``min_period`` steps once the drift :math:`1 - \frac1p\sum_i \cos(n_i, r_i)` of the oriented rows
    of its look-ahead N from those at its last refresh R passed ``drift_threshold`` on the previous step.

    The drift is measured on RowNorm steps from sums that ride the statistics all-reduce (identical on every rank,
    no extra collective). State per matrix: R (one shard-sized buffer) and host counters, all checkpointed. On CUDA
    the drift and the step's verdict reach the host together, asynchronously (:class:`~lightning_muon.device.HostCopy`,
    read at the next plan): nothing on the host is written by a copy in flight, and nothing travels to the device.
    """

    measures_drift = True

    def __init__(self) -> None:
        self._pending: dict[int, HostCopy] = {}  # per matrix state: [drift, ok] of its last measured step

    def init_state(self, state: dict[str, Any], param: Tensor) -> None:
        state["refresh_momentum"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["refresh_age"] = torch.tensor(-1, dtype=torch.int64)
        state["refresh_drift"] = torch.tensor(0.0, dtype=torch.float32)
        state["refreshes"] = torch.tensor(0, dtype=torch.int64)

    def plan(self, group: dict[str, Any], states: list[dict[str, Any]]) -> list[bool]:
        return [self._due(group, state) for state in states]

    def _due(self, group: dict[str, Any], state: dict[str, Any]) -> bool:
        age = int(state["refresh_age"])
        longest = group["period"] if group["max_period"] is None else group["max_period"]
        if age < 0 or age >= longest or warming_up(group):
            return True
        if age < group["min_period"]:
            return False
        self.settle(state)
        return float(state["refresh_drift"]) > group["drift_threshold"]

    def settle(self, state: dict[str, Any]) -> None:
        """Take a matrix's drift from its last measured step into ``state`` once the copy has landed on the host
        (queued a step earlier: normally done); that step's verdict came with it, and a skipped step keeps the old
        drift."""
        pending = self._pending.pop(id(state), None)
        if pending is not None:
            drift, ok = pending.value().tolist()
            if ok:
                state["refresh_drift"].fill_(drift)

    def settle_all(self, states: Iterable[dict[str, Any]]) -> None:
        """:meth:`settle` every matrix (before a state dict is taken)."""
        for state in states:
            self.settle(state)

    def forget(self) -> None:
        """Drop the drifts in flight (a state dict is being loaded over the states they belong to)."""
        self._pending.clear()

    def statistics(self, group, state, momentum, grad, dim, fused):
        """Σ N², and the drift's sums: per column N·R and R² when the sums run over dim 0 (partial over ranks), else
        the sum of the row cosines (whole rows: they add up here)."""
        ref = local(state["refresh_momentum"])
        sumsq, dot, rr = drift_sums(momentum, grad, ref, group["momentum"], group["nesterov"], dim)
        return sumsq, [dot, rr] if dim == -momentum.ndim else [_cosines(dot, sumsq, rr).sum()]

    def drift(self, sums: list[Tensor], sumsq: Tensor, rows: int) -> Tensor:
        total = _cosines(sums[0], sumsq, sums[1]).sum() if len(sums) == 2 else sums[0]
        return 1 - total.float() / rows

    def advance(
        self,
        group: dict[str, Any],
        refreshed: list[tuple[dict[str, Any], Tensor]],
        measured: list[tuple[dict[str, Any], Tensor]],
        ok: Tensor | None,
    ) -> None:
        """Refreshed matrices ``(state, grad)`` keep their look-ahead N as the new reference (age 1, drift 0); the
        measured ones ``(state, drift)`` age by one and hand their drift to the host. A skipped step (``ok`` False)
        keeps the old reference and drift."""
        for state, grad in refreshed:
            self._pending.pop(id(state), None)
            ref = local(state["refresh_momentum"])
            n = lookahead(local(state["momentum_buffer"]), grad, group["momentum"], group["nesterov"], updated=True)
            ref.copy_(n if ok is None else torch.where(ok, n, ref))
            state["refresh_age"].fill_(1)
            state["refresh_drift"].zero_()
            state["refreshes"].add_(1)
        for state, drift in measured:
            state["refresh_age"].add_(1)
            self.settle(state)  # one drift in flight per matrix
            verdict = torch.ones_like(drift) if ok is None else ok.to(drift.dtype)
            self._pending[id(state)] = device.HostCopy(torch.stack([drift, verdict]))
            if not drift.is_cuda:  # the value is on the host already
                self.settle(state)


def refresh_counts(param_groups: list[dict[str, Any]], states: dict[Tensor, dict[str, Any]]) -> dict[str, int]:
    """Refreshes so far per Muon group (``"group<i>"``, the total over its matrices) and per matrix by name: an
    adaptive matrix's own counter, else the refresh steps of its group."""
    counts = {}
    for g, group in enumerate(param_groups):
        if not group["use_muon"]:
            continue
        names = group.get("param_names") or [f"group{g}.{i}" for i in range(len(group["params"]))]
        fixed = fixed_refreshes(group["step"], group["period"], group["refresh_warmup"])
        per_matrix = {
            name: int(states[p]["refreshes"]) if "refreshes" in states.get(p, {}) else fixed
            for name, p in zip(names, group["params"])
        }
        counts[f"group{g}"] = sum(per_matrix.values())
        counts.update(per_matrix)
    return counts


def fixed_refreshes(steps: int, period: int, warmup: int) -> int:
    r"""Refreshes of a fixed schedule in its first ``steps`` steps: :math:`\min(s, t_w) + \lceil s/K \rceil -
    \lceil \min(s, t_w)/K \rceil` (every warm-up step, then the steps with :math:`(t-1) \bmod K = 0` after it)."""
    dense = min(steps, warmup)
    return dense + -(-steps // period) - -(-dense // period)


def _cosines(dot: Tensor, nn: Tensor, rr: Tensor) -> Tensor:
    """Cosines of oriented rows from their sums N·R, N², R² (0 where either row is zero)."""
    return dot / (nn * rr).sqrt().clamp_min(1e-30)
