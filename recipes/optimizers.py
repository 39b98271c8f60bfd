"""The recipe's optimizers and learning-rate schedules: AdamW, Muon (K = 1) or Periodic Row-wise Muon on
:func:`~lightning_muon.muon_param_groups`, under linear warm-up then cosine, constant or warm-up–stable–decay."""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

from torch import nn

from lightning_muon.optim import PeriodicRowwiseMuon
from lightning_muon.param_groups import muon_param_groups

__all__ = ["OPTIMIZERS", "LRSchedule", "Optimizer", "build_optimizer", "decay_steps", "lr_factor"]

Optimizer = Literal["adamw", "muon", "periodic_muon"]
LRSchedule = Literal["cosine", "constant", "wsd"]
OPTIMIZERS = get_args(Optimizer)


def build_optimizer(
    model: nn.Module,
    optimizer: Optimizer,
    muon: dict[str, Any],
    adamw: dict[str, Any],
    overrides: dict[str, dict[str, Any]],
) -> PeriodicRowwiseMuon:
    """``PeriodicRowwiseMuon(groups, **muon)``: for ``"adamw"`` every parameter in one AdamW group (its AdamW groups
    are torch's AdamW), else :func:`~lightning_muon.muon_param_groups` with ``adamw`` options and layer-wise
    ``overrides``."""
    if optimizer == "adamw":
        groups = [{"params": list(model.named_parameters()), "use_muon": False, **adamw}]
    else:
        groups = muon_param_groups(model, adamw=adamw, overrides=overrides)
    return PeriodicRowwiseMuon(groups, **muon)


def decay_steps(total: int, fraction: float) -> int:
    """Steps of a WSD schedule's linear decay: ``max(1, round(fraction · total))``; its stable phase ends at
    ``total − decay_steps`` (where the frontier study branches)."""
    return max(1, round(fraction * total))


def lr_factor(step: int, total: int, warmup_steps: int, schedule: LRSchedule, decay_fraction: float) -> float:
    r"""The learning rate's factor at optimizer step ``s`` of ``T``: :math:`(s+1)/w` during the warm-up, then 1
    (constant); :math:`\tfrac12(1 + \cos \pi p)` over the progress :math:`p` after the warm-up (cosine); or 1 until
    the decay's first step :math:`T - d`, then :math:`(T - s)/d`, :math:`1/d` at the last (WSD)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "wsd":
        return min(1.0, (total - step) / decay_steps(total, decay_fraction))
    progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
    return 0.5 * (1 + math.cos(math.pi * progress))
