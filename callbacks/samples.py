"""Write predicted samples as PNG files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

# ruff: noqa: E402 (the extra is checked before the modules that need it are imported)
from lightning_muon.extras import require

require("metrics", "SampleWriter")


class SampleWriter(BasePredictionWriter):
    """Write each predicted sample (``predict_step`` returning ``{"index", "label", "image"}``, uint8 images) to
    ``<output_dir>/<index:06d>_class<label>.png`` from the rank that generated it.

    Args:
        output_dir: the image folder (created); default ``samples`` beside the logger's versions
            (``lightning_logs/samples``), or ``<default_root_dir>/samples`` without a logger. The path is printed
            when prediction ends.
    """

    def __init__(self, output_dir: str | None = None) -> None:
        super().__init__(write_interval="batch")
        self.output_dir = output_dir

    def folder(self, trainer: L.Trainer) -> Path:
        """Where the samples go."""
        if self.output_dir:
            return Path(self.output_dir)
        root = getattr(trainer.logger, "root_dir", None)  # TensorBoard / CSV: <save_dir>/<name>, lightning_logs
        return Path(root or trainer.default_root_dir) / "samples"

    @override
    def on_predict_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        rank_zero_info(f"Predicted samples: {self.folder(trainer).resolve()}")

    @override
    def write_on_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, prediction: Any, *args: Any) -> None:
        from PIL import Image

        folder = self.folder(trainer)
        folder.mkdir(parents=True, exist_ok=True)
        for index, label, image in zip(prediction["index"].tolist(), prediction["label"].tolist(), prediction["image"]):
            array = image.permute(1, 2, 0).cpu().numpy()
            Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array).save(
                folder / f"{index:06d}_class{label}.png"
            )
