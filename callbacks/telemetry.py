"""``OptimizerTelemetry``: optimizer time, branch, communication, update RMS and gradient norm under ``optim/``."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_muon.optim import PeriodicRowwiseMuon

__all__ = ["OptimizerTelemetry"]


def _sq_norm(tensors: list[Tensor]) -> float:
    """Σ‖t‖² over tensors; DTensors reduce over their mesh (every rank gets the global value)."""
    total = 0.0
    for t in tensors:
        sq = t.detach().float().square().sum()
        total += float(sq.full_tensor() if isinstance(sq, DTensor) else sq)
    return total


class OptimizerTelemetry(Callback):
    """Per-step optimizer telemetry, logged every ``log_every_n_steps`` (default: the Trainer's) at the global step.

    - ``optim/step_ms``: wall time from the end of backward to the end of ``optimizer.step`` (CUDA-synchronized).
    - ``optim/refresh``: 1 when the step ran NS5 refreshes, 0 on RowNorm steps (PeriodicRowwiseMuon).
    - ``optim/<branch>_bytes_sent`` / ``_bytes_received`` / ``_collectives``: ``comm_stats()`` since the last log.
    - ``optim/grad_norm/group<i>`` and ``optim/update_rms/group<i>`` (RMS of the parameter change of that step).
    """

    def __init__(self, log_every_n_steps: int | None = None) -> None:
        super().__init__()
        self.log_every_n_steps = log_every_n_steps
        self._start = 0.0
        self._before: list[list[Tensor]] | None = None
        self._grad_norms: list[float] = []

    def _every(self, trainer: L.Trainer) -> int:
        return self.log_every_n_steps or trainer.log_every_n_steps or 1

    def _logging_now(self, trainer: L.Trainer) -> bool:
        return (trainer.global_step + 1) % self._every(trainer) == 0  # the step about to run

    @staticmethod
    def _sync(pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if self._logging_now(trainer):
            groups = optimizer.param_groups
            self._grad_norms = [_sq_norm([p.grad for p in g["params"] if p.grad is not None]) ** 0.5 for g in groups]
            self._before = [[p.detach().clone() for p in g["params"]] for g in groups]
        self._sync(pl_module)
        self._start = time.perf_counter()

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self._sync(pl_module)
        elapsed = time.perf_counter() - self._start
        optimizer = trainer.optimizers[0]
        if self._before is None:
            return
        values = {"optim/step_ms": 1e3 * elapsed}
        if isinstance(optimizer, PeriodicRowwiseMuon):
            values["optim/refresh"] = float(optimizer.last_branches["refresh"] > 0)
            for branch, stats in optimizer.comm_stats().items():
                values.update({f"optim/{branch}_{k}": float(v) for k, v in stats.items()})
        for i, (group, before) in enumerate(zip(optimizer.param_groups, self._before)):
            numel = sum(p.numel() for p in group["params"]) or 1
            delta = _sq_norm([p.detach() - b for p, b in zip(group["params"], before)])
            values[f"optim/update_rms/group{i}"] = (delta / numel) ** 0.5
            values[f"optim/grad_norm/group{i}"] = self._grad_norms[i]
        self._before = None
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(values, step=trainer.global_step)
