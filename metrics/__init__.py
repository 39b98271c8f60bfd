"""Generation-quality metrics (torchmetrics), their functional formulas and feature extractors, and GenEval 2."""

# ruff: noqa: E402 (the extra is checked before the modules that need it are imported)
from lightning_muon.extras import require

require("metrics", "lightning_muon.metrics")

from lightning_muon.metrics.evaluation import METRIC_NAMES, MetricSuite, Sampling
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
from lightning_muon.metrics.geneval2 import GenEval2, GenEval2Prompt, SoftTifaJudge, load_geneval2
from lightning_muon.metrics.reference import ensure_reference, ensure_references, update_with_images

__all__ = [
    "METRIC_NAMES",
    "ClipFeatures",
    "DigitsFeatures",
    "DinoV2Features",
    "FeatureExtractor",
    "FrechetDistance",
    "GenEval2",
    "GenEval2Prompt",
    "HPSv2Score",
    "InceptionFeatures",
    "InceptionScore",
    "KernelInceptionDistance",
    "MaximumMeanDiscrepancy",
    "MetricSuite",
    "PrecisionRecallDensityCoverage",
    "Sampling",
    "SoftTifaJudge",
    "ensure_reference",
    "ensure_references",
    "load_geneval2",
    "update_with_images",
]
