"""One way for callbacks to report scalars."""

from __future__ import annotations

import lightning as L

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
