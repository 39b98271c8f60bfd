"""``GenerationEvaluation``: sample a fixed, globally indexed set during training and log generation metrics."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor
from typing_extensions import override

from lightning_muon.callbacks.ema import EMA
from lightning_muon.callbacks.protocols import Generator, RealImages, check_protocol
from lightning_muon.callbacks.publish import logger_step, publish_scalars
from lightning_muon.checkpoint import atomic_write
from lightning_muon.metrics.features import cache_dir
from lightning_muon.metrics.generation import HPSv2Score
from lightning_muon.metrics.geneval2 import GenEval2
from lightning_muon.metrics.images import folder_images, image_set_fingerprint
from lightning_muon.metrics.presets import build_metrics
from lightning_muon.metrics.reference import ensure_references
from lightning_muon.parallelize import rank_and_world

__all__ = [
    "GenerationEvaluation",
    "append_jsonl",
    "check_generated_images",
    "flatten_metrics",
    "prepare_references",
    "sample_conditions",
    "score_generation",
]

log = logging.getLogger(__name__)


def sample_conditions(indices: Tensor, num_classes: int, seed: int) -> tuple[Tensor, Tensor]:
    """Sample i has class ``i mod num_classes`` and noise seed ``seed + i``: the same on any number of ranks."""
    return indices % num_classes, seed + indices


def read_prompts(path: str | os.PathLike) -> list[str]:
    """The prompts of a text file, one per line (blank lines skipped); an error when there are none."""
    prompts = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompts file {path} has no prompts (one per line).")
    return prompts


def check_generated_images(images: Tensor) -> None:
    """Raise unless ``images`` are what the metrics take: uint8 ``(N, 1 or 3, H, W)``."""
    if images.ndim != 4 or images.dtype != torch.uint8 or images.shape[1] not in (1, 3):
        raise ValueError(
            f"generate() returned {images.dtype} images of shape {tuple(images.shape)}; the generation metrics take "
            "uint8 (N, 1 or 3, H, W). A model trained in a latent space must decode its samples: set vae_path "
            "(DiTModule(vae_path=...), `model.vae_path` in the config) to the AutoencoderKL of the latents."
        )


def sample_grid(images: Tensor, min_size: int = 256) -> Tensor:
    """uint8 images ``(N, C, h, w)`` as one square float grid ``(3, H, W)`` in [0, 1], each image upscaled
    (nearest, by an integer factor) so the grid is at least ``min_size`` pixels wide."""
    import math

    from torchvision.utils import make_grid

    nrow = max(1, math.isqrt(len(images)))
    scale = max(1, math.ceil(min_size / (nrow * (images.shape[-1] + 1))))
    x = torch.nn.functional.interpolate(images.float() / 255, scale_factor=scale, mode="nearest")
    return make_grid(x, nrow=nrow, padding=1, pad_value=1.0)


def flatten_metrics(name: str, value: Tensor | dict[str, Tensor]) -> dict[str, float]:
    """``{"eval/<name>": v}`` for a scalar, ``{"eval/<key>": v}`` for each entry of a dict (e.g. PRDC's recall)."""
    if isinstance(value, dict):
        suffix = name.rsplit("_", 1)[-1] if "_" in name else ""
        return {f"eval/{k}_{suffix}" if suffix else f"eval/{k}": float(v) for k, v in value.items()}
    return {f"eval/{name}": float(value)}


def append_jsonl(path: str | os.PathLike, row: dict[str, Any]) -> None:
    """Append one JSON line atomically: the file is rewritten under a temporary name and renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = path.read_text() if path.is_file() else ""
    atomic_write(path, lambda tmp: tmp.write_text(old + json.dumps(row) + "\n"))


class IndexedImages(torch.utils.data.Dataset):
    """Rank ``rank``'s share (samples i ≡ rank mod W) of a set of images, as ``(image, global index)`` pairs."""

    def __init__(self, share: Any, rank: int, world: int) -> None:
        self.share, self.rank, self.world = share, rank, world

    def __len__(self) -> int:
        return len(self.share)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.share[i], self.rank + i * self.world


def prepare_references(
    metrics: dict[str, Any], real_images: Any, cache_dir: Path, data_name: str, batch_size: int
) -> None:
    """Load or compute (once, cached in ``cache_dir``) the reference statistics of every metric that has none.

    ``real_images()`` returns the real images as an indexable set of uint8 images (a tensor, or a lazy dataset such
    as :func:`~lightning_muon.metrics.images.folder_images`). The cache is keyed by the metric, the extractor's
    settings and weights and a fingerprint of the images (:func:`image_set_fingerprint`); images are decoded only
    when a cache is missing or stale, and then each rank decodes only its share i ≡ rank (mod W), once for all
    metrics.
    """
    pending = {n: m for n, m in metrics.items() if getattr(m, "reference", True) is None}
    if not pending:
        return
    from torch.utils.data import DataLoader, Subset

    rank, world = rank_and_world()
    images = real_images()
    data = {"name": data_name, "count": len(images), "fingerprint": image_set_fingerprint(images)}
    share = IndexedImages(Subset(images, range(rank, len(images), world)), rank, world)
    paths = {name: Path(cache_dir) / f"{name}_{data_name}_{len(images)}.pt" for name in pending}
    ensure_references(pending, paths, lambda: DataLoader(share, batch_size=batch_size), data, progress=False)


def _generate_share(
    module: Any,
    count: int,
    conditions_of: Callable[[Tensor], Any],
    seed: int,
    num_inference_steps: int,
    guidance_scale: float,
    batch_size: int,
    progress: bool,
    desc: str,
) -> Iterator[tuple[Tensor, Tensor]]:
    """This rank's samples i ≡ rank (mod W) of ``count``, as ``(images, global indices)`` batches: sample i is
    conditioned on ``conditions_of(i)`` with seed ``seed + i``. Every rank runs the same number of equal-sized
    batches (padded; the padding is dropped here), as FSDP needs every rank in every forward."""
    from tqdm.auto import tqdm

    rank, world = rank_and_world()
    per_rank = -(-count // world)
    indices = torch.arange(rank, per_rank * world, world)
    bar = progress and rank == 0 and sys.stderr.isatty()  # a redirected run prints LineProgress lines instead
    for b in tqdm(range(0, per_rank, batch_size), desc=desc, disable=not bar, leave=False):
        idx = indices[b : b + batch_size]
        keep = idx < count
        images = module.generate(  # padding samples repeat a real one's condition
            conditions_of(idx % count),
            (seed + idx).tolist(),
            num_inference_steps,
            guidance_scale,
            batch_size=batch_size,
        )
        yield images[keep.to(images.device)], idx[keep]


@torch.no_grad()
def score_generation(
    module: Any,
    metrics: dict[str, Any],
    num_samples: int,
    num_classes: int,
    seed: int,
    num_inference_steps: int,
    guidance_scale: float,
    batch_size: int,
    grid_size: int = 0,
    progress: bool = True,
    desc: str = "generating",
    prompts: list[str] | None = None,
) -> tuple[dict[str, float], Tensor | None]:
    """Generate the globally indexed sample set with ``module.generate`` and compute ``metrics`` on it.

    Sample i is conditioned on class ``i mod num_classes``, or with ``prompts`` on prompt ``i mod len(prompts)``
    (text-to-image; :class:`HPSv2Score` then scores image–prompt pairs); its seed is ``seed + i``. A
    :class:`GenEval2` metric gets a sample set of its own: each of its benchmark prompts, ``images_per_prompt`` times,
    with seeds ``seed + j``. Rank r generates the samples i ≡ r (mod W) (see :func:`_generate_share`). Returns
    ``{"eval/...": value, "eval/seconds"}`` and up to ``grid_size`` samples of this rank (uint8) for a grid.
    """
    start = time.perf_counter()
    for metric in metrics.values():
        metric.reset()
    sets = {name: m for name, m in metrics.items() if isinstance(m, GenEval2)}
    shared = {name: m for name, m in metrics.items() if name not in sets}
    settings = (seed, num_inference_steps, guidance_scale, batch_size, progress)
    grid: list[Tensor] = []

    def conditions_of(idx: Tensor) -> Any:
        return (
            [prompts[i % len(prompts)] for i in idx.tolist()] if prompts else sample_conditions(idx, num_classes, 0)[0]
        )

    for images, idx in _generate_share(module, num_samples if shared else 0, conditions_of, *settings, desc):
        for metric in shared.values():
            if isinstance(metric, HPSv2Score):
                metric.update(images, conditions_of(idx))
            else:  # global sample indices: order-dependent metrics (KID, IS) see the single-process order
                metric.update(images, real=False, index=idx)
        if sum(len(g) for g in grid) < grid_size:
            grid.append(images.cpu())
    for name, metric in sets.items():
        prompts_of = lambda idx, m=metric: [m.prompt_of(i).prompt for i in idx.tolist()]  # noqa: E731
        for images, idx in _generate_share(module, metric.num_samples, prompts_of, *settings, f"{desc} ({name})"):
            metric.update(images, idx)
            if sum(len(g) for g in grid) < grid_size:
                grid.append(images.cpu())
    values: dict[str, float] = {}
    for name, metric in metrics.items():
        values.update(flatten_metrics(name, metric.compute()))
    values["eval/seconds"] = time.perf_counter() - start
    return values, (torch.cat(grid)[:grid_size] if grid else None)


class GenerationEvaluation(Callback):
    """Every ``every_n_steps`` training steps, whenever a checkpoint is saved (``on_checkpoint``) and at the end of
    training, generate ``num_samples`` images with
    the module's EMA weights, update the metrics and log ``eval/<metric>`` to every logger (at the step of that batch's
    ``train/loss``, :func:`~lightning_muon.callbacks.publish.logger_step`), an
    image grid to TensorBoard, ``eval/seconds``, and a line in ``metrics.jsonl`` beside the checkpoints.

    Sample i has class ``i mod num_classes`` and seed ``seed + i`` whatever the world size; rank r generates the
    samples i ≡ r (mod W) in equal-sized batches (FSDP needs every rank in every forward), padding included and
    dropped. Reference (real) statistics are computed once per metric and cached in ``reference_dir``. Metrics and
    their weights are built in ``setup``: missing weights fail before training starts.

    The LightningModule must meet :class:`~lightning_muon.callbacks.protocols.Generator` (``generate(conditions,
    seeds, num_inference_steps, guidance_scale, batch_size=)`` → uint8 images, and ``device``); the datamodule
    :class:`~lightning_muon.callbacks.protocols.RealImages` (``real_images()``) unless ``real_images_dir`` is given.
    Both are checked in ``setup``, naming what is missing. ``examples/custom_module.py`` is a module of one's own.

    Args:
        metrics: names from :data:`lightning_muon.metrics.presets.METRIC_NAMES`.
        every_n_steps: evaluation period in optimizer steps (0: only at the end of training).
        on_checkpoint: also evaluate whenever a checkpoint is saved (once per global step).
        num_samples: generated images per evaluation.
        num_classes: classes of the conditions.
        num_inference_steps / guidance_scale: sampler settings.
        batch_size: images generated per forward pass on each rank.
        reference_dir: cache of reference statistics (default: ``eval_reference`` in the library's cache directory,
            ``$LIGHTNING_MUON_CACHE`` or ``~/.cache/lightning_muon``: shared by runs, keyed by the real images).
        grid_size: images in the logged grid.
        seed: base noise seed.
        dinov2_weights / inception_weights / clip_weights / hps_weights: local weights for those metrics.
        clip_model / hps_model: open_clip architectures of ``clip_weights`` / ``hps_weights`` (a name, or the path
            of an open_clip model-config JSON file).
        clip_quick_gelu: build the CLIP of ``cmmd`` with QuickGELU, as OpenAI's weights need (False for LAION's).
        fid_resize: ``tf1`` (torch-fidelity's resize, the default) or ``clean`` (clean-fid's PIL bicubic) for the
            InceptionV3 metrics.
        prompts_file: text-to-image evaluation: one prompt per line, sample i gets prompt ``i mod lines``
            (needed by ``hpsv2``; the module must encode prompts, e.g. ``DiTModule(text_encoder_path=...)``).
        geneval2_prompts: GenEval 2's benchmark file (the reference's ``geneval2_data.jsonl``), needed by
            ``geneval2``, which generates its own samples: each benchmark prompt, ``geneval2_images_per_prompt``
            times.
        geneval2_judge: the Soft-TIFA judge's weights (a transformers vision-language model directory or cached hub
            id; the reference's is Qwen3-VL-8B-Instruct).
        geneval2_images_per_prompt: images per GenEval 2 prompt (the reference scores one).
        real_images_dir: an image folder with the reference images, instead of the datamodule's ``real_images()``
            (latent-shard training has no images), resized and center-cropped to ``real_image_size``.
        progress: show a progress bar on rank 0.
    """

    def __init__(
        self,
        metrics: list[str] | tuple[str, ...] = ("fd_digits", "prdc_digits"),
        every_n_steps: int = 500,
        on_checkpoint: bool = False,
        num_samples: int = 1000,
        num_classes: int = 10,
        num_inference_steps: int = 25,
        guidance_scale: float = 1.0,
        batch_size: int = 250,
        reference_dir: str | None = None,
        grid_size: int = 64,
        seed: int = 0,
        dinov2_weights: str | None = None,
        inception_weights: str | None = None,
        clip_weights: str | None = None,
        hps_weights: str | None = None,
        clip_model: str = "ViT-L-14-336",
        hps_model: str = "ViT-H-14",
        clip_quick_gelu: bool = True,
        fid_resize: str = "tf1",
        prompts_file: str | None = None,
        geneval2_prompts: str | None = None,
        geneval2_judge: str | None = None,
        geneval2_images_per_prompt: int = 1,
        real_images_dir: str | None = None,
        real_image_size: int = 512,
        progress: bool = True,
    ) -> None:
        super().__init__()
        if every_n_steps < 0 or num_samples < 2:
            raise ValueError(f"every_n_steps must be >= 0 and num_samples >= 2, got {every_n_steps}, {num_samples}.")
        self.metric_names = list(metrics)
        self.every_n_steps, self.on_checkpoint = every_n_steps, on_checkpoint
        self.num_samples, self.num_classes = num_samples, num_classes
        self.num_inference_steps, self.guidance_scale, self.batch_size = num_inference_steps, guidance_scale, batch_size
        self.reference_dir, self.grid_size, self.seed, self.progress = reference_dir, grid_size, seed, progress
        self.weights = dict(
            dinov2_weights=dinov2_weights,
            inception_weights=inception_weights,
            clip_weights=clip_weights,
            hps_weights=hps_weights,
            clip_model=clip_model,
            hps_model=hps_model,
            clip_quick_gelu=clip_quick_gelu,
            fid_resize=fid_resize,
            geneval2_prompts=geneval2_prompts,
            geneval2_judge=geneval2_judge,
            geneval2_images_per_prompt=geneval2_images_per_prompt,
        )
        self.prompts_file, self.real_images_dir, self.real_image_size = prompts_file, real_images_dir, real_image_size
        self.prompts: list[str] | None = None
        self.metrics: dict[str, Any] = {}
        self._last_step = -1
        self.history: list[dict[str, float]] = []

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.prompts_file:
            self.prompts = read_prompts(self.prompts_file)
        if "hpsv2" in self.metric_names and not self.prompts:
            raise ValueError("hpsv2 scores image-prompt pairs: pass prompts_file= (one prompt per line).")
        check_protocol(pl_module, Generator, "LightningModule")
        if not self.real_images_dir:
            check_protocol(trainer.datamodule, RealImages, "datamodule")
        self.metrics = build_metrics(self.metric_names, **self.weights)
        for metric in self.metrics.values():
            metric.to(pl_module.device)

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A one-sample, one-step dry run of ``generate()`` (every rank: FSDP needs all of them) before the first
        training step: a module whose samples the metrics cannot read fails now, not after thousands of steps.
        (In ``setup`` the model does not exist yet: Lightning calls ``configure_model`` after the callbacks' setup.)"""
        prompts = self.prompts or [m.prompts[0].prompt for m in self.metrics.values() if isinstance(m, GenEval2)]
        condition = [prompts[0]] if prompts else torch.zeros(1, dtype=torch.long)
        images = pl_module.generate(condition, [self.seed], 1, 1.0, batch_size=1)
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
        if self.real_images_dir:
            real, name = (
                lambda: folder_images(self.real_images_dir, self.real_image_size),
                Path(self.real_images_dir).name,
            )
        else:
            real, name = getattr(trainer.datamodule, "real_images", None), type(trainer.datamodule).__name__
        if real is None:
            raise AttributeError("GenerationEvaluation needs real_images_dir= or a datamodule with real_images().")
        cache = Path(self.reference_dir or cache_dir() / "eval_reference")
        prepare_references(self.metrics, real, cache, name, self.batch_size)

    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule, monitorable: bool = True) -> dict[str, float]:
        """Run one evaluation now (all ranks must call it); returns the logged values (also put in
        ``trainer.callback_metrics`` when ``monitorable``, for ``ModelCheckpoint(monitor="eval/...")``)."""
        self._last_step = trainer.global_step
        for callback in trainer.callbacks:  # the average this step's checkpoint holds, whatever the callback order
            if isinstance(callback, EMA):
                callback.update(trainer, pl_module)
        self._references(trainer)
        desc = f"eval @ step {trainer.global_step}"
        values, grid = score_generation(
            pl_module,
            self.metrics,
            self.num_samples,
            self.num_classes,
            self.seed,
            self.num_inference_steps,
            self.guidance_scale,
            self.batch_size,
            self.grid_size,
            self.progress,
            desc,
            self.prompts,
        )
        self.history.append({"step": trainer.global_step, **values})
        publish_scalars(trainer, pl_module, values, monitorable)
        if trainer.is_global_zero:
            self._publish(trainer, values, grid)
        return values

    def _publish(self, trainer: L.Trainer, values: dict[str, float], grid: Tensor | None) -> None:
        for logger in trainer.loggers:
            if grid is not None and hasattr(logger.experiment, "add_image"):
                logger.experiment.add_image("eval/samples", sample_grid(grid), logger_step(trainer))
        ckpt = trainer.checkpoint_callback
        folder = Path(ckpt.dirpath) if ckpt is not None and ckpt.dirpath else Path(trainer.log_dir or ".")
        append_jsonl(folder / "metrics.jsonl", {"step": trainer.global_step, "epoch": trainer.current_epoch, **values})
        log.info("step %d: %s", trainer.global_step, ", ".join(f"{k}={v:.4g}" for k, v in values.items()))
