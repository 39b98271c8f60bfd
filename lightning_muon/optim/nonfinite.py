r"""The step's non-finite verdict: one value, ``ok``, a 0-d bool device tensor, True when every gradient on every rank
is finite.

On the wire a rank's verdict is its *flag*, a float32 0 (finite) or NaN, so that flags add up in the all-reduce the
step runs anyway, or ride the first refresh bucket: :func:`flags_ok` reads the verdict from any set of flags, never
synchronizing with the host. ``nonfinite="skip"`` hands ``ok`` to every write (an identity where it is False);
``"raise"`` reads it once on the host and raises :class:`NonFiniteGradient`, named by :func:`culprit`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["NonFiniteGradient", "culprit", "flags_ok", "local_flag"]

HINT = "Lower the learning rate, enable gradient clipping or loss scaling, or use nonfinite='skip' to skip such steps."


class NonFiniteGradient(FloatingPointError):
    """A gradient of the step is NaN/inf (or its squares overflow float32); nothing was written."""


def local_flag(statistics: Sequence[Tensor], grads: Sequence[Tensor], device: torch.device) -> Tensor:
    """This rank's flag: 0 when the row ``statistics`` (already read, Σ N²) and every other gradient (one
    multi-tensor norm) are finite, else NaN (float32, on the device)."""
    probes = [s.sum() for s in statistics] + (list(torch._foreach_norm(list(grads))) if grads else [])
    probe = torch.stack([p.float() for p in probes]).sum() if probes else torch.zeros((), device=device)
    return torch.where(probe.isfinite(), 0.0, float("nan")).to(device)


def flags_ok(flags: Tensor) -> Tensor:
    """The verdict from the flags of every rank (or their sum): a 0-d bool device tensor, no host synchronization."""
    return flags.isfinite().all()


def culprit(named_grads: Sequence[tuple[str, Tensor]]) -> str:
    """The error message naming a local parameter whose gradient is non-finite or whose squares overflow (the
    statistics the verdict is read from); else it was on another rank. One host synchronization per gradient."""
    for name, grad in named_grads:
        if not bool(torch.isfinite(grad).all()):
            return f"Non-finite (NaN or inf) gradient in {name}. {HINT}"
    for name, grad in named_grads:
        if not bool(torch.isfinite(grad.float().square().sum())):
            return f"Gradient of {name} is finite, but its squares overflow float32 (|g| > ~1e19). {HINT}"
    return f"Non-finite (NaN or inf) or overflowing gradient in a parameter on another rank. {HINT}"
