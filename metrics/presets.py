"""Named metric sets for evaluation callbacks and the ``evaluate`` command, built from local weight files."""

from __future__ import annotations

from collections.abc import Sequence

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

__all__ = ["METRIC_NAMES", "build_metrics"]

#: name -> (what it is, the path arguments it needs)
METRIC_NAMES = {
    "fd_digits": ("Fréchet distance on digits-classifier features (offline default)", ()),
    "prdc_digits": ("precision/recall/density/coverage on digits-classifier features", ()),
    "fd_dinov2": ("FD-DINOv2 (DINOv2 ViT-L/14 CLS features)", ("dinov2_weights",)),
    "prdc_dinov2": ("precision/recall/density/coverage on DINOv2 features, k=5", ("dinov2_weights",)),
    "fid": ("FID (InceptionV3 pool3, torch-fidelity weights and resize)", ("inception_weights",)),
    "kid": ("KID (InceptionV3 pool3, torch-fidelity's 100 subsets of 1000)", ("inception_weights",)),
    "is": ("Inception Score (InceptionV3 logits, 10 splits; generated images only)", ("inception_weights",)),
    "sfid": ("sFID (ADM's spatial InceptionV3 features, mixed_6/conv[:7])", ("inception_weights",)),
    "cmmd": ("CMMD: RBF MMD on CLIP ViT-L/14@336 embeddings", ("clip_weights",)),
    "hpsv2": ("HPSv2.1 image-prompt score", ("hps_weights",)),
    "geneval2": (
        "GenEval 2 with Soft-TIFA (a VLM judge answers one question per prompt atom; its own prompts)",
        ("geneval2_prompts", "geneval2_judge"),
    ),
}


def build_metrics(
    names: Sequence[str],
    dinov2_weights: str | None = None,
    inception_weights: str | None = None,
    clip_weights: str | None = None,
    hps_weights: str | None = None,
    clip_model: str = "ViT-L-14-336",
    hps_model: str = "ViT-H-14",
    clip_quick_gelu: bool = True,
    fid_resize: str = "tf1",
    geneval2_prompts: str | None = None,
    geneval2_judge: str | None = None,
    geneval2_images_per_prompt: int = 1,
) -> dict[str, Metric]:
    """Construct the named metrics; extractors are shared where they are the same network (one pass per batch
    feeds FD and PRDC on DINOv2, or FID, KID, IS and sFID on one InceptionV3).

    ``clip_model`` / ``hps_model`` are the open_clip architectures of ``clip_weights`` / ``hps_weights`` (a name, or
    a model-config JSON path for a custom architecture); ``clip_quick_gelu`` is True for OpenAI's CLIP weights
    (CMMD's). ``fid_resize`` is ``"tf1"`` (torch-fidelity) or ``"clean"`` (clean-fid's PIL bicubic).
    ``geneval2_prompts`` is GenEval 2's ``geneval2_data.jsonl`` and ``geneval2_judge`` its judge's weights
    (:class:`~lightning_muon.metrics.geneval2.GenEval2`).

    Raises:
        ValueError: an unknown name, or a name whose weights argument is missing.
        FileNotFoundError: weights that do not exist (raised by the extractor).
    """
    paths = {
        "dinov2_weights": dinov2_weights,
        "inception_weights": inception_weights,
        "clip_weights": clip_weights,
        "hps_weights": hps_weights,
        "geneval2_prompts": geneval2_prompts,
        "geneval2_judge": geneval2_judge,
    }
    for name in names:
        if name not in METRIC_NAMES:
            raise ValueError(f"Unknown metric {name!r}; choose from {sorted(METRIC_NAMES)}.")
        for needed in METRIC_NAMES[name][1]:
            if not paths[needed]:
                raise ValueError(f"Metric {name!r} needs `{needed}=` (a local path); this library never downloads.")
    cache: dict[str, object] = {}

    def extractor(kind: str):
        if kind not in cache:
            cache[kind] = {
                "digits": lambda: DigitsFeatures(),
                "dinov2": lambda: DinoV2Features(dinov2_weights),
                "inception": lambda: InceptionFeatures(inception_weights, resize=fid_resize),
                "clip": lambda: ClipFeatures(clip_weights, clip_model, quick_gelu=clip_quick_gelu),
            }[kind]()
        return cache[kind]

    def inception(layer: str) -> InceptionFeatures:
        return extractor("inception").view(layer)

    factories = {
        "fd_digits": lambda: FrechetDistance(extractor("digits")),
        "prdc_digits": lambda: PrecisionRecallDensityCoverage(extractor("digits")),
        "fd_dinov2": lambda: FrechetDistance(extractor("dinov2")),
        "prdc_dinov2": lambda: PrecisionRecallDensityCoverage(extractor("dinov2")),
        "fid": lambda: FrechetDistance(extractor("inception")),
        "kid": lambda: KernelInceptionDistance(extractor("inception")),
        "is": lambda: InceptionScore(inception("logits")),
        "sfid": lambda: FrechetDistance(inception("spatial")),
        "cmmd": lambda: MaximumMeanDiscrepancy(extractor("clip")),
        "hpsv2": lambda: HPSv2Score(hps_weights, hps_model),
        "geneval2": lambda: GenEval2(geneval2_prompts, geneval2_judge, geneval2_images_per_prompt),
    }
    return {name: factories[name]() for name in names}
