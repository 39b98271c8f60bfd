"""Generation-quality metrics (torchmetrics), their functional formulas and feature extractors."""

from lightning_muon.metrics.features import (
    ClipFeatures,
    DigitsFeatures,
    DinoV2Features,
    FeatureExtractor,
    InceptionFeatures,
)
from lightning_muon.metrics.generation import (
    FrechetDistance,
    HPSv2Score,
    InceptionScore,
    KernelInceptionDistance,
    MaximumMeanDiscrepancy,
    PrecisionRecallDensityCoverage,
)
from lightning_muon.metrics.reference import ensure_reference, ensure_references, update_with_images

__all__ = [
    "ClipFeatures",
    "DigitsFeatures",
    "DinoV2Features",
    "FeatureExtractor",
    "FrechetDistance",
    "HPSv2Score",
    "InceptionFeatures",
    "InceptionScore",
    "KernelInceptionDistance",
    "MaximumMeanDiscrepancy",
    "PrecisionRecallDensityCoverage",
    "ensure_reference",
    "ensure_references",
    "update_with_images",
]
