"""``benchmarks/quality_study.py``: the lr-sweep planning on written rows (fast), and ``--quick`` end to end: real
training runs, the CSV schema, resumption, the report (slow)."""

import argparse
import csv
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
import quality_study as qs  # noqa: E402

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
    "arm",
    "role",
    "device",
    "refreshes",
    "gamma_descent",
    "gamma_rms",
]


def args(**overrides) -> argparse.Namespace:
    ns = qs.build_parser().parse_args(["--configs", "digits8", "--gammas", "0.15", "0.3", "--periods", "3", "6"])
    vars(ns).update(overrides)
    return ns


def finished(run: qs.Run, val_loss: float) -> dict:
    arm = run.arm
    return {
        "config": run.config,
        "arm": arm.name,
        "optimizer": arm.optimizer,
        "period": arm.period,
        "rownorm_scale": arm.scale,
        "lr": run.lr,
        "seed": run.seed,
        "step": 100,
        "val_loss": val_loss,
    }


def train(rows: list, runs: list, loss) -> None:
    """'Train' ``runs``: rows whose validation loss is ``loss(run)``."""
    rows += [finished(run, loss(run)) for run in runs if run.key not in {qs.run_key(r) for r in rows}]


def test_sweep_extends_at_the_edge_and_chooses_inside():
    a = args(lrs_muon=[0.01, 0.02, 0.04, 0.08], max_extend=3)
    rows: list = []
    # validation loss lowest at lr 0.16 (outside the initial grid) for Muon, at 0.02 for everything else
    loss = lambda run: abs(run.lr - (0.16 if run.arm == qs.MUON else 0.02)) + (0.05 if run.arm.scale == 0.3 else 0)  # noqa: E731
    for _ in range(6):
        train(rows, qs.plan(rows, a).runs, loss)
    plan = qs.plan(rows, a)
    muon = plan.sweeps["digits8", "muon"]
    assert [r.lr for r in muon.runs] == [0.01, 0.02, 0.04, 0.08, 0.16, 0.32] and muon.chosen == 0.16
    assert not muon.at_edge
    assert plan.sweeps["digits8", "K=3 γ=0.15"].chosen == 0.02
    assert plan.best_gamma["digits8"] == 0.15  # γ 0.3's losses are higher at every lr
    assert plan.sweeps["digits8", "K=6 γ=0.15"].chosen == 0.02  # the K sweep runs at the best γ
    names = [arm.name for arm in plan.reported["digits8"]]
    assert names == ["adamw", "muon", "K=3 γ=0.15", "K=3 auto", "K=3 auto_rms", "K=6 γ=0.15"]
    seeds = {(r.arm.name, r.lr, r.seed) for r in plan.runs if r.seed > 0}
    assert ("muon", 0.16, 2) in seeds and ("K=6 γ=0.15", 0.02, 1) in seeds
    assert not any(name == "K=3 γ=0.3" for name, *_ in seeds)  # not reported: no seeds beyond the sweep


def test_sweep_reports_an_edge_when_extensions_run_out_and_skips_diverged_runs():
    a = args(lrs_muon=[0.01, 0.02], max_extend=1, auto=[])
    rows: list = []
    # Muon diverges (no finite loss) at every lr above 0.01, and improves without bound below it
    loss = lambda run: (run.lr if run.lr <= 0.01 else float("nan")) if run.arm == qs.MUON else abs(run.lr - 0.02)  # noqa: E731
    for _ in range(4):
        train(rows, qs.plan(rows, a).runs, loss)
    muon = qs.plan(rows, a).sweeps["digits8", "muon"]
    assert [r.lr for r in muon.runs] == [0.005, 0.01, 0.02] and muon.chosen == 0.005 and muon.at_edge


def test_nothing_is_chosen_before_the_sweep_is_done():
    a = args()
    plan = qs.plan([], a)
    assert all(s.chosen is None for s in plan.sweeps.values()) and plan.best_gamma["digits8"] is None
    assert {r.seed for r in plan.runs} == {0}  # no seeds and no K sweep before the choices exist


def study(out: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "quality_study.py"), "--quick", "--out", str(out), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.mark.slow
def test_quick_study_csv_schema_resume_and_report(tmp_path):
    first = study(tmp_path, "--jobs", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    with (tmp_path / "quality_study.csv").open() as f:
        reader = csv.DictReader(f)
        assert REQUIRED == reader.fieldnames
        rows = list(reader)
    assert {r["optimizer"] for r in rows} == {"adamw", "muon", "periodic_muon"}
    assert {r["arm"] for r in rows} >= {"adamw", "muon", "K=3 γ=0.15", "K=3 γ=0.3", "K=3 auto"}
    assert {r["role"] for r in rows} == {"sweep", "seeds"}
    assert any(r["arm"].startswith("K=6") for r in rows)  # the K sweep ran at the best γ
    for r in rows:  # NS5 refreshes per matrix: every step for Muon, fewer for Periodic, none for AdamW
        refreshes, step = float(r["refreshes"]), int(r["step"])
        if r["optimizer"] == "muon":
            assert refreshes == step
        elif r["optimizer"] == "periodic_muon":
            assert 0 < refreshes < step
        else:
            assert refreshes == 0
        measured = r["rownorm_scale"] == "auto"  # the calibrated γ is recorded where the optimizer measures it
        assert (float(r["gamma_descent"]) > 0) if measured else r["gamma_descent"] == "nan"
    keys = {(r["arm"], r["lr"], r["seed"]) for r in rows}
    assert len(keys) == len(rows) // 2  # two evaluations (steps 20, 40) per run, no run trained twice
    assert all(float(r["fd"]) > 0 and 0 <= float(r["precision"]) <= 1 and float(r["val_loss"]) > 0 for r in rows)
    assert all(0 < float(r["optimizer_seconds"]) < float(r["wall_seconds"]) for r in rows)

    report = (tmp_path / "quality_study.md").read_text()
    for text in (
        "### Learning-rate sweeps",
        "| muon | 0.02: ",
        "no (grid extensions ran out)",
        "### Time to quality",
        "FD at equal training wall time",
        "### γ at K=3",
        "| auto | ",
        "### K at γ",
        "| 6 | ",
    ):
        assert text in report, text
    from PIL import Image

    for name in ("digits8_fd_vs_step.png", "digits8_fd_vs_wall.png", "digits8_gamma_lr.png"):
        with Image.open(tmp_path / f"quality_study_{name}") as image:
            assert image.size[0] > 300

    again = study(tmp_path, "--jobs", "2")  # resumable: every run is in the CSV, nothing is trained again
    assert again.returncode == 0, again.stderr[-3000:]
    with (tmp_path / "quality_study.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)

    # control: a CSV that is not this study's is refused, not reported
    (tmp_path / "quality_study.csv").write_text("a,b\n1,2\n")
    broken = study(tmp_path, "--report-only")
    assert broken.returncode != 0 and "lacks columns" in broken.stderr
