"""``lightning-muon evaluate``: generation metrics for every checkpoint of one or several runs, as CSV, Markdown
and one PNG per metric (metric vs training step, a line per run) — the paper's AdamW / Muon / Periodic comparison.

    lightning-muon evaluate lightning_logs/version_0 lightning_logs/version_1 --out eval --metrics fd_digits prdc_digits

Reads single-file Lightning checkpoints and the torch.distributed.checkpoint directories that ``muon_fsdp`` /
``ModelParallelStrategy`` write (converted in this one process). Rerunning skips checkpoints already in the CSV.
"""

from __future__ import annotations

import argparse
import csv
import glob
import inspect
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from lightning_muon.callbacks.generation import prepare_references, score_generation
from lightning_muon.metrics.images import folder_images
from lightning_muon.metrics.presets import METRIC_NAMES, build_metrics
from lightning_muon.recipes.data import DigitsDataModule
from lightning_muon.recipes.module import DiTModule

__all__ = ["find_checkpoints", "load_checkpoint", "main"]


def _is_distributed_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / ".metadata").is_file()


def find_checkpoints(run: str) -> list[Path]:
    """Checkpoints under a run directory (or matching a glob): ``*.ckpt`` files and distributed-checkpoint
    directories, ``last.ckpt`` excluded (it repeats another step)."""
    roots = [Path(p) for p in sorted(glob.glob(run))] or [Path(run)]
    found: list[Path] = []
    for root in roots:
        if root.suffix == ".ckpt" and (root.is_file() or _is_distributed_checkpoint(root)):
            found.append(root)
            continue
        for path in sorted(root.rglob("*.ckpt")):
            if path.name != "last.ckpt" and (path.is_file() or _is_distributed_checkpoint(path)):
                found.append(path)
    return found


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A Lightning checkpoint as a dict with ``state_dict``, ``hyper_parameters`` and ``global_step``.

    Distributed checkpoints are converted with ``dcp_to_torch_save`` (no process group needed); the rest of their
    content comes from the ``meta.pt`` file Lightning writes beside the shards. ``torch.load(weights_only=True)``.
    """
    if not _is_distributed_checkpoint(path):
        return torch.load(path, map_location="cpu", weights_only=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(path), f"{tmp}/full.pt")
        state = torch.load(f"{tmp}/full.pt", map_location="cpu", weights_only=True)
    meta = torch.load(path / "meta.pt", map_location="cpu", weights_only=True)
    return {**meta, "state_dict": state["state_dict"]}


def module_from_checkpoint(checkpoint: dict[str, Any], device: torch.device) -> DiTModule:
    hparams = checkpoint.get("hyper_parameters")
    if not hparams:
        raise ValueError("The checkpoint has no hyper_parameters: it was not written by DiTModule.")
    accepted = inspect.signature(DiTModule.__init__).parameters
    module = DiTModule(**{k: v for k, v in hparams.items() if k in accepted})  # LightningCLI adds _instantiator
    module.configure_model()
    missing, unexpected = module.load_state_dict(checkpoint["state_dict"], strict=False)
    if unexpected or [k for k in missing if not k.startswith("vae.")]:
        raise ValueError(f"Checkpoint does not match its hyper-parameters: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}.")  # fmt: skip
    return module.to(device).eval()


def _read_rows(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    columns = ["run", "checkpoint", "step"] + sorted({k for r in rows for k in r} - {"run", "checkpoint", "step"})
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def write_markdown(rows: list[dict[str, Any]], path: Path) -> None:
    metrics = sorted({k for r in rows for k in r} - {"run", "checkpoint", "step"})
    lines = ["| run | step | " + " | ".join(metrics) + " |", "|---|---:|" + "---:|" * len(metrics)]
    for r in sorted(rows, key=lambda r: (r["run"], int(r["step"]))):
        cells = [f"{float(r[m]):.4g}" if r.get(m) not in (None, "") else "" for m in metrics]
        lines.append(f"| {r['run']} | {r['step']} | " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")


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
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-muon evaluate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("runs", nargs="+", help="run directories or globs (checkpoints are found recursively)")
    parser.add_argument("--out", default="eval", help="output directory (results.csv, results.md, <metric>.png)")
    parser.add_argument("--metrics", nargs="+", default=["fd_digits", "prdc_digits"], choices=sorted(METRIC_NAMES))
    parser.add_argument("--num-samples", type=int, default=1000)
    parser.add_argument("--num-classes", type=int, default=10)
    parser.add_argument("--num-inference-steps", type=int, default=25)
    parser.add_argument("--guidance-scale", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts-file", default=None, help="text-to-image: one prompt per line (sample i: i mod P)")
    parser.add_argument("--real", default="digits", help="'digits' or an image folder with the real images")
    parser.add_argument("--image-size", type=int, default=256, help="resolution of an image-folder reference")
    for name in ("dinov2", "inception", "clip", "hps"):
        parser.add_argument(
            f"--{name}-weights", default=None, help=f"local {name} weights for the metrics needing them"
        )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    from tqdm.auto import tqdm

    prompts = None
    if args.prompts_file:
        prompts = [line.strip() for line in Path(args.prompts_file).read_text().splitlines() if line.strip()]
    if "hpsv2" in args.metrics and not prompts:
        parser.error("--metrics hpsv2 scores image-prompt pairs: pass --prompts-file.")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = build_metrics(args.metrics, args.dinov2_weights, args.inception_weights, args.clip_weights,
                            args.hps_weights)  # fmt: skip
    device = torch.device(args.device)
    for metric in metrics.values():
        metric.to(device)
    if args.real == "digits":
        real, data_name = DigitsDataModule().real_images, "digits"
    else:
        real = lambda: folder_images(args.real, args.image_size)  # noqa: E731
        data_name = Path(args.real).name
    prepare_references(metrics, real, out / "reference", data_name, args.batch_size)

    csv_path = out / "results.csv"
    rows = _read_rows(csv_path)
    done = {(r["run"], r["checkpoint"]) for r in rows}
    todo = [(Path(run).name or run, ckpt) for run in args.runs for ckpt in find_checkpoints(run)]
    todo = [(run, ckpt) for run, ckpt in todo if (run, str(ckpt)) not in done]
    if not todo and not rows:
        raise SystemExit(f"No checkpoints found under {args.runs}.")
    for run, ckpt in tqdm(todo, desc="checkpoints", unit="ckpt"):
        checkpoint = load_checkpoint(ckpt)
        module = module_from_checkpoint(checkpoint, device)
        values, _ = score_generation(module, metrics, args.num_samples, args.num_classes, args.seed,
                                     args.num_inference_steps, args.guidance_scale, args.batch_size,
                                     desc=ckpt.name, prompts=prompts)  # fmt: skip
        rows.append({"run": run, "checkpoint": str(ckpt), "step": int(checkpoint.get("global_step", 0)), **values})
        _write_rows(csv_path, rows)  # after every checkpoint: an interrupted evaluation resumes where it stopped
    write_markdown(rows, out / "results.md")
    for path in plot(rows, out):
        print(path)
    print(csv_path)
    print(out / "results.md")


if __name__ == "__main__":
    main()
