"""Callbacks the fault matrix adds to a run (this folder is on its ``PYTHONPATH``): a signal delivered to the process
itself at a chosen step — while a checkpoint is being saved, or between steps."""

from __future__ import annotations

import os
import signal

import lightning as L
from lightning.pytorch.callbacks import Callback


class SignalDuringSave(Callback):
    """``signal`` to this process from inside the save of the checkpoint at ``step`` (every rank), so the handler runs
    while the checkpoint is being written."""

    def __init__(self, signal_name: str = "SIGTERM", step: int = 4) -> None:
        self.signum, self.step = signal.Signals[signal_name], step

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)


class SignalAfterStep(Callback):
    """``signal`` to this process after optimizer step ``step`` (every rank): Slurm's pre-emption warning."""

    def __init__(self, signal_name: str = "SIGUSR1", step: int = 3) -> None:
        self.signum, self.step = signal.Signals[signal_name], step

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.signum)
