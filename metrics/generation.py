"""torchmetrics ``Metric``s of generation quality; the formulas live in :mod:`lightning_muon.metrics.functional`.

Real-image (reference) statistics can be saved once and loaded later (:mod:`~lightning_muon.metrics.reference`).
A loaded reference is kept outside the synchronized states, so under DDP it is never summed or concatenated across
ranks, and ``reset()`` keeps it. Every metric works when some ranks are given no images, and the O(N²) metrics (PRDC,
MMD, KID) split their distance work across ranks after the one all-gather of features that torchmetrics' sync does.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from lightning_muon.metrics.features import (
    FeatureExtractor,
    clip_image_size,
    clip_mean_std,
    load_open_clip,
    open_clip_model_name,
)
from lightning_muon.metrics.functional import (
    check_mmd_inputs,
    check_prdc_inputs,
    frechet_distance,
    gaussian_from_sums,
    inception_score,
    kid_subset_values,
    knn_candidates,
    letterbox,
    merge_knn,
    mmd_from_sums,
    mmd_kernel_sums,
    prdc_counts,
    prdc_from_counts,
    preference_scores,
)
from lightning_muon.metrics.images import check_images, normalize, to_unit_float
from lightning_muon.metrics.reference import ReferenceCache, distributed
from lightning_muon.optim.transport import note_gloo_collectives

__all__ = [
    "FrechetDistance",
    "HPSv2Score",
    "InceptionScore",
    "KernelInceptionDistance",
    "MaximumMeanDiscrepancy",
    "PrecisionRecallDensityCoverage",
]


class FrechetDistance(ReferenceCache, Metric):
    r"""Fréchet distance between Gaussians fitted to features of real and generated images.

    ``FrechetDistance(DinoV2Features(...))`` is FD-DINOv2; ``FrechetDistance(InceptionFeatures(...))`` is FID and
    ``FrechetDistance(InceptionFeatures(..., layer="spatial"))`` is sFID. States are :math:`\sum x`,
    :math:`\sum xx^\top` and counts in float64 (``dist_reduce_fx="sum"``, so empty ranks add zeros);
    :func:`~lightning_muon.metrics.functional.frechet_distance` computes the distance. Fewer samples than feature
    dimensions give a singular covariance and a biased distance: a warning says so.

    Args:
        extractor: a :class:`~lightning_muon.metrics.features.FeatureExtractor`.
        reset_real_features: whether ``reset()`` also clears the real-image sums.
        kwargs: torchmetrics ``Metric`` options.
    """

    kind = "frechet"
    higher_is_better = False
    full_state_update = False

    def __init__(self, extractor: FeatureExtractor, reset_real_features: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extractor = extractor
        self.reset_real_features = reset_real_features
        self.reference = None
        d = int(extractor.num_features)
        for side in ("real", "fake"):
            self.add_state(f"{side}_sum", torch.zeros(d, dtype=torch.float64), dist_reduce_fx="sum")
            self.add_state(f"{side}_outer_sum", torch.zeros(d, d, dtype=torch.float64), dist_reduce_fx="sum")
            self.add_state(f"{side}_n", torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def _extractor(self) -> FeatureExtractor:
        return self.extractor

    def update(self, images: Tensor, real: bool, index: Tensor | Sequence[int] | None = None) -> None:
        """Add a batch (``index`` is accepted for a uniform call; sums do not depend on the order)."""
        self._check_real_update(real)
        self.update_features(self.extractor(images), real)

    def update_features(self, features: Tensor, real: bool) -> None:
        """Add precomputed extractor features ``(B, d)``."""
        side = "real" if real else "fake"
        x = features.double()
        setattr(self, f"{side}_sum", getattr(self, f"{side}_sum") + x.sum(0))
        setattr(self, f"{side}_outer_sum", getattr(self, f"{side}_outer_sum") + x.T @ x)
        setattr(self, f"{side}_n", getattr(self, f"{side}_n") + len(x))

    def reset(self) -> None:
        kept = (self.real_sum, self.real_outer_sum, self.real_n)
        super().reset()
        if not self.reset_real_features:
            self.real_sum, self.real_outer_sum, self.real_n = kept

    def _reference_from_states(self) -> dict[str, Tensor]:
        mu, sigma = gaussian_from_sums(self.real_sum, self.real_outer_sum, self.real_n)
        return {"mu": mu, "sigma": sigma, "n": self.real_n.clone()}

    def load_adm_reference(self, path: str | os.PathLike) -> None:
        """Use a reference batch of ADM's evaluator (``VIRTUAL_imagenet256_labeled.npz``; guided-diffusion): its
        ``mu``/``sigma`` (pool3), or ``mu_s``/``sigma_s`` with ``layer="spatial"`` (sFID). Read with
        ``allow_pickle=False``. Those statistics come from the TF graph that torch-fidelity's InceptionV3 ports, so
        compare FID-50K against them only with :class:`InceptionFeatures`."""
        import numpy as np

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"ADM reference batch {str(path)!r} does not exist.")
        keys = ("mu_s", "sigma_s") if getattr(self.extractor, "layer", None) == "spatial" else ("mu", "sigma")
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in keys if k not in npz.files]
            if missing:
                raise ValueError(
                    f"{str(path)!r} has no {missing} (it holds {npz.files}); is it an ADM reference batch?"
                )
            mu, sigma = (torch.from_numpy(npz[k]).double() for k in keys)
        d = int(self.extractor.num_features)
        if mu.shape != (d,) or sigma.shape != (d, d):
            raise ValueError(f"{str(path)!r} holds {tuple(mu.shape)} statistics; this metric's features are {d}-d.")
        self.set_reference({"mu": mu, "sigma": sigma, "n": torch.tensor(-1)})

    def compute(self) -> Tensor:
        real = self.reference or self._reference_from_states()
        mu, sigma = gaussian_from_sums(self.fake_sum, self.fake_outer_sum, self.fake_n)
        d = len(mu)
        small = {s: n for s, n in (("real", int(real["n"])), ("generated", int(self.fake_n))) if 0 <= n < d}
        if small:
            warnings.warn(
                f"Fréchet distance on {d}-d features from {small} samples: fewer samples than dimensions give a "
                "singular covariance and a biased, sample-size-dependent value; use at least as many samples.",
                stacklevel=2,
            )
        return frechet_distance(real["mu"], real["sigma"], mu, sigma).float()


class _FeatureLists(Metric):
    """Metric states that keep every feature vector (``dist_reduce_fx="cat"``: gathered over ranks), optionally with
    each sample's global index so that order-dependent metrics (KID's subsets, IS's splits) see the samples in the
    same order however they were split across ranks.

    A rank that saw no images contributes ``(0, d)`` tensors to the gather (torchmetrics would send a 1-D
    placeholder that does not match the other ranks' shapes).
    """

    full_state_update = False

    def _add_feature_list(self, name: str) -> None:
        self.add_state(f"{name}_features", [], dist_reduce_fx="cat")
        self.add_state(f"{name}_index", [], dist_reduce_fx="cat")

    def _append(self, name: str, features: Tensor, index: Tensor | Sequence[int] | None) -> None:
        getattr(self, f"{name}_features").append(features)
        if index is not None:
            index = torch.as_tensor(index, dtype=torch.long, device=features.device).reshape(-1)
            if len(index) != len(features):
                raise ValueError(f"Got {len(features)} images but {len(index)} indices.")
            getattr(self, f"{name}_index").append(index)

    def _sync_dist(self, dist_sync_fn: Callable = None, process_group: Any = None) -> None:
        d = int(self._extractor().num_features)
        for attr, default in self._defaults.items():
            if isinstance(default, list) and isinstance(getattr(self, attr), list) and not getattr(self, attr):
                shape, dtype = ((0, d), torch.float32) if attr.endswith("_features") else ((0,), torch.long)
                setattr(self, attr, [torch.zeros(shape, dtype=dtype, device=self.device)])
        kwargs = {"dist_sync_fn": dist_sync_fn} if dist_sync_fn is not None else {}
        super()._sync_dist(process_group=process_group, **kwargs)

    def _ordered(self, name: str) -> Tensor:
        """All features of ``name`` ``(N, d)``, sorted by their indices when every sample was given one."""
        d = int(self._extractor().num_features)
        features = _cat(getattr(self, f"{name}_features"), (-1, d), self.device)
        index = _cat(getattr(self, f"{name}_index"), (-1,), self.device)
        return features[index.argsort()] if len(index) == len(features) > 0 else features


def _cat(parts: list[Tensor] | Tensor, shape: tuple[int, ...], device: torch.device) -> Tensor:
    if isinstance(parts, Tensor):
        return parts.reshape(shape)
    return dim_zero_cat(parts).reshape(shape) if parts else torch.zeros([0, *shape[1:]], device=device)


class _FeatureSetMetric(ReferenceCache, _FeatureLists):
    """Real and generated feature sets for the k-NN and kernel metrics. ``compute`` runs on every rank after the
    gather, and :meth:`_shard` tells each rank which part of the O(N²) work is its own."""

    def __init__(self, extractor: FeatureExtractor, reset_real_features: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extractor = extractor
        self.reset_real_features = reset_real_features
        self.reference = None
        self._add_feature_list("real")
        self._add_feature_list("fake")

    def _extractor(self) -> FeatureExtractor:
        return self.extractor

    def update(self, images: Tensor, real: bool, index: Tensor | Sequence[int] | None = None) -> None:
        """Add a batch; ``index`` (optional) numbers the samples globally, so the metric sees them in that order."""
        self._check_real_update(real)
        self.update_features(self.extractor(images), real, index)

    def update_features(self, features: Tensor, real: bool, index: Tensor | Sequence[int] | None = None) -> None:
        """Add precomputed extractor features ``(B, d)``."""
        self._append("real" if real else "fake", features, index)

    def reset(self) -> None:
        kept = (self.real_features, self.real_index)
        super().reset()
        if not self.reset_real_features:
            self.real_features, self.real_index = kept

    def _reference_from_states(self) -> dict[str, Tensor]:
        return {"features": self._ordered("real")}

    def _features(self) -> tuple[Tensor, Tensor]:
        return (self.reference or self._reference_from_states())["features"], self._ordered("fake")

    def _shard(self) -> tuple[int, int]:
        """``(rank, world)`` when the features were gathered over ranks (each computes its share), else ``(0, 1)``."""
        if self._is_synced and distributed():
            group = self.process_group
            note_gloo_collectives(group)
            return dist.get_rank(group), dist.get_world_size(group)
        return 0, 1

    def _sum(self, t: Tensor) -> Tensor:
        """``t`` summed over the ranks that shared the work."""
        if self._shard()[1] > 1:
            dist.all_reduce(t, group=self.process_group)
        return t


class PrecisionRecallDensityCoverage(_FeatureSetMetric):
    """Precision, recall, density and coverage (Naeem et al. 2020) on extractor features, k-NN with ``k``.

    ``compute()`` returns ``{"precision", "recall", "density", "coverage"}``. Under DDP the k-NN blocks and the
    real rows are split across ranks: one all-gather of k-NN candidates and one all-reduce of counts.

    Args:
        extractor: a :class:`~lightning_muon.metrics.FeatureExtractor`.
        k: neighbours of the k-NN radii (Naeem et al. use 5).
        chunk_size: rows per block of the distance matrices (memory ∝ ``chunk_size`` × samples).
        kwargs: torchmetrics ``Metric`` options (``dist_sync_on_step``, ``process_group``, ...).
    """

    kind = "prdc"
    higher_is_better = True

    def __init__(self, extractor: FeatureExtractor, k: int = 5, chunk_size: int = 1024, **kwargs: Any) -> None:
        super().__init__(extractor, **kwargs)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}.")
        self.k, self.chunk_size = k, chunk_size

    def _radii(self, x: Tensor, shard: tuple[int, int]) -> Tensor:
        candidates = knn_candidates(x, self.k, self.chunk_size, shard)
        if shard[1] > 1:
            parts = [torch.empty_like(candidates) for _ in range(shard[1])]
            dist.all_gather(parts, candidates, group=self.process_group)
            candidates = torch.cat(parts, 1)
        return merge_knn(candidates, self.k)

    def compute(self) -> dict[str, Tensor]:
        real, fake = self._features()
        check_prdc_inputs(real, fake, self.k)
        shard = self._shard()
        real_radii, fake_radii = self._radii(real, shard), self._radii(fake, shard)
        rank, world = shard
        rows = range(rank * len(real) // world, (rank + 1) * len(real) // world)
        counts = self._sum(prdc_counts(real, fake, real_radii, fake_radii, self.chunk_size, rows))
        return {name: v.float() for name, v in prdc_from_counts(counts, len(real), len(fake), self.k).items()}


class MaximumMeanDiscrepancy(_FeatureSetMetric):
    r"""RBF-kernel MMD between real and generated features; with :class:`ClipFeatures` and the defaults this is CMMD.
    Under DDP each rank sums the kernel over its share of row blocks; one all-reduce of three sums.

    Args:
        extractor: a :class:`~lightning_muon.metrics.FeatureExtractor`.
        sigma: RBF bandwidth :math:`\sigma` (CMMD's 10).
        scale: factor on the MMD (CMMD's 1000).
        chunk_size: rows per kernel block, summed in float64.
        kwargs: torchmetrics ``Metric`` options.
    """

    kind = "mmd"
    higher_is_better = False

    def __init__(
        self, extractor: FeatureExtractor, sigma: float = 10.0, scale: float = 1000.0, chunk_size: int = 4096, **kwargs
    ) -> None:
        super().__init__(extractor, **kwargs)
        self.sigma, self.scale, self.chunk_size = sigma, scale, chunk_size

    def compute(self) -> Tensor:
        real, fake = self._features()
        check_mmd_inputs(real, fake)
        sums = self._sum(mmd_kernel_sums(real, fake, self.sigma, self.chunk_size, self._shard()))
        return mmd_from_sums(sums, len(real), len(fake), self.scale).float()


class KernelInceptionDistance(_FeatureSetMetric):
    """KID (Bińkowski et al. 2018) as torch-fidelity computes it: the unbiased polynomial-kernel MMD² on
    ``subsets`` random subsets of ``subset_size`` real and generated features (``numpy.random.RandomState(seed)``,
    torch-fidelity's draw order), mean and std over subsets. Under DDP the subsets are split across ranks; pass
    ``index=`` to ``update`` so the gathered samples are in the single-process order the draws refer to.

    ``compute()`` returns ``{"kid": mean, "kid_std": std}``.

    Args:
        extractor: a :class:`~lightning_muon.metrics.FeatureExtractor` (InceptionV3 pool3 for KID).
        subsets: random subsets drawn.
        subset_size: real and generated features per subset.
        degree: polynomial kernel degree.
        gamma: kernel scale (``None``: 1 / feature dimension).
        coef0: kernel offset.
        seed: seed of the subset draws.
        kwargs: torchmetrics ``Metric`` options.
    """

    kind = "kid"
    higher_is_better = False

    def __init__(
        self,
        extractor: FeatureExtractor,
        subsets: int = 100,
        subset_size: int = 1000,
        degree: int = 3,
        gamma: float | None = None,
        coef0: float = 1.0,
        seed: int = 2020,
        **kwargs: Any,
    ) -> None:
        super().__init__(extractor, **kwargs)
        if subsets < 1 or subset_size < 2:
            raise ValueError(f"KID needs subsets >= 1 and subset_size >= 2, got {subsets} and {subset_size}.")
        self.subsets, self.subset_size, self.seed = subsets, subset_size, seed
        self.degree, self.gamma, self.coef0 = degree, gamma, coef0

    def compute(self) -> dict[str, Tensor]:
        real, fake = self._features()
        values = kid_subset_values(
            real, fake, self.subsets, self.subset_size, self.degree, self.gamma, self.coef0, self.seed, self._shard()
        )
        values = self._sum(values)
        return {"kid": values.mean().float(), "kid_std": values.std(unbiased=False).float()}


class InceptionScore(_FeatureLists):
    """Inception Score of generated images as torch-fidelity computes it (``splits`` splits of the shuffled
    ``InceptionFeatures(..., layer="logits")``); needs no real images. ``compute()`` returns
    ``{"is": mean, "is_std": std}``. Pass ``index=`` to ``update`` under DDP to get the single-process order.

    Args:
        extractor: an InceptionV3 logits extractor.
        splits: splits of the generated set.
        seed: seed of the shuffle (``None``: no shuffle).
        kwargs: torchmetrics ``Metric`` options.
    """

    higher_is_better = True

    def __init__(self, extractor: FeatureExtractor, splits: int = 10, seed: int | None = 2020, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extractor, self.splits, self.seed = extractor, splits, seed
        self._add_feature_list("fake")

    def _extractor(self) -> FeatureExtractor:
        return self.extractor

    def update(self, images: Tensor, real: bool = False, index: Tensor | Sequence[int] | None = None) -> None:
        if real:
            raise ValueError("The Inception Score takes generated images only (real=False).")
        self._append("fake", self.extractor(images), index)

    def compute(self) -> dict[str, Tensor]:
        mean, std = inception_score(self._ordered("fake"), self.splits, self.seed)
        return {"is": mean.float(), "is_std": std.float()}


class HPSv2Score(Metric):
    """Human Preference Score v2.1: mean cosine similarity of open_clip image and prompt embeddings, with the
    ``hpsv2`` package's scoring recipe: ``ToTensor``, its letterbox ``ResizeMaxSize`` (the longer side bicubically
    (antialiased) to 224, the shorter padded with black, centered), OpenAI mean/std, ``ViT-H-14`` (GELU).

    Args:
        weights: the HPS v2.1 checkpoint (``HPS_v2.1_compressed.pt``), a local file.
        model_name: open_clip architecture of the checkpoint (HPS v2.1: ``"ViT-H-14"``).
        batch_size: images per forward pass.
        kwargs: torchmetrics ``Metric`` options.
    """

    higher_is_better = True
    full_state_update = False

    def __init__(
        self, weights: str | os.PathLike, model_name: str = "ViT-H-14", batch_size: int = 32, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        import open_clip

        self.model = load_open_clip(model_name, weights, quick_gelu=False)
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
        check_images(images)
        out = [torch.zeros(0, device=self.device)]
        with torch.no_grad():
            for start in range(0, len(images), self.batch_size):
                x = letterbox(to_unit_float(images[start : start + self.batch_size].to(self.device)), self.image_size)
                tokens = self.tokenizer(list(prompts[start : start + self.batch_size])).to(self.device)
                image_emb = self.model.encode_image(normalize(x, self.mean, self.std))
                out.append(preference_scores(image_emb, self.model.encode_text(tokens)))
        return torch.cat(out)

    def update(self, images: Tensor, prompts: Sequence[str]) -> None:
        s = self.scores(images, prompts)
        self.score_sum += s.double().sum()
        self.count += len(s)

    def compute(self) -> Tensor:
        if int(self.count) == 0:
            raise ValueError("HPSv2Score has no samples; call update(images, prompts) first.")
        return (self.score_sum / self.count).float()
