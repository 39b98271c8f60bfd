"""The fault matrix: the default ``lightning-muon fit`` (1 CPU), ``lightning-muon evaluate`` and a 2-rank ``muon_fsdp``
fit, each run as a user runs it (a subprocess of the CLI), under one fault at a time. For each: the exit code, the
message, what is on disk afterwards, and whether rerunning with ``fit --ckpt_path DIR`` ends with exactly the weights
of the uninterrupted run.

Full disks and read-only directories are real: a tmpfs of a computed size (or mounted read-only) at the checkpoint,
cache or output directory, so the kernel returns ``ENOSPC`` / ``EROFS`` exactly where the row says (sizes in pages,
measured on the uninterrupted run: the checkpoint directory holds ``metrics.jsonl`` and the checkpoints, the
TensorBoard logs live elsewhere). Mounting needs root (CAP_SYS_ADMIN); without it :func:`can_mount` is false.
Signals are sent by a callback to its own process (``signals.py`` beside this file) at a chosen step: from inside a
checkpoint's save (SIGTERM) or between steps (SIGUSR1 with Slurm's environment: Lightning's requeue path).

    python benchmarks/faults.py --matrix        # the table in docs/reliability.md
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import yaml

from lightning_muon.checkpoint import (
    checkpoint_problem,
    is_distributed_checkpoint,
    load_distributed,
    newest_checkpoint,
    read_metadata,
)

ROOT = Path(__file__).parents[2]
DEFAULT = ROOT / "recipes" / "configs" / "digits_tiny.yaml"
RUN = Path(__file__).parent / "fault_run.yaml"
PAGE = 4096
HOSTILE = {"num_layers": 200_000, "num_attention_heads": 64, "attention_head_dim": 128}
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "1",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_JOB_NAME": "fault-matrix",
    "SLURM_NODELIST": "127.0.0.1",
    "SLURM_NODEID": "0",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}


# ------------------------------------------------------------------------------------------------ filesystems
def _mount(path: Path, options: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], check=True, capture_output=True)


@contextlib.contextmanager
def filesystem(path: Path, pages: int | None = None, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``pages`` pages (or read-only) at ``path`` while the block runs."""
    _mount(path, ",".join(["ro" if read_only else "rw", f"size={(pages or 1) * PAGE}"]))
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


def can_mount() -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with filesystem(Path(tmp) / "m", pages=1):
                return True
        except (OSError, subprocess.CalledProcessError):
            return False


def pages(path: Path) -> int:
    """Pages a file or directory tree takes on a tmpfs."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(math.ceil(p.stat().st_size / PAGE) for p in files)


# ------------------------------------------------------------------------------------------------------- runs
def cli(args: list[str], env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightning_muon.recipes.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def environment(cache: Path, **extra: str) -> dict[str, str]:
    python_path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": python_path, "LIGHTNING_MUON_CACHE": str(cache), **extra}


def fit_args(root: Path, ckpt_dir: Path, ranks: int = 1, callbacks: tuple[dict, ...] = (), resume: Path | None = None):
    """``fit`` of the default recipe for 6 steps (``fault_run.yaml``), checkpoints in ``ckpt_dir``."""
    config = yaml.safe_load(RUN.read_text())
    config["trainer"]["callbacks"][0]["init_args"]["dirpath"] = str(ckpt_dir)
    config["trainer"]["callbacks"] += list(callbacks)
    if ranks > 1:
        config["trainer"].update(devices=ranks, strategy="muon_fsdp")
    root.mkdir(parents=True, exist_ok=True)
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    args = ["fit", "--config", str(DEFAULT), "--config", str(root / "run.yaml")]
    args += ["--trainer.default_root_dir", str(root / "logs")]
    return args + (["--ckpt_path", str(resume)] if resume else [])


def evaluate_args(runs: Path, out: Path) -> list[str]:
    return ["evaluate", str(runs), "--out", str(out), "--metrics", "fd_digits", "--num-samples", "32"] + [
        "--num-inference-steps",
        "2",
    ]


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The ``model.*`` and ``ema.*`` tensors of a checkpoint (file or distributed directory)."""
    if not is_distributed_checkpoint(path):
        state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
        return {k: v for k, v in state.items() if k.startswith(("model.", "ema."))}
    metadata = read_metadata(path).state_dict_metadata
    state = {
        k.removeprefix("state_dict."): torch.empty(tuple(v.size), dtype=v.properties.dtype)
        for k, v in metadata.items()
        if k.startswith(("state_dict.model.", "state_dict.ema."))
    }
    load_distributed({"state_dict": state}, path)
    return state


def difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        return math.inf
    return max((x.double() - b[k].double()).abs().max().item() for k, x in a.items())


def listing(directory: Path, planted: str = "") -> str:
    """Checkpoints (complete / damaged), other files and temporaries left in ``directory`` (``planted``: the
    checkpoint the row damaged itself)."""
    if not directory.exists():
        return "nothing"
    names = []
    for path in sorted(directory.iterdir()):
        if path.name.startswith("."):
            names.append(f"{path.name} (temporary!)")
        elif path.name == planted:
            names.append(f"{path.name} (truncated by the row)")
        elif path.suffix == ".ckpt":
            names.append(f"{path.name} {'complete' if checkpoint_problem(path) is None else 'DAMAGED'}")
        else:
            names.append(path.name)
    return ", ".join(names) or "empty"


def message_of(proc: subprocess.CompletedProcess, marker: str) -> str:
    """The stderr line holding ``marker`` (the last line when none does)."""
    lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
    found = [line for line in lines if marker in line]
    return (found[-1] if found else lines[-1] if lines else "")[:300]


class Matrix:
    """Runs the rows, sharing one uninterrupted run per kind (the reference weights) and one feature cache."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.cache = base / "cache"
        self.rows: list[dict[str, Any]] = []
        self.reference: dict[int, dict[str, Any]] = {}

    def env(self, **extra: str) -> dict[str, str]:
        return environment(self.cache, **extra)

    # ------------------------------------------------------------------------------------------ references
    def uninterrupted(self, ranks: int) -> dict[str, Any]:
        """The run without a fault: its checkpoint directory, page counts and final weights."""
        if ranks not in self.reference:
            root = self.base / f"reference-{ranks}"
            shutil.rmtree(root, ignore_errors=True)
            proc = cli(fit_args(root, root / "ckpt", ranks), self.env())
            if proc.returncode != 0:
                raise RuntimeError(f"the uninterrupted {ranks}-rank run failed:\n{proc.stderr[-3000:]}")
            ckpt = root / "ckpt"
            self.reference[ranks] = {
                "ckpt": ckpt,
                "checkpoint_pages": pages(ckpt / "epoch=0-step=2.ckpt"),
                "jsonl_pages": 1,
                "final": weights(ckpt / "last.ckpt"),
            }
        return self.reference[ranks]

    def resume(self, root: Path, ckpt_dir: Path, ranks: int = 1) -> str:
        """Rerun the interrupted command, with ``--ckpt_path`` the checkpoint directory it left, and compare the final
        weights with the uninterrupted run's."""
        proc = cli(fit_args(root, ckpt_dir, ranks, resume=ckpt_dir), self.env())
        if proc.returncode != 0:
            return f"FAILED (exit {proc.returncode}: {message_of(proc, 'Error')})"
        newest, step = newest_checkpoint(ckpt_dir)  # last.ckpt, or last-v1.ckpt beside files the run did not write
        diff = difference(weights(newest), self.uninterrupted(ranks)["final"])
        return "exact" if diff == 0 and step == 6 else f"DIFFERS by {diff:.3g} (step {step})"

    def add(self, run: str, fault: str, proc: subprocess.CompletedProcess | None, expect: tuple[int, str], **row):
        code = None if proc is None else proc.returncode
        message = row.pop("message", None) or ("" if proc is None else message_of(proc, expect[1]))
        ok = code == expect[0] and expect[1] in message
        ok &= "temporary!" not in row.get("on_disk", "") and "DAMAGED" not in row.get("on_disk", "")
        ok &= row.get("resume", "exact") == "exact" or row["resume"].startswith("n/a (")  # nothing to resume
        self.rows.append({"run": run, "fault": fault, "exit": code, "message": message, **row, "ok": bool(ok)})

    # ----------------------------------------------------------------------------------------------- fit
    def disk_full(self, ranks: int, name: str, fault: str, free_pages: Callable[[dict[str, Any]], int], at: str):
        """The checkpoint directory a tmpfs with room for the step-2 files and ``free_pages`` more."""
        ref = self.uninterrupted(ranks)
        root = self.base / name
        ckpt = root / "ckpt"
        size = ref["jsonl_pages"] + 2 * ref["checkpoint_pages"] + free_pages(ref)
        with filesystem(ckpt, pages=size):
            proc = cli(fit_args(root, ckpt, ranks), self.env())
            on_disk = listing(ckpt)
            shutil.copytree(ckpt, root / "left", dirs_exist_ok=True)
        shutil.copytree(root / "left", ckpt, dirs_exist_ok=True)  # space freed: the same directory, on a big disk
        run = "fit" if ranks == 1 else f"muon_fsdp fit, {ranks} ranks"
        resume = self.resume(root, ckpt, ranks)
        self.add(run, fault, proc, (1, "No space left"), on_disk=on_disk, resume=resume, where=at)

    def fit_rows(self) -> None:
        one = 1
        self.disk_full(
            one,
            "full-at-checkpoint",
            "disk full at a checkpoint (less free than it needs)",
            lambda r: 1,
            "epoch=0-step=4.ckpt",
        )
        self.disk_full(
            one,
            "full-mid-checkpoint",
            "disk full in the middle of writing a checkpoint",
            lambda r: r["checkpoint_pages"] - 8,
            "epoch=0-step=4.ckpt",
        )
        self.disk_full(one, "full-at-jsonl", "disk full at metrics.jsonl", lambda r: 0, "metrics.jsonl")
        self.cache_fault("fit", "disk full at the reference cache", read_only=False)
        self.cache_fault("fit", "cache directory not writable", read_only=True)
        root = self.base / "ro-output"
        with filesystem(root / "logs", read_only=True):
            proc = cli(fit_args(root, root / "logs" / "ckpt"), self.env())
            on_disk = listing(root / "logs")
        self.add(
            "fit",
            "output directory read-only",
            proc,
            (1, "Cannot write to"),
            on_disk=on_disk,
            resume="n/a (nothing interrupted)",
        )
        self.signal_rows(1)
        self.damaged_rows(1)

    def cache_fault(self, run: str, fault: str, read_only: bool) -> None:
        """An empty feature cache on a one-page (or read-only) tmpfs: the digits classifier and the reference
        statistics cannot be cached; the run warns and goes on."""
        root = self.base / ("ro-cache" if read_only else "full-cache") / run
        cache = root / "cache"
        with filesystem(cache, pages=1, read_only=read_only):
            if run == "fit":
                proc = cli(fit_args(root, root / "ckpt"), environment(cache))
            else:
                self.uninterrupted(1)
                proc = cli(evaluate_args(self.reference[1]["ckpt"], root / "eval"), environment(cache))
            on_disk = f"cache: {listing(cache)}"
        resume = "n/a (nothing interrupted)"
        if run == "fit" and proc.returncode == 0:
            diff = difference(weights(root / "ckpt" / "last.ckpt"), self.uninterrupted(1)["final"])
            resume = "n/a (nothing interrupted)" if diff == 0 else f"weights DIFFER by {diff:.3g}"
        self.add(run, fault, proc, (0, "not cached"), on_disk=on_disk, resume=resume)

    def signal_rows(self, ranks: int) -> None:
        run = "fit" if ranks == 1 else f"muon_fsdp fit, {ranks} ranks"
        root = self.base / f"sigterm-{ranks}"
        during_save = {"class_path": "signals.SignalDuringSave", "init_args": {"signal_name": "SIGTERM", "step": 4}}
        proc = cli(fit_args(root, root / "ckpt", ranks, (during_save,)), self.env())
        self.add(
            run,
            "SIGTERM during a checkpoint save (step 4)",
            proc,
            (143, "Stopped by SIGTERM"),
            on_disk=listing(root / "ckpt"),
            resume=self.resume(root, root / "ckpt", ranks),
            message=message_of(proc, "Stopped by SIGTERM"),
        )
        if ranks > 1:
            return self.plain_trainer_sigterm_row(ranks)
        root = self.base / "slurm"
        warning = {"class_path": "signals.SignalAfterStep", "init_args": {"signal_name": "SIGUSR1", "step": 3}}
        proc = cli(fit_args(root, root / "ckpt", ranks, (warning,)), self.env(**SLURM))
        hpc = sorted((root / "logs").glob("hpc_ckpt_*.ckpt"))
        on_disk = listing(root / "logs")
        resume = "FAILED (no hpc_ckpt_*.ckpt)"
        if hpc:
            again = self.base / "slurm-requeued"
            proc2 = cli(fit_args(again, again / "ckpt", resume=hpc[-1]), self.env())
            resume = f"FAILED (exit {proc2.returncode})"
            if proc2.returncode == 0:
                diff = difference(weights(again / "ckpt" / "last.ckpt"), self.uninterrupted(1)["final"])
                resume = "exact" if diff == 0 else f"DIFFERS by {diff:.3g}"
        self.add(
            run,
            "Slurm pre-emption: SIGUSR1 with SLURM_JOB_ID (step 3)",
            proc,
            (0, "hpc_ckpt"),
            on_disk=on_disk,
            resume=resume,
            message=message_of(proc, "Slurm pre-emption: saved"),
        )

    def plain_trainer_sigterm_row(self, ranks: int) -> None:
        """``Trainer(strategy="muon_fsdp")`` in a user's script (no CLI, no callback of ours; log_every_n_steps 2):
        SIGTERM to the last rank only after step 3. The strategy's pre-emption agrees at the next logging step: every
        rank stops before step 5, exit 143 (without the agreement that rank would stop alone and the others hang)."""
        root = self.base / f"plain-sigterm-{ranks}"
        script = ROOT / "tests" / "scripts" / "fit_muon_fsdp.py"
        cmd = [sys.executable, str(script), "--devices", str(ranks), "--epochs", "2", "--root", str(root / "run")]
        cmd += ["--record", str(root / "record.json"), "--sigterm", "3", str(ranks - 1), "--log-every-n-steps", "2"]
        root.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env(), cwd=root, timeout=600)
        stopped = {}
        for rank in range(ranks):
            path = root / "run" / f"stopped_rank{rank}.json"
            stopped[rank] = json.loads(path.read_text())["step"] if path.is_file() else None
        agreed = set(stopped.values()) == {4}
        message = "every rank stopped before step 5" if agreed else f"ranks stopped at {stopped}"
        run, fault = f"Trainer(strategy='muon_fsdp'), {ranks} ranks", "SIGTERM to one rank (step 3)"
        expect = (143, "every rank stopped before step 5")
        self.add(
            run, fault, proc, expect, on_disk=f"stops: {stopped}", message=message, resume="n/a (no checkpoint written)"
        )

    def damaged_rows(self, ranks: int) -> None:
        """The uninterrupted run's checkpoints with step 4 truncated and steps 6 / last gone: resuming from the
        directory takes step 2; naming the truncated one (and a checkpoint with hostile sizes) is one line."""
        run = "fit" if ranks == 1 else f"muon_fsdp fit, {ranks} ranks"
        ref = self.uninterrupted(ranks)
        root = self.base / f"truncated-{ranks}"
        left = root / "left"
        shutil.copytree(ref["ckpt"], left, dirs_exist_ok=True)
        for name in ("epoch=0-step=6.ckpt", "last.ckpt"):
            target = left / name
            shutil.rmtree(target) if target.is_dir() else target.unlink()
        damaged = left / "epoch=0-step=4.ckpt"
        victim = max(damaged.glob("*.distcp"), key=lambda p: p.stat().st_size) if damaged.is_dir() else damaged
        os.truncate(victim, victim.stat().st_size // 2)
        proc = cli(["validate", "--ckpt_path", str(damaged), "--trainer.devices", "1"], self.env())
        on_disk = listing(left, planted=damaged.name)
        self.add(
            run,
            "truncated checkpoint named on the command line",
            proc,
            (2, "truncated, damaged"),
            on_disk=on_disk,
            resume=self.resume(root, left, ranks),
        )
        if ranks > 1:
            return
        hostile = root / "hostile.ckpt"
        checkpoint = torch.load(ref["ckpt"] / "epoch=0-step=2.ckpt", weights_only=True)
        checkpoint["hyper_parameters"]["model_config"].update(HOSTILE)
        torch.save(checkpoint, hostile)
        start = time.perf_counter()
        proc = cli(["validate", "--ckpt_path", str(hostile)], self.env())
        seconds = time.perf_counter() - start
        self.add(
            run,
            "checkpoint with hostile sizes (200,000 layers of 64x128)",
            proc,
            (2, "num_layers"),
            on_disk=f"refused after {seconds:.1f} s (process start included)",
            resume="n/a (nothing interrupted)",
        )

    # ------------------------------------------------------------------------------------------ evaluate
    def evaluate_rows(self) -> None:
        runs = self.uninterrupted(1)["ckpt"]
        straight = self.base / "eval-reference"
        cli(evaluate_args(runs, straight), self.env())
        root = self.base / "eval-full"
        with filesystem(root / "out", pages=1):
            proc = cli(evaluate_args(runs, root / "out"), self.env())
            on_disk = listing(root / "out")
            shutil.copytree(root / "out", root / "left", dirs_exist_ok=True)
        again = cli(evaluate_args(runs, root / "left"), self.env())
        same = (root / "left" / "results.csv").is_file() and _rows(root / "left") == _rows(straight)
        resume = "exact" if again.returncode == 0 and same else f"DIFFERS (exit {again.returncode})"
        self.add("evaluate", "disk full at results.csv", proc, (1, "No space left"), on_disk=on_disk, resume=resume)
        self.cache_fault("evaluate", "disk full at the reference cache", read_only=False)
        self.cache_fault("evaluate", "cache directory not writable", read_only=True)
        root = self.base / "eval-ro"
        with filesystem(root / "out", read_only=True):
            proc = cli(evaluate_args(runs, root / "out"), self.env())
        self.add(
            "evaluate",
            "output directory read-only",
            proc,
            (1, "Cannot write to"),
            on_disk="nothing",
            resume="n/a (nothing interrupted)",
        )
        bad = self.base / "eval-damaged"
        shutil.copytree(runs, bad / "run", dirs_exist_ok=True)
        os.truncate(bad / "run" / "epoch=0-step=4.ckpt", 1000)
        checkpoint = torch.load(runs / "epoch=0-step=2.ckpt", weights_only=True)
        checkpoint["hyper_parameters"]["model_config"].update(HOSTILE)
        checkpoint["global_step"] = 8
        torch.save(checkpoint, bad / "run" / "hostile.ckpt")
        proc = cli(evaluate_args(bad / "run", bad / "out"), self.env())
        errors = (bad / "out" / "errors.txt").read_text() if (bad / "out" / "errors.txt").is_file() else ""
        scored = sorted(r["step"] for r in _rows(bad / "out"))
        named = "epoch=0-step=4.ckpt" in errors and "num_layers" in errors
        self.add(
            "evaluate",
            "a truncated checkpoint and one with hostile sizes in the run",
            proc,
            (1, "naming both"),
            message=f"errors.txt: {len(errors.splitlines())} lines, naming both" if named else errors[:200],
            on_disk=f"results.csv scores steps {scored}",
            resume="n/a (nothing interrupted)",
        )

    # ---------------------------------------------------------------------------------------- muon_fsdp
    def muon_fsdp_rows(self, ranks: int = 2) -> None:
        ref = self.uninterrupted(ranks)
        self.disk_full(
            ranks, "fsdp-full", "disk full at a checkpoint", lambda r: r["checkpoint_pages"] // 2, "epoch=0-step=4.ckpt"
        )
        self.signal_rows(ranks)
        self.damaged_rows(ranks)
        assert ref["final"]

    def run_all(self, kinds: tuple[str, ...] = ("fit", "evaluate", "muon_fsdp")) -> list[dict[str, Any]]:
        for kind in kinds:
            {"fit": self.fit_rows, "evaluate": self.evaluate_rows, "muon_fsdp": self.muon_fsdp_rows}[kind]()
        return self.rows


def _rows(out: Path) -> list[dict[str, str]]:
    import csv

    path = out / "results.csv"
    if not path.is_file():
        return []
    with path.open() as f:
        return sorted(
            ({k: v for k, v in r.items() if k != "eval/seconds"} for r in csv.DictReader(f)), key=lambda r: r["step"]
        )


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | fault | exit | message | on disk afterwards | resume | ok |", "|---|---|---:|---|---|---|---|"]
    for r in rows:
        cells = [r["run"], r["fault"], str(r["exit"]), f"`{r['message']}`", r["on_disk"], r["resume"]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + f" | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines)
