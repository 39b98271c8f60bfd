"""Lightning callbacks: generation evaluation and optimizer telemetry."""

from lightning_muon.callbacks.generation import GenerationEvaluation
from lightning_muon.callbacks.telemetry import OptimizerTelemetry

__all__ = ["GenerationEvaluation", "OptimizerTelemetry"]
