"""``benchmarks/quality_study.py --quick``: real training runs end to end, the CSV schema, resumption, the report."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# the columns the study must write, spelled out here (importing the script's list would let it drift unnoticed)
REQUIRED = [
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
]


def study(out: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "quality_study.py"), "--quick", "--out", str(out), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.mark.slow
def test_quick_study_csv_schema_resume_and_report(tmp_path):
    first = study(tmp_path, "--jobs", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    with (tmp_path / "quality_study.csv").open() as f:
        reader = csv.DictReader(f)
        assert REQUIRED == reader.fieldnames[: len(REQUIRED)]
        rows = list(reader)
    runs = {(r["optimizer"], r["period"], r["rownorm_scale"], r["lr"], r["seed"], r["variant"]) for r in rows}
    assert {r["optimizer"] for r in rows} == {"adamw", "muon", "periodic_muon"}
    assert {r["role"] for r in rows} >= {"sweep", "seeds", "variants"}
    assert {r["variant"] for r in rows} == {"ns5", "baseline", "turbo_muon", "adaptive"}
    for r in rows:  # NS5 refreshes per matrix: every step for Muon, at most every step otherwise, none for AdamW
        refreshes, step = float(r["refreshes"]), int(r["step"])
        if r["optimizer"] == "muon":
            assert refreshes == step
        elif r["optimizer"] == "periodic_muon":
            assert 0 < refreshes < step if int(r["period"]) > 1 else refreshes == step
        else:
            assert refreshes == 0
    assert len(runs) == len(rows) // 2  # two evaluations (steps 20, 40) per run, no run trained twice
    assert all(float(r["fd"]) > 0 and 0 <= float(r["precision"]) <= 1 and float(r["val_loss"]) > 0 for r in rows)
    assert all(0 < float(r["optimizer_seconds"]) < float(r["wall_seconds"]) for r in rows)
    for optimizer in ("adamw", "muon", "periodic_muon"):  # ≥ 2 seeds at the chosen learning rate in --quick
        assert len({r["seed"] for r in rows if r["optimizer"] == optimizer and r["role"] == "seeds"}) >= 1

    report = (tmp_path / "quality_study.md").read_text()
    texts = ("| optimizer | seeds | best FD", "Muon vs AdamW, best FD", "Periodic vs Muon, optimizer time", "K (γ")
    for text in (*texts, "## Variants", "| periodic | adaptive | 2 |", "| muon | turbo_muon | 2 |"):
        assert text in report
    from PIL import Image

    for name in ("digits8_fd_vs_step.png", "digits8_fd_vs_wall.png", "ablations.png"):
        name = "quality_study_" + name
        with Image.open(tmp_path / name) as image:
            assert image.size[0] > 300

    again = study(tmp_path, "--jobs", "2")  # resumable: every run is in the CSV, nothing is trained again
    assert again.returncode == 0 and "runs:" not in again.stderr
    with (tmp_path / "quality_study.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)

    # control: a CSV that is not this study's is refused, not reported
    (tmp_path / "quality_study.csv").write_text("a,b\n1,2\n")
    broken = study(tmp_path, "--report-only")
    assert broken.returncode != 0 and "lacks columns" in broken.stderr
