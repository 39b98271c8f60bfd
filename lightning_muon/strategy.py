"""``muon_fsdp``: Lightning's ``ModelParallelStrategy`` specialized for FSDP2 + PeriodicRowwiseMuon.

``Trainer(strategy="muon_fsdp")`` (or ``MuonFSDPStrategy(...)``) builds a data-parallel device mesh over all ranks
(or a replicate × shard mesh with ``hsdp=True``: replicate across nodes, shard within a node), applies
:func:`shard_transformer` unless ``configure_model`` already sharded the module, checks the Muon matrices of a
:class:`~lightning_muon.PeriodicRowwiseMuon` (any other optimizer runs as plain FSDP2), and saves / resumes through
torch.distributed.checkpoint (a resumed run may use another number of devices): saves are crash-consistent, loads
unpickle nothing but plain data, and ``ckpt_path`` may be a directory (its newest complete checkpoint) — see
:mod:`lightning_muon.checkpoint`. CPU runs use gloo, CUDA runs NCCL;
``num_nodes`` and cluster environments (torchrun, SLURM, …) work as in Lightning.

The sharding plan itself (what a block is, ``shard_transformer``, the mixed-precision policy) is in
:mod:`lightning_muon.parallelize`; this module holds Lightning's hooks, and in :class:`LoaderResume` the corrections
to Lightning's resume of a dataloader. ``setup`` follows ``ModelParallelStrategy.setup`` step for step rather than
calling it: the automatic sharding must happen before materialization, in the middle of that method, and it also
serves modules without ``configure_model`` (which ``ModelParallelStrategy.setup`` rejects).

The process group belongs to Lightning and the launcher: the strategy never destroys it nor runs a collective in
teardown (a rank that raised must not wait in a barrier for ranks that will never arrive). At interpreter exit a
still-initialized group is destroyed by an ``atexit`` hook registered in ``setup_environment``, after gloo's workers had
their exit grace. (A finished gloo run
that aborted at exit — "terminate called without an active exception" — did so because gloo's worker threads took
the GIL during finalization: :func:`~lightning_muon.optim.transport.release_gloo_workers_at_exit`.)

A rank that raises under NCCL aborts its process group at once (:meth:`MuonFSDPStrategy.on_exception`, before the
callbacks' ``on_exception``): its in-flight collectives are cancelled, so its teardown and exit cannot block on peers
that will never answer, and it exits with its own error. NCCL tells the other ranks nothing: they wait in their next
collective until the launcher stops them (torchrun stops every worker when one fails; ``srun --kill-on-bad-exit=1``
does the same under Slurm) or the group's ``timeout`` passes (docs/multi-node.md).
"""

from __future__ import annotations

import atexit
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from typing_extensions import override

import lightning_muon.compat as compat
from lightning_muon.callbacks.preemption import Preemption
from lightning_muon.checkpoint import (
    META_FILE,
    AtomicCheckpointIO,
    checkpoint_problem,
    is_distributed_checkpoint,
    load_distributed,
    on_rank_zero,
    remove_checkpoint,
    resolve_checkpoint,
    save_distributed_checkpoint,
)
from lightning_muon.optim import PeriodicRowwiseMuon
from lightning_muon.optim.shards import row_shard
from lightning_muon.optim.transport import note_gloo_collectives, release_gloo_workers_at_exit
from lightning_muon.parallelize import Blocks, MixedPrecision, default_mp_policy, shard_transformer

__all__ = ["MuonFSDPStrategy"]


def _has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _is_sharded(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


class LoaderResume:
    """Lightning's resume of a dataloader, corrected (Lightning 2.6; each fix has a test that fails without it).

    - Every rank's position is kept, not only rank 0's (``combined_loader_per_rank``): with the device count
      unchanged each rank resumes where it stopped.
    - A checkpoint taken at an epoch's last batch resumes at the next epoch's start: Lightning ends that epoch on
      restart, and the old position applied to the new epoch would skip all of it.
    - The sampler gets the resumed epoch before Lightning's first iterator (``process_dataloader``); it otherwise
      fast-forwards through the epoch-0 permutation (Lightning issue #21938).
    - After a resume mid-epoch the epoch being trained counts as started (``on_train_start``), as in an
      uninterrupted run; otherwise the next last-batch checkpoint resumes with its sampler epoch one behind (found
      by the SIGKILL test).
    """

    _resumed_epoch: int | None = None  # set when a checkpoint is loaded, used until training starts

    def _keep_loader_positions(self, checkpoint: dict[str, Any]) -> None:
        fit_state = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        if "combined_loader" in fit_state and torch.distributed.is_initialized():
            per_rank: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(per_rank, fit_state["combined_loader"])
            fit_state["combined_loader_per_rank"] = per_rank

    def _restore_loader_position(self, meta: dict[str, Any]) -> None:
        """This rank's saved position when the device count is unchanged (rank 0's otherwise), and the epoch the
        resumed run trains first."""
        fit_loop = meta.get("loops", {}).get("fit_loop", {})
        last_batch = bool(fit_loop.get("epoch_loop.batch_progress", {}).get("is_last_batch"))
        self._resumed_epoch = None
        if "epoch_progress" in fit_loop:
            self._resumed_epoch = int(fit_loop["epoch_progress"]["current"]["completed"]) + last_batch
        state = fit_loop.get("state_dict", {})
        per_rank = state.pop("combined_loader_per_rank", None)
        if per_rank is not None and len(per_rank) == self.world_size:
            state["combined_loader"] = per_rank[self.global_rank]
        if last_batch:
            state.pop("combined_loader", None)

    def process_dataloader(self, dataloader: Any) -> Any:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.training and self._resumed_epoch is not None:
            compat.set_sampler_epoch(dataloader, self._resumed_epoch)
        return dataloader

    def on_train_start(self) -> None:
        super().on_train_start()
        loop = self.lightning_module.trainer.fit_loop
        if self._resumed_epoch is not None and compat.restarted_mid_epoch(loop):
            for tracker in (loop.epoch_progress.current, loop.epoch_progress.total):
                tracker.ready = tracker.started = tracker.processed + 1
        self._resumed_epoch = None


class MuonFSDPStrategy(LoaderResume, ModelParallelStrategy):
    """FSDP2 data parallelism for PeriodicRowwiseMuon (registered as ``strategy="muon_fsdp"``).

    Args:
        hsdp: shard within a node and replicate across nodes (mesh ``(num_nodes, devices)``) instead of sharding
            over all ranks.
        mp_policy: ``MixedPrecisionPolicy`` (or :class:`MixedPrecision` by dtype names, as in a YAML config) for the
            automatic sharding (ignored when ``configure_model`` shards).
            Default: bf16 params with fp32 gradient reduction when the trainer precision is bf16
            (:func:`default_mp_policy`), no casting otherwise.
        reshard_after_forward: see :func:`shard_transformer`.
        blocks: what a transformer block is, each one FSDP2 unit (:data:`~lightning_muon.parallelize.Blocks`: a
            module name pattern, classes or class names such as ``["LlamaDecoderLayer"]``; ``None``: the repeated
            layers :func:`~lightning_muon.parallelize.find_blocks` finds). Give ``muon_param_groups`` the same.
        save_distributed_checkpoint: write torch.distributed.checkpoint directories (resumable on any device
            count); ``False`` gathers one full checkpoint file on rank 0.
        process_group_backend: ``"gloo"`` / ``"nccl"``; default by device.
        timeout: collective timeout of the process group (a ``timedelta`` or seconds). Under gloo a rank that raises
            makes the others fail at their next collective within a second (closed sockets); under NCCL they learn
            nothing and wait in it until the launcher stops them or this timeout passes (default 30 minutes) — keep
            it above the longest stretch one rank may spend alone (a checkpoint save, an evaluation's rank-0 work).
    """

    strategy_name = "muon_fsdp"

    def __init__(
        self,
        hsdp: bool = False,
        mp_policy: MixedPrecision | MixedPrecisionPolicy | None = None,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        blocks: str | list[str] | None = None,
    ) -> None:
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.checkpoint_io = AtomicCheckpointIO()  # a plugin given to the Trainer replaces it
        self.hsdp = hsdp
        self.mp_policy = mp_policy.policy() if isinstance(mp_policy, MixedPrecision) else mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.blocks: Blocks = blocks
        self._shard_mesh: DeviceMesh | None = None
        self._aborted = False

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The mesh parameters are sharded over (1-D, or (replicate, shard) with ``hsdp``)."""
        if self._shard_mesh is None:
            raise RuntimeError("The device mesh exists once the strategy's environment is set up (Trainer.fit).")
        return self._shard_mesh

    @override
    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
        note_gloo_collectives()
        atexit.unregister(_destroy_process_group_at_exit)  # registered once per process
        atexit.register(_destroy_process_group_at_exit)
        if self.hsdp:
            self._shard_mesh = init_device_mesh(
                self.root_device.type, (self.num_nodes, self.num_processes), mesh_dim_names=("replicate", "shard")
            )
        else:
            self._shard_mesh = self.device_mesh["data_parallel"]
        compat.set_device_mesh(self.lightning_module, self._shard_mesh)  # what configure_model() sees

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        if not any(isinstance(c, Preemption) for c in trainer.callbacks):
            trainer.callbacks.append(Preemption())  # signals agreed by every rank without a per-step collective
        if not any(isinstance(c, _AbortFirst) for c in trainer.callbacks):
            trainer.callbacks.insert(0, _AbortFirst())  # Lightning runs callbacks' on_exception before ours
        self.accelerator.setup(trainer)
        if any(isinstance(m, FullyShardedDataParallel) for m in self.model.modules()):
            raise TypeError(
                "Found FSDP1 (FullyShardedDataParallel) modules: muon_fsdp needs FSDP2 DTensor parameters. Use "
                "torch.distributed.fsdp.fully_shard in configure_model(), or let the strategy shard the model."
            )
        if not _is_sharded(self.model):
            mp_policy = self.mp_policy or default_mp_policy(getattr(self.precision_plugin, "precision", None))
            shard_transformer(self.model, self.shard_mesh, mp_policy, self.reshard_after_forward, self.blocks)
        # a model built on the meta device (configure_model) is materialized shard by shard, after sharding
        materialize = _has_meta_tensors(self.model)
        compat.materialize_distributed_module(self.model, self.root_device)
        if materialize and callable(hook := getattr(self.lightning_module, "on_materialized", None)):
            hook()  # re-initialize what reset_parameters() does not cover
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            self._check_optimizers()
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            compat.optimizers_to_device(self.optimizers, self.root_device)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Under NCCL (alone or in a mixed ``"cpu:gloo,cuda:nccl"`` group) abort the process group now: a rank that
        raised must not block in teardown or at exit on collectives its peers will never finish (gloo's failing
        sockets already end them). Not for :class:`SIGTERMException`, which every rank raises at the same step
        (:class:`~lightning_muon.callbacks.Preemption`): collectives still work there. Runs once, first: Lightning
        calls the callbacks' ``on_exception`` before the strategy's, and a callback's collective there (an
        ``OnExceptionCheckpoint`` save) would block this rank before the abort — ``_AbortFirst``, the first
        callback, calls this hook before them."""
        if self._aborted or isinstance(exception, SIGTERMException) or not torch.distributed.is_initialized():
            return
        if "nccl" in str(torch.distributed.get_backend()):
            self._aborted = True
            compat.abort_process_group()

    def _check_optimizers(self) -> None:
        """Muon matrices must be row-sharded DTensors (checked now, naming the parameter, not at the first step);
        any other optimizer steps the FSDP2 shards as plain FSDP2."""
        for optimizer in self.optimizers:
            if not isinstance(optimizer, PeriodicRowwiseMuon):
                rank_zero_info(
                    f"muon_fsdp: {type(optimizer).__name__} steps the FSDP2-sharded parameters as plain "
                    "FSDP2 (no Muon branch)."
                )
                continue
            for group in optimizer.param_groups:
                if not group["use_muon"]:
                    continue
                for i, p in enumerate(group["params"]):
                    name = (group.get("param_names") or [f"#{i}"] * (i + 1))[i]
                    if not isinstance(p, DTensor):
                        raise TypeError(
                            f"Muon parameter {name} {tuple(p.shape)} is not a DTensor: under muon_fsdp "
                            "every matrix must be sharded with FSDP2 fully_shard (not FSDP1 flat "
                            "parameters, not left unsharded). Build the optimizer from the module's "
                            "parameters after sharding (configure_optimizers)."
                        )
                    try:
                        row_shard(p)
                    except ValueError as err:
                        raise ValueError(f"Muon parameter {name}: {err}") from err

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """Crash-consistent saves: a distributed checkpoint is written beside its target and renamed into place when
        complete (:func:`~lightning_muon.checkpoint.save_distributed_checkpoint`); a full one is written by rank 0
        through ``checkpoint_io`` (:class:`~lightning_muon.checkpoint.AtomicCheckpointIO`). A failure on rank 0 is
        raised on every rank. Every rank's dataloader position is kept (``combined_loader_per_rank``)."""
        if storage_options is not None:
            raise TypeError("muon_fsdp writes checkpoints itself: storage_options is not supported.")
        path = Path(self.broadcast(str(filepath)))
        self._keep_loader_positions(checkpoint)
        if not self._save_distributed_checkpoint:

            def save() -> None:
                if path.is_dir():
                    remove_checkpoint(path)
                self.checkpoint_io.save_checkpoint(checkpoint, path)

            on_rank_zero(save, self.global_rank, self.broadcast)
            return
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        save_distributed_checkpoint(state, checkpoint, path, self.global_rank, self.broadcast)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Resume from a checkpoint, or from the newest complete one under a directory. Nothing is unpickled beyond
        tensors and plain containers; an incomplete or damaged checkpoint is refused before any state is touched.
        Each rank gets back its own dataloader position when the device count is unchanged."""
        path = self._checkpoint_chosen_by_rank_zero(checkpoint_path)
        if not is_distributed_checkpoint(path):
            meta = super().load_checkpoint(path, weights_only=True)
        else:
            assert self.model is not None and self.lightning_module is not None
            model_state = {"state_dict": get_model_state_dict(self.model)}
            load_distributed(model_state, path)
            self.model.load_state_dict(model_state["state_dict"], strict=self.lightning_module.strict_loading)
            for i, optimizer in enumerate(self.optimizers):
                key = f"optimizer_{i}"
                optim_state = {key: get_optimizer_state_dict(self.model, optimizer)}
                load_distributed(optim_state, path)
                set_optimizer_state_dict(
                    self.model, optimizer, optim_state_dict=optim_state[key], options=StateDictOptions(cpu_offload=True)
                )
            meta = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
        self._restore_loader_position(meta)
        return meta

    def _checkpoint_chosen_by_rank_zero(self, checkpoint_path: Any) -> Path:
        """The checkpoint every rank loads: rank 0 alone resolves a directory to its newest complete checkpoint and
        checks it, then broadcasts the path or the error. Ranks resolving for themselves can pick different steps
        (a listing racing rank 0's restore of an interrupted replacement, a lagging network file system) and load
        a mixed state without any error.

        Raises:
            FileNotFoundError: the directory holds no complete checkpoint (on every rank).
            ValueError: the checkpoint is incomplete or damaged (on every rank).
        """
        decision: tuple[str | None, str | None, bool] = (None, None, False)
        if self.is_global_zero:
            try:
                path = resolve_checkpoint(checkpoint_path)
                problem = checkpoint_problem(path) if is_distributed_checkpoint(path) else None
                decision = (str(path), problem, False)
            except FileNotFoundError as err:
                decision = (None, str(err), True)
        found, problem, missing = self.broadcast(decision)
        if missing:
            raise FileNotFoundError(problem)
        if problem:
            raise ValueError(
                f"Cannot resume from {found}: {problem}. Pass the checkpoint directory instead to "
                "resume from the newest complete checkpoint in it."
            )
        return Path(found)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="FSDP2 + PeriodicRowwiseMuon (lightning-muon)")


class _AbortFirst(Callback):
    """The first callback of a ``muon_fsdp`` run: its ``on_exception`` is the strategy's, before any other's."""

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        trainer.strategy.on_exception(exception)


def _destroy_process_group_at_exit() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # registered after the transport's exit hook, so it runs first (atexit is LIFO): give gloo's workers their
        # grace here, while the group exists — after destroy_process_group that hook sees no group and skips it
        release_gloo_workers_at_exit()
        torch.distributed.destroy_process_group()


if MuonFSDPStrategy.strategy_name not in StrategyRegistry:
    MuonFSDPStrategy.register_strategies(StrategyRegistry)
