"""Exponential moving average of a module's weights, updated once per optimizer step."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


def update_averages(trainer: L.Trainer, pl_module: L.LightningModule) -> None:
    """Bring every :class:`EMA` callback's average up to the current step, whatever the callback order: what a
    callback that reads or saves the average in this step's hook (an evaluation, a pre-emption checkpoint) calls
    first, so it sees what this step's checkpoint holds."""
    for callback in trainer.callbacks:
        if isinstance(callback, EMA):
            callback.update(trainer, pl_module)


class EMA(Callback):
    r"""After every optimizer step, :math:`\bar\theta \leftarrow \beta\,\bar\theta + (1-\beta)\,\theta` for the
    parameters of ``pl_module.<source>`` into ``pl_module.<target>`` (a copy with the same parameters, e.g.
    ``copy.deepcopy(self.model)``, made in ``configure_model`` so FSDP2 shards it like the model and it is saved in
    checkpoints).

    The update runs when ``trainer.global_step`` has advanced, so under ``accumulate_grad_batches=N`` it runs once
    per N batches, as the weights change, and on skipped (non-finite) steps the average still decays toward
    unchanged weights. Works on DTensor shards: each rank averages its own shard, no communication.

    Lightning's ``EMAWeightAveraging`` does not work under ``muon_fsdp`` (measured with Lightning 2.6, test in
    ``tests/core/test_strategy.py``): it deep-copies the module in ``setup``, before the strategy shards it, so every
    rank holds a full unsharded copy, and its first update copies the DTensor shards into those plain tensors
    (``RuntimeError: aten.copy_.default got mixed torch.Tensor and DTensor``). It also swaps the average into the
    trained model for validation and copies it over the trained weights at the end of training.

    Args:
        decay: :math:`\beta` in [0, 1).
        source: attribute name of the trained network.
        target: attribute name of its average.
    """

    def __init__(self, decay: float = 0.999, source: str = "model", target: str = "ema") -> None:
        super().__init__()
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}.")
        self.decay, self.source, self.target = decay, source, target
        self.updates = 0
        self._step = -1

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name in (self.source, self.target):
            if not isinstance(getattr(pl_module, name, None), torch.nn.Module):
                raise AttributeError(
                    f"EMA needs pl_module.{name} to be a module (source={self.source!r}, "
                    f"target={self.target!r}); build the copy in configure_model()."
                )
        self._step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.update(trainer, pl_module)

    def update(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Bring the average up to the current optimizer step; a no-op when it is there already (or training has not
        started), so a callback that reads the average on this step (``GenerationEvaluation``, which may run before
        this callback) can call it first and see what the step's checkpoint holds."""
        if self._step < 0 or trainer.global_step == self._step:  # not started, or accumulating / already updated
            return
        self._step = trainer.global_step
        average, current = getattr(pl_module, self.target), getattr(pl_module, self.source)
        with torch.no_grad():
            torch._foreach_lerp_(list(average.parameters()), list(current.parameters()), 1 - self.decay)
        self.updates += 1
