"""The core install (``pip install lightning-muon``: torch and Lightning only), run by ``.ci/run`` in its own venv from
outside the clone: none of the extras' packages is installed; the optimizer trains a user's own model; a part whose
extra is missing is one line naming it; ``Trainer(strategy="muon_fsdp")`` fits that model on 2 gloo ranks
(Lightning re-launches this script once per extra rank).

    python .ci/core_install.py --root DIR
"""

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn

from lightning_muon import PeriodicRowwiseMuon, describe_param_groups, muon_param_groups

EXTRAS_PACKAGES = ("diffusers", "transformers", "open_clip", "torch_fidelity", "sklearn", "jsonargparse", "torchvision")


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = nn.Sequential(
            nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.mlp(x)


class TinyLM(nn.Module):
    """A user's own model: embedding, two blocks, a head."""

    def __init__(self, vocab: int = 32, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width), Block(width)])
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tokens(n: int = 32, length: int = 12) -> torch.Tensor:
    start = torch.randint(0, 32, (n, 1), generator=torch.Generator().manual_seed(0))
    return (start + torch.arange(length)) % 32  # each token the previous one plus one


def loss_of(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyLM()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return loss_of(self.model, batch)

    def configure_optimizers(self) -> PeriodicRowwiseMuon:
        return PeriodicRowwiseMuon(muon_param_groups(self.model, adamw={"lr": 3e-3}), lr=0.02)


def check_the_install() -> None:
    present = [name for name in EXTRAS_PACKAGES if importlib.util.find_spec(name) is not None]
    assert not present, f"the core install brought extras' packages: {present}"
    torch.manual_seed(0)
    model = TinyLM()
    groups = muon_param_groups(model, adamw={"lr": 3e-3})
    print(describe_param_groups(groups, model).splitlines()[-1])
    assert sum(p.numel() for g in groups if g.get("use_muon") for p in g["params"]) > 0, "no Muon parameter"
    opt = PeriodicRowwiseMuon(groups, lr=0.02)
    losses = []
    for _ in range(20):
        loss = loss_of(model, tokens())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    print(f"optimizer on a user model: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    try:
        import lightning_muon.metrics  # noqa: F401
    except ModuleNotFoundError as err:
        assert "pip install 'lightning-muon[metrics]'" in str(err), err
        print(f"missing extra: {err}")
    else:
        raise AssertionError("lightning_muon.metrics imported without its extra")
    command = str(Path(sys.executable).parent / "lightning-muon")  # this environment's console script
    cli = subprocess.run([command, "fit"], capture_output=True, text=True, timeout=300)
    assert cli.returncode == 2 and "lightning-muon[recipe]" in cli.stderr, (cli.returncode, cli.stderr[-2000:])
    assert len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    print(f"lightning-muon fit without the recipe: {cli.stderr.strip()}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    args = parser.parse_args()
    if "LOCAL_RANK" not in __import__("os").environ:  # rank 0 only, before Lightning launches the others
        check_the_install()
    trainer = L.Trainer(
        strategy="muon_fsdp", accelerator="cpu", devices=2, max_steps=6, default_root_dir=args.root,
        logger=False, enable_progress_bar=False, enable_checkpointing=False,
    )  # fmt: skip
    trainer.fit(LM(), torch.utils.data.DataLoader(tokens(), batch_size=4))
    if trainer.global_rank == 0:
        print(f"muon_fsdp on 2 gloo ranks: {trainer.global_step} steps, world size {trainer.world_size}")
        assert trainer.global_step == 6 and trainer.world_size == 2
        Path(args.root).mkdir(parents=True, exist_ok=True)
        Path(args.root, "core_install.ok").write_text("ok\n")


if __name__ == "__main__":
    sys.exit(main())
