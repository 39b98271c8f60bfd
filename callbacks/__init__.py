"""Lightning callbacks: generation evaluation, optimizer telemetry, EMA of the weights."""

from lightning_muon.callbacks.ema import EMA
from lightning_muon.callbacks.generation import GenerationEvaluation
from lightning_muon.callbacks.telemetry import OptimizerTelemetry

__all__ = ["EMA", "GenerationEvaluation", "OptimizerTelemetry"]
