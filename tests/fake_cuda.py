"""GPU bugs found on a CPU: a fake ``cuda:0`` device and a fake process group.

Inside :func:`fake_cuda` every tensor is a ``FakeTensor``: a host synchronization (``.item()``, ``bool(t)``,
``.tolist()`` of a device value) raises ``DataDependentOutputException``, mixing a CPU and a CUDA tensor raises
``FakeTensorDeviceMismatchError``, and a :class:`Watch` records what fake tensors cannot refuse but a GPU pays for:
pageable host-to-device copies (the CPU waits for the device queue to drain), multi-tensor (``_foreach_*``) calls on
lists of mixed dtypes (off CUDA's fast path) and collectives on CPU tensors (NCCL refuses them).

The two calls of :mod:`lightning_muon.device` that need a real CUDA runtime get CPU stand-ins there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import lightning_muon.device

CUDA = torch.device("cuda:0")


@dataclass
class Findings:
    """What the :class:`Watch` saw, one line per event."""

    pageable_copies: list[str] = field(default_factory=list)
    mixed_foreach: list[str] = field(default_factory=list)
    host_collectives: list[str] = field(default_factory=list)

    def clean(self) -> bool:
        return not (self.pageable_copies or self.mixed_foreach or self.host_collectives)


class Watch(TorchDispatchMode):
    """Records pageable host-to-device copies, mixed-dtype multi-tensor calls and collectives on CPU tensors."""

    def __init__(self, findings: Findings) -> None:
        super().__init__()
        self.findings = findings

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if name in ("aten::_to_copy", "aten::copy_"):
            self._copy(name, args, kwargs)
        elif name.startswith("aten::_foreach_"):
            if len({t.dtype for t in tensors if t.ndim > 0}) > 1:
                self.findings.mixed_foreach.append(f"{name} {sorted({str(t.dtype) for t in tensors})}")
        elif name.startswith("c10d::") and any(t.device.type == "cpu" for t in tensors):
            self.findings.host_collectives.append(name)
        return func(*args, **kwargs)

    def _copy(self, name: str, args, kwargs) -> None:
        if name == "aten::_to_copy":
            src, target = args[0], kwargs.get("device", args[0].device)
            non_blocking = kwargs.get("non_blocking", False)
        else:
            target, src = args[0].device, args[1]
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        to_device = torch.device(target).type == "cuda"
        if isinstance(src, torch.Tensor) and src.device.type == "cpu" and to_device and src.numel() > 0:
            if not (non_blocking and src.is_pinned()):
                self.findings.pageable_copies.append(f"{name} {tuple(src.shape)} {src.dtype}")


class FakeHostCopy:
    """:class:`lightning_muon.device.HostCopy` on a fake device: the copy is traced (a device-to-host copy, never a
    synchronization), and the value read on the host is zeros (a real tensor: fake tensors have no values)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype = tensor.shape, tensor.dtype
        tensor.to("cpu")

    def value(self) -> torch.Tensor:
        with unset_fake_temporarily():
            return torch.zeros(self.shape, dtype=self.dtype)


@contextlib.contextmanager
def fake_cuda(monkeypatch) -> Iterator[Findings]:
    """Fake CUDA tensors and the :class:`Watch` (entered inside the fake mode, so it sees fake tensors)."""
    monkeypatch.setattr(lightning_muon.device, "generator", lambda device, seed: torch.Generator().manual_seed(seed))
    monkeypatch.setattr(lightning_muon.device, "HostCopy", FakeHostCopy)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # FSDP2 asks which GPU this rank has
    findings = Findings()
    with FakeTensorMode(), Watch(findings):
        yield findings


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int) -> Iterator[None]:
    """torch's fake process group: collectives return at once without data (placement, shapes and calls only)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
