"""lightning-muon: Periodic Row-wise Muon for PyTorch Lightning.

Importing it before torch (``lightning-muon`` does) sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it:
idle OpenMP threads then sleep instead of spinning. Beside other CPU jobs the spinning cost the default run 4.34×
its CPU time (``benchmarks/default_run.py``); ``OMP_WAIT_POLICY=ACTIVE`` restores it. It reaches processes started from
this one too (Lightning's launcher for ``devices=N``), and has no effect in a process that imported torch first.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads the OpenMP runtime

from typing import TYPE_CHECKING

from lightning.pytorch.strategies import StrategyRegistry

from lightning_muon.optim import PeriodicRowwiseMuon, newton_schulz, row_norm, shape_factor
from lightning_muon.parallelize import find_blocks, shard_transformer
from lightning_muon.param_groups import check_param_coverage, describe_param_groups, muon_param_groups

if TYPE_CHECKING:
    from lightning_muon.strategy import MuonFSDPStrategy

__version__ = "0.1.0"


def _muon_fsdp(**init_params: object) -> "MuonFSDPStrategy":
    """What ``Trainer(strategy="muon_fsdp")`` builds: the strategy module (torch.distributed.checkpoint, the
    checkpoint I/O) is imported then, not with the package."""
    from lightning_muon.strategy import MuonFSDPStrategy

    return MuonFSDPStrategy(**init_params)


if "muon_fsdp" not in StrategyRegistry:
    StrategyRegistry.register("muon_fsdp", _muon_fsdp, description="FSDP2 + PeriodicRowwiseMuon (lightning-muon)")


def __getattr__(name: str) -> object:
    if name == "MuonFSDPStrategy":  # imported on first use (see _muon_fsdp)
        from lightning_muon.strategy import MuonFSDPStrategy

        return MuonFSDPStrategy
    raise AttributeError(f"module 'lightning_muon' has no attribute {name!r}")


__all__ = [
    "MuonFSDPStrategy",
    "PeriodicRowwiseMuon",
    "check_param_coverage",
    "describe_param_groups",
    "find_blocks",
    "muon_param_groups",
    "newton_schulz",
    "row_norm",
    "shape_factor",
    "shard_transformer",
]
