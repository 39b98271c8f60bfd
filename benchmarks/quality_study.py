"""The quality study (#26): does Periodic Row-wise Muon keep Muon's generation quality at a fraction of its optimizer
time (arXiv 2608.20818's claims), with the step size separated from the direction?

Under this project's convention both branches share the lr and its shape factor, so γ scales the RowNorm steps'
length: comparing γ values (or K values, or Periodic with Muon) at one learning rate measures mostly a total step
size. So every arm gets its own learning-rate sweep and is compared at its best:

- **Arms.** AdamW; Muon (K=1); Periodic at K=3 on a γ × lr grid (γ ∈ ``--gammas``); Periodic K=3 with a γ that
  calibrates itself at every refresh (``rownorm_scale="auto"``: descent-matched; ``"auto_rms"``: RMS-matched); and
  K ∈ ``--periods`` at the best γ of the K=3 grid (each K with its own lr sweep; γ is not re-swept per K).
- **Learning rates** are chosen per arm on seed 0 by the lowest validation loss reached (raw weights, a fixed
  timestep grid and fixed noise), never on FD. A sweep starts from ``--lrs-muon`` / ``--lrs-adamw`` (log-spaced,
  factor 2); a chosen lr at the edge of its grid adds the next one beyond it (up to ``--max-extend`` times), so a
  finished sweep's choice is interior unless the report says otherwise.
- **Budget.** A constant lr after a linear warm-up (EMA 0.995 for sampling), so a run's trajectory does not depend
  on its length and "time to a target FD" is a property of the optimizer; under a cosine decay every curve is shaped
  by where it ends. The report says for each arm whether its best FD came before the last evaluation.
- **Seeds.** Every reported arm is retrained at its chosen lr with ``--seeds`` seeds (0 is the sweep's run).
- **Clocks.** Every ``--eval-every`` steps a run records digits FD, precision, recall, density, coverage and the
  validation loss, with its cumulative optimizer seconds (end of backward to end of the batch: the interval
  ``OptimizerTelemetry``'s ``optim/step_ms`` measures) and training wall seconds (evaluations excluded).

Resumable: runs whose rows are in the CSV are not trained again, and each finished run is appended at once; the
plan is recomputed after every run (extensions, the K sweeps and the seeds start as soon as what they depend on is
known). ``--jobs`` trains runs in parallel processes (``--threads`` each).

    python benchmarks/quality_study.py                 # the default study (82 minutes on 2 CPU cores; resumable)
    python benchmarks/quality_study.py --report-only   # quality_study.md and the plots from the CSV
    python benchmarks/quality_study.py --quick         # a few minutes' smoke version (the test runs it)
    python benchmarks/quality_study.py --configs digits16 --jobs 8 --device cuda   # the larger configuration on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

from study import (
    CONFIGS,
    RUN_OPTIONS,
    StepClock,
    as_float,
    digits_evaluation,
    execute_planned,
    muon_state,
    quality_of,
    run_study,
)

COLUMNS = [
    "config",
    "optimizer",
    "period",
    "rownorm_scale",  # γ, or "auto" / "auto_rms"; 0 outside periodic_muon
    "lr",
    "seed",
    "step",
    "fd",
    "precision",
    "recall",
    "density",
    "coverage",
    "val_loss",
    "optimizer_seconds",
    "wall_seconds",
    "arm",
    "role",  # "sweep" (seed 0 of an lr sweep) or "seeds"
    "device",
    "refreshes",  # NS5 refreshes per Muon matrix so far
    "gamma_descent",  # mean over Muon matrices of the descent-matched γ at their latest refresh (auto arms only)
    "gamma_rms",  # the same for the RMS-matched γ
]

PAPER_GAMMA = 0.15


PLOTS = "quality_study_"  # prefix of the PNG files beside the CSV


@dataclasses.dataclass(frozen=True)
class Arm:
    """An optimizer setting whose learning rate is swept: AdamW, Muon, or Periodic at (K, γ)."""

    optimizer: str  # "adamw", "muon", "periodic_muon"
    period: int = 1
    scale: float | str = 0.0  # γ or "auto" / "auto_rms" (periodic_muon only)

    @property
    def name(self) -> str:
        if self.optimizer != "periodic_muon":
            return self.optimizer
        return f"K={self.period} γ={self.scale:g}" if isinstance(self.scale, float) else f"K={self.period} {self.scale}"

    @property
    def is_muon(self) -> bool:
        return self.optimizer != "adamw"


ADAMW, MUON = Arm("adamw"), Arm("muon")


def periodic(period: int, scale: float | str) -> Arm:
    return Arm("periodic_muon", period, scale)


def parse_scale(text: str) -> float | str:
    return text if text in ("auto", "auto_rms") else round(float(text), 6)


@dataclasses.dataclass(frozen=True)
class Run:
    config: str
    arm: Arm
    lr: float
    seed: int

    @property
    def key(self) -> tuple:
        return (self.config, self.arm.name, round(self.lr, 10), self.seed)


def run_key(row: dict[str, Any]) -> tuple:
    return (row["config"], row["arm"], round(float(row["lr"]), 10), int(row["seed"]))


def arm_of(row: dict[str, Any]) -> Arm:
    if row["optimizer"] != "periodic_muon":
        return Arm(row["optimizer"])
    return periodic(int(row["period"]), parse_scale(row["rownorm_scale"]))


# ----------------------------------------------------------------------------------------------------- one run
def train_one(run: Run, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train ``run`` and return one row per evaluated step."""
    import lightning as L
    import torch

    from lightning_muon.callbacks import GenerationEvaluation
    from lightning_muon.recipes.data import DigitsDataModule
    from lightning_muon.recipes.module import DiTModule

    torch.set_num_threads(args.threads)
    L.seed_everything(run.seed, verbose=False)
    spec = CONFIGS[run.config]
    steps, eval_every = budget(run.config, args)
    arm = run.arm
    options = dict(  # written flat, as RUN_OPTIONS and the CSV's columns: upgrade_hparams puts them under ``muon``
        model_config=spec["model_config"],
        optimizer=arm.optimizer,
        period=arm.period,
        rownorm_scale=arm.scale if arm.optimizer == "periodic_muon" else PAPER_GAMMA,
        warmup_steps=max(1, steps // 30),
        schedule="constant",
        **RUN_OPTIONS,
        **({"lr": run.lr} if arm.is_muon else {"adamw_lr": run.lr}),
    )
    module = DiTModule(**DiTModule.upgrade_hparams(options))
    data = DigitsDataModule(batch_size=64, image_size=spec["image_size"])

    class Clock(StepClock):
        """The clocks (evaluations excluded from the wall clock), NS5 refreshes per matrix and the calibrated γ
        means at each evaluated step; the validation loss of each evaluation."""

        def __init__(self) -> None:
            super().__init__()
            self.snapshots, self.val = {}, {}

        def on_step(self, trainer, now: float) -> None:
            if trainer.global_step % eval_every == 0:
                state = muon_state(trainer.optimizers[0])
                self.snapshots[trainer.global_step] = (self.optimizer_seconds, self.wall, *state)

        def on_validation_end(self, trainer, pl_module) -> None:
            loss = trainer.callback_metrics.get("val/loss")
            if not trainer.sanity_checking and loss is not None:
                self.val.setdefault(trainer.global_step, float(loss))

    class EvalTimer(GenerationEvaluation):
        def evaluate(self, trainer, pl_module, monitorable: bool = True):
            start = time.perf_counter()
            try:
                return super().evaluate(trainer, pl_module, monitorable)
            finally:
                clock.excluded += time.perf_counter() - start

    clock = Clock()
    evaluation = digits_evaluation(eval_every, args, EvalTimer)
    trainer = L.Trainer(
        accelerator=args.device,
        devices=1,
        max_steps=steps,
        val_check_interval=eval_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        callbacks=[clock, evaluation],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(Path(args.work) / "runs" / "_".join(map(str, run.key))),
    )
    trainer.fit(module, data)
    rows = []
    for entry in evaluation.history:
        step = int(entry["step"])
        opt_s, wall_s, refreshes, g_descent, g_rms = clock.snapshots.get(step, (math.nan,) * 5)
        rows.append(
            {
                "config": run.config,
                "optimizer": arm.optimizer,
                "period": arm.period,
                "rownorm_scale": arm.scale,
                "lr": run.lr,
                "seed": run.seed,
                "step": step,
                **quality_of(entry),
                "val_loss": clock.val.get(step, math.nan),
                "optimizer_seconds": opt_s,
                "wall_seconds": wall_s,
                "arm": arm.name,
                "role": "sweep" if run.seed == args.seed0 else "seeds",
                "device": args.device_label,
                "refreshes": refreshes,
                "gamma_descent": g_descent,
                "gamma_rms": g_rms,
            }
        )
    return rows


def budget(config: str, args: argparse.Namespace) -> tuple[int, int]:
    """(steps, evaluation period) of ``config``: ``--steps`` / ``--eval-every`` or the config's defaults."""
    return args.steps or CONFIGS[config]["steps"], args.eval_every or CONFIGS[config]["eval_every"]


def _worker(run: Run, ns: dict) -> list[dict[str, Any]]:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    return train_one(run, argparse.Namespace(**ns))


# ------------------------------------------------------------------------------------------------------ planning


def lowest_val_loss(run_rows: list[dict[str, Any]]) -> float:
    """The lowest finite validation loss among one run's rows (inf: the run diverged or has no rows)."""
    return min((x for x in (as_float(r["val_loss"]) for r in run_rows) if math.isfinite(x)), default=math.inf)


def best_val_loss(rows: list[dict[str, Any]], key: tuple) -> float:
    """The lowest validation loss the run ``key`` reached (inf for a run that diverged or is missing)."""
    return lowest_val_loss([r for r in rows if run_key(r) == key])


@dataclasses.dataclass
class Sweep:
    """One arm's lr sweep on seed 0: its runs so far and, once they are all done, the chosen lr (and whether that
    still sits at the edge of the grid because ``--max-extend`` ran out)."""

    runs: list[Run]
    chosen: float | None
    at_edge: bool = False


def sweep(rows: list[dict[str, Any]], done: set, config: str, arm: Arm, args: argparse.Namespace) -> Sweep:
    lrs = sorted(args.lrs_muon if arm.is_muon else args.lrs_adamw)
    for extension in range(args.max_extend + 1):
        runs = [Run(config, arm, lr, args.seed0) for lr in lrs]
        if any(r.key not in done for r in runs):
            return Sweep(runs, None)
        best = min(lrs, key=lambda lr: best_val_loss(rows, Run(config, arm, lr, args.seed0).key))
        if best not in (lrs[0], lrs[-1]):
            return Sweep(runs, best)
        if extension < args.max_extend:
            lrs = [lrs[0] / 2, *lrs] if best == lrs[0] else [*lrs, lrs[-1] * 2]
    return Sweep(runs, best, at_edge=True)


@dataclasses.dataclass
class Plan:
    """Every run known to be needed so far, the sweeps by (config, arm name), the arms reported with seeds and the
    best γ of the K=3 grid (None until its sweeps are done), per config."""

    runs: list[Run]
    sweeps: dict[tuple[str, str], Sweep]
    reported: dict[str, list[Arm]]
    best_gamma: dict[str, float | None]


def plan(rows: list[dict[str, Any]], args: argparse.Namespace) -> Plan:
    done = {run_key(r) for r in rows}
    runs, sweeps, reported, best_gamma = [], {}, {}, {}
    for config in args.configs:
        base = [ADAMW, MUON, *(periodic(3, g) for g in args.gammas), *(periodic(3, s) for s in args.auto)]
        for arm in base:
            sweeps[config, arm.name] = sweep(rows, done, config, arm, args)
        grid = {g: sweeps[config, periodic(3, g).name] for g in args.gammas}
        best_gamma[config] = None
        if all(s.chosen is not None for s in grid.values()):
            scored = {
                g: best_val_loss(rows, Run(config, periodic(3, g), s.chosen, args.seed0).key) for g, s in grid.items()
            }
            best_gamma[config] = gamma = min(scored, key=scored.get)
            for k in (k for k in args.periods if k != 3):
                sweeps[config, periodic(k, gamma).name] = sweep(rows, done, config, periodic(k, gamma), args)
        reported[config] = [ADAMW, MUON]
        reported[config] += [periodic(3, g) for g in sorted({PAPER_GAMMA, best_gamma[config] or PAPER_GAMMA})]
        reported[config] += [periodic(3, s) for s in args.auto]
        if best_gamma[config] is not None:
            reported[config] += [periodic(k, best_gamma[config]) for k in args.periods if k != 3]
        for (c, _), s in sweeps.items():
            if c == config:
                runs += s.runs
        for arm in reported[config]:
            s = sweeps.get((config, arm.name))
            if s is not None and s.chosen is not None:
                runs += [Run(config, arm, s.chosen, args.seed0 + i) for i in range(1, args.seeds)]
    return Plan(runs, sweeps, reported, best_gamma)


def execute(rows: list[dict[str, Any]], args: argparse.Namespace, csv_path: Path) -> None:
    """Train every planned run whose rows are not in the CSV (``--jobs`` at a time), appending each run's rows as it
    ends and planning again: sweep extensions, K sweeps and seeds start as soon as their inputs are known."""
    execute_planned(rows, args, csv_path, lambda: plan(rows, args).runs, run_key, _worker, COLUMNS)


# --------------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a few minutes' smoke version (tiny budget and grids)")
    parser.add_argument("--out", default="benchmarks/results", help="quality_study.csv / .md / PNGs go here")
    parser.add_argument("--configs", nargs="+", default=["digits8"], choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: per config)")
    parser.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (default: per config)")
    parser.add_argument("--samples", type=int, default=500, help="generated images per evaluation")
    parser.add_argument("--inference-steps", type=int, default=10, help="sampler steps per generated image")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per reported arm at its chosen learning rate")
    parser.add_argument("--lrs-muon", type=float, nargs="+", default=[0.0025, 0.005, 0.01, 0.02], help="initial grid")
    parser.add_argument("--lrs-adamw", type=float, nargs="+", default=[5e-4, 1e-3, 2e-3, 4e-3], help="initial grid")
    parser.add_argument("--max-extend", type=int, default=3, help="grid extensions per sweep at its edge")
    parser.add_argument("--gammas", type=float, nargs="+", default=[0.075, 0.15, 0.3, 0.6, 1.2], help="K=3 γ grid")
    parser.add_argument("--periods", type=int, nargs="+", default=[2, 3, 4, 6], help="K at the best γ")
    parser.add_argument("--auto", nargs="*", default=["auto", "auto_rms"], choices=["auto", "auto_rms"])
    parser.add_argument("--seed0", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="parallel runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--device", default="cpu", help="Lightning accelerator (cpu, cuda)")
    parser.add_argument("--report-only", action="store_true", help="regenerate the report from the CSV")
    return parser


def main(argv: list[str] | None = None) -> None:
    from quality_report import report

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every, args.samples, args.inference_steps, args.seeds = 40, 20, 100, 4, 2
        args.lrs_muon, args.lrs_adamw, args.max_extend = [0.02, 0.04], [2e-3, 4e-3], 0
        args.gammas, args.periods, args.auto = [0.15, 0.3], [3, 6], ["auto"]
    args.gammas = [round(g, 6) for g in args.gammas]
    args.device_label = args.device
    args.work = str(Path(args.out) / ".quality_study_work")
    page = lambda rows, out: report(rows, plan(rows, args), args, out)  # noqa: E731
    run_study(parser, args, argv, "quality_study.py", "quality_study", COLUMNS, execute, page)


if __name__ == "__main__":
    main()
