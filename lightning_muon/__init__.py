"""lightning-muon: Periodic Row-wise Muon for PyTorch Lightning.

Importing it before torch (``lightning-muon`` does) sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it:
idle OpenMP threads then sleep instead of spinning. Beside other CPU jobs the spinning cost the default run 4.34×
its CPU time (``benchmarks/default_run.py``); ``OMP_WAIT_POLICY=ACTIVE`` restores it. It reaches processes started from
this one too (Lightning's launcher for ``devices=N``), and has no effect in a process that imported torch first.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads the OpenMP runtime

from lightning_muon.optim import PeriodicRowwiseMuon, newton_schulz, row_norm, shape_factor
from lightning_muon.parallelize import find_blocks, shard_transformer
from lightning_muon.param_groups import check_param_coverage, describe_param_groups, muon_param_groups
from lightning_muon.strategy import MuonFSDPStrategy  # registers strategy="muon_fsdp"

__version__ = "0.1.0"

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
