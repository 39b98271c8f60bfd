"""fit -> validate -> test -> predict with Trainer(strategy="muon_fsdp", devices=2) in one process (CPU, gloo).

python tests/scripts/lifecycle_muon_fsdp.py OUT_DIR
"""

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parents[1]))
from helpers import tiny_dit  # noqa: E402

from lightning_muon import PeriodicRowwiseMuon, muon_param_groups  # noqa: E402


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_dit()

    def _loss(self, batch):
        x, y = batch
        t = torch.full((len(x),), 500.0)
        return torch.nn.functional.mse_loss(self.model(x, timestep=t, class_labels=y).sample, x)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        x, y = batch
        return self.model(x, timestep=torch.full((len(x),), 500.0), class_labels=y).sample

    def configure_optimizers(self):
        return PeriodicRowwiseMuon(muon_param_groups(self.model, adamw={"lr": 1e-3}), lr=0.02, period=3)


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g))
    loader = DataLoader(data, batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="muon_fsdp",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Module()
    stages = []
    trainer.fit(module, loader, loader)
    stages.append("fit")
    val = trainer.validate(module, loader)
    stages.append("validate")
    test = trainer.test(module, loader)
    stages.append("test")
    predictions = trainer.predict(module, loader)
    stages.append("predict")
    if trainer.is_global_zero:
        done = {
            "stages": stages,
            "val_loss": val[0]["val_loss"],
            "test_loss": test[0]["test_loss"],
            "predictions": sum(len(p) for p in predictions),
        }
        (out / "done.json").write_text(json.dumps(done))


if __name__ == "__main__":
    main()
