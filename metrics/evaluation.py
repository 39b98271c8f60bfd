"""The evaluation engine: which metrics (:class:`MetricSuite`), their reference statistics, the sharded generation of
a globally indexed sample set, and its scores — used by :class:`~lightning_muon.callbacks.GenerationEvaluation`
during training and by ``lightning-muon evaluate`` on checkpoints, so the two score alike.

Sample i is conditioned on class ``i mod num_classes`` (or prompt ``i mod P``) with noise seed ``seed + i`` whatever
the world size; rank r generates the samples i ≡ r (mod W) in equal-sized batches (FSDP needs every rank in every
forward), padding included and dropped.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Subset
from torchmetrics import Metric

from lightning_muon.metrics.features import ClipFeatures, DigitsFeatures, DinoV2Features, InceptionFeatures
from lightning_muon.metrics.generation import (
    FrechetDistance,
    HPSv2Score,
    InceptionScore,
    KernelInceptionDistance,
    MaximumMeanDiscrepancy,
    PrecisionRecallDensityCoverage,
)
from lightning_muon.metrics.geneval2 import GenEval2
from lightning_muon.metrics.images import folder_images, image_set_fingerprint
from lightning_muon.metrics.reference import ensure_references
from lightning_muon.parallelize import rank_and_world

__all__ = [
    "METRICS",
    "METRIC_NAMES",
    "MetricSpec",
    "MetricSuite",
    "Sampling",
    "Scores",
    "check_generated_images",
    "metrics_on",
    "prepare_references",
    "read_prompts",
    "real_images_of",
    "sample_conditions",
    "score_generation",
]


class MetricSpec(NamedTuple):
    """One metric name: what it is, the :class:`MetricSuite` paths it needs, and how it is built from the suite and
    ``extractor(kind)``, the suite's shared feature networks (:data:`EXTRACTORS`)."""

    description: str
    needs: tuple[str, ...]
    build: Callable[[MetricSuite, Callable[[str], Any]], Metric]


#: Every metric name, in one place: adding a metric is one entry here (and its class in ``metrics/generation.py``).
METRICS: dict[str, MetricSpec] = {
    "fd_digits": MetricSpec(
        "Fréchet distance on digits-classifier features (offline default)", (),
        lambda s, ext: FrechetDistance(ext("digits")),
    ),
    "prdc_digits": MetricSpec(
        "precision/recall/density/coverage on digits-classifier features", (),
        lambda s, ext: PrecisionRecallDensityCoverage(ext("digits")),
    ),
    "fd_dinov2": MetricSpec(
        "FD-DINOv2 (DINOv2 ViT-L/14 CLS features)", ("dinov2_weights",),
        lambda s, ext: FrechetDistance(ext("dinov2")),
    ),
    "prdc_dinov2": MetricSpec(
        "precision/recall/density/coverage on DINOv2 features, k=5", ("dinov2_weights",),
        lambda s, ext: PrecisionRecallDensityCoverage(ext("dinov2")),
    ),
    "fid": MetricSpec(
        "FID (InceptionV3 pool3, torch-fidelity weights and resize)", ("inception_weights",),
        lambda s, ext: FrechetDistance(ext("inception")),
    ),
    "kid": MetricSpec(
        "KID (InceptionV3 pool3, torch-fidelity's 100 subsets of 1000)", ("inception_weights",),
        lambda s, ext: KernelInceptionDistance(ext("inception")),
    ),
    "is": MetricSpec(
        "Inception Score (InceptionV3 logits, 10 splits; generated images only)", ("inception_weights",),
        lambda s, ext: InceptionScore(ext("inception").view("logits")),
    ),
    "sfid": MetricSpec(
        "sFID (ADM's spatial InceptionV3 features, mixed_6/conv[:7])", ("inception_weights",),
        lambda s, ext: FrechetDistance(ext("inception").view("spatial")),
    ),
    "cmmd": MetricSpec(
        "CMMD: RBF MMD on CLIP ViT-L/14@336 embeddings", ("clip_weights",),
        lambda s, ext: MaximumMeanDiscrepancy(ext("clip")),
    ),
    "hpsv2": MetricSpec(
        "HPSv2.1 image-prompt score", ("hps_weights",),
        lambda s, ext: HPSv2Score(s.hps_weights, s.hps_model),
    ),
    "geneval2": MetricSpec(
        "GenEval 2 with Soft-TIFA (a VLM judge answers one question per prompt atom; its own prompts)",
        ("geneval2_prompts", "geneval2_judge"),
        lambda s, ext: GenEval2(s.geneval2_prompts, s.geneval2_judge, s.geneval2_images_per_prompt),
    ),
}  # fmt: skip
#: name -> (what it is, the path arguments it needs): the registry's public summary
METRIC_NAMES = {name: (spec.description, spec.needs) for name, spec in METRICS.items()}
#: the suite's shared feature networks, built once per kind
EXTRACTORS: dict[str, Callable[[MetricSuite], Any]] = {
    "digits": lambda s: DigitsFeatures(),
    "dinov2": lambda s: DinoV2Features(s.dinov2_weights),
    "inception": lambda s: InceptionFeatures(s.inception_weights, resize=s.fid_resize),
    "clip": lambda s: ClipFeatures(s.clip_weights, s.clip_model, quick_gelu=s.clip_quick_gelu),
}


def _option(help: str, default: Any = None) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class MetricSuite:
    """Which metrics to compute and the local files they are built from (this library never downloads)."""

    metrics: tuple[str, ...] = _option(
        "names from lightning_muon.metrics.evaluation.METRIC_NAMES", ("fd_digits", "prdc_digits")
    )
    dinov2_weights: str | None = _option("local DINOv2 weights (fd_dinov2, prdc_dinov2)")
    inception_weights: str | None = _option("local torch-fidelity InceptionV3 weights (fid, kid, is, sfid)")
    clip_weights: str | None = _option("local CLIP weights (cmmd)")
    hps_weights: str | None = _option("local HPSv2.1 weights (hpsv2)")
    clip_model: str = _option("open_clip architecture of clip_weights (a name or a model-config JSON)", "ViT-L-14-336")
    hps_model: str = _option("open_clip architecture of hps_weights (a name or a model-config JSON)", "ViT-H-14")
    clip_quick_gelu: bool = _option("build cmmd's CLIP with QuickGELU, as OpenAI's weights need", True)
    fid_resize: str = _option("tf1 (torch-fidelity's resize) or clean (clean-fid's PIL bicubic) for InceptionV3", "tf1")
    geneval2_prompts: str | None = _option("GenEval 2's benchmark file (geneval2_data.jsonl)")
    geneval2_judge: str | None = _option("the Soft-TIFA judge (a transformers VLM directory or cached hub id)")
    geneval2_images_per_prompt: int = _option("images per GenEval 2 prompt (the reference scores one)", 1)

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", tuple(self.metrics))

    def build(self) -> dict[str, Metric]:
        """Construct the named metrics; extractors are shared where they are the same network (one pass per batch
        feeds FD and PRDC on DINOv2, or FID, KID, IS and sFID on one InceptionV3).

        Raises:
            ValueError: an unknown name, or a name whose weights argument is missing.
            FileNotFoundError: weights that do not exist (raised by the extractor).
        """
        names = self.metrics
        for name in names:
            if name not in METRICS:
                raise ValueError(f"Unknown metric {name!r}; choose from {sorted(METRICS)}.")
            for needed in METRICS[name].needs:
                if not getattr(self, needed):
                    raise ValueError(f"Metric {name!r} needs `{needed}=` (a local path); this library never downloads.")
        cache: dict[str, object] = {}

        def extractor(kind: str):
            if kind not in cache:
                cache[kind] = EXTRACTORS[kind](self)
            return cache[kind]

        return {name: METRICS[name].build(self, extractor) for name in names}


@dataclass(frozen=True)
class Sampling:
    """How the evaluated sample set is generated (the defaults of the callback and of ``evaluate``)."""

    num_samples: int = _option("generated images per evaluation", 1000)
    num_classes: int = _option("classes of the conditions: sample i has class i mod num_classes", 10)
    num_inference_steps: int = _option("sampler steps (Euler for flow, DDIM for DDPM)", 25)
    guidance_scale: float = _option("classifier-free guidance (1 disables the unconditional pass)", 1.0)
    batch_size: int = _option("images generated per forward pass on each rank", 250)
    seed: int = _option("base noise seed: sample i has seed seed + i", 0)
    prompts_file: str | None = _option("text-to-image: one prompt per line, sample i gets prompt i mod lines")


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


def flatten_metrics(name: str, value: Tensor | dict[str, Tensor]) -> dict[str, float]:
    """``{"eval/<name>": v}`` for a scalar, ``{"eval/<key>": v}`` for each entry of a dict (e.g. PRDC's recall)."""
    if isinstance(value, dict):
        suffix = name.rsplit("_", 1)[-1] if "_" in name else ""
        return {f"eval/{k}_{suffix}" if suffix else f"eval/{k}": float(v) for k, v in value.items()}
    return {f"eval/{name}": float(value)}


class IndexedImages(torch.utils.data.Dataset):
    """Rank ``rank``'s share (samples i ≡ rank mod W) of a set of images, as ``(image, global index)`` pairs."""

    def __init__(self, share: Any, rank: int, world: int) -> None:
        self.share, self.rank, self.world = share, rank, world

    def __len__(self) -> int:
        return len(self.share)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.share[i], self.rank + i * self.world


@contextlib.contextmanager
def metrics_on(metrics: dict[str, Metric], device: torch.device) -> Iterator[None]:
    """The metrics — their networks, states and reference statistics — on ``device`` for the block, and back on the
    CPU after it (also after an error): evaluation networks (DINOv2, CLIP, HPS, a VLM judge) occupy a training GPU
    only while an evaluation runs."""
    for metric in metrics.values():
        metric.to(device)
    try:
        yield
    finally:
        for metric in metrics.values():
            metric.to("cpu")


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

    rank, world = rank_and_world()
    images = real_images()
    data = {"name": data_name, "count": len(images), "fingerprint": image_set_fingerprint(images)}
    share = IndexedImages(Subset(images, range(rank, len(images), world)), rank, world)
    paths = {name: Path(cache_dir) / f"{name}_{data_name}_{len(images)}.pt" for name in pending}
    ensure_references(pending, paths, lambda: DataLoader(share, batch_size=batch_size), data, progress=False)


def real_images_of(
    folder: str | None, size: int, default: Callable[[], Any] | None, default_name: str
) -> tuple[Callable[[], Any], str]:
    """Where the reference (real) images come from, and the name their cache is keyed by: an image ``folder``
    (resized and center-cropped to ``size``), else ``default`` (e.g. a datamodule's ``real_images``)."""
    if folder:
        return (lambda: folder_images(folder, size)), Path(folder).name
    if default is None:
        raise AttributeError("The evaluation needs real_images_dir= or a datamodule with real_images().")
    return default, default_name


def _generate_share(
    module: Any,
    count: int,
    conditions_of: Callable[[Tensor], Any],
    sampling: Sampling,
    progress: bool,
    desc: str,
) -> Iterator[tuple[Tensor, Tensor]]:
    """This rank's samples i ≡ rank (mod W) of ``count``, as ``(images, global indices)`` batches: sample i is
    conditioned on ``conditions_of(i)`` with seed ``sampling.seed + i``. Every rank runs the same number of
    equal-sized batches (padded; the padding is dropped here), as FSDP needs every rank in every forward."""
    from tqdm.auto import tqdm

    rank, world = rank_and_world()
    per_rank = -(-count // world)
    indices = torch.arange(rank, per_rank * world, world)
    bar = progress and rank == 0 and sys.stderr.isatty()  # a redirected run prints LineProgress lines instead
    batch_size = sampling.batch_size
    for b in tqdm(range(0, per_rank, batch_size), desc=desc, disable=not bar, leave=False):
        idx = indices[b : b + batch_size]
        keep = idx < count
        images = module.generate(  # padding samples repeat a real one's condition
            conditions_of(idx % count),
            (sampling.seed + idx).tolist(),
            sampling.num_inference_steps,
            sampling.guidance_scale,
            batch_size=batch_size,
        )
        yield images[keep.to(images.device)], idx[keep]


class Scores(NamedTuple):
    """One evaluation: ``{"eval/...": value, "eval/seconds"}``, up to ``grid_size`` samples of this rank (uint8), and
    for every value key whether larger is better (its metric's ``higher_is_better``)."""

    values: dict[str, float]
    grid: Tensor | None
    higher_is_better: dict[str, bool]


@torch.no_grad()
def score_generation(
    module: Any,
    metrics: dict[str, Any],
    sampling: Sampling,
    grid_size: int = 0,
    progress: bool = True,
    desc: str = "generating",
    prompts: list[str] | None = None,
) -> Scores:
    """Generate the globally indexed sample set with ``module.generate`` and compute ``metrics`` on it.

    ``sampling`` (:class:`Sampling`) says how: ``num_samples`` samples, sample i conditioned on class
    ``i mod num_classes``, or with ``prompts`` (the lines of ``sampling.prompts_file``, read once by the caller) on
    prompt ``i mod len(prompts)`` (text-to-image; :class:`HPSv2Score` then scores image–prompt pairs); its seed is
    ``seed + i``. A :class:`GenEval2` metric gets a sample set of its own: each of its benchmark prompts,
    ``images_per_prompt`` times, with seeds ``seed + j``. Rank r generates the samples i ≡ r (mod W) (see
    :func:`_generate_share`).
    """
    start = time.perf_counter()
    for metric in metrics.values():
        metric.reset()
    sets = {name: m for name, m in metrics.items() if isinstance(m, GenEval2)}
    shared = {name: m for name, m in metrics.items() if name not in sets}
    settings = (sampling, progress)
    grid: list[Tensor] = []

    def conditions_of(idx: Tensor) -> Any:
        if prompts:
            return [prompts[i % len(prompts)] for i in idx.tolist()]
        return sample_conditions(idx, sampling.num_classes, 0)[0]

    count = sampling.num_samples if shared else 0
    for images, idx in _generate_share(module, count, conditions_of, *settings, desc):
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
    higher: dict[str, bool] = {}
    for name, metric in metrics.items():
        flat = flatten_metrics(name, metric.compute())
        values.update(flat)
        higher.update(dict.fromkeys(flat, bool(metric.higher_is_better)))
    values["eval/seconds"] = time.perf_counter() - start
    return Scores(values, torch.cat(grid)[:grid_size] if grid else None, higher)
