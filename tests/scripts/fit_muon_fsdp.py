"""Fit a tiny diffusers DiT with Trainer(strategy="muon_fsdp") on CPU; rank 0 writes per-step loss and branches.

Run by tests/core/test_strategy.py as a subprocess (Lightning re-launches the script once per extra device):

    python tests/scripts/fit_muon_fsdp.py --devices 2 --epochs 1 --root DIR --record out.json [--ckpt-path CKPT]
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parents[1]))
from helpers import tiny_dit  # noqa: E402

from lightning_muon import PeriodicRowwiseMuon, muon_param_groups  # noqa: E402

GLOBAL_BATCH, SAMPLES = 8, 48  # 6 optimizer steps per epoch


class TinyFlowDiT(L.LightningModule):
    """Rectified-flow loss on a tiny class-conditional DiT; noise and timesteps come with each sample."""

    def __init__(self, optimizer: str = "muon", partial_shard: bool = False, shard: bool = False) -> None:
        super().__init__()
        self.optimizer, self.partial_shard, self.shard = optimizer, partial_shard, shard
        self.model = tiny_dit()
        for m in self.model.modules():  # no random label dropout: the loss must not depend on the world size
            if hasattr(m, "dropout_prob"):
                m.dropout_prob = 0.0

    def training_step(self, batch, batch_idx):
        x0, noise, t, y = batch
        xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        pred = self.model(xt, timestep=t * 999, class_labels=y).sample
        loss = torch.nn.functional.mse_loss(pred, noise - x0)
        self.log("train_loss", loss, sync_dist=True, on_step=True, prog_bar=True)
        return loss

    def configure_model(self):
        if self.shard:  # Lightning's own ModelParallelStrategy leaves sharding to the module
            from lightning_muon import shard_transformer

            shard_transformer(self, self.device_mesh["data_parallel"])
        if self.partial_shard:  # a user sharding by hand and forgetting a block: its matrices stay plain tensors
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.model.transformer_blocks[1], mesh=self.device_mesh)

    def configure_optimizers(self):
        if self.optimizer == "adamw":
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        groups = muon_param_groups(self.model, adamw={"lr": 1e-3})
        adaptive = (
            {"schedule": "adaptive", "drift_threshold": 0.5, "max_period": 4} if self.optimizer == "adaptive" else {}
        )
        return PeriodicRowwiseMuon(groups, lr=0.02, period=3, weight_decay=0.01, ns_dtype=torch.float32, **adaptive)


class Record(Callback):
    def __init__(self, path: str) -> None:
        self.path, self.rows = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = trainer.optimizers[0]
        self.rows.append(
            {
                "step": trainer.global_step,
                "loss": float(trainer.callback_metrics["train_loss"]),
                "branches": dict(getattr(opt, "last_branches", {})),
                "refreshes": opt.refresh_counts() if hasattr(opt, "refresh_counts") else {},
                "world": trainer.world_size,
            }
        )

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(self.rows))


class SigtermAt(Callback):
    """SIGTERM to this rank's own process after optimizer step ``step`` (rank ``rank`` only: the others learn it from
    the agreement); each rank writes the step it stopped at to ``<root>/stopped_rank<r>.json``."""

    def __init__(self, root: str, step: int, rank: int) -> None:
        self.root, self.step, self.rank = root, step, rank

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_exception(self, trainer, pl_module, exception):
        record = {"step": trainer.global_step, "exception": type(exception).__name__}
        record["callbacks"] = [type(c).__name__ for c in trainer.callbacks]
        Path(self.root).mkdir(parents=True, exist_ok=True)
        Path(self.root, f"stopped_rank{trainer.global_rank}.json").write_text(json.dumps(record))


def ema_weight_averaging() -> Callback:
    """Lightning's own EMA callback (Lightning >= 2.6; the lower-bound environment has 2.4 and never asks for it)."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    return EMAWeightAveraging(decay=0.9)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(SAMPLES, 4, 8, 8, generator=g),
        torch.randn(SAMPLES, 4, 8, 8, generator=g),
        torch.rand(SAMPLES, generator=g),
        torch.randint(0, 10, (SAMPLES,), generator=g),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--ckpt-path", default=None)
    parser.add_argument("--optimizer", default="muon", choices=["muon", "adamw", "adaptive"])
    parser.add_argument("--partial-shard", action="store_true")
    parser.add_argument("--strategy", default="muon_fsdp", choices=["muon_fsdp", "model_parallel"])
    parser.add_argument("--ema-weight-averaging", action="store_true", help="add Lightning's EMAWeightAveraging")
    parser.add_argument("--sigterm", type=int, nargs=2, metavar=("STEP", "RANK"), help="SIGTERM to RANK after STEP")
    parser.add_argument("--log-every-n-steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.epochs,
        strategy=ModelParallelStrategy(args.devices, 1) if args.strategy == "model_parallel" else "muon_fsdp",
        default_root_dir=args.root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=args.log_every_n_steps,
        callbacks=[Record(args.record), ModelCheckpoint(dirpath=f"{args.root}/ckpt", save_last=True, save_top_k=0)]
        + ([ema_weight_averaging()] if args.ema_weight_averaging else [])
        + ([SigtermAt(args.root, *args.sigterm)] if args.sigterm else []),
    )
    loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH // args.devices, shuffle=False)
    module = TinyFlowDiT(args.optimizer, args.partial_shard, shard=args.strategy == "model_parallel")
    trainer.fit(module, loader, ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main()
