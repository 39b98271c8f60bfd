"""``GenerationEvaluation``: sample a fixed, globally indexed set during training and log generation metrics."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_muon.callbacks.ema import update_averages
from lightning_muon.callbacks.protocols import Generator, RealImages, check_protocol
from lightning_muon.callbacks.publish import logger_step, publish_scalars
from lightning_muon.checkpoint import atomic_write
from lightning_muon.metrics.evaluation import (
    MetricSuite,
    Sampling,
    check_generated_images,
    metrics_on,
    prepare_references,
    read_prompts,
    real_images_of,
    score_generation,
)
from lightning_muon.metrics.features import cache_dir
from lightning_muon.metrics.geneval2 import GenEval2

__all__ = ["GenerationEvaluation", "append_jsonl", "sample_grid"]

log = logging.getLogger(__name__)


def sample_grid(images: Tensor, min_size: int = 256) -> Tensor:
    """uint8 images ``(N, C, h, w)`` as one square float grid ``(3, H, W)`` in [0, 1], each image upscaled
    (nearest, by an integer factor) so the grid is at least ``min_size`` pixels wide."""

    from torchvision.utils import make_grid

    nrow = max(1, math.isqrt(len(images)))
    scale = max(1, math.ceil(min_size / (nrow * (images.shape[-1] + 1))))
    x = torch.nn.functional.interpolate(images.float() / 255, scale_factor=scale, mode="nearest")
    return make_grid(x, nrow=nrow, padding=1, pad_value=1.0)


def append_jsonl(path: str | os.PathLike, row: dict[str, Any]) -> None:
    """Append one JSON line atomically (the file is rewritten under a temporary name and renamed), replacing a line of
    the same ``step``: a run resumed from before an evaluation it had logged logs it once."""
    path = Path(path)
    kept = [line for line in (path.read_text().splitlines() if path.is_file() else []) if _step(line) != row["step"]]
    atomic_write(path, lambda tmp: tmp.write_text("".join(f"{line}\n" for line in [*kept, json.dumps(row)])))


def _step(line: str) -> object:
    try:
        return json.loads(line).get("step")
    except (ValueError, AttributeError):  # not a JSON object: kept as it is
        return None


class GenerationEvaluation(Callback):
    """Every ``every_n_steps`` training steps, whenever a checkpoint is saved (``on_checkpoint``) and at the end of
    training, generate ``sampling.num_samples`` images with
    the module's EMA weights, update the metrics and log ``eval/<metric>`` to every logger (at the step of that batch's
    ``train/loss``, :func:`~lightning_muon.callbacks.publish.logger_step`), an
    image grid to TensorBoard, ``eval/seconds``, and a line in ``metrics.jsonl`` beside the checkpoints.

    Sample i has class ``i mod num_classes`` and seed ``seed + i`` whatever the world size; rank r generates the
    samples i ≡ r (mod W) in equal-sized batches (FSDP needs every rank in every forward), padding included and
    dropped. Reference (real) statistics are computed once per metric and cached in ``reference_dir``. Metrics and
    their weights are built in ``setup``: missing weights fail before training starts. They stay on the CPU between
    evaluations and come to the module's device for each (:func:`~lightning_muon.metrics.evaluation.metrics_on`): a
    DINOv2, CLIP, HPS network or a VLM judge takes no training GPU memory while training runs.

    The LightningModule must meet :class:`~lightning_muon.callbacks.protocols.Generator` (``generate(conditions,
    seeds, num_inference_steps, guidance_scale, batch_size=)`` → uint8 images, and ``device``); the datamodule
    :class:`~lightning_muon.callbacks.protocols.RealImages` (``real_images()``) unless ``real_images_dir`` is given.
    Both are checked in ``setup``, naming what is missing. ``examples/custom_module.py`` is a module of one's own.

    Args:
        suite: which metrics, and the local weights they are built from
            (:class:`~lightning_muon.metrics.MetricSuite`: ``metrics`` names from
            :data:`~lightning_muon.metrics.METRIC_NAMES`, ``dinov2_weights``, ``inception_weights``, ...); a dict of its
            fields works too (``--trainer.callbacks.init_args.suite.metrics``).
        sampling: how the evaluated set is generated (:class:`~lightning_muon.metrics.Sampling`: ``num_samples``,
            ``num_classes``, ``num_inference_steps``, ``guidance_scale``, ``batch_size``, ``seed``, ``prompts_file``
            — text-to-image: sample i gets prompt ``i mod lines``, needed by ``hpsv2``); or a dict of its fields.
        every_n_steps: evaluation period in optimizer steps (0: only at the end of training).
        on_checkpoint: also evaluate whenever a checkpoint is saved (once per global step).
        reference_dir: cache of reference statistics (default: ``eval_reference`` in the library's cache directory,
            ``$LIGHTNING_MUON_CACHE`` or ``~/.cache/lightning_muon``: shared by runs, keyed by the real images).
        grid_size: images in the logged grid.
        real_images_dir: an image folder with the reference images, instead of the datamodule's ``real_images()``
            (latent-shard training has no images).
        real_image_size: the side ``real_images_dir``'s images are resized and center-cropped to.
        progress: show a progress bar on rank 0.
    """

    def __init__(
        self,
        suite: MetricSuite = MetricSuite(),
        sampling: Sampling = Sampling(),
        every_n_steps: int = 500,
        on_checkpoint: bool = False,
        reference_dir: str | None = None,
        grid_size: int = 64,
        real_images_dir: str | None = None,
        real_image_size: int = 512,
        progress: bool = True,
    ) -> None:
        super().__init__()
        suite = MetricSuite(**suite) if isinstance(suite, Mapping) else suite
        sampling = Sampling(**sampling) if isinstance(sampling, Mapping) else sampling
        if every_n_steps < 0 or sampling.num_samples < 2:
            raise ValueError(
                f"every_n_steps must be >= 0 and num_samples >= 2, got {every_n_steps}, {sampling.num_samples}."
            )
        self.suite, self.sampling = suite, sampling
        self.every_n_steps, self.on_checkpoint = every_n_steps, on_checkpoint
        self.reference_dir, self.grid_size, self.progress = reference_dir, grid_size, progress
        self.metric_names = list(suite.metrics)
        self.real_images_dir, self.real_image_size = real_images_dir, real_image_size
        self.prompts: list[str] | None = None
        self.metrics: dict[str, Any] = {}
        self._last_step = -1
        self.history: list[dict[str, float]] = []
        #: whether a larger value of each logged key is better (its metric's ``higher_is_better``)
        self.higher_is_better: dict[str, bool] = {}

    @classmethod
    def upgrade_init_args(cls, init_args: Mapping[str, Any]) -> dict[str, Any]:
        """A config's ``init_args`` written before the metric suite and the sampling options became objects, in
        today's form: each flat field of :class:`~lightning_muon.metrics.MetricSuite` under ``suite``, of
        :class:`~lightning_muon.metrics.Sampling` under ``sampling``. Today's arguments pass unchanged."""
        out = dict(init_args)
        for name, kind in (("suite", MetricSuite), ("sampling", Sampling)):
            flat = {f.name: out.pop(f.name) for f in fields(kind) if f.name in out}
            if flat:
                out[name] = {**flat, **dict(out.get(name) or {})}
        return out

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.sampling.prompts_file:
            self.prompts = read_prompts(self.sampling.prompts_file)
        if "hpsv2" in self.metric_names and not self.prompts:
            raise ValueError("hpsv2 scores image-prompt pairs: pass prompts_file= (one prompt per line).")
        check_protocol(pl_module, Generator, "LightningModule")
        if not self.real_images_dir:
            check_protocol(trainer.datamodule, RealImages, "datamodule")
        self.metrics = self.suite.build()  # on the CPU: each evaluation brings them to the GPU and back (metrics_on)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A one-sample, one-step dry run of ``generate()`` (every rank: FSDP needs all of them) before the first
        training step: a module whose samples the metrics cannot read fails now, not after thousands of steps.
        (In ``setup`` the model does not exist yet: Lightning calls ``configure_model`` after the callbacks' setup.)"""
        prompts = self.prompts or [m.prompts[0].prompt for m in self.metrics.values() if isinstance(m, GenEval2)]
        condition = [prompts[0]] if prompts else torch.zeros(1, dtype=torch.long)
        images = pl_module.generate(condition, [self.sampling.seed], 1, 1.0, batch_size=1)
        check_generated_images(images)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(metrics=self.metric_names, every_n_steps=self.every_n_steps)

    def _due(self, trainer: L.Trainer) -> bool:
        """An evaluation step not yet evaluated: every ``every_n_steps``, and the last step of ``max_steps`` (so the
        final evaluation can be monitored by the checkpoint saved there)."""
        step = trainer.global_step
        last = 0 < trainer.max_steps <= step
        periodic = bool(self.every_n_steps) and step > 0 and step % self.every_n_steps == 0
        return (periodic or last) and step != self._last_step

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A run resumed at a step whose evaluation did not finish (a checkpoint written on an exception or
        preemption during it) evaluates that step now."""
        if self._due(trainer):
            self.evaluate(trainer, pl_module, monitorable=False)  # Lightning allows no step-level log() here

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self._due(trainer):
            self.evaluate(trainer, pl_module)

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        if self.on_checkpoint and trainer.training and trainer.global_step != self._last_step:
            self.evaluate(trainer, pl_module, monitorable=False)
            checkpoint.setdefault("callbacks", {})[self.state_key] = self.state_dict()  # taken before this hook

    @override
    def state_dict(self) -> dict[str, Any]:
        """The evaluations done so far (``history``: step and values), so a resumed run neither repeats nor loses
        one."""
        return {"history": list(self.history)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = list(state_dict.get("history", []))
        self._last_step = max((int(row["step"]) for row in self.history), default=-1)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.global_step != self._last_step:  # training stopped before max_steps (max_epochs, early stop)
            self.evaluate(trainer, pl_module, monitorable=False)

    def _references(self, trainer: L.Trainer) -> None:
        default = getattr(trainer.datamodule, "real_images", None)
        real, name = real_images_of(
            self.real_images_dir, self.real_image_size, default, type(trainer.datamodule).__name__
        )
        cache = Path(self.reference_dir or cache_dir() / "eval_reference")
        prepare_references(self.metrics, real, cache, name, self.sampling.batch_size)

    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule, monitorable: bool = True) -> dict[str, float]:
        """Run one evaluation now (all ranks must call it); returns the logged values (also put in
        ``trainer.callback_metrics`` when ``monitorable``, for ``ModelCheckpoint(monitor="eval/...")``)."""
        self._last_step = trainer.global_step
        update_averages(trainer, pl_module)
        desc = f"eval @ step {trainer.global_step}"
        with metrics_on(self.metrics, pl_module.device):
            self._references(trainer)
            values, grid, higher_is_better = score_generation(
                pl_module,
                self.metrics,
                self.sampling,
                self.grid_size,
                self.progress,
                desc,
                self.prompts,
            )
        self.history.append({"step": trainer.global_step, **values})
        self.higher_is_better.update(higher_is_better)
        publish_scalars(trainer, pl_module, values, monitorable)
        # on every rank: without a checkpoint callback the folder is trainer.log_dir, a broadcast
        ckpt = trainer.checkpoint_callback
        folder = Path(ckpt.dirpath) if ckpt is not None and ckpt.dirpath else Path(trainer.log_dir or ".")
        if trainer.is_global_zero:
            self._publish(trainer, values, grid, folder)
        return values

    def _publish(self, trainer: L.Trainer, values: dict[str, float], grid: Tensor | None, folder: Path) -> None:
        """Rank 0: the sample grid to the loggers, a row of ``folder/metrics.jsonl``, a log line (no collective)."""
        for logger in trainer.loggers:
            if grid is not None and hasattr(logger.experiment, "add_image"):
                logger.experiment.add_image("eval/samples", sample_grid(grid), logger_step(trainer))
        append_jsonl(folder / "metrics.jsonl", {"step": trainer.global_step, "epoch": trainer.current_epoch, **values})
        log.info("step %d: %s", trainer.global_step, ", ".join(f"{k}={v:.4g}" for k, v in values.items()))
