"""The calls that need a real CUDA runtime, in one place.

Everything else in this package runs unchanged on a fake CUDA device (``FakeTensorMode``), where tests catch host
synchronizations, CPU/CUDA mixes and pageable host-to-device copies without a GPU; these two are replaced there by
CPU stand-ins (``tests/fake_cuda.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HostCopy", "generator"]


def generator(device: torch.device | str, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``: what it draws is made on the device (no host copy, no stall).
    On a CPU it is the CPU generator, so CPU runs draw exactly what a CPU generator of that seed draws."""
    return torch.Generator(device=device).manual_seed(seed)


class HostCopy:
    """A device tensor's value on its way to the host without stalling the device queue: on CUDA a non-blocking copy
    into pinned memory and an event recorded after it; :meth:`value` waits for that event only."""

    def __init__(self, tensor: Tensor) -> None:
        self._ready: torch.cuda.Event | None = None
        if tensor.is_cuda:
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = tensor.detach().to("cpu", copy=True)

    def value(self) -> Tensor:
        """The host tensor (on CUDA: once the copy has landed; queued a step earlier, it normally has)."""
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._host
