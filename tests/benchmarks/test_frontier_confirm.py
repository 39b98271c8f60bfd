"""``benchmarks/frontier_confirm.py``: the pre-registered analysis on written rows — the lr chosen on the tuning seeds'
FD (edge extension, confirmation only after every choice), the paired t on ln FD against scipy's and a hand count,
and Holm's step-down decisions against a worked example. Each with a control."""

import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
import frontier_confirm as fc  # noqa: E402


def row(arm: str, lr: float, seed: int, budget: int, fd: float, role: str) -> dict:
    return {"config": "digits8", "arm": arm, "lr": str(lr), "seed": str(seed), "budget": str(budget), "fd": str(fd),
            "role": role}  # fmt: skip


def tuned(fd_of) -> list[dict]:
    """Tuning rows of every arm and budget on its initial grid, FD = ``fd_of(arm, lr, budget)``."""
    return [
        row(arm, lr, seed, T, fd_of(arm, lr, T), "tune")
        for arm in fc.PLAN["arms"]
        for T in fc.PLAN["budgets"]
        for lr in fc.initial_grid(arm, T)
        for seed in fc.PLAN["tune_seeds"]
    ]


def bowl(arm: str, lr: float, T: int) -> float:
    """FD lowest at the third point of each grid: every choice interior."""
    grid = fc.initial_grid(arm, T)
    return 1.0 + abs(math.log(lr / grid[2]))


def test_lr_is_chosen_on_tuning_fd_and_confirmation_waits_for_every_choice():
    rows = tuned(bowl)
    _, chosen, missing = fc.choose(rows)
    assert not missing and chosen == {
        (a, T): fc.initial_grid(a, T)[2] for a in fc.PLAN["arms"] for T in fc.PLAN["budgets"]
    }
    units = fc.planned_units(rows)
    assert {u.seed for u in units} == set(fc.PLAN["seeds"])  # confirmation: fresh seeds only
    assert sum(len(u.budgets) for u in units) == len(fc.PLAN["arms"]) * len(fc.PLAN["budgets"]) * 10
    # control: one tuning row missing → that cell is trained and nothing confirmatory starts
    pending = fc.planned_units(rows[1:])
    assert len(pending) == 1 and pending[0].seed == int(rows[0]["seed"]) and pending[0].arm == rows[0]["arm"]


def test_a_choice_at_the_grid_edge_extends_the_grid():
    rows = tuned(lambda arm, lr, T: 1 / lr)  # FD keeps falling with lr: every choice at the top edge
    grids, chosen, missing = fc.choose(rows)
    assert not chosen and missing
    top = {(arm, T): fc.initial_grid(arm, T)[-1] * fc.LR_FACTOR for arm in fc.PLAN["arms"] for T in fc.PLAN["budgets"]}
    assert {(a, round(lr, 10), T) for a, lr, _, T in missing} == {(a, round(lr, 10), T) for (a, T), lr in top.items()}
    assert all(grids[key][-1] == pytest.approx(lr) for key, lr in top.items())


def test_paired_t_on_log_fd_and_holm_decisions():
    from scipy import stats

    rows = tuned(bowl)
    _, chosen, _ = fc.choose(rows)
    # periodic 1.5× Muon's FD at 240 steps; every arm jitters by its own zero-sum pattern (the other pairs: equal)
    wobble = [1.0, 1.3, 0.8, 1.1, 0.9, 1.2, 1.05, 0.95, 1.15, 0.85]
    z = [1, -1, 0.5, -0.5, 2, -2, 0.3, -0.3, 1.5, -1.5]

    def fd(arm: str, T: int, i: int) -> float:
        return wobble[i] * (1.5 if (arm, T) == ("periodic", 240) else 1.0) * math.exp(0.05 * z[(i + len(arm)) % 10])

    for (arm, T), lr in chosen.items():
        rows += [row(arm, lr, seed, T, fd(arm, T, i), "confirm") for i, seed in enumerate(fc.PLAN["seeds"])]
    tests = {(t["a"], t["b"], t["budget"]): t for t in fc.confirmatory_tests(rows)}
    t = tests["periodic", "muon", 240]
    fa, fb = [fd("periodic", 240, i) for i in range(10)], [fd("muon", 240, i) for i in range(10)]
    ref = stats.ttest_rel([math.log(x) for x in fa], [math.log(x) for x in fb])
    assert t["t"] == pytest.approx(ref.statistic) and t["p"] == pytest.approx(ref.pvalue)
    assert t["ratio"] == pytest.approx(math.exp(sum(math.log(a / b) for a, b in zip(fa, fb)) / 10))
    assert t["ci"][0] < t["ratio"] < t["ci"][1] and t["reject"] and t["holm"] == pytest.approx(0.05 / 9)
    # both comparisons with periodic at 240 are rejected; control: the equal pairs are kept
    assert {key for key, t in tests.items() if t["reject"]} == {("periodic", "muon", 240), ("warmup", "periodic", 240)}
    # an incomplete family gets no decision
    assert all("reject" not in t for t in fc.confirmatory_tests(rows[:-1]))


def test_holm_step_down():
    """Worked example: m = 4, α = 0.05 → thresholds 0.0125, 0.0167, 0.025, 0.05 by rank; 0.04 > 0.025 stops there,
    so the last p (0.045 < 0.05) is kept too (control: Bonferroni-free reading would reject it)."""
    thresholds, reject = fc.holm([0.01, 0.04, 0.015, 0.045], 0.05)
    assert thresholds == pytest.approx([0.0125, 0.025, 0.05 / 3, 0.05])
    assert reject == [True, False, True, False]
