"""What :class:`~lightning_muon.callbacks.GenerationEvaluation` needs from a LightningModule and a datamodule."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class Generator(Protocol):
    """A LightningModule that samples images.

    ``generate`` is called on every rank with the same number of conditions (FSDP needs every rank in every
    forward); sample i must depend only on its condition and seed, not on the batch it is in.
    """

    device: torch.device

    def generate(
        self,
        conditions: Tensor | Sequence[str],
        seeds: Sequence[int],
        num_inference_steps: int,
        guidance_scale: float,
        batch_size: int | None = None,
    ) -> Tensor:
        """Images ``(len(seeds), C, H, W)`` as uint8 with 1 or 3 channels: ``conditions`` are class labels (long,
        on any device) or prompts; ``seeds[i]`` seeds sample i's noise; ``batch_size`` bounds one forward pass."""
        ...


@runtime_checkable
class RealImages(Protocol):
    """A datamodule that provides the reference images (unless ``real_images_dir=`` is given)."""

    def real_images(self) -> Any:
        """All real images as a uint8 tensor ``(N, C, H, W)`` or a dataset of such images."""
        ...


_MEMBERS = {"Generator": ("generate", "device"), "RealImages": ("real_images",)}


def check_protocol(obj: Any, protocol: type, role: str) -> None:
    """Raise a ``TypeError`` naming each member of ``protocol`` that ``obj`` lacks."""
    missing = [name for name in _MEMBERS[protocol.__name__] if not hasattr(obj, name)]
    if missing:
        raise TypeError(
            f"GenerationEvaluation needs the {role} ({type(obj).__name__}) to provide {', '.join(missing)} "
            f"(see lightning_muon.callbacks.protocols.{protocol.__name__})."
        )
