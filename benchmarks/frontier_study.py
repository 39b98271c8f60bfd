"""The quality-vs-compute frontier (#37): the best generation quality each optimizer reaches at each budget, each
budget with its own tuned learning rate, under a decaying schedule — "the same quality in less time" asked at every
budget, not only at the plateau where every tuned optimizer ends equal.

- **Schedule: warm-up–stable–decay** (``DiTModule(schedule="wsd")``, Hägele et al. 2024): linear warm-up
  (``--warmup`` steps), a constant lr, then a linear decay to 0 over the last ``--decay-fraction`` of the budget.
  Before its decay a WSD run *is* the constant run, so one **unit** per (arm, lr, seed) gives the whole frontier:
  a constant-lr run to the last branch point, checkpointed at each budget ``T``'s decay start ``T − d(T)``; each
  branch resumes from there as WSD with ``max_steps=T`` — exactly the WSD run of ``T`` steps (tested in
  ``tests/recipes/test_recipe.py``) — and is evaluated once, at ``T``.
- **Budgets**: ``--budget-fractions`` (10/20/40/80/100%) of ``--steps``.
- **Per budget, measured at its end**: digits FD, precision, recall, density, coverage (``--samples`` EMA samples);
  the validation loss (raw weights, fixed timestep grid and noise); optimizer seconds (end of backward to end of the
  batch) and training wall seconds (evaluation excluded), stable part up to the branch plus the decay.
- **Learning rates** are chosen per (arm, budget) by the lowest mean validation loss at the budget's end over the
  *tuning* seeds (``--tune-seeds``, never reported), on a ×√2 grid; a choice at the grid's edge at any budget adds
  the next rate beyond it (up to ``--max-extend`` times).
- **Reported seeds** (``--seeds``, disjoint from the tuning seeds) are trained at every lr some budget chose; a budget
  reports the seeds at its own choice. Never chosen on FD.
- **Arms** (``--arms``; ``ARMS``): AdamW, Muon, Periodic (K=3, γ 0.15, the paper's), auto-γ (descent- and
  RMS-matched), adaptive refresh, layer-wise K, Polar Express, Turbo-Muon, Gram NS, a refresh warm-up — every one
  with its own sweep.

Resumable: units whose rows are in the CSV are not trained again; each finished unit is appended at once (a unit cut
short is trained again from its start); the plan is recomputed after every unit. ``--jobs`` units in parallel. Stop
it with Ctrl-C or by killing its process group: its workers are processes of their own.

    python benchmarks/frontier_study.py --jobs 2                       # AdamW, Muon, Periodic (resumable)
    python benchmarks/frontier_study.py --jobs 2 --arms all            # every arm
    python benchmarks/frontier_study.py --report-only                  # frontier.md and the PNG from the CSV
    python benchmarks/frontier_study.py --quick                        # a few minutes' smoke version (a test runs it)
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shutil
import tempfile
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
    "arm",
    "lr",
    "seed",
    "budget",  # the run's length T in optimizer steps; its row is measured at step T
    "fd",
    "precision",
    "recall",
    "density",
    "coverage",
    "val_loss",
    "optimizer_seconds",
    "wall_seconds",
    "refreshes",  # NS5 refreshes per Muon matrix over the T steps (0 for AdamW)
    "role",  # "tune" (a tuning seed) or "report"
    "device",
]

PERIODIC = {"optimizer": "periodic_muon", "period": 3, "rownorm_scale": 0.15}
#: the arms: DiTModule options beside the lr (``lr`` for Muon-family arms, ``adamw_lr`` for AdamW), written flat as
#: before the optimizer's options moved under ``muon`` (the CSV's columns); DiTModule.upgrade_hparams nests them
ARMS: dict[str, dict[str, Any]] = {
    "adamw": {"optimizer": "adamw"},
    "muon": {"optimizer": "muon"},
    "periodic": PERIODIC,
    "auto": {**PERIODIC, "rownorm_scale": "auto"},
    "auto_rms": {**PERIODIC, "rownorm_scale": "auto_rms"},
    "adaptive": {**PERIODIC, "refresh_schedule": "adaptive", "max_period": 6},
    "layerwise": {**PERIODIC, "param_overrides": {"attention": {"period": 2}, "feed_forward": {"period": 4}}},
    "polar_express": {**PERIODIC, "ns_coefficients": "polar_express"},
    "turbo_muon": {**PERIODIC, "ns_coefficients": "turbo_muon", "ns_normalize": "aol", "ns_steps": 4},
    "gram": {**PERIODIC, "ns_method": "gram"},
    # refresh warm-up (#37's item 3: Periodic trails at short budgets): the first 60 steps all refresh (3× the lr
    # warm-up, half the shortest budget; +10% refreshes at 1200 steps) — one N, not tuned
    "warmup": {**PERIODIC, "refresh_warmup": 60},
    # the same at half the length: is 60 special? (added once the 60-step arm had closed the gap)
    "warmup30": {**PERIODIC, "refresh_warmup": 30},
}
DEFAULT_ARMS = ["adamw", "muon", "periodic"]
#: evaluation sample i of a unit of seed s (``--seed-scope all``) has noise seed ``EVAL_SEED_STRIDE·s + i``
EVAL_SEED_STRIDE = 100_000


def is_muon(arm: str) -> bool:
    return ARMS[arm]["optimizer"] != "adamw"


def initial_grid(arm: str, args: argparse.Namespace) -> list[float]:
    """The lr grid a sweep starts from: ``--lrs-adamw``, ``--lrs-muon`` (Muon, Periodic), or ``--lrs-variants`` for
    Periodic's variants — which share its K and γ, so their grid starts where Periodic's chosen rates lie (the edge
    extension still follows any arm that wants lower or higher)."""
    if not is_muon(arm):
        return args.lrs_adamw
    return args.lrs_muon if arm in ("muon", "periodic") else args.lrs_variants


@dataclasses.dataclass(frozen=True)
class Unit:
    """One constant-lr run of ``arm`` at ``lr`` and ``seed`` with its WSD branches, one per budget (``budgets``:
    the run lengths it branches at; empty: every budget of the study)."""

    config: str
    arm: str
    lr: float
    seed: int
    budgets: tuple[int, ...] = ()

    @property
    def key(self) -> tuple:
        return (self.config, self.arm, round(self.lr, 10), self.seed)


def unit_key(row: dict[str, Any]) -> tuple:
    return (row["config"], row["arm"], round(float(row["lr"]), 10), int(row["seed"]))


def budgets(args: argparse.Namespace) -> list[int]:
    """The run lengths T, ascending."""
    return sorted({max(2, round(f * args.steps)) for f in args.budget_fractions})


# ----------------------------------------------------------------------------------------------------- one unit
def train_unit(unit: Unit, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train ``unit``: the stable run, then each budget's decay branch; one row per budget."""
    import lightning as L
    import torch

    from lightning_muon.recipes.data import DigitsDataModule
    from lightning_muon.recipes.module import DiTModule
    from lightning_muon.recipes.optimizers import decay_steps

    torch.set_num_threads(args.threads)
    spec = CONFIGS[unit.config]
    branch_at = {T - decay_steps(T, args.decay_fraction): T for T in unit.budgets or budgets(args)}  # start → T
    # --seed-scope all: the seed sets the data order, the training draws and the evaluation samples as well as the
    # weights (the same seed draws the same for every arm: pairs); "weights": the exploratory frontier.csv's runs
    draws = unit.seed if args.seed_scope == "all" else 0
    # a directory of this process's own: a worker left running by a killed study cannot delete its checkpoints
    (Path(args.work) / "units").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="_".join(map(str, unit.key)) + "_", dir=Path(args.work) / "units"))

    def module(schedule: str) -> DiTModule:
        lr = {"lr": unit.lr} if is_muon(unit.arm) else {"adamw_lr": unit.lr}
        options = dict(
            model_config=spec["model_config"],
            schedule=schedule,
            warmup_steps=args.warmup,
            decay_fraction=args.decay_fraction,
            noise_seed=draws,
            **RUN_OPTIONS,
            **ARMS[unit.arm],
            **lr,
        )
        return DiTModule(**DiTModule.upgrade_hparams(options))

    class Clock(StepClock):
        """The clocks of every step; in the stable run, a checkpoint at each branch point (its writing time excluded
        from the wall clock) and the clocks there."""

        def __init__(self, start: tuple[float, float] = (0.0, 0.0), save: bool = False) -> None:
            super().__init__(*start)
            self.save, self.at_branch = save, {}

        def on_step(self, trainer, now: float) -> None:
            if self.save and trainer.global_step in branch_at:
                trainer.save_checkpoint(work / f"branch_{trainer.global_step}.ckpt")
                self.at_branch[trainer.global_step] = (self.optimizer_seconds, self.wall)
                self.excluded += time.perf_counter() - now

    def trainer(max_steps: int, callbacks: list) -> L.Trainer:
        return L.Trainer(
            accelerator=args.device,
            devices=1,
            max_steps=max_steps,
            limit_val_batches=0,  # the validation loss is measured once, at the end (below)
            gradient_clip_val=1.0,
            callbacks=callbacks,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(work),
        )

    data = DigitsDataModule(batch_size=64, image_size=spec["image_size"], seed=draws)
    L.seed_everything(unit.seed, verbose=False)
    stable = Clock(save=True)
    trainer(max(branch_at), [stable]).fit(module("constant"), data)
    rows = []
    for start, T in sorted(branch_at.items()):
        L.seed_everything(unit.seed, verbose=False)
        clock = Clock(start=stable.at_branch[start])  # before the evaluation: its clocks stop at step T
        evaluation = digits_evaluation(T, args, seed=EVAL_SEED_STRIDE * draws)  # once: from T − d(T) to T
        branch = module("wsd")
        run = trainer(T, [clock, evaluation])
        run.fit(branch, data, ckpt_path=work / f"branch_{start}.ckpt")
        validation = L.Trainer(
            accelerator=args.device,
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=str(work),
        )
        val = validation.validate(branch, data, verbose=False)[0]["val/loss"]
        entry = evaluation.history[-1]
        rows.append(
            {
                "config": unit.config,
                "arm": unit.arm,
                "lr": unit.lr,
                "seed": unit.seed,
                "budget": T,
                **quality_of(entry),
                "val_loss": float(val),
                "optimizer_seconds": clock.optimizer_seconds,
                "wall_seconds": clock.wall,
                "refreshes": muon_state(run.optimizers[0])[0],
                "role": "tune" if unit.seed in args.tune_seeds else args.reported_role,
                "device": args.device,
            }
        )
    shutil.rmtree(work)
    return rows


def _worker(unit: Unit, ns: dict) -> list[dict[str, Any]]:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    return train_unit(unit, argparse.Namespace(**ns))


# ------------------------------------------------------------------------------------------------------ planning
def mean(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x)]
    return sum(xs) / len(xs) if xs else math.inf


@dataclasses.dataclass
class Sweep:
    """One arm's lr sweep on the tuning seeds: its units so far and, once they are all done, the lr chosen at each
    budget (and the budgets whose choice still sits at the grid's edge because ``--max-extend`` ran out)."""

    units: list[Unit]
    chosen: dict[int, float] | None
    at_edge: frozenset[int] = frozenset()


def tuning_loss(rows: list[dict[str, Any]], config: str, arm: str, lr: float, T: int) -> float:
    """Mean validation loss at the end of budget ``T`` over the tuning seeds (inf if any diverged)."""
    losses = [
        as_float(r["val_loss"])
        for r in rows
        if r["config"] == config
        and r["arm"] == arm
        and round(float(r["lr"]), 10) == round(lr, 10)
        and int(r["budget"]) == T
        and r["role"] == "tune"
    ]
    return mean(losses) if losses and all(math.isfinite(x) for x in losses) else math.inf


def sweep(rows: list[dict[str, Any]], done: set, config: str, arm: str, args: argparse.Namespace) -> Sweep:
    lrs = sorted(initial_grid(arm, args))
    for extension in range(args.max_extend + 1):
        units = [Unit(config, arm, lr, seed) for lr in lrs for seed in args.tune_seeds]
        if any(u.key not in done for u in units):
            return Sweep(units, None)
        chosen = {T: min(lrs, key=lambda lr: tuning_loss(rows, config, arm, lr, T)) for T in budgets(args)}
        low, high = any(lr == lrs[0] for lr in chosen.values()), any(lr == lrs[-1] for lr in chosen.values())
        if not (low or high) or extension == args.max_extend:
            edge = frozenset(T for T, lr in chosen.items() if lr in (lrs[0], lrs[-1]))
            return Sweep(units, chosen, edge)
        lrs = ([lrs[0] / args.lr_factor] if low else []) + lrs + ([lrs[-1] * args.lr_factor] if high else [])
    raise AssertionError("unreachable")


@dataclasses.dataclass
class Plan:
    units: list[Unit]
    sweeps: dict[tuple[str, str], Sweep]


def plan(rows: list[dict[str, Any]], args: argparse.Namespace) -> Plan:
    """The units known to be needed so far: every arm's sweep, then the reported seeds at each chosen lr."""
    done = {unit_key(r) for r in rows}
    units, sweeps = [], {}
    for config in args.configs:
        for arm in args.arms:
            s = sweeps[config, arm] = sweep(rows, done, config, arm, args)
            units += s.units
            for lr in sorted(set((s.chosen or {}).values())):
                units += [Unit(config, arm, lr, seed) for seed in args.seeds]
    return Plan(units, sweeps)


def execute(rows: list[dict[str, Any]], args: argparse.Namespace, csv_path: Path) -> None:
    """Train every planned unit whose rows are not in the CSV (``--jobs`` at a time), appending each unit's rows as
    it ends and planning again (extensions and reported seeds start as soon as their inputs are known)."""
    execute_planned(rows, args, csv_path, lambda: plan(rows, args).units, unit_key, _worker, COLUMNS)


# --------------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--quick", action="store_true", help="a few minutes' smoke version (tiny budget and grids)")
    add("--out", default="benchmarks/results", help="frontier.csv / .md / .png go here")
    add("--configs", nargs="+", default=["digits8"], choices=list(CONFIGS))
    add("--arms", nargs="+", default=DEFAULT_ARMS, choices=[*ARMS, "all"], help="arms to sweep and report")
    add("--steps", type=int, default=1200, help="the longest budget, in optimizer steps")
    add("--budget-fractions", type=float, nargs="+", default=[0.1, 0.2, 0.4, 0.8, 1.0])
    add("--warmup", type=int, default=20, help="linear warm-up steps (shared by every budget)")
    add("--decay-fraction", type=float, default=0.2, help="WSD decay: this share of each budget")
    add("--samples", type=int, default=500, help="generated images per evaluation")
    add("--inference-steps", type=int, default=10, help="sampler steps per generated image")
    add("--tune-seeds", type=int, nargs="+", default=[100, 101], help="seeds that choose the lr (never reported)")
    add("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="reported seeds")
    add(
        "--lrs-muon", type=float, nargs="+", default=[0.005, 0.00707, 0.01, 0.01414, 0.02, 0.02828], help="initial grid"
    )
    add(
        "--lrs-variants",
        type=float,
        nargs="+",
        default=[0.01, 0.01414, 0.02, 0.02828, 0.04, 0.05657],
        help="initial grid of Periodic's variants (Periodic chose 0.014–0.057)",
    )
    add("--lrs-adamw", type=float, nargs="+", default=[1e-3, 1.414e-3, 2e-3, 2.828e-3, 4e-3], help="initial grid")
    add("--lr-factor", type=float, default=math.sqrt(2), help="grid spacing of an extension")
    add("--max-extend", type=int, default=6, help="grid extensions per sweep at its edge")
    add("--jobs", type=int, default=2, help="parallel units")
    add("--threads", type=int, default=1, help="torch threads per unit")
    add("--device", default="cpu", help="Lightning accelerator (cpu, cuda)")
    add(
        "--seed-scope",
        choices=["weights", "all"],
        default="weights",
        help="what a seed sets: the initial weights only (how frontier.csv was made: its rows stay exploratory), or "
        "also the data order, the training noise and timesteps and the evaluation samples",
    )
    add("--report-only", action="store_true", help="regenerate the report from the CSV")
    return parser


def main(argv: list[str] | None = None) -> None:
    from frontier_report import report

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.budget_fractions, args.warmup, args.samples, args.inference_steps = 40, [0.5, 1.0], 4, 100, 4
        args.tune_seeds, args.seeds, args.max_extend = [100], [0, 1], 0
        args.lrs_muon, args.lrs_adamw = [0.014, 0.02, 0.028], [1.4e-3, 2e-3, 2.8e-3]
        args.lrs_variants = args.lrs_muon
    if "all" in args.arms:
        args.arms = list(ARMS)
    if set(args.tune_seeds) & set(args.seeds):
        parser.error(
            f"--tune-seeds {args.tune_seeds} and --seeds {args.seeds} overlap: the lr would be chosen on "
            "a reported seed."
        )
    args.work, args.reported_role = str(Path(args.out) / ".frontier_work"), "report"
    page = lambda rows, out: report(rows, plan(rows, args), args, out)  # noqa: E731
    run_study(parser, args, argv, "frontier_study.py", "frontier", COLUMNS, execute, page)


if __name__ == "__main__":
    main()
