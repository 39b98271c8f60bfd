"""``lightning-muon doctor``: a pre-flight check of a GPU node before a long job (on a CPU, the parts that apply).

Each check prints one table row (``ok``, ``skipped`` with the reason, or ``FAILED`` with what differs) and all rows go
to a JSON file:

- **versions**: Python, torch, CUDA, NCCL, Lightning, diffusers, the devices.
- **bf16**: whether the device multiplies bf16 natively (the optimizer's default NS5 dtype there).
- **optimizer**: ``PeriodicRowwiseMuon(period=1)`` against ``torch.optim.Muon`` on the device (6 steps, to 1e-4
  relative), and on CUDA a Periodic (K=3) run on the device against the same run on the CPU (fp32 NS5 on both).
- **ns5**: NS5 time of one matrix pair of a block (h × h, 4h × h) at each hidden width, ours against
  ``torch.optim.Muon``'s: ours in bf16 (fp32 on a CPU without native bf16, where torch's always-bf16 NS5 is
  emulated and slow).
- **collectives**: NCCL all-reduce, all-gather and all-to-all bus bandwidth among the visible GPUs (skipped with
  fewer than two).
- **fused**: the ``torch.compile``-d RowNorm step (``fused=True``) against the eager one.
- **train step**: one optimizer step of the DiT-XL/2 config with two of its 28 blocks (full width, its per-GPU
  batch under bf16 autocast; batch 2 on a CPU).
- **memory** (CUDA): the same step's ``max_memory_allocated`` and that of sampling a batch with guidance (an
  evaluation's generation), each against :mod:`lightning_muon.recipes.memory`'s estimate of the same model on one
  GPU; ``FAILED`` above 1.25×.
- **sharded fit**: ``muon_fsdp`` on 2 ranks under torchrun (the node's GPUs with NCCL and bf16-mixed; gloo CPU
  ranks on a CPU), K+1 steps in scatter and in gather mode with a NaN planted on one rank at step 2 (every rank must
  skip it), a distributed checkpoint, and resumes on 2 and on 1 rank; compared with one rank and with an
  uninterrupted run (bf16 tolerance on CUDA) — :mod:`lightning_muon.recipes.doctor_worker`.
- **transports**: both sharded refresh transports (gather, scatter) as rank 0 of 8 over torch's fake process group
  in one process — real kernels on this device, collectives without data — under
  ``torch.cuda.set_sync_debug_mode("error")`` on CUDA: on a single GPU too, where the multi-rank checks are skipped.
- **no host sync** (CUDA): the loop users run — ``lightning-muon fit`` of the default recipe with every callback the
  CLI adds, ``muon_fsdp`` on the node's GPUs (up to 2) — with its typical steps (not logging, evaluating, saving or
  validating) under ``torch.cuda.set_sync_debug_mode("error")``.
- **evaluate**: ``lightning-muon evaluate`` under torchrun on 2 ranks of the sharded fit's checkpoint, 5 samples
  (not divisible by the world size), against the same evaluation in one process.
- **failure**: one of 2 ranks raises; the seconds until every rank has exited, its error in the output.

    lightning-muon doctor                       # all checks, JSON to lightning_logs/doctor.json
    lightning-muon doctor --skip fused          # leave a check out
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from lightning_muon.parallelize import free_port
from lightning_muon.recipes.doctor_checks import (
    Result,
    bf16,
    collectives,
    fused,
    memory,
    ns5,
    optimizer,
    train_step,
    versions,
)
from lightning_muon.recipes.flags import plain_help
from lightning_muon.recipes.shipped import CONFIGS

CHECKS = (
    "versions",
    "bf16",
    "optimizer",
    "ns5",
    "collectives",
    "fused",
    "train step",
    "memory",
    "sharded fit",
    "transports",
    "no host sync",
    "evaluate",
    "failure",
)


def _ranks(device: torch.device) -> int:
    """Ranks of the multi-process checks: 2 GPUs (0 when fewer), or 2 gloo CPU ranks."""
    if device.type != "cuda":
        return 2
    return 2 if torch.cuda.device_count() >= 2 else 0


def _torchrun(nproc: int, module: str, args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc-per-node nproc -m module args`` on 127.0.0.1."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", module, *args]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _worker(nproc: int, out: Path, *args: str) -> dict:
    """One doctor_worker fit: its full parameters and what each rank saw; raises with the output's tail on failure."""
    proc = _torchrun(nproc, "lightning_muon.recipes.doctor_worker", ["fit", "--out", str(out), *args])
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args) or 'fit'} on {nproc} ranks exited {proc.returncode}: {_tail(proc)}")
    return {
        "params": torch.load(out / "params.pt", weights_only=True),
        **json.loads((out / "ranks.json").read_text()),
    }


def _tail(proc: subprocess.CompletedProcess) -> str:
    """The child's error line (not torchrun's own ChildFailedError), else the output's end."""
    lines = (proc.stdout + proc.stderr).splitlines()
    errors = [x for x in lines if re.search(r"\w(Error|Exception): |^No ", x) and "ChildFailedError" not in x]
    return (errors[-1] if errors else "\n".join(lines[-3:])).strip()[:300]


def _params_rel(a: dict, b: dict) -> float:
    """‖a − b‖ / ‖b‖ over all parameters together (per tensor, the key biases — zero gradient in exact arithmetic,
    so AdamW normalizes rounding noise — would dominate)."""
    diff = sum(float((a[k] - b[k]).square().sum()) for k in b)
    return (diff / max(sum(float(b[k].square().sum()) for k in b), 1e-30)) ** 0.5


def sharded_fit(device: torch.device, work: Path) -> Result:
    """K+1 steps on 2 ranks in scatter and gather mode and on 1 rank, each skipping the planted NaN step on every
    rank; resumes of the scatter run's checkpoint on 2 and 1 ranks against an uninterrupted run."""
    world = _ranks(device)
    if not world:
        return Result("sharded fit", "skipped", "fewer than 2 GPUs")
    tol = 2e-2 if device.type == "cuda" else 1e-4  # bf16-mixed on CUDA (backward not bit-deterministic); fp32
    steps, more = "4", "6"  # K + 1 with K = 3, then two more after a resume
    scatter = _worker(world, work / "scatter", "--steps", steps, "--save")
    gather = _worker(world, work / "gather", "--steps", steps, "--refresh", "gather")
    single = _worker(1, work / "single", "--steps", steps)
    straight = _worker(world, work / "straight", "--steps", more)
    ckpt = str(work / "scatter" / "last.ckpt")
    resumed = {n: _worker(n, work / f"resumed{n}", "--steps", more, "--ckpt-path", ckpt) for n in (world, 1)}
    runs = {"scatter": scatter, "gather": gather, "single": single}
    skipped = {run: [r["skipped"] for r in out["ranks"]] for run, out in runs.items()}
    figures: dict[str, float | str] = {
        "world": world,
        "gather_vs_scatter_rel": _params_rel(gather["params"], scatter["params"]),
        "single_vs_sharded_rel": _params_rel(single["params"], scatter["params"]),
        f"resumed_{world}_vs_straight_rel": _params_rel(resumed[world]["params"], straight["params"]),
        "resumed_1_vs_straight_rel": _params_rel(resumed[1]["params"], straight["params"]),
    }
    bad = [f"{k} {v:.2e} > {tol:.0e}" for k, v in figures.items() if k.endswith("_rel") and not v <= tol]
    bad += [f"{run}: steps skipped per rank {s} (want 1 each)" for run, s in skipped.items() if set(s) != {1}]
    detail = f"{world} ranks, NaN step skipped on every rank; " + ", ".join(
        f"{k} {v:.1e}" for k, v in figures.items() if k.endswith("_rel")
    )
    return Result("sharded fit", "FAILED" if bad else "ok", "; ".join(bad) or detail, figures)


def transports(device: torch.device, work: Path) -> Result:
    out = work / "transports"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "lightning_muon.recipes.doctor_worker", "transports", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return Result("transports", "FAILED", _tail(proc))
    counts = json.loads((out / "transports.json").read_text())["collectives"]
    watched = "under set_sync_debug_mode('error')" if device.type == "cuda" else "(the sync check needs CUDA)"
    detail = f"gather and scatter, 4 steps as rank 0 of 8 {watched}: collectives {counts}"
    figures = {f"{t}_{b}_collectives": n for t, c in counts.items() for b, n in c.items()}
    return Result("transports", "ok", detail, figures)


#: the default recipe's busy steps in the "no host sync" run: logging 5, evaluation 8, checkpoints 10, validation 12
BUSY_EVERY = (5, 8, 10, 12)
SYNC_DEBUG_RUN = f"""
trainer:
  accelerator: gpu
  strategy: muon_fsdp
  max_steps: 16
  log_every_n_steps: {BUSY_EVERY[0]}
  val_check_interval: {BUSY_EVERY[3]}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{every_n_train_steps: {BUSY_EVERY[2]}, save_last: true}}
    - class_path: lightning_muon.callbacks.GenerationEvaluation
      init_args:
        every_n_steps: {BUSY_EVERY[1]}
        sampling: {{num_samples: 101, num_inference_steps: 3, batch_size: 32}}
    - class_path: lightning_muon.callbacks.OptimizerTelemetry
    - class_path: lightning.pytorch.callbacks.LearningRateMonitor
      init_args: {{logging_interval: step}}
    - class_path: lightning_muon.recipes.doctor_worker.SyncDebug
      init_args: {{busy_every: {list(BUSY_EVERY)}}}
"""


def no_host_sync(device: torch.device, work: Path) -> Result:
    if device.type != "cuda":
        return Result("no host sync", "skipped", "CUDA's sync debug mode needs a GPU")

    world = min(torch.cuda.device_count(), 2)
    run = work / "sync_debug"
    run.mkdir(parents=True, exist_ok=True)
    (run / "run.yaml").write_text(SYNC_DEBUG_RUN + f"  devices: {world}\n  default_root_dir: {run}\n")
    args = ["fit", "--config", str(CONFIGS / "digits_tiny.yaml"), "--config", str(run / "run.yaml")]
    proc = _torchrun(world, "lightning_muon.recipes.cli", args)
    if proc.returncode != 0:
        return Result("no host sync", "FAILED", f"exited {proc.returncode}: {_tail(proc)}")
    detail = f"lightning-muon fit on {world} GPU(s): the typical steps of 16 under set_sync_debug_mode('error')"
    return Result("no host sync", "ok", detail, {"world": world})


def evaluate_check(device: torch.device, work: Path) -> Result:
    """``evaluate`` of the sharded fit's checkpoint under torchrun (5 samples on 2 ranks) and in one process."""
    world = _ranks(device)
    ckpt = work / "scatter" / "last.ckpt"
    if not world or not ckpt.exists():
        return Result("evaluate", "skipped", "needs the sharded fit's checkpoint (2 ranks)")
    values = {}
    for n in (world, 1):
        out = work / f"evaluate{n}"
        args = ["evaluate", str(ckpt), "--num_samples", "5", "--num_inference_steps", "2", "--metrics", "fd_digits",
                "--out", str(out)]  # fmt: skip
        proc = _torchrun(n, "lightning_muon.recipes.cli", args)
        if proc.returncode != 0:
            return Result("evaluate", "FAILED", f"on {n} ranks exited {proc.returncode}: {_tail(proc)}")
        with (out / "results.csv").open() as f:
            values[n] = float(next(csv.DictReader(f))["eval/fd_digits"])
    rel = abs(values[world] - values[1]) / max(abs(values[1]), 1e-12)
    figures = {"fd_ranks": values[world], "fd_single": values[1], "rel": rel}
    detail = f"5 samples, FD {values[world]:.4g} on {world} ranks, {values[1]:.4g} in one process"
    return Result("evaluate", "ok" if rel <= 1e-3 else "FAILED", detail, figures)


def failure(device: torch.device, work: Path, limit: float = 60.0) -> Result:
    world = _ranks(device)
    if not world:
        return Result("failure", "skipped", "fewer than 2 GPUs")
    out = work / "failure"
    proc = _torchrun(world, "lightning_muon.recipes.doctor_worker", ["fail", "--out", str(out)])
    ended = time.time()
    raised = out / "raised.txt"
    if proc.returncode == 0 or not raised.is_file():
        return Result("failure", "FAILED", f"exit code {proc.returncode}; the planted error was not raised")
    seconds = ended - float(raised.read_text())
    figures = {"seconds_to_exit": seconds, "exit_code": proc.returncode}
    bad = [f"{seconds:.1f} s > {limit:.0f} s"] if seconds > limit else []
    if "fails on purpose" not in proc.stderr:
        bad.append("the rank's error is missing from the output")
    detail = f"one of {world} ranks raised: all exited {seconds:.1f} s later (exit code {proc.returncode})"
    return Result("failure", "FAILED" if bad else "ok", "; ".join(bad) or detail, figures)


def run_checks(
    device: torch.device, hiddens: list[int], skip: set[str], config: str | None = None, work: Path | None = None
) -> list[Result]:
    """Every check not in ``skip``; an exception in one is its FAILED row, the others still run. ``work``: where the
    multi-process checks write (a temporary directory by default)."""
    work = Path(work or tempfile.mkdtemp(prefix="lightning_muon_doctor_"))
    checks: dict[str, Callable[[], Result]] = {
        "versions": lambda: versions(device),
        "bf16": lambda: bf16(device),
        "optimizer": lambda: optimizer(device),
        "ns5": lambda: ns5(device, hiddens),
        "collectives": lambda: collectives(device),
        "fused": lambda: fused(device),
        "train step": lambda: train_step(device, config),
        "memory": lambda: memory(device, config),
        "sharded fit": lambda: sharded_fit(device, work),
        "transports": lambda: transports(device, work),
        "no host sync": lambda: no_host_sync(device, work),
        "evaluate": lambda: evaluate_check(device, work),
        "failure": lambda: failure(device, work),
    }
    results = []
    for name, check in checks.items():
        if name in skip:
            results.append(Result(name, "skipped", "--skip"))
            continue
        try:
            results.append(check())
        except Exception as err:  # a pre-flight check reports every failure and goes on to the next check
            results.append(Result(name, "FAILED", f"{type(err).__name__}: {err}".splitlines()[0][:200]))
    return results


def table(results: list[Result]) -> str:
    lines = ["| check | status | detail |", "|---|---|---|"]
    lines += [f"| {r.name} | {r.status} | {r.detail} |" for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lightning-muon doctor",
        description=plain_help(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda, cuda:N or cpu (default: cuda if any)",
    )
    parser.add_argument(
        "--hidden", type=int, nargs="+", default=None, help="NS5 timing widths (default 2048 4096; 256 512 on a CPU)"
    )
    parser.add_argument("--skip", nargs="*", default=[], choices=CHECKS, metavar="CHECK", help=f"of {CHECKS}")
    parser.add_argument("--config", default=None, help="config of the train step (default: dit_xl2_imagenet256.yaml)")
    parser.add_argument("--out", default="lightning_logs/doctor.json", help="JSON with every figure")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    hiddens = args.hidden or ([2048, 4096] if device.type == "cuda" else [256, 512])
    results = run_checks(device, hiddens, set(args.skip), args.config)
    print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(f"Figures: {out}")
    return 1 if any(r.status == "FAILED" for r in results) else 0
