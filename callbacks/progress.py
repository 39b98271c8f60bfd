"""A progress bar that counts optimizer steps toward ``max_steps``."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override


class StepProgressBar(RichProgressBar):
    """Lightning's rich progress bar, but when ``max_steps`` is set it is one bar for the whole run: optimizer step
    ``global_step`` of ``max_steps`` (step-based runs have ``max_epochs=-1``, which the stock bar shows as
    "Epoch 62/-2" over the batches of one epoch). Without ``max_steps`` it is the stock bar.

    Args:
        refresh_rate: redraw every this many batches (0 disables the bar).
        leave: keep finished bars on screen.
    """

    def __init__(self, refresh_rate: int = 1, leave: bool = False) -> None:
        super().__init__(refresh_rate=refresh_rate, leave=leave)  # typed: no console_kwargs (Any) from a config

    @property
    @override
    def total_train_batches(self) -> int | float:
        steps = self.trainer.max_steps
        return steps if steps > 0 else super().total_train_batches

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_steps > 0:
            return f"Step (epoch {current_epoch})"
        return super()._get_train_description(current_epoch)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.max_steps <= 0:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)
