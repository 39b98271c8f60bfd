"""Lightning callbacks: generation evaluation, optimizer telemetry, EMA, step progress (a bar, or lines in a log), a
sample writer, signals acted on between steps (pre-emption).

Each is imported on first use (``from lightning_muon.callbacks import Preemption`` loads the pre-emption module only):
the core install — the optimizer and ``muon_fsdp``, which adds :class:`Preemption` to a run — never loads the
metrics' stack that :class:`GenerationEvaluation` brings.
"""

import importlib
from typing import TYPE_CHECKING

#: each public name and the module that defines it
_MODULES = {
    "EMA": "ema",
    "GenerationEvaluation": "generation",
    "Generator": "protocols",
    "LineProgress": "progress",
    "OptimizerTelemetry": "telemetry",
    "Preemption": "preemption",
    "RealImages": "protocols",
    "SampleWriter": "samples",
    "StepProgressBar": "progress",
}

__all__ = [
    "EMA",
    "GenerationEvaluation",
    "Generator",
    "LineProgress",
    "OptimizerTelemetry",
    "Preemption",
    "RealImages",
    "SampleWriter",
    "StepProgressBar",
]

if TYPE_CHECKING:  # what type checkers and the API reference see
    from lightning_muon.callbacks.ema import EMA
    from lightning_muon.callbacks.generation import GenerationEvaluation
    from lightning_muon.callbacks.preemption import Preemption
    from lightning_muon.callbacks.progress import LineProgress, StepProgressBar
    from lightning_muon.callbacks.protocols import Generator, RealImages
    from lightning_muon.callbacks.samples import SampleWriter
    from lightning_muon.callbacks.telemetry import OptimizerTelemetry


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(f"module 'lightning_muon.callbacks' has no attribute {name!r}")
    return getattr(importlib.import_module(f"lightning_muon.callbacks.{_MODULES[name]}"), name)


def __dir__() -> list[str]:
    return __all__
