"""Every collective and every host read of a tensor in each training step of the loop users run (#43).

``lightning-muon fit`` with the default recipe and every callback the CLI adds (progress, pre-emption, the recipe's
checkpoints, generation evaluation, telemetry, lr monitor), ``--trainer.strategy=muon_fsdp`` on 2 gloo ranks. In each
rank the script wraps ``torch.distributed``'s collectives and the tensor methods that read a value on the host
(``.item()``, ``.tolist()``, ``bool()``, ``float()``, ``int()``, ``.cpu()``, ``.numpy()``) — on a GPU each one waits
for the device to drain — and counts them per training step (one step: a call of Lightning's
``_TrainingEpochLoop.advance`` and everything up to the next, validation included), attributed to their origin: the
first frame outside torch (FSDP2's own frames count as "FSDP2", the optimizer's as "optimizer"). A collective's own
internal reads belong to it. Steps are typed by what happened in them: ``logging`` (the logger wrote),
``evaluation`` (a generation evaluation ran), ``checkpoint`` (a checkpoint was saved), ``validation``; ``typical``
is none of these.

The budget of a typical step: collectives from FSDP2 and the optimizer only, host reads 0 from this package and from
Lightning. ``tests/core/test_step_census.py`` runs this script and holds it to that (control: ``--control``, which
adds a callback logging a value with ``sync_dist=True`` every step — what ``DiTModule.training_step`` did).

    python benchmarks/step_census.py                  # the table, and benchmarks/results/step_census.json
    python benchmarks/step_census.py --control        # the same with a per-step sync_dist=True
"""

from __future__ import annotations

import argparse
import atexit
import collections
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLLECTIVES = (
    "all_reduce", "broadcast", "barrier", "all_gather", "all_gather_into_tensor", "all_gather_single",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "reduce", "gather", "scatter",
    "send", "recv", "isend", "irecv", "all_gather_object", "broadcast_object_list", "gather_object",
    "scatter_object_list", "monitored_barrier",
)  # fmt: skip
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "cpu", "numpy")
KINDS = ("typical", "logging", "evaluation", "checkpoint", "validation")
BUDGET_ORIGINS = ("FSDP2", "optimizer")  # the only collectives a typical step may make
#: host reads of tensors a GPU run keeps on the host too: not syncs (origin prefix → why)
HOST_RESIDENT = {
    "optimizer lightning_muon/optim/adamw.py": "AdamW's step counts are CPU tensors on any device, as torch.optim's",
}
#: STEP_CENSUS_TRACE="<part of 'event | origin'>": each matching event prints the stack that made it (stderr)
TRACE = os.environ.get("STEP_CENSUS_TRACE")


# ------------------------------------------------------------------------------------------- in each rank: counting
class Census:
    """Events per step window of one rank: ``steps[i] = {"marks": set, "events": Counter((event, origin))}``."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.local = threading.local()

    def record(self, event: str) -> None:
        if self.steps:
            where = origin()
            self.steps[-1]["events"][event, where] += 1
            if (
                TRACE and TRACE in f"{event} | {where}" and len(self.steps) > 2
            ):  # where a typical step's event comes from
                traceback.print_stack(sys._getframe(2), limit=14)

    def mark(self, kind: str) -> None:
        if self.steps:
            self.steps[-1]["marks"].add(kind)

    def counting(self, fn, event: str):
        """``fn`` counted as ``event``; events nested inside it (a collective's own reads) are not."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if getattr(self.local, "inside", False):
                return fn(*args, **kwargs)
            self.record(event)
            self.local.inside = True
            try:
                return fn(*args, **kwargs)
            finally:
                self.local.inside = False

        return wrapper

    def marking(self, fn, kind: str):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.mark(kind)
            return fn(*args, **kwargs)

        return wrapper

    def install(self, count: bool = True) -> None:
        """The step windows and their marks; with ``count``, the collectives and host reads too (``count=False``
        times the steps without the wrappers' cost)."""
        import torch
        import torch.distributed as dist
        from lightning.pytorch import Trainer
        from lightning.pytorch.loops import _EvaluationLoop
        from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
        from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

        from lightning_muon.callbacks import GenerationEvaluation

        for name in COLLECTIVES if count else ():
            if hasattr(dist, name):
                setattr(dist, name, self.counting(getattr(dist, name), name))
        for name in READS if count else ():
            setattr(torch.Tensor, name, self.counting(getattr(torch.Tensor, name), f".{name}()"))
        advance = _TrainingEpochLoop.advance

        @functools.wraps(advance)
        def new_step(loop, *args, **kwargs):
            self.steps.append({"marks": set(), "events": collections.Counter(), "start": time.perf_counter()})
            return advance(loop, *args, **kwargs)

        _TrainingEpochLoop.advance = new_step
        _LoggerConnector.log_metrics = self.marking(_LoggerConnector.log_metrics, "logging")
        Trainer.save_checkpoint = self.marking(Trainer.save_checkpoint, "checkpoint")
        _EvaluationLoop.run = self.marking(_EvaluationLoop.run, "validation")
        GenerationEvaluation.evaluate = self.marking(GenerationEvaluation.evaluate, "evaluation")

    def dump(self, path: Path) -> None:
        ends = [s["start"] for s in self.steps[1:]] + [time.perf_counter()]
        steps = [
            {
                "marks": sorted(s["marks"]),
                "events": [[e, o, n] for (e, o), n in s["events"].items()],
                "seconds": t - s["start"],
            }
            for s, t in zip(self.steps, ends, strict=True)
        ]
        path.write_text(json.dumps({"steps": steps}))


def origin() -> str:
    """The first frame, innermost first, outside torch and this script: ``FSDP2``, ``optimizer <file>:<function>``
    (``lightning_muon/optim``), ``lightning-muon <file>:<function>``, ``Lightning <file>:<function>`` or
    ``<package> <file>:<function>``."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if "/torch/distributed/fsdp/" in path:
            return "FSDP2"
        if path != __file__ and "/torch/" not in path and "functools" not in path:
            return _name(path, frame.f_code.co_name)
        frame = frame.f_back
    return "?"


def _name(path: str, function: str) -> str:
    p = Path(path)
    if p.is_relative_to(ROOT):
        rel = p.relative_to(ROOT).as_posix()
        package = "optimizer" if rel.startswith("lightning_muon/optim/") else "lightning-muon"
        return f"{package} {rel}:{function}"
    parts = p.parts
    for package in ("lightning", "torchmetrics", "lightning_fabric", "diffusers"):
        if package in parts:
            rel = "/".join(parts[len(parts) - parts[::-1].index(package) :])
            return f"{'Lightning' if package.startswith('lightning') else package} {rel}:{function}"
    return f"{p.name}:{function}"


def run_rank(out: Path, fit_args: list[str]) -> None:
    """One rank (Lightning re-runs this script for rank 1): count, fit, write ``census_rank<r>.json``."""
    census = Census()
    census.install(count=not os.environ.get("STEP_CENSUS_TIMING"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    atexit.register(census.dump, out / f"census_rank{rank}.json")
    from lightning_muon.recipes.cli import main

    main(["fit", *fit_args])


def __getattr__(name: str):
    """``step_census.SyncDistLoss``, the control's callback (built on demand: the parent process never imports
    Lightning): it logs the step's loss with ``sync_dist=True`` every step, as ``DiTModule.training_step`` did."""
    if name != "SyncDistLoss":
        raise AttributeError(name)
    from lightning.pytorch.callbacks import Callback

    class SyncDistLoss(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pl_module.log("control/loss", outputs["loss"].detach(), sync_dist=True)

    return SyncDistLoss


# --------------------------------------------------------------------------------------------------- the census
#: the default recipe's callbacks at a scale where each kind of step occurs within a few dozen steps
SCALE = """
trainer:
  devices: 2
  strategy: muon_fsdp
  log_every_n_steps: 5
  val_check_interval: 12
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {every_n_train_steps: 10, save_top_k: -1, save_last: true}
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {monitor: eval/fd_digits, mode: min, every_n_train_steps: 10, save_top_k: 1}
    - class_path: lightning_muon.callbacks.GenerationEvaluation
      init_args: {every_n_steps: 8, sampling: {num_samples: 101, num_inference_steps: 3, batch_size: 32}}
    - class_path: lightning_muon.callbacks.OptimizerTelemetry
    - class_path: lightning.pytorch.callbacks.LearningRateMonitor
      init_args: {logging_interval: step}
data:
  init_args: {batch_size: 16}
"""


def fit_args(work: Path, steps: int, control: bool) -> list[str]:
    """The default recipe on 2 ranks with every callback (``SCALE``)."""
    (work / "scale.yaml").write_text(SCALE)
    args = ["--config", str(ROOT / "recipes" / "configs" / "digits_tiny.yaml"), "--config", str(work / "scale.yaml")]
    args += [f"--trainer.max_steps={steps}", f"--trainer.default_root_dir={work}"]
    return args + (["--control"] if control else [])


def summarize(rank_steps: list[list[dict]]) -> dict:
    """Per rank and kind of step: the steps of that kind and the mean count per step of each (event, origin)."""
    ranks = []
    for steps in rank_steps:
        table: dict[str, dict] = {}
        for kind in KINDS:
            chosen = [s for s in steps if (kind == "typical" and not s["marks"]) or kind in s["marks"]]
            counts: collections.Counter = collections.Counter()
            for s in chosen:
                for event, where, n in s["events"]:
                    counts[f"{event} | {where}"] += n
            table[kind] = {"steps": len(chosen), "per_step": {k: v / max(len(chosen), 1) for k, v in counts.items()}}
        ranks.append(table)
    return {"ranks": ranks}


def violations(summary: dict) -> list[str]:
    """What a typical step does beyond its budget, on any rank."""
    found = []
    for rank, table in enumerate(summary["ranks"]):
        for key, per_step in table["typical"]["per_step"].items():
            event, where = key.split(" | ")
            if event.startswith("."):
                ours = where.startswith(("lightning-muon", "optimizer", "Lightning"))
                if ours and not where.startswith(tuple(HOST_RESIDENT)):
                    found.append(f"rank {rank}: {per_step:g} {event} per typical step from {where}")
            elif where.split()[0] not in BUDGET_ORIGINS:
                found.append(f"rank {rank}: {per_step:g} {event} per typical step from {where}")
    return found


def markdown(summary: dict) -> str:
    table = summary["ranks"][0]
    keys = sorted({k for kind in KINDS for k in table[kind]["per_step"]})
    head = " | ".join(f"{kind} ({table[kind]['steps']})" for kind in KINDS)
    lines = [f"| event | origin | {head} |", "|---|---|" + "---:|" * len(KINDS)]
    for key in keys:
        event, where = key.split(" | ")
        cells = " | ".join(f"{table[kind]['per_step'].get(key, 0):.3g}" for kind in KINDS)
        lines.append(f"| `{event}` | {where} | {cells} |")
    return "\n".join(lines)


def run_fit(steps: int, control: bool = False, python: str = sys.executable, timing: bool = False) -> list[dict]:
    """The 2-rank fit in a fresh process tree under ``python``; each rank's step windows."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cmd = [python, __file__, "--rank", str(work), *fit_args(work, steps, control)]
        env = {**os.environ, **({"STEP_CENSUS_TIMING": "1"} if timing else {})}
        proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=1800, env=env)
        files = [work / f"census_rank{r}.json" for r in range(2)]
        for _ in range(100):  # rank 1 may still be writing at exit
            if all(f.is_file() for f in files):
                break
            time.sleep(0.1)
        if proc.returncode != 0 or not all(f.is_file() for f in files):
            raise RuntimeError(f"the census run failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        # the first step also warms up (lazy inits); the last window also holds the end of training
        return [json.loads(f.read_text())["steps"][1:-1] for f in files]


def census(steps: int = 26, control: bool = False) -> dict:
    """The census of a 2-rank fit: the summary, the violations of the typical step's budget and the table."""
    summary = summarize(run_fit(steps, control))
    summary["violations"] = violations(summary)
    summary["table"] = markdown(summary)
    return summary


def typical_seconds(steps: int, python: str) -> float:
    """The median wall time of a typical step (the slower rank's), without the census' wrappers."""
    ranks = run_fit(steps, python=python, timing=True)
    return max(statistics.median(s["seconds"] for s in windows if not s["marks"]) for windows in ranks)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank"]:  # a rank of the fit (Lightning re-runs this command line for rank 1)
        control = "--control" in argv
        args = [a for a in argv[2:] if a != "--control"]
        if control:
            args.append("--trainer.callbacks+=step_census.SyncDistLoss")
        sys.path.insert(0, str(Path(__file__).parent))
        run_rank(Path(argv[1]), args)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=26, help="optimizer steps of the fit")
    parser.add_argument("--control", action="store_true", help="add a per-step sync_dist=True log (the old loss log)")
    parser.add_argument("--out", default="benchmarks/results/step_census.json")
    parser.add_argument(
        "--timing",
        nargs="*",
        metavar="LABEL=PYTHON",
        help="instead: the median typical step time (no wrappers), 60 steps, under each interpreter (e.g. "
        "before=/tmp/old/bin/python after=python: an environment with another checkout installed)",
    )
    args = parser.parse_args(argv)
    if args.timing is not None:
        runs = dict(item.split("=", 1) for item in args.timing) or {"this checkout": sys.executable}
        seconds = {label: typical_seconds(60, python) for label, python in runs.items()}
        first = next(iter(seconds.values()))
        print("| code | typical 2-rank step (ms, median) | ratio |\n|---|---:|---:|")
        print("\n".join(f"| {k} | {1000 * v:.1f} | {v / first:.2f} |" for k, v in seconds.items()))
        Path(args.out).write_text(json.dumps({"command": " ".join(["python", __file__, *argv]), "seconds": seconds}))
        return
    summary = census(args.steps, args.control)
    print(summary["table"])
    print("\nviolations of the typical step's budget:", *(summary["violations"] or ["none"]), sep="\n- ")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(["python", __file__, *argv]), **summary}, indent=1))


if __name__ == "__main__":
    main()
