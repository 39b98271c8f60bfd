"""Lightning callbacks: generation evaluation, optimizer telemetry, EMA, step progress (a bar, or lines in a log), a
sample writer, signals acted on between steps (pre-emption)."""

from lightning_muon.callbacks.ema import EMA
from lightning_muon.callbacks.generation import GenerationEvaluation
from lightning_muon.callbacks.preemption import Preemption
from lightning_muon.callbacks.progress import LineProgress, StepProgressBar
from lightning_muon.callbacks.samples import SampleWriter
from lightning_muon.callbacks.telemetry import OptimizerTelemetry

__all__ = [
    "EMA",
    "GenerationEvaluation",
    "LineProgress",
    "OptimizerTelemetry",
    "Preemption",
    "SampleWriter",
    "StepProgressBar",
]
