"""Train a small MLP on sklearn's digits with AdamW, Muon (K=1) and Periodic Row-wise Muon (K=3), side by side.

A quick look at the optimizer on a real offline dataset (about half a minute on a laptop CPU):

    python examples/optimizer_demo.py --epochs 20
"""

from __future__ import annotations

import argparse
import time

import torch
from sklearn.datasets import load_digits
from torch import nn

from lightning_muon import PeriodicRowwiseMuon, describe_param_groups, muon_param_groups


class Net(nn.Module):
    """Input projection, two residual hidden blocks (Muon), output head (AdamW)."""

    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.embed = nn.Linear(64, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(2)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    period = 1 if name == "muon" else 3
    groups = muon_param_groups(model, adamw={"lr": 2e-3})
    return PeriodicRowwiseMuon(groups, lr=0.02, period=period, weight_decay=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = perm[:1500], perm[1500:]
    net = Net()
    print(describe_param_groups(muon_param_groups(net), net).splitlines()[-1])
    print(f"{'optimizer':<14} {'train loss':>10} {'test acc':>9} {'seconds':>8}")
    for name in ("adamw", "muon", "periodic_muon"):
        torch.manual_seed(0)
        model = Net()
        opt = make_optimizer(name, model)
        start = time.perf_counter()
        for _ in range(args.epochs):
            order = train[torch.randperm(len(train))]
            for i in range(0, len(order), args.batch_size):
                idx = order[i : i + args.batch_size]
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        with torch.no_grad():
            acc = (model(x[test]).argmax(-1) == y[test]).float().mean().item()
            train_loss = nn.functional.cross_entropy(model(x[train]), y[train]).item()
        print(f"{name:<14} {train_loss:>10.4f} {acc:>9.3f} {time.perf_counter() - start:>8.1f}")


if __name__ == "__main__":
    main()
