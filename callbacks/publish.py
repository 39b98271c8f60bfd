"""One way to report scalars: callbacks' values, and a training loss without a per-step collective."""

from __future__ import annotations

import lightning as L
import torch
from torch import Tensor

from lightning_muon import compat


def publish_scalars(
    trainer: L.Trainer, pl_module: L.LightningModule, values: dict[str, float], monitorable: bool = True
) -> None:
    """Report ``values`` at :func:`logger_step`, where Lightning logs this batch's own values.

    ``pl_module.log(..., logger=False, sync_dist=False)`` puts them in ``trainer.callback_metrics``, so
    ``ModelCheckpoint(monitor=...)`` and ``EarlyStopping`` can use them (the values are already reduced over ranks;
    ``monitorable=False`` in hooks where Lightning forbids ``log``). Rank 0 also writes them to every logger directly:
    Lightning flushes logged values to loggers only on ``log_every_n_steps`` steps, which would drop an evaluation
    falling between two of them.
    """
    if monitorable:
        pl_module.log_dict(values, on_step=True, on_epoch=False, sync_dist=False, logger=False)
    if trainer.is_global_zero:
        for logger in trainer.loggers:
            logger.log_metrics(values, step=logger_step(trainer))


def logger_step(trainer: L.Trainer) -> int:
    """The logger step of the batch in progress, the one Lightning writes ``train/loss``, ``val/loss`` and
    ``LearningRateMonitor``'s rates at: the optimizer steps completed before that batch. The values of optimizer step
    k (an evaluation after it, its telemetry) go to logger step k - 1 with that batch's loss, so the curves line up;
    checkpoint names and ``metrics.jsonl`` keep the optimizer step k."""
    return compat.batches_that_stepped(trainer)


def log_on_logging_steps(pl_module: L.LightningModule, name: str, value: Tensor) -> None:
    """``pl_module.log(name, mean of value over ranks)`` on the steps Lightning writes the loggers (every
    ``log_every_n_steps``), and nothing on the others: one all-reduce and one host read per logging step, none in
    between (``sync_dist=True`` on every step costs a barrier and an all-reduce each step: a host sync on a GPU).
    Between logging steps ``trainer.callback_metrics[name]`` keeps the last logged value, the same on every rank. Not
    on the progress bar: Lightning reads every progress-bar value on the host after each batch
    (:class:`~lightning_muon.callbacks.StepProgressBar` and :class:`~lightning_muon.callbacks.LineProgress` show
    ``train/loss`` as of the last logging step)."""
    trainer = pl_module._trainer
    if trainer is None or not compat.logging_this_step(trainer):
        return
    value = value.detach().float().clone()
    if trainer.world_size > 1 and torch.distributed.is_initialized():
        torch.distributed.all_reduce(value)
        value /= trainer.world_size
    pl_module.log(name, value, on_step=True, on_epoch=False)
