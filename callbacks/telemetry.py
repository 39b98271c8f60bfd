"""``OptimizerTelemetry``: optimizer time, branch, communication, update RMS and gradient norm under ``optim/``."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_muon.callbacks.publish import publish_scalars
from lightning_muon.optim import PeriodicRowwiseMuon
from lightning_muon.optim.kernels import AUTO_SCALES

__all__ = ["OptimizerTelemetry", "squared_norms"]


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_group(tensors: list[Tensor]) -> dist.ProcessGroup | None:
    """The group DTensor shards are split over (their sums add up there; replicas of HSDP are not added again)."""
    for t in tensors:
        if isinstance(t, DTensor):
            dims = [i for i, placement in enumerate(t.placements) if placement.is_shard()]
            if dims:
                return t.device_mesh.get_group(dims[0])
    return None


def squared_norms(lists: list[list[Tensor]]) -> Tensor:
    """Σ‖t‖² of each list of tensors, as one float64 vector: local shards summed on the device, then ONE all-reduce
    over the shard group when they are DTensors (every rank gets the global values)."""
    flat = [t for ts in lists for t in ts]
    device = flat[0].device if flat else torch.device("cpu")
    sums = [
        torch.stack([_local(t).double().square().sum() for t in ts]).sum()
        if ts
        else torch.zeros((), dtype=torch.float64, device=device)
        for ts in lists
    ]
    out = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64, device=device)
    group = _shard_group(flat)
    if group is not None:
        dist.all_reduce(out, group=group)
    return out


def scale_summary(optimizer: PeriodicRowwiseMuon) -> dict[str, float]:
    """Per Muon group, from the γ candidates each matrix measured at its latest refresh
    (:func:`~lightning_muon.optim.kernels.refresh_scales`): the mean RowNorm-to-NS5 ratios (their inverses) and,
    under ``rownorm_scale="auto"``, the γ in use (mean / min / max). One host read."""
    values = {}
    for g, group in enumerate(optimizer.param_groups):
        states = [optimizer.state.get(p, {}) for p in group["params"]] if group["use_muon"] else []
        scales = [s["refresh_scales"] for s in states if "refresh_scales" in s]
        table = torch.stack(scales).double().cpu() if scales else torch.zeros(0, 2, dtype=torch.float64)
        table = table[(table > 0).all(1)]  # matrices that refreshed
        if not len(table):
            continue
        values[f"optim/rownorm_vs_ns5/descent/group{g}"] = float((1 / table[:, 0]).mean())
        values[f"optim/rownorm_vs_ns5/rms/group{g}"] = float((1 / table[:, 1]).mean())
        if isinstance(group["rownorm_scale"], str):
            gamma = table[:, AUTO_SCALES[group["rownorm_scale"]]] * group["auto_scale_multiplier"]
            values.update({f"optim/gamma/group{g}/{k}": float(f(gamma)) for k, f in STATS.items()})
    return values


STATS = {"mean": torch.mean, "min": torch.min, "max": torch.max}


class OptimizerTelemetry(Callback):
    """Optimizer telemetry, measured and logged every ``log_every_n_steps`` (default: the Trainer's) at the global
    step by rank 0 to every logger (the values are already global). Other steps are not touched: no host
    synchronization, no collective, no copy.

    - ``optim/step_ms``: wall time from the end of backward to the end of the training batch (CUDA events on GPUs,
      read on the logging step).
    - ``optim/refresh``: 1 when the step ran NS5 refreshes, 0 on RowNorm steps (PeriodicRowwiseMuon).
    - ``optim/<branch>_bytes_sent`` / ``_bytes_received`` / ``_collectives``: ``comm_stats()`` since the last log.
    - ``optim/nonfinite_skipped``: steps skipped for NaN/inf gradients so far.
    - ``optim/refreshes/group<i>`` and ``optim/refreshes/<parameter>``: NS5 refreshes so far per Muon group and per
      matrix (:meth:`~lightning_muon.PeriodicRowwiseMuon.refresh_counts`; per matrix they differ under the adaptive
      schedule).
    - ``optim/grad_norm/group<i>`` and ``optim/update_rms/group<i>`` (RMS of the parameter change of that step): one
      bucketed all-reduce for all groups.
    - What γ means in this model, per Muon group, from each matrix's latest refresh (:func:`scale_summary`; the
      callback makes the optimizer measure it, ``measure_scales``): ``optim/rownorm_vs_ns5/descent/group<i>`` and
      ``.../rms/group<i>``, the mean RowNorm-to-NS5 ratio of first-order descent and of RMS (a RowNorm step at
      γ = 1 relative to that refresh's step), and under ``rownorm_scale="auto"`` the calibrated
      ``optim/gamma/group<i>/{mean,min,max}``.

    Args:
        log_every_n_steps: logging period in optimizer steps (``None``: the Trainer's ``log_every_n_steps``).
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        super().__init__()
        self.log_every_n_steps = log_every_n_steps
        self._start: Any = None
        self._before: list[list[Tensor]] | None = None
        self._grad_sq: Tensor | None = None

    def _every(self, trainer: L.Trainer) -> int:
        return self.log_every_n_steps or trainer.log_every_n_steps or 1

    def _logging_now(self, trainer: L.Trainer) -> bool:
        return (trainer.global_step + 1) % self._every(trainer) == 0  # the step about to run

    @staticmethod
    def _clock(pl_module: L.LightningModule) -> Any:
        if pl_module.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if isinstance(optimizer, PeriodicRowwiseMuon):
            optimizer.measure_scales = True
        if not self._logging_now(trainer):
            return
        groups = optimizer.param_groups
        self._grad_sq = squared_norms([[p.grad for p in g["params"] if p.grad is not None] for g in groups])
        self._before = [[p.detach().clone() for p in g["params"]] for g in groups]
        self._start = self._clock(pl_module)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._before is None:
            return
        end = self._clock(pl_module)
        if isinstance(end, float):
            elapsed_ms = 1e3 * (end - self._start)
        else:
            end.synchronize()  # the logging step only
            elapsed_ms = self._start.elapsed_time(end)
        optimizer = trainer.optimizers[0]
        values = {"optim/step_ms": elapsed_ms}
        if isinstance(optimizer, PeriodicRowwiseMuon):
            values["optim/refresh"] = float(optimizer.last_branches["refresh"] > 0)
            values["optim/nonfinite_skipped"] = float(optimizer.nonfinite_steps_skipped)
            for branch, stats in optimizer.comm_stats().items():
                values.update({f"optim/{branch}_{k}": float(v) for k, v in stats.items()})
            values.update({f"optim/refreshes/{k}": float(v) for k, v in optimizer.refresh_counts().items()})
            values.update(scale_summary(optimizer))
        groups = optimizer.param_groups
        deltas = [[p.detach() - b for p, b in zip(g["params"], before)] for g, before in zip(groups, self._before)]
        update_sq = squared_norms(deltas).tolist()
        grad_sq = self._grad_sq.tolist()
        for i, group in enumerate(groups):
            numel = sum(p.numel() for p in group["params"]) or 1
            values[f"optim/update_rms/group{i}"] = (update_sq[i] / numel) ** 0.5
            values[f"optim/grad_norm/group{i}"] = grad_sq[i] ** 0.5
        self._before = self._grad_sq = None
        publish_scalars(trainer, pl_module, values)
