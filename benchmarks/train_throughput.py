"""Digits DiT training throughput on CPU: steps/s and optimizer share of the step for adamw, muon, periodic_muon.

The default recipe's model and data, the training step as Lightning runs it (forward, backward, optimizer step,
EMA update), timed round-robin over the three optimizers in one process. Prints a table and writes JSON.

    python benchmarks/train_throughput.py --steps 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lightning_muon.recipes.data import DigitsDataModule
from lightning_muon.recipes.module import DiTModule
from lightning_muon.recipes.networks import TINY_DIT

NAMES = ("adamw", "muon", "periodic_muon")


def make(name: str, hidden_heads: int) -> tuple[DiTModule, torch.optim.Optimizer]:
    torch.manual_seed(0)
    module = DiTModule(model_config={**TINY_DIT, "num_attention_heads": hidden_heads}, optimizer=name)
    module.configure_model()
    return module, module.configure_optimizers()["optimizer"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per optimizer (a multiple of 3)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads of 32 dims (4: the default model)")
    parser.add_argument("--out", default="benchmarks/results/train_throughput.json")
    args = parser.parse_args()
    data = DigitsDataModule(batch_size=64)
    data.setup()
    batches = list(data.train_dataloader())
    runs = {name: make(name, args.heads) for name in NAMES}
    step_times = {n: [] for n in NAMES}
    opt_times = {n: [] for n in NAMES}
    for i in range(3 + args.steps):  # 3 warm-up steps
        for name, (module, opt) in runs.items():
            batch = batches[i % len(batches)]
            start = time.perf_counter()
            loss = module.training_step(batch, i)
            opt.zero_grad()
            loss.backward()
            mid = time.perf_counter()
            opt.step()
            end = time.perf_counter()
            module.on_train_batch_end(None, batch, i)
            done = time.perf_counter()
            if i >= 3:
                step_times[name].append(done - start)
                opt_times[name].append(end - mid)
    params = sum(p.numel() for p in runs["adamw"][0].model.parameters())
    med = {n: sum(step_times[n]) / len(step_times[n]) for n in NAMES}
    opt = {n: sum(opt_times[n]) / len(opt_times[n]) for n in NAMES}
    print(
        f"digits DiT, {params / 1e6:.2f}M params, batch 64, CPU threads={torch.get_num_threads()}, "
        f"mean over {args.steps} steps"
    )
    print(f"| {'optimizer':<14} | {'steps/s':>7} | {'ms/step':>7} | {'optimizer ms':>12} | {'optimizer share':>15} |")
    print("|" + "|".join("-" * w for w in (16, 9, 9, 14, 17)) + "|")
    for n in NAMES:
        print(
            f"| {n:<14} | {1 / med[n]:>7.1f} | {med[n] * 1e3:>7.1f} | {opt[n] * 1e3:>12.2f} | "
            f"{100 * opt[n] / med[n]:>14.1f}% |"
        )
    overhead = {n: opt[n] - opt["adamw"] for n in ("muon", "periodic_muon")}
    ratio = overhead["periodic_muon"] / overhead["muon"] if overhead["muon"] > 0 else float("nan")
    print(
        f"optimizer overhead over AdamW: muon {overhead['muon'] * 1e3:.2f} ms, periodic "
        f"{overhead['periodic_muon'] * 1e3:.2f} ms, ratio {ratio:.2f} (target <= 0.5): "
        f"{'met' if ratio <= 0.5 else 'MISSED'}"
    )
    print("median step ms: " + ", ".join(f"{n} {statistics.median(step_times[n]) * 1e3:.1f}" for n in NAMES))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"config": vars(args), "mean_step_s": med, "mean_optimizer_s": opt, "overhead_ratio": ratio}, indent=2
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
