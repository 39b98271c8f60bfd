"""Lightning callbacks: generation evaluation, optimizer telemetry, EMA, step progress (a bar, or lines in a log), a
sample writer."""

from lightning_muon.callbacks.ema import EMA
from lightning_muon.callbacks.generation import GenerationEvaluation
from lightning_muon.callbacks.progress import LineProgress, StepProgressBar
from lightning_muon.callbacks.samples import SampleWriter
from lightning_muon.callbacks.telemetry import OptimizerTelemetry

__all__ = ["EMA", "GenerationEvaluation", "LineProgress", "OptimizerTelemetry", "SampleWriter", "StepProgressBar"]
