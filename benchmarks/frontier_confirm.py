"""The frontier's confirmatory run (#47): hypotheses and analysis fixed in ``PLAN`` and committed before its first
confirmatory row, then trained on seeds never used before.

Why: ``frontier.csv`` (``frontier_study.py``) is **exploratory**. Its seeds varied only the initial weights (the data
order, the training noise and timesteps and the evaluation samples were the same for every seed), its learning rates
were chosen on validation loss while FD is reported, its "beyond 2 SE" marks were uncorrected over 80 comparisons, and
its warm-up arms were added after its seeds had shown the gap they close.

**The protocol** (``PLAN``; nothing in it is changed once a confirmatory row exists):

1. **Units** are ``frontier_study.train_unit``'s WSD runs (warm-up 20 steps, decay over the last 20% of the budget,
   the digits8 DiT, 500 EMA samples with 10 sampler steps) under ``--seed-scope all``: a seed sets the initial
   weights, the data order, the training noise and timesteps and the evaluation samples' noise, and the same seed
   draws the same for every arm (the comparisons are paired by seed).
2. **Tuning** (seeds ``PLAN["tune_seeds"]``, never reported): each (arm, budget) has its own ×√2 grid; the lr chosen
   is the one with the lowest mean FD over the tuning seeds at that budget (a diverged run counts as FD = ∞); a choice
   at the grid's edge adds the next rate beyond it, up to ``MAX_EXTEND`` times. Confirmatory units start only once
   every choice is made.
3. **Confirmation** (seeds ``PLAN["seeds"]``, fresh): every arm at each budget's chosen lr, n = 10 per arm.
4. **Hypotheses** (``PLAN["comparisons"]`` at each budget, a family of 9): H0 — the two arms reach the same FD in
   expectation. Test: two-sided paired t-test (df = n − 1) on the per-seed differences of ln FD (``ratio`` =
   exp(mean difference), the geometric-mean FD ratio A/B). **Holm–Bonferroni over the 9 at α = 0.05**; a comparison
   with a non-finite FD on any seed is not rejected. The report prints the paired mean FD difference, the ratio with
   its unadjusted 95% CI, t, p, Holm's threshold and the decision, from the CSV alone.
   Expectations from the exploratory data (which direction a rejection would most likely take, not tested one-sided):
   Periodic's FD above Muon's at 120 and 240 steps and equal at 1200; the 60-step warm-up below Periodic at 120 and
   240; AdamW above Muon at 120 and 240 (the positive control).

Resumable (rows appended per unit; ``frontier_confirm.csv``); ``--jobs`` units in parallel.

    python benchmarks/frontier_confirm.py --jobs 2         # tune, then confirm (resumable)
    python benchmarks/frontier_confirm.py --report-only    # frontier_confirm.md and the FD-vs-lr PNG from the CSV
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from frontier_study import COLUMNS, Unit, _worker, mean
from study import as_float, execute_planned, run_study

PLAN: dict[str, Any] = {
    "config": "digits8",
    "arms": ["adamw", "muon", "periodic", "warmup"],
    "budgets": [120, 240, 1200],
    "tune_seeds": [200, 201],
    "seeds": list(range(1000, 1010)),
    "comparisons": [("periodic", "muon"), ("warmup", "periodic"), ("adamw", "muon")],  # (A, B): ln FD_A − ln FD_B
    "alpha": 0.05,
}
#: initial tuning grids, ×√2 apart, centred where the exploratory sweeps' FD was lowest
_MUON_SHORT = [0.02, 0.02828, 0.04, 0.05657, 0.08, 0.1131]
_MUON_LONG = [0.005, 0.00707, 0.01, 0.01414, 0.02, 0.02828]
GRIDS = {
    ("adamw", "short"): [0.00566, 0.008, 0.0113, 0.016, 0.0226, 0.032],
    ("adamw", "long"): [0.002, 0.00283, 0.004, 0.00566, 0.008, 0.0113],
    **{(arm, "short"): _MUON_SHORT for arm in ("muon", "periodic", "warmup")},
    **{(arm, "long"): _MUON_LONG for arm in ("muon", "periodic", "warmup")},
}
MAX_EXTEND = 4
LR_FACTOR = math.sqrt(2)


def initial_grid(arm: str, budget: int) -> list[float]:
    return GRIDS[arm, "short" if budget <= 240 else "long"]


def _lr(value: Any) -> float:
    return round(float(value), 10)


def fd_table(rows: list[dict[str, Any]], role: str) -> dict[tuple, dict[int, float]]:
    """``{(arm, lr, budget): {seed: FD}}`` of the rows of ``role``."""
    table: dict[tuple, dict[int, float]] = defaultdict(dict)
    for r in rows:
        if r["role"] == role and r["config"] == PLAN["config"]:
            table[r["arm"], _lr(r["lr"]), int(r["budget"])][int(r["seed"])] = as_float(r["fd"])
    return table


def tuning_fd(table: dict, arm: str, lr: float, budget: int) -> float:
    """Mean FD over the tuning seeds (∞ if any diverged or is missing)."""
    fds = [table.get((arm, _lr(lr), budget), {}).get(s, math.nan) for s in PLAN["tune_seeds"]]
    return mean(fds) if all(math.isfinite(x) for x in fds) else math.inf


def choose(rows: list[dict[str, Any]]) -> tuple[dict[tuple, list[float]], dict[tuple, float], set[tuple]]:
    """Step 2 of the protocol: each (arm, budget)'s grid so far, its chosen lr once its grid is done (and interior or
    out of extensions), and the tuning cells ``(arm, lr, seed, budget)`` still to train."""
    table = fd_table(rows, "tune")
    grids, chosen, missing = {}, {}, set()
    for arm in PLAN["arms"]:
        for T in PLAN["budgets"]:
            lrs = sorted(initial_grid(arm, T))
            for extension in range(MAX_EXTEND + 1):
                grids[arm, T] = lrs
                cells = {(arm, lr, s, T) for lr in lrs for s in PLAN["tune_seeds"]}
                todo = {c for c in cells if c[2] not in table.get((arm, _lr(c[1]), T), {})}
                if todo:
                    missing |= todo
                    break
                best = min(lrs, key=lambda lr: tuning_fd(table, arm, lr, T))
                if best not in (lrs[0], lrs[-1]) or extension == MAX_EXTEND:
                    chosen[arm, T] = best
                    break
                lrs = [lrs[0] / LR_FACTOR, *lrs] if best == lrs[0] else [*lrs, lrs[-1] * LR_FACTOR]
    return grids, chosen, missing


def planned_units(rows: list[dict[str, Any]]) -> list[Unit]:
    """The units still to train: the tuning cells, then (once every lr is chosen) the confirmatory ones; cells of one
    (arm, lr, seed) share a unit branching at each of their budgets. Longest first."""
    _, chosen, cells = choose(rows)
    if not cells:
        table = fd_table(rows, "confirm")
        cells = {
            (arm, lr, s, T)
            for (arm, T), lr in chosen.items()
            for s in PLAN["seeds"]
            if s not in table.get((arm, _lr(lr), T), {})
        }
    by_unit: dict[tuple, set[int]] = defaultdict(set)
    for arm, lr, seed, T in cells:
        by_unit[arm, lr, seed].add(T)
    units = [Unit(PLAN["config"], arm, lr, seed, tuple(sorted(Ts))) for (arm, lr, seed), Ts in by_unit.items()]
    return sorted(units, key=lambda u: (-max(u.budgets), u.arm, u.lr, u.seed))


# ------------------------------------------------------------------------------------------------------ analysis
def holm(pvalues: list[float], alpha: float) -> tuple[list[float], list[bool]]:
    """Holm–Bonferroni: the i-th smallest p (0-based) is compared with α/(m − i); rejections stop at the first
    failure. Returns each test's threshold and decision, in the input order."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    thresholds, reject, going = [math.nan] * m, [False] * m, True
    for rank, i in enumerate(order):
        thresholds[i] = alpha / (m - rank)
        going = going and pvalues[i] <= thresholds[i]
        reject[i] = going
    return thresholds, reject


def confirmatory_tests(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step 4 of the protocol from the CSV: one row per (comparison, budget) with n, the paired mean FD difference,
    the geometric-mean ratio and its 95% CI, t, p, Holm's threshold and decision (``None`` until complete)."""
    from scipy import stats

    _, chosen, _ = choose(rows)
    table = fd_table(rows, "confirm")
    tests = []
    for a, b in PLAN["comparisons"]:
        for T in PLAN["budgets"]:
            fa = table.get((a, _lr(chosen.get((a, T), math.nan)), T), {})
            fb = table.get((b, _lr(chosen.get((b, T), math.nan)), T), {})
            seeds = [s for s in PLAN["seeds"] if s in fa and s in fb]
            test = {"a": a, "b": b, "budget": T, "n": len(seeds), "complete": len(seeds) == len(PLAN["seeds"])}
            finite = all(math.isfinite(fa[s]) and math.isfinite(fb[s]) and min(fa[s], fb[s]) > 0 for s in seeds)
            if len(seeds) >= 2 and finite:
                d = [math.log(fa[s]) - math.log(fb[s]) for s in seeds]
                t, p = stats.ttest_rel([math.log(fa[s]) for s in seeds], [math.log(fb[s]) for s in seeds])
                half = stats.t.ppf(0.975, len(d) - 1) * stats.sem(d)
                md = sum(d) / len(d)
                test |= {
                    "fd_a": mean([fa[s] for s in seeds]),
                    "fd_b": mean([fb[s] for s in seeds]),
                    "fd_diff": mean([fa[s] - fb[s] for s in seeds]),
                    "ratio": math.exp(md),
                    "ci": (math.exp(md - half), math.exp(md + half)),
                    "t": float(t),
                    "p": float(p),
                }
            else:
                test["p"] = 1.0 if seeds else math.nan  # a diverged run: not rejected (PLAN, step 4)
            tests.append(test)
    if all(t["complete"] for t in tests):
        thresholds, reject = holm([t["p"] for t in tests], PLAN["alpha"])
        for test, threshold, decision in zip(tests, thresholds, reject, strict=True):
            test |= {"holm": threshold, "reject": decision}
    return tests


# -------------------------------------------------------------------------------------------------------- report
def _fmt(x: Any, spec: str = ".3g") -> str:
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def compute_line(rows: list[dict[str, Any]]) -> str:
    """Training seconds spent, per role: each unit (arm, lr, seed) counted once, at its longest budget's clock (one
    thread per unit; evaluation not counted)."""
    longest: dict[tuple, float] = {}
    for r in rows:
        key = (r["role"], r["arm"], _lr(r["lr"]), int(r["seed"]))
        longest[key] = max(longest.get(key, 0.0), float(r["wall_seconds"]))
    hours = {role: sum(s for k, s in longest.items() if k[0] == role) / 3600 for role in ("tune", "confirm")}
    units = {role: sum(k[0] == role for k in longest) for role in hours}
    return (
        f"Compute: {units['tune']} tuning units, {hours['tune']:.1f} CPU-hours of training; {units['confirm']} "
        f"confirmatory units, {hours['confirm']:.1f} CPU-hours (one thread per unit; evaluation not counted)."
    )


def report(rows: list[dict[str, Any]], args: argparse.Namespace, out: Path) -> str:
    """``frontier_confirm.md`` and ``frontier_confirm_fd_vs_lr.png``; returns the page."""
    grids, chosen, _ = choose(rows)
    table = fd_table(rows, "tune")
    lines = [
        "# Frontier, confirmatory run",
        "",
        f"Protocol: `benchmarks/frontier_confirm.py` (PLAN, committed before the first confirmatory row). "
        f"Command: `{getattr(args, 'command', '')}`; machine: {getattr(args, 'machine', '')}.",
        "",
        compute_line(rows),
        "",
        "## Learning rates chosen on the tuning seeds' FD",
        "",
        "| arm | budget | grid (mean FD of the tuning seeds; **chosen**) |",
        "|---|---:|---|",
    ]
    for (arm, T), lrs in grids.items():
        cells = [
            (f"**{lr:.4g}: {_fmt(tuning_fd(table, arm, lr, T))}**" if chosen.get((arm, T)) == lr else None)
            or f"{lr:.4g}: {_fmt(tuning_fd(table, arm, lr, T))}"
            for lr in lrs
        ]
        lines.append(f"| {arm} | {T} | {' · '.join(cells)} |")
    tests = confirmatory_tests(rows)
    lines += [
        "",
        f"## Confirmatory tests (paired t on ln FD over seeds {PLAN['seeds'][0]}–{PLAN['seeds'][-1]}, Holm over "
        f"{len(tests)} at α = {PLAN['alpha']})",
        "",
        "| A vs B | budget | n | FD A | FD B | mean FD A − B | ratio A/B (95% CI) | t | p | Holm α | decision |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for t in tests:
        ci = t.get("ci")
        ratio = f"{_fmt(t.get('ratio'))} ({_fmt(ci[0])}–{_fmt(ci[1])})" if ci else "—"
        decision = {True: "**reject H0**", False: "keep H0"}.get(t.get("reject"), "pending")
        lines.append(
            f"| {t['a']} vs {t['b']} | {t['budget']} | {t['n']} | {_fmt(t.get('fd_a'))} | {_fmt(t.get('fd_b'))} | "
            f"{_fmt(t.get('fd_diff'), '+.3g')} | {ratio} | {_fmt(t.get('t'), '.2f')} | {_fmt(t.get('p'), '.2g')} | "
            f"{_fmt(t.get('holm'), '.2g')} | {decision} |"
        )
    plot_fd_vs_lr(rows, "tune", out / "frontier_confirm_fd_vs_lr.png", chosen)
    lines += ["", "![FD vs lr per arm and budget](frontier_confirm_fd_vs_lr.png)", ""]
    page = "\n".join(lines)
    (out / "frontier_confirm.md").write_text(page)
    return page


def plot_fd_vs_lr(rows: list[dict[str, Any]], role: str, path: Path, chosen: dict[tuple, float]) -> None:
    """FD (mean over the seeds of ``role``) against lr, one panel per budget, one line per arm, chosen lrs ringed:
    how flat each choice is."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = fd_table(rows, role)
    budgets = sorted({T for (_, _, T) in table})
    if not budgets:
        return
    fig, axes = plt.subplots(1, len(budgets), figsize=(4 * len(budgets), 3.4), squeeze=False)
    for ax, T in zip(axes[0], budgets, strict=True):
        for arm in sorted({a for (a, _, t) in table if t == T}):
            lrs = sorted(lr for (a, lr, t) in table if a == arm and t == T)
            fds = [mean(list(table[arm, lr, T].values())) for lr in lrs]
            (line,) = ax.plot(lrs, fds, marker="o", ms=3, label=arm)
            if (arm, T) in chosen:
                lr = _lr(chosen[arm, T])
                ax.plot([lr], [mean(list(table[arm, lr, T].values()))], "o", ms=9, mfc="none", color=line.get_color())
        ax.set(xscale="log", yscale="log", title=f"{T} steps", xlabel="lr")
    axes[0][0].set_ylabel("FD (mean over seeds)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--out", default="benchmarks/results", help="frontier_confirm.csv / .md / .png go here")
    add("--jobs", type=int, default=2, help="parallel units")
    add("--threads", type=int, default=1, help="torch threads per unit")
    add("--device", default="cpu", help="Lightning accelerator (cpu, cuda)")
    add("--report-only", action="store_true", help="regenerate the report from the CSV")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    # the fixed part of the protocol: frontier_study's unit at its defaults, every seed varying every draw
    args.warmup, args.decay_fraction, args.samples, args.inference_steps = 20, 0.2, 500, 10
    args.tune_seeds, args.seed_scope, args.reported_role = PLAN["tune_seeds"], "all", "confirm"
    args.work = str(Path(args.out) / ".frontier_confirm_work")

    def execute(rows, args, csv_path):
        execute_planned(rows, args, csv_path, lambda: planned_units(rows), lambda row: None, _worker, COLUMNS)

    page = lambda rows, out: report(rows, args, out)  # noqa: E731
    run_study(parser, args, argv, "frontier_confirm.py", "frontier_confirm", COLUMNS, execute, page)


if __name__ == "__main__":
    main()
