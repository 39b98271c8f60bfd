"""A transformers Llama in your own LightningModule, trained with Periodic Row-wise Muon under ``muon_fsdp``.

Nothing in the model is this project's: ``muon_param_groups`` finds its blocks (``model.layers.i``, the items of a
``ModuleList`` that repeat one class) and sends their linear weights to Muon, the embeddings, norms and ``lm_head`` to
AdamW; ``muon_fsdp`` shards each block as an FSDP2 unit. ``--blocks LlamaDecoderLayer`` says the same explicitly.

    python examples/llama_muon_fsdp.py --devices 2 --max-steps 20
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_muon import MuonFSDPStrategy, PeriodicRowwiseMuon, describe_param_groups, muon_param_groups


class LlamaModule(L.LightningModule):
    """Next-token prediction with a (tiny, random-init) Llama; any ``AutoModelForCausalLM`` works the same way."""

    def __init__(self, blocks: list[str] | None = None, lr: float = 0.02, adamw_lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train/loss", loss)  # this rank's loss: no collective per step
        return loss

    def configure_optimizers(self) -> PeriodicRowwiseMuon:
        groups = muon_param_groups(self.model, adamw={"lr": self.hparams.adamw_lr}, blocks=self.hparams.blocks)
        if self.global_rank == 0:
            print(describe_param_groups(groups, self.model).splitlines()[-1])
        return PeriodicRowwiseMuon(groups, lr=self.hparams.lr, period=3, rownorm_scale=0.15, weight_decay=0.01)


def token_data(batch_size: int, sequences: int = 32, length: int = 16) -> DataLoader:
    """Random token sequences with a learnable rule (each token is the previous one plus one, modulo the vocab)."""
    start = torch.randint(0, 64, (sequences, 1), generator=torch.Generator().manual_seed(0))
    return DataLoader((start + torch.arange(length)) % 64, batch_size=batch_size, shuffle=False)


class Record(Callback):
    """Writes each step's loss averaged over ranks (the test compares runs; training itself needs none of this)."""

    def __init__(self, path: str | None) -> None:
        self.path, self.rows = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.path:
            loss = trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")
            self.rows.append({"step": trainer.global_step, "loss": float(loss)})

    def on_train_end(self, trainer, pl_module) -> None:
        if not self.path:
            return
        params = {
            n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for n, p in pl_module.named_parameters()
        }
        if trainer.global_rank == 0:
            Path(self.path).write_text(json.dumps(self.rows))
            torch.save(params, Path(self.path).with_suffix(".pt"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=20, help="-1: until --max-epochs")
    parser.add_argument("--max-epochs", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=4, help="per device")
    parser.add_argument("--blocks", nargs="*", default=None, help="block class names (default: found)")
    parser.add_argument("--root", default="llama_logs")
    parser.add_argument("--ckpt-path", default=None, help="resume from this (distributed) checkpoint")
    parser.add_argument("--record", default=None, help="write per-step mean losses and the final weights here")
    args = parser.parse_args(argv)
    trainer = L.Trainer(
        strategy=MuonFSDPStrategy(blocks=args.blocks),
        accelerator="cpu",
        devices=args.devices,
        max_steps=args.max_steps,
        max_epochs=args.max_epochs,
        default_root_dir=args.root,
        logger=False,
        enable_progress_bar=False,
        callbacks=[Record(args.record), ModelCheckpoint(dirpath=f"{args.root}/ckpt", save_last=True)],
    )
    trainer.fit(LlamaModule(args.blocks), token_data(args.batch_size), ckpt_path=args.ckpt_path)


if __name__ == "__main__":
    main()
