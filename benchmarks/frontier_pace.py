"""Seconds per training step of every frontier arm, measured side by side in one process (#37).

The frontier's own clocks come from units trained one arm after another, hours apart, two at a time on a shared
2-core machine: its wall seconds differ between arms by more than the arms differ (auto-γ, which does more work per
refresh than Periodic, clocked 0.8× Periodic's seconds). Here every arm takes one training step in turn — the same
batch, the same model, the same machine state — so each sees the same conditions: forward, backward, gradient
clipping, the optimizer step (the arm's own refresh schedule, warm-up included) and the EMA update. Data loading and
Lightning's loop are left out (the same for every arm).

Writes ``frontier_pace.json``: per arm, cumulative training and optimizer seconds after every step, and NS5 refreshes
per matrix at the end. ``frontier_report`` turns them into seconds at each budget: measured up to ``--steps``, then
the rate of the second half (past any warm-up) times the remaining steps.

    python benchmarks/frontier_pace.py                # every arm, 300 steps each (about 3 minutes here)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings
from pathlib import Path

from frontier_study import ARMS, is_muon
from study import CONFIGS, RUN_OPTIONS, muon_state


def pace(arms: list[str], args: argparse.Namespace) -> dict[str, dict[str, list[float] | float]]:
    """Round-robin ``args.steps`` training steps of every arm; cumulative seconds after each step."""
    import torch

    from lightning_muon.recipes.data import DigitsDataModule
    from lightning_muon.recipes.module import DiTModule

    warnings.filterwarnings("ignore", message=".*self.log.*")  # training_step outside a Trainer: nothing to log to
    torch.set_num_threads(args.threads)
    spec = CONFIGS[args.config]
    data = DigitsDataModule(batch_size=64, image_size=spec["image_size"])
    data.setup()
    batches = list(data.train_dataloader())
    runs = {}
    for arm in arms:
        torch.manual_seed(0)
        lr = {"lr": args.lr_muon} if is_muon(arm) else {"adamw_lr": args.lr_adamw}
        options = dict(model_config=spec["model_config"], schedule="constant", **RUN_OPTIONS, **ARMS[arm], **lr)
        module = DiTModule(**DiTModule.upgrade_hparams(options))  # the arms are written flat (frontier_study.ARMS)
        module.configure_model()
        runs[arm] = (module, module.configure_optimizers()["optimizer"])
    clocks = {arm: {"step_s": [], "optimizer_s": []} for arm in arms}
    for i in range(args.steps):
        batch = batches[i % len(batches)]
        for arm, (module, opt) in runs.items():
            start = time.perf_counter()
            loss = module.training_step(batch, i)
            opt.zero_grad()
            loss.backward()
            mid = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(module.model.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                ema = 1 - module.hparams.ema_decay
                torch._foreach_lerp_(list(module.ema.parameters()), list(module.model.parameters()), ema)
            end = time.perf_counter()
            for key, seconds in (("step_s", end - start), ("optimizer_s", end - mid)):
                so_far = clocks[arm][key]
                so_far.append((so_far[-1] if so_far else 0.0) + seconds)
    for arm, (_, opt) in runs.items():
        clocks[arm]["refreshes"] = muon_state(opt)[0]
    return clocks


def seconds_at(clock: dict[str, list[float]], key: str, T: int) -> float:
    """Cumulative seconds after ``T`` steps: measured up to the clock's length, then its second half's rate."""
    measured = clock[key]
    S = len(measured)
    if T <= S:
        return measured[T - 1]
    half = S // 2
    rate = (measured[-1] - measured[half - 1]) / (S - half)
    return measured[-1] + (T - S) * rate


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--config", default="digits8", choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=300, help="timed steps per arm (past the longest warm-up)")
    parser.add_argument("--lr-muon", type=float, default=0.02, help="Muon-family lr (adaptive refreshes depend on it)")
    parser.add_argument("--lr-adamw", type=float, default=0.004)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: as each frontier unit)")
    parser.add_argument("--out", default="benchmarks/results/frontier_pace.json")
    args = parser.parse_args(argv)
    clocks = pace(args.arms, args)
    muon = clocks.get("muon")
    print(f"{args.config}, {args.steps} steps per arm, round-robin, {args.threads} thread(s)")
    print(f"| {'arm':<14} | {'ms/step':>7} | {'optimizer ms':>12} | {'vs Muon':>7} | {'refreshes/matrix':>16} |")
    print("|" + "|".join("-" * w for w in (16, 9, 14, 9, 18)) + "|")
    for arm, clock in clocks.items():
        ms = 1e3 * clock["step_s"][-1] / args.steps
        opt_ms = 1e3 * clock["optimizer_s"][-1] / args.steps
        ratio = f"{clock['step_s'][-1] / muon['step_s'][-1]:.3f}×" if muon else "—"
        print(f"| {arm:<14} | {ms:>7.2f} | {opt_ms:>12.2f} | {ratio:>7} | {clock['refreshes']:>16.1f} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores"
    out.write_text(json.dumps({"config": vars(args), "machine": machine, "arms": clocks}))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
