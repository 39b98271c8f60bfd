"""The examples run as a user runs them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parents[1] / "examples"


@pytest.mark.distributed
def test_custom_module_on_two_cpu_ranks_with_muon_fsdp_and_both_callbacks(tmp_path):
    env = {**os.environ, "LIGHTNING_MUON_CACHE": str(tmp_path / "cache"), "MASTER_ADDR": "127.0.0.1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "custom_module.py"),
            "--devices",
            "2",
            "--max-steps",
            "40",
            "--eval-every",
            "20",
            "--num-samples",
            "100",
            "--root",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    checkpoints = tmp_path / "logs" / "lightning_logs" / "version_0" / "checkpoints"
    rows = [json.loads(line) for line in (checkpoints / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [20, 40]
    best = min(rows, key=lambda r: r["eval/fd_digits"])
    assert (checkpoints / f"best-step={best['step']}.ckpt").is_dir()  # a distributed checkpoint, kept by FD
    assert f"best eval/fd_digits {best['eval/fd_digits']:.4g} at step {best['step']}" in proc.stdout


def test_generation_evaluation_names_what_a_module_lacks(tmp_path):
    import lightning as L
    import torch

    from lightning_muon.callbacks import GenerationEvaluation
    from lightning_muon.recipes.data import DigitsDataModule

    class NoGenerate(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 2)

        def training_step(self, batch, batch_idx):
            return self.layer.weight.sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[GenerationEvaluation()],
        default_root_dir=tmp_path,
    )
    with pytest.raises(TypeError, match=r"LightningModule \(NoGenerate\) to provide generate"):
        trainer.fit(NoGenerate(), DigitsDataModule())
