"""The quality study: does Muon beat AdamW on generation quality at an equal step budget, and does Periodic
Row-wise Muon keep that gain at a fraction of the optimizer cost? (arXiv 2608.20818's headline claims, checked at
small scale on this project's own runs.)

Two configurations built offline: ``digits8`` (the default digits DiT on sklearn's 8×8 digits) and ``digits16``
(the digits upscaled to 16×16 with a wider, deeper DiT). Arms: AdamW, Muon (K=1) and Periodic Row-wise Muon (K=3,
γ=0.15), each with a learning-rate sweep (best chosen on the final validation loss, never on a test metric) and
more seeds at the chosen rate; ablations on ``digits8`` at the chosen rate: K ∈ {1, 2, 3, 4, 6} and
γ ∈ {0.05, 0.1, 0.15, 0.3}. Every ``--eval-every`` steps each run records digits FD, precision, recall, density,
coverage and validation loss, with its cumulative optimizer seconds (end of backward to end of the batch, the
interval ``OptimizerTelemetry``'s ``optim/step_ms`` measures) and training wall seconds (evaluations excluded).

Resumable: a run whose rows are in the CSV is skipped (finished runs are appended as they end). ``--jobs``
trains runs in parallel processes (one thread each by default). ``--quick`` is a ≤ 10 minute smoke version.

    python benchmarks/quality_study.py                 # the default study (≤ 90 min on 2 CPU cores)
    python benchmarks/quality_study.py --report-only   # regenerate quality_study.md and the plots from the CSV
    python benchmarks/quality_study.py --steps 3000 --seeds 5 --jobs 8 --device cuda   # scaled up on a GPU
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

COLUMNS = [
    "config",
    "optimizer",
    "period",
    "rownorm_scale",
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
    "role",
    "device",
    "variant",
    "refreshes",  # NS5 refreshes per Muon matrix so far
]

#: the configurations: the digits resolution, DiT kwargs and the default step budget (equal for every arm)
CONFIGS = {
    "digits8": {
        "image_size": 8,
        "steps": 400,
        "model_config": {
            "num_attention_heads": 4,
            "attention_head_dim": 32,
            "in_channels": 1,
            "num_layers": 4,
            "sample_size": 8,
            "patch_size": 2,
            "num_embeds_ada_norm": 10,
        },
    },
    "digits16": {
        "image_size": 16,
        "steps": 200,
        "model_config": {
            "num_attention_heads": 6,
            "attention_head_dim": 32,
            "in_channels": 1,
            "num_layers": 6,
            "sample_size": 16,
            "patch_size": 4,
            "num_embeds_ada_norm": 10,
        },
    },
}

#: the arms: optimizer name, K, γ; the learning rates swept (Muon: its lr; AdamW: adamw_lr)
ARMS = {"adamw": ("adamw", 1, 0.0), "muon": ("muon", 1, 0.0), "periodic": ("periodic_muon", 3, 0.15)}
LRS = {"adamw": (3e-4, 1e-3, 3e-3), "muon": (0.01, 0.02, 0.05), "periodic": (0.01, 0.02, 0.05)}
PERIODS, SCALES = (1, 2, 3, 4, 6), (0.05, 0.1, 0.15, 0.3)
#: optimizer variants compared with the default on the first configuration at the chosen learning rates: the arms
#: they run on and their DiTModule options on top of the arm. "ns5" is the default every other run uses.
#: Orthogonalizers (#16) on Muon (K=1) and Periodic (K=3); refresh schedules (#15) on Periodic, each with fewer
#: refreshes than K=3: adaptive (threshold 0.35 chosen on seed 0 as the lowest of 0.3/0.35/0.4/0.45 with at most
#: K=3's refreshes: 126 per matrix vs 134 in 400 steps) and one layer type at K=6 with the others at K=3.
VARIANTS: dict[str, tuple[tuple[str, ...], dict[str, Any]]] = {
    "ns5": (("muon", "periodic"), {}),
    # the default again, trained with the variants (same code, NS dtype and machine load): their reference
    "baseline": (("muon", "periodic"), {}),
    "polar_express": (("muon", "periodic"), {"ns_coefficients": "polar_express", "ns_method": "gram"}),
    "turbo_muon": (
        ("muon", "periodic"),
        {"ns_coefficients": "turbo_muon", "ns_steps": 4, "ns_normalize": "aol", "ns_method": "gram"},
    ),
    "adaptive": (
        ("periodic",),
        {"refresh_schedule": "adaptive", "drift_threshold": 0.35, "min_period": 2, "max_period": 6},
    ),
    **{
        f"{layer}_k6": (("periodic",), {"param_overrides": {layer: {"period": 6}}})
        for layer in ("attention", "feed_forward", "modulation")
    },
}
PLOTS = "quality_study_"  # prefix of the PNG files beside the CSV


@dataclasses.dataclass(frozen=True)
class Run:
    config: str
    arm: str
    period: int
    rownorm_scale: float
    lr: float
    seed: int
    role: str  # "sweep", "seeds", "ablation_k", "ablation_gamma", "variants"
    variant: str = "ns5"

    @property
    def optimizer(self) -> str:
        """Periodic Row-wise Muon at K=1 is vanilla Muon (γ unused): one run, not two."""
        name = ARMS[self.arm][0]
        return "muon" if name == "periodic_muon" and self.period == 1 else name

    @property
    def key(self) -> tuple:
        """(config, optimizer, K, γ, lr, seed, variant) as the CSV rows spell them (K=1 and γ=0 outside
        periodic_muon)."""
        periodic = self.optimizer == "periodic_muon"
        period, scale = (self.period, round(self.rownorm_scale, 6)) if periodic else (1, 0.0)
        return (self.config, self.optimizer, period, scale, self.lr, self.seed, self.variant)


def run_key(row: dict[str, Any]) -> tuple:
    return (
        row["config"],
        row["optimizer"],
        int(row["period"]),
        round(float(row["rownorm_scale"]), 6),
        float(row["lr"]),
        int(row["seed"]),
        row.get("variant") or "ns5",
    )


# ----------------------------------------------------------------------------------------------------- one run
def train_one(run: Run, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Train ``run`` and return one row per evaluated step."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_muon.callbacks import GenerationEvaluation
    from lightning_muon.recipes.data import DigitsDataModule
    from lightning_muon.recipes.module import DiTModule

    torch.set_num_threads(args.threads)
    L.seed_everything(run.seed, verbose=False)
    spec = CONFIGS[run.config]
    steps, eval_every = budget(run.config, args)
    _, optimizer, period, scale, *_ = run.key
    lr = {"lr": run.lr} if optimizer != "adamw" else {"adamw_lr": run.lr}
    module = DiTModule(
        model_config=spec["model_config"],
        optimizer=optimizer,
        period=period,
        rownorm_scale=scale or 0.15,
        warmup_steps=max(1, steps // 30),
        schedule="cosine",
        ema_decay=0.995,
        cfg_dropout=0.1,
        nonfinite="skip",
        ns_dtype="float32",  # the same NS arithmetic whether or not the CPU has native bf16 (the default picks it)
        **lr,
        **VARIANTS[run.variant][1],
    )
    data = DigitsDataModule(batch_size=64, image_size=spec["image_size"])

    class Clock(Callback):
        """Cumulative optimizer seconds and training wall seconds (evaluation time excluded) per step."""

        def __init__(self) -> None:
            self.optimizer_seconds, self.eval_seconds, self.snapshots = 0.0, 0.0, {}
            self._t0 = self._start = 0.0

        def on_train_start(self, trainer, pl_module) -> None:
            self._start = time.perf_counter()

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            now = time.perf_counter()
            self.optimizer_seconds += now - self._t0
            if trainer.global_step % eval_every == 0:
                wall = now - self._start - self.eval_seconds
                counts = trainer.optimizers[0].refresh_counts()
                groups = [v for k, v in counts.items() if re.fullmatch(r"group\d+", k)]
                per_matrix = sum(groups) / max(1, len(counts) - len(groups))
                self.snapshots[trainer.global_step] = (self.optimizer_seconds, wall, per_matrix)

        def on_validation_end(self, trainer, pl_module) -> None:
            if not trainer.sanity_checking:
                loss = trainer.callback_metrics.get("val/loss")
                self.snapshots.setdefault(("val", trainer.global_step), float(loss) if loss is not None else math.nan)

    class EvalTimer(GenerationEvaluation):
        def evaluate(self, trainer, pl_module, monitorable: bool = True):
            start = time.perf_counter()
            try:
                return super().evaluate(trainer, pl_module, monitorable)
            finally:
                clock.eval_seconds += time.perf_counter() - start

    clock = Clock()
    evaluation = EvalTimer(
        metrics=["fd_digits", "prdc_digits"],
        every_n_steps=eval_every,
        num_samples=args.samples,
        num_inference_steps=args.inference_steps,
        batch_size=250,
        grid_size=0,
        progress=False,
        reference_dir=str(Path(args.work) / "eval_reference"),  # shared by every run: computed once
    )
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
        opt_s, wall_s, refreshes = clock.snapshots.get(step, (math.nan, math.nan, math.nan))
        rows.append(
            {
                "config": run.config,
                "optimizer": optimizer,
                "period": period,
                "rownorm_scale": scale,
                "lr": run.lr,
                "seed": run.seed,
                "step": step,
                "fd": entry.get("eval/fd_digits"),
                "precision": entry.get("eval/precision_digits"),
                "recall": entry.get("eval/recall_digits"),
                "density": entry.get("eval/density_digits"),
                "coverage": entry.get("eval/coverage_digits"),
                "val_loss": clock.snapshots.get(("val", step), math.nan),
                "optimizer_seconds": opt_s,
                "wall_seconds": wall_s,
                "role": run.role,
                "device": args.device_label,
                "variant": run.variant,
                "refreshes": refreshes,
            }
        )
    return rows


def budget(config: str, args: argparse.Namespace) -> tuple[int, int]:
    """(steps, evaluation period) of ``config``: ``--steps`` / ``--eval-every`` or the config's default, 4 evals."""
    steps = args.steps or CONFIGS[config]["steps"]
    return steps, args.eval_every or max(1, steps // 4)


def _worker(payload: tuple[Run, dict]) -> list[dict[str, Any]]:
    import warnings

    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    run, ns = payload
    return train_one(run, argparse.Namespace(**ns))


# ------------------------------------------------------------------------------------------------------ planning
def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    with path.open() as f:
        return [dict(r) for r in csv.DictReader(f)]


def append_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    new = not path.is_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerows(rows)


def final_val_loss(rows: list[dict[str, Any]], key: tuple) -> float:
    mine = [r for r in rows if run_key(r) == key]
    last = max(mine, key=lambda r: int(r["step"]), default=None)
    return float(last["val_loss"]) if last and last["val_loss"] not in ("", "nan") else math.inf


def chosen_lr(rows: list[dict[str, Any]], config: str, arm: str, args: argparse.Namespace) -> float:
    """The swept learning rate with the lowest final validation loss (seed ``args.seed0``)."""
    _, period, scale = ARMS[arm]
    candidates = [Run(config, arm, period, scale, lr, args.seed0, "sweep") for lr in args.lrs[arm]]
    return min(candidates, key=lambda r: final_val_loss(rows, r.key)).lr


def plan(rows: list[dict[str, Any]], args: argparse.Namespace) -> tuple[list[Run], list[Run]]:
    """(sweep runs, runs that depend on the chosen learning rates); the second list is only final once every
    sweep run is done."""
    sweep, later = [], []
    for config in args.configs:
        for arm, (_, period, scale) in ARMS.items():
            sweep += [Run(config, arm, period, scale, lr, args.seed0, "sweep") for lr in args.lrs[arm]]
    for config in args.configs:
        for arm, (_, period, scale) in ARMS.items():
            lr = chosen_lr(rows, config, arm, args)
            later += [Run(config, arm, period, scale, lr, args.seed0 + s, "seeds") for s in range(1, args.seeds)]
    if args.ablations:
        config, lr = args.configs[0], chosen_lr(rows, args.configs[0], "periodic", args)
        for seed in range(args.seed0, args.seed0 + args.ablation_seeds):
            later += [Run(config, "periodic", k, 0.15, lr, seed, "ablation_k") for k in args.periods]
            later += [Run(config, "periodic", 3, g, lr, seed, "ablation_gamma") for g in args.scales]
    config = args.configs[0]
    for arm in ("muon", "periodic"):
        _, period, scale = ARMS[arm]
        lr = chosen_lr(rows, config, arm, args)
        for variant in [v for v in args.variants if arm in VARIANTS[v][0]]:
            seeds = range(args.seed0, args.seed0 + args.seeds)
            later += [Run(config, arm, period, scale, lr, seed, "variants", variant) for seed in seeds]
    return sweep, later


def execute(runs: list[Run], rows: list[dict[str, Any]], args: argparse.Namespace, csv_path: Path) -> None:
    """Train every run whose rows are not in the CSV yet (``--jobs`` in parallel), appending rows as runs end."""
    done = {run_key(r) for r in rows}
    todo, seen = [], set()
    for run in runs:
        if run.key not in done and run.key not in seen:
            todo.append(run)
            seen.add(run.key)
    if not todo:
        return
    from tqdm.auto import tqdm

    ns = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}
    payloads = [(run, ns) for run in todo]
    bar = tqdm(total=len(todo), desc="runs", unit="run")
    if args.jobs <= 1:
        results = map(_worker, payloads)
    else:
        import multiprocessing as mp

        pool = mp.get_context("spawn").Pool(args.jobs)
        results = pool.imap_unordered(_worker, payloads)
    for new_rows in results:
        append_rows(csv_path, new_rows)
        rows.extend({k: str(v) for k, v in r.items()} for r in new_rows)
        bar.update()
    bar.close()
    if args.jobs > 1:
        pool.close()
        pool.join()


# --------------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="≤ 10 min smoke version (tiny budget, 1 config)")
    parser.add_argument("--out", default="benchmarks/results", help="quality_study.csv / .md / PNGs go here")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: per config)")
    parser.add_argument("--eval-every", type=int, default=None, help="evaluate every N steps (default: steps / 4)")
    parser.add_argument("--samples", type=int, default=500, help="generated images per evaluation")
    parser.add_argument("--inference-steps", type=int, default=10, help="sampler steps per generated image")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per arm at the chosen learning rate")
    parser.add_argument("--ablation-seeds", type=int, default=2)
    parser.add_argument("--no-ablations", dest="ablations", action="store_false")
    parser.add_argument(
        "--variants",
        nargs="*",
        default=[v for v in VARIANTS if v != "ns5"],
        choices=[v for v in VARIANTS if v != "ns5"],
        help="optimizer variants compared with 'baseline' (the default, trained beside them) at K=1 and K=3 "
        "(none: --variants with no value)",
    )
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
        args.configs, args.steps, args.eval_every, args.samples, args.inference_steps = ["digits8"], 40, 20, 100, 4
        args.seeds, args.ablation_seeds, args.periods, args.scales = 2, 1, (1, 3), (0.15,)
        args.variants = [v for v in ("baseline", "turbo_muon", "adaptive") if v in args.variants]
        args.lrs = {"adamw": (1e-3, 3e-3), "muon": (0.02, 0.05), "periodic": (0.02, 0.05)}
    else:
        args.periods, args.scales, args.lrs = PERIODS, SCALES, LRS
    args.command = "python benchmarks/quality_study.py " + " ".join(argv if argv is not None else sys.argv[1:])
    args.machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.device}"
    args.device_label = args.device
    args.work = str(Path(args.out) / ".quality_study_work")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "quality_study.csv"
    rows = read_rows(csv_path)
    if args.report_only and not rows:
        parser.error(f"--report-only: {csv_path} has no rows; run the study first.")
    if rows and not set(COLUMNS) <= set(rows[0]):
        parser.error(f"{csv_path} lacks columns {sorted(set(COLUMNS) - set(rows[0]))}; it is not this study's CSV.")
    if not args.report_only:
        sweep, _ = plan(rows, args)
        execute(sweep, rows, args, csv_path)
        _, later = plan(rows, args)  # the chosen learning rates are known now
        execute(later, rows, args, csv_path)
    args.planned = len({run.key for run in [r for part in plan(rows, args) for r in part]})
    provenance = out / "quality_study.json"
    if args.report_only and provenance.is_file():  # the page keeps naming the command that trained the runs
        vars(args).update(json.loads(provenance.read_text()))
    provenance.write_text(json.dumps({"command": args.command, "machine": args.machine}))
    print(report(rows, args, out))


if __name__ == "__main__":
    main()
