"""The multi-process checks of ``lightning-muon doctor``, one process per rank under torchrun (NCCL on GPUs, gloo on
CPU ranks):

    python -m torch.distributed.run --nproc-per-node 2 -m lightning_muon.recipes.doctor_worker fit --out DIR
    python -m torch.distributed.run --nproc-per-node 2 -m lightning_muon.recipes.doctor_worker fail --out DIR

``fit`` trains the default tiny DiT with ``strategy="muon_fsdp"`` (bf16-mixed on CUDA) for ``--steps`` steps, a
NaN planted in one gradient of the last rank at step 2 (every rank must skip that step), saves a distributed
checkpoint ``OUT/last.ckpt`` (or resumes from ``--ckpt-path``) and writes the full parameters and what every rank
saw. Its initial weights, noise, timesteps and data do not depend on the number of ranks, so runs on any number of
ranks train the same model.

``fail`` raises on the last rank at step 2 and writes when it did: the doctor times how long the other ranks take to
exit.

``transports`` (one process, no torchrun) steps both sharded refresh transports as rank 0 of 8 over torch's fake
process group: on a single GPU, what the multi-rank checks cannot run.

    python -m lightning_muon.recipes.doctor_worker transports --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import lightning_muon.device as device
from lightning_muon import PeriodicRowwiseMuon, compat
from lightning_muon.optim import MuonConfig
from lightning_muon.optim.shards import local
from lightning_muon.recipes.module import DiTModule
from lightning_muon.recipes.networks import build_transformer
from lightning_muon.strategy import MuonFSDPStrategy

GLOBAL_BATCH, SAMPLES, NAN_STEP = 8, 64, 2


class SameOnAnyWorld(DiTModule):
    """The default tiny DiT whose step draws noise and timesteps for the whole global batch (seeded by the step) and
    keeps this rank's samples: the model trained does not depend on the number of ranks. A constant lr: a run
    resumed for two more steps trains as one run of all of them."""

    refresh: str = "scatter"  # the refresh transport under test
    fail_at: int | None = None  # a step at which the last rank raises

    def __init__(self) -> None:
        super().__init__(cfg_dropout=0.0, ema_decay=0.0, muon=MuonConfig(ns_dtype="float32"), schedule="constant")

    def configure_model(self) -> None:
        """The full network from a fixed seed on every rank, sharded by the strategy afterwards: the same initial
        weights on any number of ranks (built on the meta device, each rank would initialize its own shard)."""
        if self.model is None:
            torch.manual_seed(0)
            self.model = build_transformer(self.hparams.architecture, self.model_config)
        super().configure_model()

    def optimizer_options(self) -> tuple[dict[str, Any], dict[str, Any]]:
        muon, adamw = super().optimizer_options()
        return {**muon, "refresh": self.refresh}, adamw

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The samples of global batch ``global_step`` (not the loader's position, which Lightning does not restore
        for a plain DataLoader on resume), this rank's share of them."""
        rank, world = self.trainer.global_rank, self.trainer.world_size
        if self.fail_at is not None and self.global_step == self.fail_at and rank == world - 1:
            raise RuntimeError(f"doctor: rank {rank} fails on purpose at step {self.global_step}")
        if not hasattr(self, "_samples"):
            self._samples = [t.to(self.device) for t in samples()]  # once, before the steps that are watched
        index = (self.global_step * GLOBAL_BATCH + torch.arange(GLOBAL_BATCH, device=self.device)) % SAMPLES
        x0, labels = (t[index[rank::world]] for t in self._samples)
        g = device.generator(self.device, self.global_step)
        noise = torch.randn((GLOBAL_BATCH, *x0.shape[1:]), generator=g, device=self.device)[rank::world]
        t = torch.rand(GLOBAL_BATCH, generator=g, device=self.device)[rank::world]
        loss = self.loss(self.model, x0, {"labels": labels}, t, noise)
        self.log("train/loss", loss, sync_dist=True)
        return loss


class PlantNaN(Callback):
    """A NaN in the first non-empty local gradient of the last rank, before the optimizer step of ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        if trainer.global_step == self.step and trainer.global_rank == trainer.world_size - 1:
            grad = next(local(p.grad) for p in pl_module.parameters() if p.grad is not None and p.grad.numel() > 0)
            grad.view(-1)[0] = float("nan")


class SyncDebug(Callback):
    """CUDA's sync debug mode "error" over the typical steps after the second — from a step's start to the next
    step's start, so Lightning's work after the callbacks is watched too — and "default" over the busy steps (optimizer
    steps that a multiple of one of ``busy_every``: the run's logging, evaluation, checkpoint and validation steps,
    which may read on the host) and after training.

    Args:
        busy_every: intervals of the run's busy steps.
    """

    def __init__(self, busy_every: list[int] | None = None) -> None:
        self.busy_every = busy_every or []

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step + 1  # the optimizer step about to run
        typical = step > 2 and not any(step % n == 0 for n in self.busy_every)
        torch.cuda.set_sync_debug_mode("error" if typical else "default")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        torch.cuda.set_sync_debug_mode("default")


def samples() -> tuple[torch.Tensor, torch.Tensor]:
    """Digits-sized images in [-1, 1] and their labels."""
    g = torch.Generator().manual_seed(0)
    return torch.rand(SAMPLES, 1, 8, 8, generator=g) * 2 - 1, torch.randint(0, 10, (SAMPLES,), generator=g)


def data() -> DataLoader:
    """What drives the steps (their samples come from :func:`samples` by global step)."""
    world = int(os.environ.get("WORLD_SIZE", 1))  # asked before Lightning joins the process group
    return DataLoader(TensorDataset(torch.arange(SAMPLES)), batch_size=GLOBAL_BATCH // world)


def trainer_for(args: argparse.Namespace, callbacks: list[Callback]) -> L.Trainer:
    cuda = torch.cuda.is_available()
    return L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        num_nodes=1,
        strategy=MuonFSDPStrategy(),
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=args.steps,
        default_root_dir=args.out,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=callbacks,
    )


def fit(args: argparse.Namespace) -> None:
    out = Path(args.out)
    callbacks: list[Callback] = [PlantNaN(NAN_STEP)]
    if args.save:  # as a run saves: at its last step, during training
        callbacks.append(ModelCheckpoint(dirpath=out, every_n_train_steps=args.steps, save_last=True, save_top_k=0))
    trainer = trainer_for(args, callbacks)
    module = SameOnAnyWorld()
    module.refresh = args.refresh
    trainer.fit(module, data(), ckpt_path=args.ckpt_path)
    opt = trainer.optimizers[0]
    seen = [None] * trainer.world_size
    refreshes = {k: v for k, v in opt.refresh_counts().items() if k.startswith("group")}
    mine = {"rank": trainer.global_rank, "skipped": opt.nonfinite_steps_skipped, "refreshes": refreshes}
    torch.distributed.all_gather_object(seen, mine)
    params = {k: v.full_tensor().float().cpu() for k, v in module.model.state_dict().items()}
    if trainer.is_global_zero:
        torch.save(params, out / "params.pt")
        (out / "ranks.json").write_text(json.dumps({"world": trainer.world_size, "ranks": seen}))


def fail(args: argparse.Namespace) -> None:
    trainer = trainer_for(args, [])
    module = SameOnAnyWorld()
    module.fail_at = NAN_STEP
    try:
        trainer.fit(module, data())
    except RuntimeError as err:
        if "fails on purpose" in str(err):
            (Path(args.out) / "raised.txt").write_text(str(time.time()))
        raise


#: the transports' matrices: tall, wide, square, fewer rows than ranks (empty shards), one row, uneven — 10, so every
#: rank of 8 owns a refresh (the fake group checks the exchange's buffers of this rank only)
SHAPES = [(64, 32), (32, 64), (40, 40), (3, 64), (1, 48), (13, 24), (48, 48), (24, 56), (56, 24), (30, 30)]


def transports(args: argparse.Namespace) -> None:
    """Both sharded refresh transports as rank 0 of 8 over torch's fake process group, on this process's one device
    (collectives return without data: placement, kernels and host syncs are what is checked): ``SHAPES`` sharded
    with FSDP2, K = 3, four steps; on CUDA every step after the first under
    ``torch.cuda.set_sync_debug_mode("error")``. Writes the collectives each transport made."""
    on = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    compat.init_fake_process_group(rank=0, world_size=8)
    mesh = init_device_mesh(on.type, (8,))
    counts = {}
    for refresh in ("gather", "scatter"):
        g = torch.Generator().manual_seed(0)
        module = nn.Module()
        module.weights = nn.ParameterList(nn.Parameter(torch.randn(shape, generator=g).to(on)) for shape in SHAPES)
        fully_shard(module, mesh=mesh)
        params = list(module.weights)
        opt = PeriodicRowwiseMuon(params, period=3, refresh=refresh)  # one bucket: this rank owns a refresh in it
        for step in range(4):
            for p in params:
                p.grad = p.detach() * 0.01 + 1.0
            if on.type == "cuda" and step:
                torch.cuda.set_sync_debug_mode("error")
            try:
                opt.step()
            finally:
                if on.type == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
        counts[refresh] = {branch: stats["collectives"] for branch, stats in opt.comm_stats().items()}
    torch.distributed.destroy_process_group()
    (Path(args.out) / "transports.json").write_text(json.dumps({"device": on.type, "collectives": counts}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning_muon.recipes.doctor_worker", description=__doc__)
    parser.add_argument("check", choices=["fit", "fail", "transports"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--refresh", default="scatter", choices=["scatter", "gather"])
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--save", action="store_true", help="save a distributed checkpoint OUT/last.ckpt at the end")
    args = parser.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    {"fit": fit, "fail": fail, "transports": transports}[args.check](args)


if __name__ == "__main__":
    main()
