"""Every private Lightning and torch API this package uses, in one place, each with the reason no public API serves.

A new Lightning or torch release that moves one of them breaks this module, and ``tests/test_compat.py`` (run on the
newest versions and on the declared lower bounds, ``.ci/run``) says which. Nothing else in the package imports a
private name of either library. (``torch._foreach_*`` are not listed: they are torch.optim's own multi-tensor kernels,
used by every torch optimizer and stable across releases.)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    import lightning as L

__all__ = [
    "abort_process_group",
    "all_gather_single",
    "batches_that_stepped",
    "cluster_environment",
    "cpu_has_native_bf16",
    "dcp_set_element",
    "hpc_save_path",
    "init_fake_process_group",
    "logging_this_step",
    "materialize_distributed_module",
    "optimizers_to_device",
    "restarted_mid_epoch",
    "set_device_mesh",
    "set_sampler_epoch",
    "skip_sigterm_broadcast",
    "torch_muon_orthogonalize",
]


def materialize_distributed_module(module: nn.Module, device: torch.device) -> None:
    """``to_empty`` then ``reset_parameters`` of every module left on the meta device, shard by shard (Lightning's
    ``_materialize_distributed_module``; its ``ModelParallelStrategy`` does the same, and Lightning exposes no public
    function for it)."""
    from lightning.fabric.utilities.init import _materialize_distributed_module

    _materialize_distributed_module(module, device)


def optimizers_to_device(optimizers: list[torch.optim.Optimizer], device: torch.device) -> None:
    """Optimizer states moved to ``device`` after a resume (Lightning's ``_optimizers_to_device``: what its
    strategies call in ``setup``; no public equivalent)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def set_sampler_epoch(dataloader: Any, epoch: int) -> None:
    """``set_epoch`` on every sampler of a (possibly wrapped) dataloader (Lightning's ``_set_sampler_epoch``: it finds
    the samplers inside Lightning's own wrappers, which are private too)."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    _set_sampler_epoch(dataloader, epoch)


def batches_that_stepped(trainer: L.Trainer) -> int:
    """The logger step of the batch in progress — the step Lightning writes the batch's ``self.log`` values at
    (``fit_loop.epoch_loop._batches_that_stepped``; ``trainer.global_step`` counts optimizer steps, which differ
    under gradient accumulation and by one inside the batch)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def logging_this_step(trainer: L.Trainer) -> bool:
    """Whether Lightning writes the loggers at the end of the training batch in progress (``_LoggerConnector.
    should_update_logs``, every ``log_every_n_steps``, or ``fast_dev_run``): the decision its loop makes, asked the
    same way before it makes it; no public property tells it."""
    return bool(trainer._logger_connector.should_update_logs or trainer.fast_dev_run)


def skip_sigterm_broadcast(trainer: L.Trainer) -> None:
    """Switch off the SIGTERM check Lightning >= 2.6 makes before every training batch of a multi-rank run
    (``_TrainingEpochLoop._broadcast_sigterm_tensor``: a broadcast and ``.item()``, a host sync every step; Lightning
    #21487) — for a run whose :class:`~lightning_muon.callbacks.Preemption` agrees on signals itself, with
    Lightning's handlers replaced (the flag it broadcasts could never be set). Lightning 2.5 has no such check."""
    loop = trainer.fit_loop.epoch_loop
    if hasattr(loop, "_broadcast_sigterm_tensor"):
        loop._broadcast_sigterm_tensor = lambda: None


def restarted_mid_epoch(fit_loop: Any) -> bool:
    """Whether the fit loop resumed inside an epoch (``_FitLoop.restarted_mid_epoch``, Lightning >= 2.5: a property
    of a private class; the loop's progress counters alone do not tell it)."""
    return bool(fit_loop.restarted_mid_epoch)


def cluster_environment(trainer: L.Trainer) -> Any:
    """The cluster environment Lightning detected (SLURM, torchrun, …) — what its own signal handlers read
    (``trainer._accelerator_connector.cluster_environment``); single-device strategies keep none of their own."""
    return trainer._accelerator_connector.cluster_environment


def hpc_save_path(trainer: L.Trainer) -> Path:
    """Where Lightning's Slurm requeue saves, and where ``fit`` looks for a checkpoint to resume a requeued job:
    ``default_root_dir/hpc_ckpt_<N+1>.ckpt`` (``trainer._checkpoint_connector.hpc_save_path``)."""
    return Path(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))


def set_device_mesh(module: L.LightningModule, mesh: Any) -> None:
    """The mesh ``LightningModule.device_mesh`` returns in ``configure_model`` (a read-only property over
    ``_device_mesh``, which Lightning's ``ModelParallelStrategy`` sets the same way)."""
    module._device_mesh = mesh


def abort_process_group(group: Any = None) -> None:
    """Abort a process group now, unblocking collectives in flight (``distributed_c10d._abort_process_group``; torch
    has no public abort: ``destroy_process_group`` waits for them under NCCL)."""
    from torch.distributed.distributed_c10d import _abort_process_group

    _abort_process_group(group)


def init_fake_process_group(rank: int, world_size: int) -> None:
    """torch's fake process group as the default group: this one process is rank ``rank`` of ``world_size``, every
    collective returns at once without data (``torch.testing._internal.distributed.fake_pg``: what torch's own
    sharding tests trace with; no public equivalent). ``doctor`` steps the sharded transports with it on one GPU."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``dist.all_gather_single`` (torch ≥ 2.14), else ``all_gather_into_tensor``, which 2.14 deprecates."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 / AMX), not emulated (``torch.ops.mkldnn.
    _is_mkldnn_bf16_supported``: torch's CPU bf16 tests use it; ``torch.backends`` has no public query)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def dcp_set_element(root: dict[str, Any], path: Any, value: Any) -> None:
    """Put ``value`` at ``path`` in a nested state dict, as torch's ``DefaultLoadPlanner.load_bytes`` does
    (``torch.distributed.checkpoint._nested_dict.set_element``): :class:`~lightning_muon.checkpoint.SafeLoadPlanner`
    overrides ``load_bytes`` to read with ``weights_only=True`` and must place the value the same way."""
    from torch.distributed.checkpoint._nested_dict import set_element

    set_element(root, path, value)


def torch_muon_orthogonalize(x: torch.Tensor, coefficients: tuple[float, float, float], steps: int) -> torch.Tensor:
    """``torch.optim.Muon``'s own Newton–Schulz (``torch.optim._muon._zeropower_via_newtonschulz``): the reference
    ``lightning-muon doctor`` times ours against; the class exposes no function for it."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(x, coefficients, steps, 1e-7)
