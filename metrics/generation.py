"""torchmetrics ``Metric``s of generation quality; the formulas live in :mod:`lightning_muon.metrics.functional`.

Real-image (reference) statistics can be saved once and loaded later. A loaded reference is kept outside the
synchronized states, so under DDP it is never summed or concatenated across ranks, and ``reset()`` keeps it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.image.fid import FrechetInceptionDistance
from torchmetrics.utilities import dim_zero_cat

from lightning_muon.metrics.features import (
    FeatureExtractor,
    atomic_save,
    clip_image_size,
    clip_mean_std,
    load_open_clip,
    open_clip_model_name,
    resize_normalize,
    to_unit_float,
)
from lightning_muon.metrics.functional import frechet_distance, gaussian_from_sums, mmd, prdc

__all__ = [
    "FrechetDistance",
    "HPSv2Score",
    "MaximumMeanDiscrepancy",
    "PrecisionRecallDensityCoverage",
    "ensure_reference",
    "update_with_images",
]


class _ReferenceCache:
    """Save / load the real-image statistics of a metric to a file tagged with the extractor that made them."""

    kind: str

    def _extractor(self) -> FeatureExtractor:
        raise NotImplementedError

    def _reference_from_states(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def _tag(self) -> dict[str, Any]:
        extractor = self._extractor()
        return {"metric": self.kind, "extractor": extractor.name, "num_features": int(extractor.num_features)}

    def save_reference(self, path: str | os.PathLike) -> None:
        """Write the real statistics accumulated so far (all ranks take part in the sync; rank 0 writes)."""
        with self.sync_context(should_unsync=True):
            reference = self._reference_from_states()
        if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
            atomic_save({**self._tag(), "reference": {k: v.cpu() for k, v in reference.items()}}, path)

    def load_reference(self, path: str | os.PathLike) -> None:
        """Use the reference statistics in ``path`` instead of real images; ``update(..., real=True)`` is then an error.

        Raises:
            FileNotFoundError: no such file.
            ValueError: the file was made by another metric, extractor or feature size.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"Reference statistics file {str(path)!r} does not exist; create it with "
                "save_reference() after updating the metric with real images."
            )
        saved = torch.load(path, map_location="cpu", weights_only=True)
        tag = {k: saved.get(k) for k in self._tag()}
        if tag != self._tag():
            raise ValueError(
                f"Reference statistics in {str(path)!r} were made for {tag}, but this metric is "
                f"{self._tag()}. Delete the file to recompute it with the current extractor."
            )
        self.reference = {k: v.to(self.device) for k, v in saved["reference"].items()}

    def _check_real_update(self, real: bool) -> None:
        if real and self.reference is not None:
            raise RuntimeError("Reference statistics are loaded: update with generated images only (real=False).")


class FrechetDistance(_ReferenceCache, FrechetInceptionDistance):
    r"""Fréchet distance between Gaussians fitted to features of real and generated images.

    ``FrechetDistance(DinoV2Features(...))`` is FD-DINOv2; ``FrechetDistance(InceptionFeatures(...))`` is FID.
    torchmetrics' ``FrechetInceptionDistance`` accumulates :math:`\sum x`, :math:`\sum xx^\top` and counts in float64
    (``dist_reduce_fx="sum"``); :func:`~lightning_muon.metrics.functional.frechet_distance` computes the distance.

    Args:
        extractor: a :class:`~lightning_muon.metrics.features.FeatureExtractor`.
        reset_real_features: whether ``reset()`` also clears the real-image sums.
    """

    kind = "frechet"
    higher_is_better = False

    def __init__(self, extractor: FeatureExtractor, reset_real_features: bool = True, **kwargs: Any) -> None:
        super().__init__(feature=extractor, reset_real_features=reset_real_features, **kwargs)
        self.reference: dict[str, Tensor] | None = None

    def _extractor(self) -> FeatureExtractor:
        return self.inception

    def update(self, imgs: Tensor, real: bool) -> None:
        self._check_real_update(real)
        super().update(imgs, real)

    def _reference_from_states(self) -> dict[str, Tensor]:
        mu, sigma = gaussian_from_sums(
            self.real_features_sum, self.real_features_cov_sum, self.real_features_num_samples
        )
        return {"mu": mu, "sigma": sigma, "n": self.real_features_num_samples.clone()}

    def compute(self) -> Tensor:
        real = self.reference or self._reference_from_states()
        mu, sigma = gaussian_from_sums(
            self.fake_features_sum, self.fake_features_cov_sum, self.fake_features_num_samples
        )
        return frechet_distance(real["mu"], real["sigma"], mu, sigma).float()


class _FeatureSetMetric(_ReferenceCache, Metric):
    """Keeps every feature vector (``dist_reduce_fx="cat"``: gathered over ranks) for the k-NN and kernel metrics."""

    full_state_update = False

    def __init__(self, extractor: FeatureExtractor, reset_real_features: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extractor = extractor
        self.reset_real_features = reset_real_features
        self.reference: dict[str, Tensor] | None = None
        self.add_state("real_features", [], dist_reduce_fx="cat")
        self.add_state("fake_features", [], dist_reduce_fx="cat")

    def _extractor(self) -> FeatureExtractor:
        return self.extractor

    def update(self, images: Tensor, real: bool) -> None:
        self._check_real_update(real)
        (self.real_features if real else self.fake_features).append(self.extractor(images))

    def reset(self) -> None:
        real = self.real_features
        super().reset()
        if not self.reset_real_features:
            self.real_features = real

    def _reference_from_states(self) -> dict[str, Tensor]:
        return {"features": _cat(self.real_features, self.extractor.num_features)}

    def _features(self) -> tuple[Tensor, Tensor]:
        real = (self.reference or self._reference_from_states())["features"]
        return real, _cat(self.fake_features, self.extractor.num_features)


def _cat(features: list[Tensor] | Tensor, num_features: int) -> Tensor:
    if isinstance(features, Tensor):
        return features
    return dim_zero_cat(features) if features else torch.zeros((0, num_features))


class PrecisionRecallDensityCoverage(_FeatureSetMetric):
    """Precision, recall, density and coverage (Naeem et al. 2020) on extractor features, k-NN with ``k``.

    ``compute()`` returns ``{"precision", "recall", "density", "coverage"}``.
    """

    kind = "prdc"
    higher_is_better = True

    def __init__(self, extractor: FeatureExtractor, k: int = 5, chunk_size: int = 1024, **kwargs: Any) -> None:
        super().__init__(extractor, **kwargs)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}.")
        self.k, self.chunk_size = k, chunk_size

    def compute(self) -> dict[str, Tensor]:
        real, fake = self._features()
        return {name: v.float() for name, v in prdc(real, fake, self.k, self.chunk_size).items()}


class MaximumMeanDiscrepancy(_FeatureSetMetric):
    """RBF-kernel MMD between real and generated features; with :class:`ClipFeatures` and the defaults this is CMMD."""

    kind = "mmd"
    higher_is_better = False

    def __init__(self, extractor: FeatureExtractor, sigma: float = 10.0, scale: float = 1000.0, **kwargs: Any) -> None:
        super().__init__(extractor, **kwargs)
        self.sigma, self.scale = sigma, scale

    def compute(self) -> Tensor:
        real, fake = self._features()
        return mmd(real, fake, self.sigma, self.scale).float()


class HPSv2Score(Metric):
    """Human Preference Score v2.1: mean cosine similarity of open_clip image and prompt embeddings.

    Args:
        weights: the HPS v2.1 checkpoint (``HPS_v2.1_compressed.pt``), a local file.
        model_name: open_clip architecture of the checkpoint (HPS v2.1: ``"ViT-H-14"``).
        batch_size: images per forward pass.
    """

    higher_is_better = True
    full_state_update = False

    def __init__(
        self, weights: str | os.PathLike, model_name: str = "ViT-H-14", batch_size: int = 32, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        import open_clip

        self.model = load_open_clip(model_name, weights)
        self.tokenizer = open_clip.get_tokenizer(open_clip_model_name(model_name))
        self.image_size = clip_image_size(self.model)
        self.mean, self.std = clip_mean_std(self.model)
        self.batch_size = batch_size
        self.add_state("score_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def scores(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """Per-pair scores ``(B,)``."""
        if len(prompts) != len(images):
            raise ValueError(f"Got {len(images)} images but {len(prompts)} prompts; pass one prompt per image.")
        out = []
        with torch.no_grad():
            for start in range(0, len(images), self.batch_size):
                x = images[start : start + self.batch_size].to(self.device)
                x = resize_normalize(to_unit_float(x), self.image_size, self.mean, self.std)
                tokens = self.tokenizer(list(prompts[start : start + self.batch_size])).to(self.device)
                image_emb = torch.nn.functional.normalize(self.model.encode_image(x).float(), dim=-1)
                text_emb = torch.nn.functional.normalize(self.model.encode_text(tokens).float(), dim=-1)
                out.append((image_emb * text_emb).sum(-1))
        return torch.cat(out)

    def update(self, images: Tensor, prompts: Sequence[str]) -> None:
        s = self.scores(images, prompts)
        self.score_sum += s.double().sum()
        self.count += len(s)

    def compute(self) -> Tensor:
        if int(self.count) == 0:
            raise ValueError("HPSv2Score has no samples; call update(images, prompts) first.")
        return (self.score_sum / self.count).float()


def update_with_images(
    metric: Metric, batches: Iterable[Tensor], real: bool, progress: bool = True, desc: str | None = None
) -> int:
    """Feed every image batch to ``metric.update(images, real=real)`` under a tqdm bar; the number of images."""
    from tqdm.auto import tqdm

    count = 0
    total = len(batches) if hasattr(batches, "__len__") else None
    bar = tqdm(
        batches,
        total=total,
        desc=desc or ("real" if real else "generated"),
        unit="batch",
        disable=not progress,
        leave=False,
    )
    for images in bar:
        metric.update(images, real=real)
        count += len(images)
    return count


def ensure_reference(
    metric: _ReferenceCache,
    path: str | os.PathLike,
    real_batches: Callable[[], Iterable[Tensor]],
    progress: bool = True,
) -> None:
    """Load the reference statistics cached at ``path``, or compute them from ``real_batches()`` once and save them.

    Under DDP every rank must call this; each passes its own shard of the real images and rank 0 writes the file.
    """
    path = Path(path)
    if not path.is_file():
        update_with_images(metric, real_batches(), real=True, progress=progress, desc=f"reference {metric.kind}")
        metric.save_reference(path)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # the file exists for every rank before anyone loads it
    metric.load_reference(path)
    metric.reset()  # drop the per-rank real states; the loaded reference replaces them
