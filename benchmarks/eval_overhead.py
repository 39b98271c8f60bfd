"""Cost of GenerationEvaluation in the default run: `lightning-muon fit` with and without it, side by side.

Runs the default digits config twice in fresh subprocesses (the digits feature classifier is trained and cached
before timing), reads eval/seconds from metrics.jsonl, prints a table and writes JSON.

    python benchmarks/eval_overhead.py
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(extra: list[str], cwd: Path) -> float:
    cmd = [sys.executable, "-m", "lightning_muon.recipes.cli", "fit", "--trainer.enable_progress_bar", "false", *extra]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/eval_overhead.json")
    args = parser.parse_args()
    from lightning_muon.metrics import DigitsFeatures

    DigitsFeatures()  # cache the classifier outside the timed runs
    with tempfile.TemporaryDirectory() as tmp:
        with_eval, without = Path(tmp, "with"), Path(tmp, "without")
        with_eval.mkdir()
        without.mkdir()
        # the same callbacks minus GenerationEvaluation
        no_eval = [
            "--trainer.callbacks",
            "[]",
            "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.every_n_train_steps",
            "500",
            "--trainer.callbacks+=lightning_muon.callbacks.OptimizerTelemetry",
        ]
        t_without = run(no_eval, without)
        t_with = run([], with_eval)
        rows = [json.loads(line) for line in next(with_eval.rglob("metrics.jsonl")).read_text().splitlines()]
    eval_seconds = [r["eval/seconds"] for r in rows]
    print("| run | wall s | evaluations | s / evaluation | eval share of wall | overhead vs no eval |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| fit without GenerationEvaluation | {t_without:.1f} | 0 | - | - | - |")
    print(
        f"| fit with GenerationEvaluation | {t_with:.1f} | {len(rows)} | {sum(eval_seconds) / len(rows):.2f} | "
        f"{100 * sum(eval_seconds) / t_with:.1f}% | {100 * (t_with / t_without - 1):+.1f}% |"
    )
    last = rows[-1]
    print("final metrics: " + ", ".join(f"{k}={v:.3f}" for k, v in last.items() if k.startswith("eval/")))
    print(f"target: callback adds <= 25% wall time: {'met' if t_with <= 1.25 * t_without else 'MISSED'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"wall_without": t_without, "wall_with": t_with, "evaluations": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
