"""What the quality studies share (``quality_study.py``, ``frontier_study.py`` and their reports, ``frontier_pace.py``,
``frontier_confirm.py``): the digits configs and run options, the evaluation every run makes, the clock every run
keeps, CSV rows read and appended, and the resumable loop that trains the planned jobs."""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

#: the configurations: digits resolution and DiT kwargs, the default step budget and evaluation period
CONFIGS: dict[str, dict[str, Any]] = {
    "digits8": {
        "image_size": 8,
        "steps": 2000,
        "eval_every": 100,
        "model_config": {
            "num_attention_heads": 4,
            "attention_head_dim": 16,
            "in_channels": 1,
            "num_layers": 3,
            "sample_size": 8,
            "patch_size": 2,
            "num_embeds_ada_norm": 10,
        },
    },
    "digits16": {
        "image_size": 16,
        "steps": 3000,
        "eval_every": 200,
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


#: DiTModule options every study run shares beside its arm's and its lr (NS in float32: the same arithmetic whether
#: or not the CPU has native bf16, which the default would pick)
RUN_OPTIONS: dict[str, Any] = dict(ema_decay=0.995, cfg_dropout=0.1, nonfinite="skip", ns_dtype="float32")


#: what each evaluation of a study run measures, as CSV columns: the GenerationEvaluation keys they come from
QUALITY_COLUMNS = {
    "fd": "eval/fd_digits",
    "precision": "eval/precision_digits",
    "recall": "eval/recall_digits",
    "density": "eval/density_digits",
    "coverage": "eval/coverage_digits",
}


def digits_evaluation(every_n_steps: int, args: argparse.Namespace, cls: type | None = None, seed: int = 0):
    """The evaluation of every study run: digits FD and PRDC of ``args.samples`` EMA samples (sample i seeded
    ``seed + i``), no grid, the reference statistics shared by every run under ``args.work`` (computed once)."""
    from lightning_muon.callbacks import GenerationEvaluation

    return (cls or GenerationEvaluation)(
        suite={"metrics": ["fd_digits", "prdc_digits"]},
        sampling={
            "num_samples": args.samples,
            "num_inference_steps": args.inference_steps,
            "batch_size": 250,
            "seed": seed,
        },
        every_n_steps=every_n_steps,
        grid_size=0,
        progress=False,
        reference_dir=str(Path(args.work) / "eval_reference"),
    )


def quality_of(entry: dict[str, Any]) -> dict[str, Any]:
    """An evaluation's ``QUALITY_COLUMNS``."""
    return {column: entry.get(key) for column, key in QUALITY_COLUMNS.items()}


def muon_state(optimizer) -> tuple[float, float, float]:
    """(NS5 refreshes per Muon matrix, mean descent-matched γ, mean RMS-matched γ) — the γ means only where the
    optimizer measured them (``rownorm_scale="auto"`` / ``"auto_rms"``), NaN elsewhere; 0 refreshes for AdamW."""
    import re

    import torch

    if not hasattr(optimizer, "refresh_counts"):
        return 0.0, math.nan, math.nan
    counts = optimizer.refresh_counts()
    groups = [v for k, v in counts.items() if re.fullmatch(r"group\d+", k)]
    per_matrix = sum(groups) / max(1, len(counts) - len(groups))
    scales = [s["refresh_scales"] for s in optimizer.state.values() if "refresh_scales" in s]
    if not scales:
        return per_matrix, math.nan, math.nan
    descent, rms = torch.stack(scales).mean(0).tolist()
    return per_matrix, descent, rms


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    with path.open() as f:
        return [dict(r) for r in csv.DictReader(f)]


def append_rows(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    new = not path.is_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        if new:
            writer.writeheader()
        writer.writerows(rows)


def as_float(value: Any) -> float:
    """A CSV cell as a float (NaN when empty or not a number)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def execute_planned(rows, args, csv_path: Path, planned, key_of_row, worker, columns: list[str]) -> None:
    """The resumable loop of both studies: ``planned()`` (recomputed after every job) lists jobs with a ``.key``;
    those whose key no CSV row has are run by ``worker(job, args)`` in ``--jobs`` spawned processes, and each job's
    rows are appended to ``csv_path`` (and ``rows``) as soon as it ends."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from multiprocessing import get_context

    from tqdm.auto import tqdm

    ns = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))}
    running: dict = {}
    bar = tqdm(desc="jobs", unit="job")
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        while True:
            busy = {key_of_row(r) for r in rows} | {job.key for job in running.values()}
            todo = list({job.key: job for job in planned() if job.key not in busy}.values())
            free = args.jobs - len(running)
            for job in todo[:free]:
                running[pool.submit(worker, job, ns)] = job
            bar.total = bar.n + len(running) + len(todo[free:])
            bar.refresh()
            if not running:
                break
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                running.pop(future)
                new_rows = future.result()
                append_rows(csv_path, new_rows, columns)
                rows.extend({k: str(v) for k, v in r.items()} for r in new_rows)
                bar.update()
    bar.close()


def run_study(parser, args, argv, script: str, name: str, columns: list[str], execute, report_page) -> None:
    """The shared part of both studies' ``main``: ``<out>/<name>.csv`` read and checked, the command and machine
    recorded in ``<name>.json``, the planned jobs trained unless ``--report-only``, and ``report_page(rows, out)``
    written and printed."""
    args.command = f"python benchmarks/{script} " + " ".join(argv if argv is not None else sys.argv[1:])
    args.machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.device}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / f"{name}.csv"
    rows = read_rows(csv_path)
    if args.report_only and not rows:
        parser.error(f"--report-only: {csv_path} has no rows; run the study first.")
    if rows and not set(columns) <= set(rows[0]):
        parser.error(f"{csv_path} lacks columns {sorted(set(columns) - set(rows[0]))}; it is not this study's CSV.")
    provenance = out / f"{name}.json"
    if not args.report_only:
        provenance.write_text(json.dumps({"command": args.command, "machine": args.machine}))
        execute(rows, args, csv_path)
    elif provenance.is_file():  # the page keeps naming the command that trained the jobs
        vars(args).update(json.loads(provenance.read_text()))
    print(report_page(rows, out))


class StepClock(Callback):
    """Optimizer seconds (from ``on_before_optimizer_step`` to the batch's end) and training wall seconds so far, the
    latter from ``wall_offset`` and without ``excluded`` (evaluations, checkpoint writes); ``on_step(trainer, now)``
    runs after each step with both up to date."""

    def __init__(self, optimizer_seconds: float = 0.0, wall_offset: float = 0.0) -> None:
        self.optimizer_seconds, self.wall_offset, self.excluded, self.wall = optimizer_seconds, wall_offset, 0.0, 0.0
        self._t0 = self._start = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        now = time.perf_counter()
        self.optimizer_seconds += now - self._t0
        self.wall = self.wall_offset + now - self._start - self.excluded
        self.on_step(trainer, now)

    def on_step(self, trainer, now: float) -> None:
        """After each step (the clocks are current)."""
