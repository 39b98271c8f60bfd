"""Signals act between optimizer steps: SIGTERM stops the run, Slurm's requeue signal saves a checkpoint, each at the
next step boundary, on every rank together."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from pathlib import Path
from types import FrameType

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

import lightning_muon.compat as compat
from lightning_muon.callbacks.ema import update_averages

log = logging.getLogger(__name__)

#: the exit code of a process ended by SIGTERM (128 + 15): a pre-empted run never reports success
SIGTERM_EXIT = 128 + signal.SIGTERM


class Preemption(Callback):
    """Replaces Lightning's signal handlers (installed at ``fit``) with ones that only take note; the work is done at
    the end of an agreement step (``on_train_batch_end``, with the step's EMA update; the stop before the next step,
    after the step's checkpoints), after one all-reduce of the flags so every rank acts at the same step.

    Why: Lightning's SLURM handler saves ``hpc_ckpt_N.ckpt`` from inside the signal handler, wherever the signal
    lands — between an optimizer step and its EMA update, even inside the step — a checkpoint whose parts are from
    different steps, which resumes inexactly (measured: 2.9e-6 on the EMA, ``benchmarks/faults.py --matrix``); its
    SIGTERM handler broadcasts from inside the handler (a collective interleaved with whatever collective is in
    flight) and, on one process, stops only at the end of the epoch and exits 0. Here:

    - **SIGTERM** (Slurm's and torchrun's stop): training stops before the next step with
      :class:`~lightning.pytorch.utilities.exceptions.SIGTERMException`, exit code 143 under ``lightning-muon``, and
      a line naming the step and how to resume; a checkpoint being written when it arrived is completed.
    - **Slurm's requeue signal** (``SLURMEnvironment(auto_requeue=True)``, SIGUSR1 by default,
      ``#SBATCH --signal=USR1@90``): ``hpc_ckpt_N.ckpt`` in ``default_root_dir`` (through the strategy's
      crash-consistent writer), then ``scontrol requeue``; training goes on until Slurm stops it (SIGTERM).

    Agreement steps are the steps Lightning writes the loggers (every ``log_every_n_steps``), or every
    ``every_n_steps`` optimizer steps: the steps between make no collective and no host read (an all-reduce read on
    the host every step would stall a GPU every step). **Worst-case delay**: a signal is acted on within
    ``every_n_steps`` (or ``log_every_n_steps``; every step when logging is off) steps of the step it arrived in.
    Keep that many steps well inside the time Slurm gives between SIGTERM and SIGKILL (``KillWait``, 30 s by
    default) and before the requeue signal's deadline (``--signal=USR1@90``). One process needs no agreement and
    acts at the next step. Lightning >= 2.6's own per-step SIGTERM broadcast is switched off while this callback runs
    (:func:`~lightning_muon.compat.skip_sigterm_broadcast`): its flag could never be set once the handlers are
    replaced. ``muon_fsdp`` adds this callback to a run that has none.

    Args:
        every_n_steps: optimizer steps between agreements of a multi-rank run (default: the logging steps).
    """

    def __init__(self, every_n_steps: int | None = None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 (or None: the logging steps), got {every_n_steps}.")
        self.every_n_steps = every_n_steps
        self._flags = {"stop": False, "requeue": False}
        self._stop = False

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._flags, self._stop = {"stop": False, "requeue": False}, False
        environment = compat.cluster_environment(trainer)  # what Lightning's own handlers read
        if isinstance(environment, SLURMEnvironment) and environment.auto_requeue:
            signal.signal(environment.requeue_signal or signal.SIGUSR1, self._take_note("requeue"))
        signal.signal(signal.SIGTERM, self._take_note("stop", trainer))
        compat.skip_sigterm_broadcast(trainer)

    def _take_note(self, flag: str, trainer: L.Trainer | None = None):
        def handler(signum: int, frame: FrameType | None) -> None:
            log.info("Received %s: acting on it before the next step.", signal.Signals(signum).name)
            launcher = trainer.strategy.launcher if trainer is not None else None
            if flag == "stop" and not self._flags["stop"] and launcher is not None:
                launcher.kill(signum)  # the ranks this process launched itself, as Lightning does
            self._flags[flag] = True

        return handler

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        if not self._agreement_step(trainer):
            return
        self._stop, requeue = self._agreed(trainer)
        if requeue:
            self._flags["requeue"] = False
            self._save_and_requeue(trainer, pl_module)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: object, i: int) -> None:
        if self._stop:
            raise SIGTERMException(SIGTERM_EXIT)

    def _agreement_step(self, trainer: L.Trainer) -> bool:
        """Every step of one process; else every ``every_n_steps`` optimizer steps, or the logging steps. The same
        answer on every rank (it depends on the step only)."""
        if trainer.world_size == 1:
            return True
        if self.every_n_steps is not None:
            return trainer.global_step % self.every_n_steps == 0
        return trainer.log_every_n_steps == 0 or compat.logging_this_step(trainer)

    def _agreed(self, trainer: L.Trainer) -> tuple[bool, bool]:
        """The flags, any rank's (one all-reduce when there are several ranks)."""
        flags = [self._flags["stop"], self._flags["requeue"]]
        if trainer.world_size > 1 and torch.distributed.is_initialized():
            t = torch.tensor(flags, dtype=torch.int32, device=trainer.strategy.root_device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            flags = [bool(v) for v in t.tolist()]
        return flags[0], flags[1]

    def _save_and_requeue(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        update_averages(trainer, pl_module)
        path = compat.hpc_save_path(trainer)
        trainer.save_checkpoint(path)
        rank_zero_info(f"Slurm pre-emption: saved {path} at step {trainer.global_step}.")
        if trainer.is_global_zero:
            job = os.environ.get("SLURM_JOB_ID", "")
            if os.environ.get("SLURM_ARRAY_JOB_ID"):
                job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ.get('SLURM_ARRAY_TASK_ID', '')}"
            try:
                code = subprocess.call(["scontrol", "requeue", job])
            except FileNotFoundError:
                code = None
            if code != 0:
                rank_zero_warn(f"Slurm pre-emption: `scontrol requeue {job}` failed ({code}); requeue the job yourself")

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            where = ""
            ckpt = trainer.checkpoint_callback
            if ckpt is not None and getattr(ckpt, "dirpath", None):
                where = f"; resume with --ckpt_path {Path(ckpt.dirpath)} (its newest complete checkpoint)"
            rank_zero_info(f"Stopped by SIGTERM before step {trainer.global_step + 1}{where}.")
