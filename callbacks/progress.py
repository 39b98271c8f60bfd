"""Progress that counts optimizer steps toward ``max_steps``: a rich bar in a terminal, lines in a log file."""

from __future__ import annotations

import datetime
import time
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar
from typing_extensions import override

from lightning_muon import compat


class _LoggedLoss:
    """``train/loss`` on the bar as of the last logging step: read on the host when Lightning writes the loggers
    (every ``log_every_n_steps``), never in between — a read every step would wait for the device every step."""

    _loss: float | None = None

    def _note_loss(self, trainer: L.Trainer) -> None:
        value = trainer.callback_metrics.get("train/loss")
        if value is not None and compat.logging_this_step(trainer):
            self._loss = float(value)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        return metrics if self._loss is None else {**metrics, "train/loss": self._loss}


class StepProgressBar(_LoggedLoss, RichProgressBar):
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
        self._note_loss(trainer)
        if trainer.max_steps <= 0:
            return super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if not self.is_disabled and self.train_progress_bar_id is None:
            self._initialize_train_progress_bar_id()
        self._update(self.train_progress_bar_id, trainer.global_step)
        self._update_metrics(trainer, pl_module)


class LineProgress(_LoggedLoss, ProgressBar):
    """Plain-text progress for a log file (stdout not a terminal, e.g. a Slurm job), where a live bar prints nothing:
    a line every ``every_n_steps`` optimizer steps — ``step 250/1500 (17%) | loss 0.412 | 12.3 steps/s | ETA
    0:01:42`` — and one per :class:`~lightning_muon.callbacks.GenerationEvaluation` result, flushed at once. Rank
    0 only. ``lightning-muon`` uses it instead of the rich bar when stdout is not a terminal.

    Args:
        every_n_steps: optimizer steps between lines (the last step always prints).
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}.")
        self.every_n_steps = every_n_steps
        self._enabled = True
        self._start: tuple[int, float] = (0, 0.0)
        self._printed_step = -1
        self._evaluations = 0

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.trainer.is_global_zero

    @property
    def is_disabled(self) -> bool:
        return not self.is_enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._start = (trainer.global_step, time.monotonic())
        self._evaluations = sum(len(h) for h in _histories(trainer))

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.is_disabled:
            return
        self._note_loss(trainer)
        step, total = trainer.global_step, trainer.max_steps
        if step != self._printed_step and (step % self.every_n_steps == 0 or step == total):
            self._printed_step = step
            print(self.line(trainer, pl_module), flush=True)
        rows = [row for history in _histories(trainer) for row in history]
        for row in rows[self._evaluations :]:
            values = ", ".join(f"{k}={v:.4g}" for k, v in row.items() if k.startswith("eval/"))
            print(f"evaluation at step {row['step']}: {values}", flush=True)
        self._evaluations = len(rows)

    def line(self, trainer: L.Trainer, pl_module: L.LightningModule) -> str:
        """The progress line of the current step."""
        step, total = trainer.global_step, trainer.max_steps
        first, start = self._start
        rate = (step - first) / max(time.monotonic() - start, 1e-9)
        parts = [f"step {step}/{total} ({100 * step // total}%)" if total > 0 else f"step {step}"]
        parts += [f"{k} {v:.4g}" for k, v in self.get_metrics(trainer, pl_module).items() if isinstance(v, float)]
        parts.append(f"{rate:.3g} steps/s")
        if total > 0 and rate > 0:
            parts.append(f"ETA {datetime.timedelta(seconds=round((total - step) / rate))}")
        return " | ".join(parts)


def _histories(trainer: L.Trainer) -> list[list[dict[str, Any]]]:
    """The result histories of the trainer's evaluation callbacks (anything with a ``history`` list of rows)."""
    return [c.history for c in trainer.callbacks if isinstance(getattr(c, "history", None), list)]
