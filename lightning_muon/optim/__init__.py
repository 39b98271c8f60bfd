"""Optimizers and their matrix kernels."""

from lightning_muon.optim.config import AdamWConfig, MuonConfig
from lightning_muon.optim.kernels import DEFAULT_NS_COEFFICIENTS, newton_schulz, row_norm, shape_factor
from lightning_muon.optim.muon import PeriodicRowwiseMuon

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "AdamWConfig",
    "MuonConfig",
    "PeriodicRowwiseMuon",
    "newton_schulz",
    "row_norm",
    "shape_factor",
]
