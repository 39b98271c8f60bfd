"""Your own LightningModule with Periodic Row-wise Muon, FSDP2 (``muon_fsdp``) and live generation metrics.

A small class-conditional transformer of one's own (not the recipe's ``DiTModule``) trained with rectified flow on
sklearn's 8×8 digits. What lightning-muon asks of it:

- ``configure_optimizers`` returns ``PeriodicRowwiseMuon`` over ``muon_param_groups``
  (block matrices → Muon, the rest → AdamW);
- transformer blocks in a ``blocks`` ``ModuleList`` (``muon_fsdp`` shards each as an FSDP2 unit), or shard the
  model yourself in ``configure_model``;
- for ``GenerationEvaluation``, ``generate(conditions, seeds, num_inference_steps,
  guidance_scale, batch_size=None)`` returning uint8 images, and a datamodule with ``real_images()`` (the
  protocols ``Generator`` and ``RealImages`` in ``lightning_muon.callbacks``).

    python examples/custom_module.py --devices 2 --max-steps 300
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor, nn

from lightning_muon import PeriodicRowwiseMuon, muon_param_groups
from lightning_muon.callbacks import GenerationEvaluation, OptimizerTelemetry, Preemption
from lightning_muon.checkpoint import AtomicCheckpointIO
from lightning_muon.recipes.data import DigitsDataModule


class Block(nn.Module):
    """Pre-norm attention + MLP, both modulated by the conditioning vector (adaLN)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False)
        self.modulation = nn.Linear(width, 4 * width)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        s1, b1, s2, b2 = self.modulation(c).unsqueeze(1).chunk(4, dim=-1)
        h = self.norm1(x) * (1 + s1) + b1
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x) * (1 + s2) + b2)


class TinyDiT(nn.Module):
    """2×2 patches of an 8×8 image → ``depth`` blocks → velocity."""

    def __init__(self, width: int = 64, depth: int = 3, heads: int = 4, num_classes: int = 10) -> None:
        super().__init__()
        self.patch = nn.Linear(4, width)
        self.pos = nn.Parameter(torch.randn(1, 16, width) * 0.02)
        self.label = nn.Embedding(num_classes, width)
        self.time = nn.Sequential(nn.Linear(1, width), nn.SiLU(), nn.Linear(width, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.out = nn.Linear(width, 4)

    def forward(self, x: Tensor, t: Tensor, labels: Tensor) -> Tensor:
        b = len(x)
        patches = x.unfold(2, 2, 2).unfold(3, 2, 2).reshape(b, 16, 4)  # (B, 1, 8, 8) → (B, 16 patches, 4)
        h = self.patch(patches) + self.pos
        c = self.label(labels) + self.time(t.view(-1, 1))
        for block in self.blocks:
            h = block(h, c)
        v = self.out(h).reshape(b, 4, 4, 2, 2).permute(0, 1, 3, 2, 4).reshape(b, 1, 8, 8)
        return v


class FlowDigits(L.LightningModule):
    """Rectified flow: x_t = (1 - t) x_0 + t ε, the network predicts ε - x_0; Euler sampling from t = 1."""

    def __init__(self, lr: float = 0.02, adamw_lr: float = 1e-3, period: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyDiT()

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        x0, labels = batch["images"], batch["labels"]
        t = torch.rand(len(x0), device=self.device)
        noise = torch.randn_like(x0)
        xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        loss = F.mse_loss(self.model(xt, t, labels), noise - x0)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> PeriodicRowwiseMuon:
        groups = muon_param_groups(self.model, adamw={"lr": self.hparams.adamw_lr})
        return PeriodicRowwiseMuon(groups, lr=self.hparams.lr, period=self.hparams.period, ns_dtype=torch.float32)

    @torch.no_grad()
    def generate(
        self,
        conditions: Tensor | Sequence[str],
        seeds: Sequence[int],
        num_inference_steps: int,
        guidance_scale: float = 1.0,
        batch_size: int | None = None,
    ) -> Tensor:
        """uint8 images (N, 1, 8, 8); sample i's noise comes from ``seeds[i]`` alone (batch-independent).
        ``guidance_scale`` is ignored: this model is trained without label dropout."""
        labels = torch.as_tensor(conditions, dtype=torch.long, device=self.device)
        x = torch.stack([torch.randn(1, 8, 8, generator=torch.Generator().manual_seed(int(s))) for s in seeds])
        x = x.to(self.device)
        ts = torch.linspace(1.0, 0.0, num_inference_steps + 1, device=self.device)
        for t, t_next in zip(ts[:-1], ts[1:]):
            x = x + (t_next - t) * self.model(x, t.expand(len(x)), labels)
        return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="CPU processes (gloo) or GPUs")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--num-samples", type=int, default=500)
    parser.add_argument("--root", default=".", help="default_root_dir: logs and checkpoints in ROOT/lightning_logs")
    args = parser.parse_args(argv)

    L.seed_everything(0)
    evaluation = GenerationEvaluation(
        suite={"metrics": ["fd_digits", "prdc_digits"]},
        sampling={"num_samples": args.num_samples, "num_inference_steps": 10, "batch_size": 250},
        every_n_steps=args.eval_every,
    )
    trainer = L.Trainer(
        accelerator="auto",
        devices=args.devices,
        strategy="muon_fsdp",
        max_steps=args.max_steps,
        default_root_dir=args.root,
        log_every_n_steps=10,
        plugins=[AtomicCheckpointIO()],  # muon_fsdp's default; any other strategy needs it named
        callbacks=[
            evaluation,
            OptimizerTelemetry(),
            Preemption(),  # SIGTERM / Slurm's requeue signal acted on between steps
            ModelCheckpoint(
                monitor="eval/fd_digits",
                mode="min",
                every_n_train_steps=args.eval_every,
                filename="best-step={step}",
                auto_insert_metric_name=False,
            ),
        ],
    )
    trainer.fit(FlowDigits(), DigitsDataModule(batch_size=32))
    if trainer.is_global_zero:
        best = min(evaluation.history, key=lambda row: row["eval/fd_digits"])
        print(
            f"best eval/fd_digits {best['eval/fd_digits']:.4g} at step {best['step']}: "
            f"{trainer.checkpoint_callback.best_model_path}"
        )


if __name__ == "__main__":
    main()
