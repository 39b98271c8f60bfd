"""``benchmarks/frontier_study.py``: the per-budget lr planning on written rows (fast), and ``--quick`` end to end:
real stable runs with WSD branches, the CSV schema, resumption, the report (slow)."""

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
import frontier_study as fs  # noqa: E402

# spelled out here (importing the script's list would let it drift unnoticed)
REQUIRED = [
    "config",
    "arm",
    "lr",
    "seed",
    "budget",
    "fd",
    "precision",
    "recall",
    "density",
    "coverage",
    "val_loss",
    "optimizer_seconds",
    "wall_seconds",
    "refreshes",
    "role",
    "device",
]


def args(*flags: str):
    ns = fs.build_parser().parse_args(["--arms", "muon", "--steps", "100", "--budget-fractions", "0.5", "1", *flags])
    return ns


def train(rows: list, units: list, loss) -> None:
    """'Train' ``units``: one row per budget whose validation loss is ``loss(unit, budget)``."""
    a = args()
    known = {fs.unit_key(r) for r in rows}
    for u in units:
        if u.key in known:
            continue
        for T in fs.budgets(a):
            role = "tune" if u.seed in a.tune_seeds else "report"
            rows.append(
                {"config": u.config, "arm": u.arm, "lr": str(u.lr), "seed": str(u.seed), "budget": str(T),
                 "val_loss": str(loss(u, T)), "role": role}
            )  # fmt: skip


def until_planned(a, loss) -> tuple[list, fs.Plan]:
    rows: list = []
    for _ in range(20):
        p = fs.plan(rows, a)
        todo = [u for u in p.units if u.key not in {fs.unit_key(r) for r in rows}]
        if not todo:
            return rows, p
        train(rows, todo, loss)
    raise AssertionError("the plan never settles")


def test_each_budget_chooses_its_own_lr_on_the_tuning_seeds_and_reports_other_seeds():
    """Short budgets prefer a larger lr here (the optimum moves from 0.02 at 50 steps to 0.01 at 100): each budget
    gets its own choice, both interior; the reported seeds are trained at both chosen rates, never the tuning
    seeds."""
    a = args("--lrs-muon", "0.005", "0.01", "0.02", "0.04")
    optimum = {50: 0.02, 100: 0.01}
    rows, p = until_planned(a, lambda u, T: 1 + (math.log2(u.lr / optimum[T])) ** 2 + 0.001 * u.seed)
    s = p.sweeps["digits8", "muon"]
    assert s.chosen == {50: 0.02, 100: 0.01} and not s.at_edge
    reported = {(u.lr, u.seed) for u in p.units if u.seed in a.seeds}
    assert reported == {(lr, seed) for lr in (0.01, 0.02) for seed in a.seeds}
    assert {u.seed for u in s.units} == set(a.tune_seeds) and not set(a.tune_seeds) & set(a.seeds)


def test_a_choice_at_the_edge_extends_the_grid_by_its_factor_until_inside():
    a = args("--lrs-muon", "0.01", "0.02", "--lr-factor", "2", "--max-extend", "3")
    rows, p = until_planned(a, lambda u, T: abs(math.log2(u.lr / 0.08)) + (0.5 if T == 50 else 0))
    s = p.sweeps["digits8", "muon"]
    assert sorted({u.lr for u in s.units}) == [0.01, 0.02, 0.04, 0.08, 0.16] and s.chosen == {50: 0.08, 100: 0.08}
    # control: without extensions the same losses leave the choice at the edge, and the report says so
    a0 = args("--lrs-muon", "0.01", "0.02", "--lr-factor", "2", "--max-extend", "0")
    _, p0 = until_planned(a0, lambda u, T: abs(math.log2(u.lr / 0.08)))
    assert p0.sweeps["digits8", "muon"].at_edge == {50, 100}


def test_a_diverged_rate_is_never_chosen_and_nothing_is_chosen_early():
    a = args("--lrs-muon", "0.005", "0.01", "0.02", "0.04")
    assert fs.plan([], a).sweeps["digits8", "muon"].chosen is None
    assert {u.seed for u in fs.plan([], a).units} == set(a.tune_seeds)  # no reported seed before a choice
    _, p = until_planned(a, lambda u, T: math.nan if u.lr >= 0.02 else 1 / u.lr)
    assert p.sweeps["digits8", "muon"].chosen == {50: 0.01, 100: 0.01}  # 0.02 would be lowest but diverged


def test_overlapping_tuning_and_reported_seeds_are_refused():
    with pytest.raises(SystemExit):
        fs.main(["--tune-seeds", "0", "--seeds", "0", "1", "--report-only", "--out", "/nonexistent"])


def study(out: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "frontier_study.py"), "--quick", "--out", str(out), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)


@pytest.mark.slow
def test_quick_frontier_csv_schema_resume_and_report(tmp_path):
    first = study(tmp_path, "--jobs", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    with (tmp_path / "frontier.csv").open() as f:
        reader = csv.DictReader(f)
        assert REQUIRED == reader.fieldnames
        rows = list(reader)
    assert {r["arm"] for r in rows} == {"adamw", "muon", "periodic"} and {r["budget"] for r in rows} == {"20", "40"}
    assert {r["role"] for r in rows} == {"tune", "report"}
    units = {(r["arm"], r["lr"], r["seed"]) for r in rows}
    assert len(units) == len(rows) // 2  # one row per budget, no unit trained twice
    assert not any((tmp_path / ".frontier_work" / "units").iterdir())  # each unit removed its checkpoints
    for r in rows:  # NS5 refreshes per matrix over the budget: every step for Muon, fewer for Periodic, none for AdamW
        refreshes, T = float(r["refreshes"]), int(r["budget"])
        assert refreshes == {"muon": T, "adamw": 0}.get(r["arm"], refreshes) and (
            r["arm"] != "periodic" or refreshes < T
        )
        assert float(r["fd"]) > 0 and 0 <= float(r["precision"]) <= 1 and float(r["val_loss"]) > 0
        assert 0 < float(r["optimizer_seconds"]) < float(r["wall_seconds"])
    by_unit = {}
    for r in rows:
        by_unit.setdefault((r["arm"], r["lr"], r["seed"]), {})[r["budget"]] = float(r["wall_seconds"])
    assert all(w["20"] < w["40"] for w in by_unit.values())  # a longer budget costs more of the shared clock

    report = (tmp_path / "frontier.md").read_text()
    for text in (
        "### FD (digits features) at each budget",
        "| muon | ",
        "### Budget each arm",
        "**periodic**",
        "**Positive control**",
    ):
        assert text in report, text
    from PIL import Image

    with Image.open(tmp_path / "frontier_digits8.png") as image:
        assert image.size[0] > 300

    again = study(tmp_path, "--jobs", "2")  # resumable: every unit is in the CSV, nothing is trained again
    assert again.returncode == 0, again.stderr[-3000:]
    with (tmp_path / "frontier.csv").open() as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    (tmp_path / "frontier.csv").write_text("a,b\n1,2\n")  # control: a CSV that is not this study's is refused
    broken = study(tmp_path, "--report-only")
    assert broken.returncode != 0 and "lacks columns" in broken.stderr


def test_paced_seconds_are_measured_then_extended_at_the_second_half_rate():
    """``seconds_at``: the measured cumulative clock up to its length, then the rate of its second half (past a
    warm-up whose steps cost more). Control: a budget inside the clock reads it, not the extension."""
    import frontier_pace as fp

    clock = {"step_s": [2.0, 4.0, 5.0, 6.0]}  # 2 s steps in a warm-up, then 1 s
    assert fp.seconds_at(clock, "step_s", 3) == 5.0
    assert fp.seconds_at(clock, "step_s", 10) == 6.0 + 6 * 1.0


def test_pace_times_each_arm_with_its_own_refresh_schedule(tmp_path):
    """A real round-robin of 6 steps: cumulative clocks that grow, and each arm's NS5 refreshes per matrix — Muon every
    step, Periodic every third, the warm-up arm every step inside its warm-up, AdamW none; the report then compares
    arms on these clocks (control: without the JSON it has no side-by-side table)."""
    import frontier_pace as fp
    import frontier_report as fr

    out = tmp_path / "frontier_pace.json"
    fp.main(["--steps", "6", "--arms", "adamw", "muon", "periodic", "warmup", "--out", str(out)])
    pace = fr.load_pace(out, "digits8")
    assert {arm: pace[arm]["refreshes"] for arm in pace} == {"adamw": 0, "muon": 6, "periodic": 2, "warmup": 6}
    for clock in pace.values():
        assert len(clock["step_s"]) == 6 and all(a < b for a, b in zip(clock["step_s"], clock["step_s"][1:]))
        assert 0 < clock["optimizer_s"][-1] < clock["step_s"][-1]
    a = args("--arms", "adamw", "muon", "periodic", "warmup")
    a.command, a.machine = "test", "test"
    assert "### Training seconds at each budget, side by side" in fr.report([], fs.plan([], a), a, tmp_path)
    out.unlink()
    assert "### Training seconds at each budget, side by side" not in fr.report([], fs.plan([], a), a, tmp_path)
