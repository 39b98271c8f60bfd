"""``lightning-muon evaluate``: generation metrics for every checkpoint of one or several runs, as CSV, Markdown
and one PNG per metric (metric vs training step, a line per run) — the paper's AdamW / Muon / Periodic comparison.

    lightning-muon evaluate lightning_logs/version_0 lightning_logs/version_1 --metrics fd_digits prdc_digits

Reads single-file Lightning checkpoints and the torch.distributed.checkpoint directories that ``muon_fsdp`` /
``ModelParallelStrategy`` write, and only the sampling weights in them (EMA when present; never the optimizer
state). Architecture, classes and the VAE / text-encoder paths come from the checkpoint's hyperparameters (flags
override). Under ``torchrun --nproc-per-node N`` generation is sharded over the N ranks (sample i is the same on
any number). Rerunning skips checkpoints already in the CSV.
"""

from __future__ import annotations

import argparse
import csv
import functools
import glob
import logging
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_muon.checkpoint import is_distributed_checkpoint, load_distributed
from lightning_muon.metrics.evaluation import (
    METRIC_NAMES,
    MetricSuite,
    Sampling,
    prepare_references,
    read_prompts,
    real_images_of,
    score_generation,
)
from lightning_muon.metrics.features import cache_dir
from lightning_muon.optim.transport import note_gloo_collectives
from lightning_muon.recipes.data import DigitsDataModule
from lightning_muon.recipes.flags import option_names, plain_help
from lightning_muon.recipes.module import DiTModule
from lightning_muon.recipes.networks import build_transformer, cast
from lightning_muon.recipes.trust import checked_checkpoint, checked_hparams, checkpoint_meta
from lightning_muon.storage import atomic_write, check_writable, exit_on_storage_error

__all__ = [
    "build_parser",
    "find_checkpoints",
    "load_generator",
    "main",
    "module_from_hparams",
    "plan_checkpoints",
]

log = logging.getLogger(__name__)


def find_checkpoints(run: str) -> list[Path]:
    """Checkpoints under a run directory (or matching a glob): ``*.ckpt`` regular files and distributed-checkpoint
    directories, each folder's ``last.ckpt`` after its step checkpoints (it usually repeats one of their steps:
    :func:`plan_checkpoints` keeps one checkpoint per step)."""
    roots = [Path(p) for p in sorted(glob.glob(run))] or [Path(run)]
    found: list[Path] = []
    for root in roots:
        if root.suffix == ".ckpt" and (root.is_file() or is_distributed_checkpoint(root)):
            found.append(root)
            continue
        paths = sorted(root.rglob("*.ckpt"), key=lambda p: (p.parent, p.name == "last.ckpt", p.name))
        found += [p for p in paths if p.is_file() or is_distributed_checkpoint(p)]
    return found


def plan_checkpoints(
    runs: list[str], rows: list[dict[str, str]]
) -> tuple[list[tuple[str, Path, dict[str, Any]]], list[str]]:
    """``(run, checkpoint, metadata)`` to evaluate — one checkpoint per distinct step of a run (``best-step=N`` and
    ``epoch=…-step=N`` are the same weights; ``last.ckpt`` only when no other holds its step), leaving out steps
    already in ``rows`` — and the checkpoints whose metadata cannot be read, as ``"path: reason"``."""
    seen = {(r["run"], str(r["step"])) for r in rows} | {(r["run"], r["checkpoint"]) for r in rows}
    todo, failed = [], []
    for run in runs:
        name = Path(run).name or run
        for ckpt in find_checkpoints(run):
            if (name, str(ckpt)) in seen:
                continue
            try:
                meta = checkpoint_meta(ckpt)
                step = str(int(meta.get("global_step", 0)))
            except Exception as err:  # unreadable or damaged: reported, the sweep goes on
                failed.append(f"{ckpt}: {type(err).__name__}: {err}")
                continue
            if (name, step) not in seen:
                seen.add((name, step))
                todo.append((name, ckpt, meta))
    return todo, failed


def module_from_hparams(hparams: dict[str, Any] | None) -> DiTModule:
    """A :class:`DiTModule` for sampling from saved hyperparameters, checked first
    (:func:`~lightning_muon.recipes.trust.checked_hparams`: plain data of the right types, nothing instantiated from
    the file): the network on the meta device (no EMA copy: the weights loaded into it are the EMA's), frozen VAE /
    text encoder loaded from their saved paths."""
    if not hparams:
        raise ValueError("The checkpoint has no hyper_parameters: it was not written by DiTModule.")
    module = DiTModule(**{**checked_hparams(hparams, DiTModule), "ema_decay": 0.0})
    with torch.device("meta"):
        module.model = build_transformer(module.hparams.architecture, module.model_config)
    module.configure_model()  # the network exists: this loads only the frozen models
    return module


def load_generator(
    path: Path, device: torch.device, dtype: torch.dtype = torch.float32, meta: dict[str, Any] | None = None
) -> tuple[DiTModule, dict]:
    """The sampling network of a checkpoint — its EMA weights when it has them, else the trained ones — and the
    checkpoint's metadata. Only those weights are read (from a distributed checkpoint with a partial
    ``torch.distributed.checkpoint.load``), never the optimizer state or the other copy, directly in ``dtype``."""
    hparams = checked_checkpoint(path, DiTModule, meta)  # complete, typed, and its sizes those of its weights
    meta = checkpoint_meta(path) if meta is None else meta  # the sweep read it already when it planned
    module = module_from_hparams(hparams)
    prefix = "ema." if hparams.get("ema_decay", 0) > 0 else "model."
    net = cast(module.model, dtype).to_empty(device=device)
    module.on_materialized()  # buffers that are not in the state dict (sin-cos position tables)
    target = net.state_dict()
    try:
        if is_distributed_checkpoint(path):
            load_distributed({"state_dict": {prefix + k: v for k, v in target.items()}}, path)
        else:
            saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["state_dict"]
            net.load_state_dict({k.removeprefix(prefix): v for k, v in saved.items() if k.startswith(prefix)})
    except (RuntimeError, KeyError) as err:
        raise ValueError(f"Checkpoint {path} does not match its hyper-parameters ({prefix}* weights): {err}") from err
    return module.to(device).eval(), meta


def _read_rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    columns = ["run", "checkpoint", "step"] + sorted({k for r in rows for k in r} - {"run", "checkpoint", "step"})

    def write(tmp: Path) -> None:
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, columns)
            writer.writeheader()
            writer.writerows(rows)

    atomic_write(path, write)


def write_markdown(rows: list[dict[str, Any]], path: Path) -> None:
    metrics = sorted({k for r in rows for k in r} - {"run", "checkpoint", "step"})
    lines = ["| run | step | " + " | ".join(metrics) + " |", "|---|---:|" + "---:|" * len(metrics)]
    for r in sorted(rows, key=lambda r: (r["run"], int(r["step"]))):
        cells = [f"{float(r[m]):.4g}" if r.get(m) not in (None, "") else "" for m in metrics]
        lines.append(f"| {r['run']} | {r['step']} | " + " | ".join(cells) + " |")
    atomic_write(path, lambda tmp: tmp.write_text("\n".join(lines) + "\n"))


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """One PNG per metric: the metric against the training step, a line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for metric in sorted({k for r in rows for k in r} - {"run", "checkpoint", "step", "eval/seconds"}):
        fig, ax = plt.subplots(figsize=(6, 4))
        for run in sorted({r["run"] for r in rows}):
            points = sorted((int(r["step"]), float(r[metric])) for r in rows if r["run"] == run and r.get(metric))
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=run)
        ax.set_xlabel("training step")
        ax.set_ylabel(metric.removeprefix("eval/"))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out / f"{metric.removeprefix('eval/').replace('/', '_')}.png"
        atomic_write(path, functools.partial(fig.savefig, dpi=120, format="png"))
        plt.close(fig)
        written.append(path)
    return written


def _init_distributed(device: str | None) -> torch.device:
    """Under torchrun (``WORLD_SIZE`` > 1) join the process group — NCCL on GPUs, gloo on CPUs — so generation and
    the metrics are sharded over ranks as in training; the device of this rank.

    On CUDA this rank's GPU (``LOCAL_RANK``) becomes the current device before the group exists and is bound to it
    (``device_id``): NCCL collectives, the object collectives (reference statistics, checkpoint metadata) included,
    run on each rank's own GPU — never all on ``cuda:0``."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available() and device in (None, "cuda")
    rank_device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device(device or "cpu")
    if cuda:
        torch.cuda.set_device(rank_device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=rank_device if cuda else None)
        note_gloo_collectives()
    return rank_device


def add_dataclass_arguments(parser: argparse.ArgumentParser, kind: type, **overrides: tuple[Any, type, str]) -> None:
    """``--num_samples`` etc.: one flag per field of the dataclass ``kind`` (:class:`Sampling`,
    :class:`MetricSuite`), with its default and help; ``overrides`` maps a name to ``(default, type, help)``."""
    for f in fields(kind):
        kind_of = type(f.default) if f.default is not None else str
        default, kind_of, doc = overrides.get(f.name, (f.default, kind_of, f.metadata["help"]))
        flags = option_names(f.name)
        if f.name == "metrics":
            parser.add_argument(*flags, nargs="+", default=list(default), choices=sorted(METRIC_NAMES), help=doc)
        elif kind_of is bool:
            parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=doc)
        else:
            parser.add_argument(*flags, type=kind_of, default=default, help=doc)


def dataclass_from_arguments(kind: type, args: argparse.Namespace, **values: Any) -> Any:
    """The ``kind`` the flags of :func:`add_dataclass_arguments` describe, ``values`` replacing parsed ones."""
    return kind(**{f.name: getattr(args, f.name) for f in fields(kind)} | values)


def build_parser() -> argparse.ArgumentParser:
    """The ``lightning-muon evaluate`` command line."""
    parser = argparse.ArgumentParser(
        prog="lightning-muon evaluate",
        description=plain_help(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("runs", nargs="+", help="run directories or globs (checkpoints are found recursively)")
    parser.add_argument(
        "--out",
        default="lightning_logs/eval",
        help="output directory (results.csv, results.md, <metric>.png); reference statistics are cached in "
        "$LIGHTNING_MUON_CACHE/eval_reference (default ~/.cache/lightning_muon)",
    )
    add_dataclass_arguments(parser, Sampling, num_classes=(None, int, "default: the checkpoint's num_classes"))
    add_dataclass_arguments(parser, MetricSuite)
    parser.add_argument("--real", default="digits", help="'digits' or an image folder with the real images")
    parser.add_argument(
        *option_names("image_size"), type=int, default=256, help="resolution of an image-folder reference"
    )
    parser.add_argument("--device", default=None, help="default: CUDA (this rank's GPU under torchrun), else cpu")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="weights of the sampling network; auto: bf16 on CUDA, fp32 on CPU",
    )
    return parser


def _score(
    module: DiTModule,
    meta: dict[str, Any],
    metrics: dict[str, Any],
    args: argparse.Namespace,
    prompts: list[str] | None,
    desc: str,
) -> dict[str, float]:
    """Generate from one checkpoint's sampling weights and score the samples."""
    num_classes = args.num_classes or meta.get("hyper_parameters", {}).get("num_classes", 10)
    sampling = dataclass_from_arguments(Sampling, args, num_classes=num_classes)
    values, _, _ = score_generation(module, metrics, sampling, desc=desc, prompts=prompts)
    return values


def _agreed_error(error: str | None) -> str | None:
    """This rank's load error of a checkpoint agreed over the ranks (one object all-gather): every failing rank's
    message, named by rank, or ``None`` when every rank loaded it — so every rank skips it or scores it together."""
    if not dist.is_initialized():
        return error
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [f"rank {rank}: {e}" for rank, e in enumerate(errors) if e]
    return "; ".join(failed) or None


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    with exit_on_storage_error():  # a full disk, a read-only --out: one line, exit code 1
        _evaluate(parser, args)


def _evaluate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from tqdm.auto import tqdm

    try:
        prompts = read_prompts(args.prompts_file) if args.prompts_file else None
    except (OSError, ValueError) as err:
        parser.error(f"--prompts_file: {err}")
    if "hpsv2" in args.metrics and not prompts:
        parser.error("--metrics hpsv2 scores image-prompt pairs: pass --prompts_file.")
    device = _init_distributed(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(args.dtype)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    out = Path(args.out)
    check_writable(out)  # before any checkpoint is scored
    try:  # a missing weights argument, or a file that is not there: a short error naming it
        metrics = dataclass_from_arguments(MetricSuite, args).build()
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    for metric in metrics.values():
        metric.to(device)
    digits = DigitsDataModule().real_images
    real, data_name = real_images_of(None if args.real == "digits" else args.real, args.image_size, digits, "digits")
    prepare_references(metrics, real, cache_dir() / "eval_reference", data_name, args.batch_size)

    csv_path = out / "results.csv"
    rows = _read_rows(csv_path)
    todo, failed = plan_checkpoints(args.runs, rows)
    if not todo and not rows and not failed:
        raise SystemExit(f"No checkpoints found under {args.runs}.")
    for run, ckpt, meta in tqdm(todo, desc="checkpoints", unit="ckpt", disable=not rank0):
        try:  # a checkpoint that cannot be loaded is reported and the sweep goes on, on every rank together
            module, error = load_generator(ckpt, device, dtype, meta)[0], None
        except Exception as err:
            module, error = None, f"{type(err).__name__}: {err}"
        if error := _agreed_error(error):
            failed.append(f"{ckpt}: {error}")
            log.error("Skipping %s: %s", ckpt, error)
            continue
        try:
            values = _score(module, meta, metrics, args, prompts, ckpt.name)
        except Exception as err:
            if not dist.is_initialized():  # one process: reported, the sweep goes on
                failed.append(f"{ckpt}: {type(err).__name__}: {err}")
                log.error("Skipping %s: %s", ckpt, err)
                continue
            # the other ranks are inside this checkpoint's collectives: end this rank now, which ends theirs
            log.error("Scoring %s failed on rank %d: %s: %s", ckpt, dist.get_rank(), type(err).__name__, err)
            raise
        rows.append({"run": run, "checkpoint": str(ckpt), "step": int(meta.get("global_step", 0)), **values})
        if rank0:
            _write_rows(csv_path, rows)  # after every checkpoint: an interrupted evaluation resumes where it stopped
    if rank0:
        write_markdown(rows, out / "results.md")
        for path in plot(rows, out):
            print(path)
        print(csv_path)
        print(out / "results.md")
        if failed:
            atomic_write(out / "errors.txt", lambda tmp: tmp.write_text("\n".join(failed) + "\n"))
            print(f"{len(failed)} checkpoint(s) could not be evaluated (listed in {out / 'errors.txt'}):")
            print("\n".join(f"  {line}" for line in failed))
    if dist.is_initialized():
        dist.destroy_process_group()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
