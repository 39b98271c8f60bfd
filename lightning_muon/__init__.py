"""lightning-muon: Periodic Row-wise Muon for PyTorch Lightning."""

from lightning_muon.optim import PeriodicRowwiseMuon, newton_schulz, row_norm, shape_factor
from lightning_muon.param_groups import check_param_coverage, describe_param_groups, muon_param_groups
from lightning_muon.strategy import MuonFSDPStrategy, shard_transformer  # registers strategy="muon_fsdp"

__version__ = "0.1.0"

__all__ = [
    "MuonFSDPStrategy",
    "PeriodicRowwiseMuon",
    "check_param_coverage",
    "describe_param_groups",
    "muon_param_groups",
    "newton_schulz",
    "row_norm",
    "shape_factor",
    "shard_transformer",
]
