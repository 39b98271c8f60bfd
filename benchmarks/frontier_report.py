"""The frontier study's report: ``frontier.md`` and ``frontier_<config>.png`` from the CSV
(``benchmarks/frontier_study.py`` runs the study and calls :func:`report`). Mean ± standard error over the reported
seeds; ``*``: the difference from Muon exceeds two standard errors of that difference; ``‡``: fewer reported seeds
than planned so far (a one-seed cell has no SE); ``e``: the lr chosen at this budget is at its grid's edge."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from frontier_pace import seconds_at
from frontier_study import ARMS, Plan, budgets, tuning_loss, unit_key
from quality_report import beyond_2se, mean_se
from study import as_float

METRICS = {"fd": ("FD (digits features)", 3), "val_loss": ("validation loss", 4)}


#: the frontier's clock columns and their names in ``frontier_pace.json``
PACED = {"wall_seconds": "step_s", "optimizer_seconds": "optimizer_s"}


class Frontier:
    """One configuration's reported rows, looked up by (arm, budget) at the lr chosen for that budget; ``pace``: the
    side-by-side clocks of ``frontier_pace.py`` per arm, if measured for this configuration."""

    def __init__(self, rows: list[dict[str, Any]], plan: Plan, config: str, args: argparse.Namespace, pace=None):
        self.rows = [r for r in rows if r["config"] == config]
        self.plan, self.config, self.args, self.pace = plan, config, args, pace or {}

    def seconds(self, arm: str, T: int, column: str) -> float:
        """Training (``wall_seconds``) or optimizer seconds of ``T`` steps: side by side where ``frontier_pace.py``
        measured the arm, else the mean of the reported seeds' own clocks."""
        if arm in self.pace:
            return seconds_at(self.pace[arm], PACED[column], T)
        return self.mean(arm, T, column)

    def lr(self, arm: str, T: int) -> float | None:
        chosen = self.plan.sweeps[self.config, arm].chosen
        return chosen[T] if chosen else None

    def cell(self, arm: str, T: int) -> list[dict[str, Any]]:
        """The reported seeds' rows of ``arm`` at budget ``T`` and its chosen lr."""
        lr = self.lr(arm, T)
        if lr is None:
            return []
        return [
            r
            for r in self.rows
            if r["arm"] == arm and int(r["budget"]) == T and r["role"] == "report" and math.isclose(float(r["lr"]), lr)
        ]

    def values(self, arm: str, T: int, column: str) -> list[float]:
        return [as_float(r[column]) for r in self.cell(arm, T)]

    def by_seed(self, arm: str, T: int, column: str) -> dict[int, float]:
        return {int(r["seed"]): as_float(r[column]) for r in self.cell(arm, T)}

    def text(self, arm: str, T: int, column: str, digits: int) -> str:
        xs = self.values(arm, T, column)
        if not xs:
            return "—"
        m, se = mean_se(xs)
        marks = "‡" if len(xs) < len(self.args.seeds) else ""
        marks += "e" if T in self.plan.sweeps[self.config, arm].at_edge else ""
        if arm != "muon" and beyond_2se(xs, self.values("muon", T, column)) == "yes":
            marks += "*"
        return f"{m:.{digits}f} ± {se:.{digits}f}{marks}" if len(xs) > 1 else f"{m:.{digits}f}{marks}"

    def mean(self, arm: str, T: int, column: str) -> float:
        return mean_se(self.values(arm, T, column))[0]


def ratio(a: list[float], b: list[float]) -> str:
    """mean(a) / mean(b) with its delta-method SE, and ``*`` when the difference is beyond 2 SE."""
    (ma, sa), (mb, sb) = mean_se(a), mean_se(b)
    if math.isnan(ma) or math.isnan(mb):
        return "—"
    r = ma / mb
    se = r * math.sqrt((sa / ma) ** 2 + (sb / mb) ** 2)
    return f"{r:.3f}× ± {se:.3f}" + ("*" if beyond_2se(a, b) == "yes" else "")


def table(header: list[str], body: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(row) + " |" for row in body),
        "",
    ]


def report(rows: list[dict[str, Any]], plan: Plan, args: argparse.Namespace, out_dir: Path) -> str:
    """frontier.md and the PNG plots, from the CSV rows and the plan they give."""
    done = {unit_key(r) for r in rows}
    planned = {u.key for u in plan.units}
    lines = [
        "# Quality against compute: the frontier",
        "",
        f"Command: `{args.command}`. Machine: {args.machine}. Regenerate: `python benchmarks/frontier_study.py "
        "--report-only`. Protocol: the docstring of `benchmarks/frontier_study.py` (WSD schedule, one stable run per "
        f"(arm, lr, seed) branching a {args.decay_fraction:g}-of-budget linear decay at every budget; the lr of each "
        f"(arm, budget) chosen by validation loss on seeds {args.tune_seeds}, reported on seeds {args.seeds}).",
        "",
        "**Exploratory.** The marks below are unpaired, uncorrected 2-SE screens (|Δ| > 2·√(SE₁² + SE₂²), about "
        "p < 0.08 at 5 seeds) over many comparisons; the section *Corrected for the comparisons made* says which "
        "survive a paired test with Holm's correction. Claims rest on the confirmatory run "
        "(`frontier_confirm.md`, fresh seeds, hypotheses committed first).",
        "",
        "Mean ± SE over the reported seeds at each budget's own lr. `*`: beyond 2 SE of Muon's; `‡`: fewer seeds than "
        "planned (so far); `e`: the chosen lr is at its grid's edge.",
        "",
        f"Units in the CSV: {len(done & planned)} of the {len(planned)} planned so far"
        + ("." if planned <= done else " (partial: run the command again to train the rest)."),
        "",
    ]
    lengths = budgets(args)
    for config in args.configs:
        f = Frontier(rows, plan, config, args, load_pace(out_dir / "frontier_pace.json", config))
        header = ["arm", *(f"{T} steps" for T in lengths)]
        lines += [f"## {config}", ""]
        lines += arms_table(f, lengths)
        for column, (title, digits) in METRICS.items():
            lines += [f"### {title} at each budget", ""]
            lines += table(header, [[arm, *(f.text(arm, T, column, digits) for T in lengths)] for arm in args.arms])
        lines += ratio_table(f, lengths, "muon", args.arms)
        variants = [arm for arm in args.arms if arm not in ("adamw", "muon", "periodic")]
        if variants and "periodic" in args.arms:  # Periodic's variants against what they modify
            lines += ratio_table(f, lengths, "periodic", variants)
        lines += corrected(f, lengths, variants)
        lines += paced_table(f, lengths)
        lines += [
            "### Seconds at each budget as trained: optimizer / training wall (mean over reported seeds)",
            "",
            "The units' own clocks: arms trained one after another, hours apart, two at a time on a shared machine — "
            "compare arms with the side-by-side table above.",
            "",
        ]
        body = [[arm, *(seconds(f, arm, T) for T in lengths)] for arm in args.arms]
        lines += table(header, body)
        lines += positive_control(f, lengths)
        lines += time_to_muon(f, lengths)
        lines += ["### Learning rate chosen at each budget (tuning seeds' validation loss)", ""]
        lines += table(header, [[arm, *(lr_text(f, arm, T) for T in lengths)] for arm in args.arms])
        lines += sweeps(f, lengths)
        png = plot(f, lengths, out_dir)
        if png:
            lines += [f"![FD against budget and against wall seconds, mean ± 2 SE]({png.name})", ""]
    text = "\n".join(lines)
    (out_dir / "frontier.md").write_text(text)
    return text


def load_pace(path: Path, config: str) -> dict[str, Any]:
    """The arms' side-by-side clocks from ``frontier_pace.json`` if it was measured on ``config``, else none."""
    if not path.exists():
        return {}
    pace = json.loads(path.read_text())
    return pace["arms"] if pace["config"]["config"] == config else {}


def paced_table(f: Frontier, lengths: list[int]) -> list[str]:
    """Training seconds of each budget side by side (``frontier_pace.py``) and relative to Muon's."""
    if not f.pace:
        return []
    body = []
    for arm in f.args.arms:
        if arm not in f.pace:
            continue
        cells = []
        for T in lengths:
            wall, muon = f.seconds(arm, T, "wall_seconds"), f.seconds("muon", T, "wall_seconds")
            cells.append(f"{wall:.1f} ({wall / muon:.2f}×)")
        body.append([arm, *cells])
    return [
        "### Training seconds at each budget, side by side (relative to Muon)",
        "",
        "`benchmarks/frontier_pace.py`: every arm one training step in turn in one process (forward, backward, "
        "clipping, the optimizer step with the arm's refresh schedule, EMA), measured over its first "
        f"{len(next(iter(f.pace.values()))['step_s'])} steps and extended at the rate of their second half.",
        "",
    ] + table(["arm", *(f"{T} steps" for T in lengths)], body)


def ratio_table(f: Frontier, lengths: list[int], base: str, arms: list[str]) -> list[str]:
    """FD of each of ``arms`` relative to ``base``'s at every budget; ``*``: beyond 2 SE of ``base``."""
    header = ["arm", *(f"{T} steps" for T in lengths)]
    body = [[arm, *(ratio(f.values(arm, T, "fd"), f.values(base, T, "fd")) for T in lengths)] for arm in arms]
    return [f"### FD relative to {base} (± delta-method SE, `*` beyond 2 SE)", ""] + table(header, body)


def corrected(f: Frontier, lengths: list[int], variants: list[str], alpha: float = 0.05) -> list[str]:
    """Every FD comparison the page marks (each arm vs Muon; each variant vs Periodic; every budget) as a paired t on
    ln FD over the seeds both have (a seed gives both arms the same initial weights), Holm over all of them."""
    from frontier_confirm import holm
    from scipy import stats

    pairs = [(arm, "muon") for arm in f.args.arms if arm != "muon"]
    pairs += [(arm, "periodic") for arm in variants if "periodic" in f.args.arms]
    tests = []
    for a, b in pairs:
        for T in lengths:
            fa, fb = f.by_seed(a, T, "fd"), f.by_seed(b, T, "fd")
            seeds = sorted(set(fa) & set(fb))
            if len(seeds) < 2 or not all(min(fa[s], fb[s]) > 0 for s in seeds):
                continue
            _, p = stats.ttest_rel([math.log(fa[s]) for s in seeds], [math.log(fb[s]) for s in seeds])
            marked = beyond_2se(list(fa.values()), list(fb.values())) == "yes"
            tests.append((a, b, T, len(seeds), float(p), marked))
    if not tests:
        return []
    thresholds, reject = holm([t[4] for t in tests], alpha)
    body = [
        [f"{a} vs {b}", str(T), str(n), f"{p:.2g}", f"{h:.2g}", "yes" if m else "no", "**yes**" if r else "no"]
        for (a, b, T, n, p, m), h, r in zip(tests, thresholds, reject, strict=True)
        if m or r
    ]
    survive = sum(reject)
    return [
        "### Corrected for the comparisons made (FD)",
        "",
        f"{len(tests)} comparisons; {sum(t[5] for t in tests)} marked beyond 2 SE (unpaired), {survive} survive a "
        f"paired t on ln FD with Holm's correction over all {len(tests)} at α = {alpha}. The marked or surviving ones:",
        "",
    ] + table(["comparison", "budget", "n", "paired p", "Holm α", "marked beyond 2 SE", "survives Holm"], body)


def arms_table(f: Frontier, lengths: list[int]) -> list[str]:
    """Each arm's DiTModule options and its NS5 refreshes per matrix over the longest budget (mean over seeds)."""
    body = []
    for arm in f.args.arms:
        options = ", ".join(f"{k}={v}" for k, v in ARMS[arm].items())
        refreshes = f.mean(arm, lengths[-1], "refreshes")
        body.append([arm, f"`{options}`", "—" if math.isnan(refreshes) else f"{refreshes:.0f}"])
    return ["### The arms", ""] + table(["arm", "options", f"refreshes per matrix in {lengths[-1]} steps"], body)


def seconds(f: Frontier, arm: str, T: int) -> str:
    opt, wall = f.mean(arm, T, "optimizer_seconds"), f.mean(arm, T, "wall_seconds")
    return "—" if math.isnan(wall) else f"{opt:.1f} / {wall:.1f}"


def lr_text(f: Frontier, arm: str, T: int) -> str:
    lr = f.lr(arm, T)
    return "—" if lr is None else f"{lr:.3g}" + ("e" if T in f.plan.sweeps[f.config, arm].at_edge else "")


def positive_control(f: Frontier, lengths: list[int]) -> list[str]:
    """Whether the study can separate two optimizers at all: the budgets where AdamW and Muon differ beyond 2 SE."""
    if "adamw" not in f.args.arms:
        return []
    found = {
        column: [T for T in lengths if beyond_2se(f.values("adamw", T, column), f.values("muon", T, column)) == "yes"]
        for column in METRICS
    }
    said = "; ".join(f"{METRICS[c][0]}: {', '.join(map(str, Ts)) or 'none'}" for c, Ts in found.items())
    return [f"**Positive control** — budgets where AdamW and Muon differ beyond 2 SE: {said}.", ""]


def time_to_muon(f: Frontier, lengths: list[int]) -> list[str]:
    """For each Muon budget T: the smallest budget at which each arm's mean FD reaches Muon's mean FD at T, with its
    mean wall and optimizer seconds relative to Muon's at T (budgets are ×2 apart: coarse; "—" if none reaches it)."""
    lines = [
        "### Budget each arm needs to reach Muon's FD at each budget",
        "",
        "Smallest budget whose mean FD ≤ Muon's mean FD at the column's budget: steps (its training / optimizer "
        "seconds relative to Muon's at that budget — side by side where measured, else as trained). Budgets are about "
        "×2 apart, so this is coarse.",
        "",
    ]
    body = []
    for arm in f.args.arms:
        cells = []
        for T in lengths:
            target = f.mean("muon", T, "fd")
            hit = next((S for S in lengths if f.mean(arm, S, "fd") <= target), None)
            if hit is None:
                cells.append("—")
                continue
            wall, opt = (f.seconds(arm, hit, c) / f.seconds("muon", T, c) for c in PACED)
            cells.append(f"{hit} ({wall:.2f}× / {opt:.2f}×)")
        body.append([arm, *cells])
    return lines + table(["arm", *(f"Muon@{T}" for T in lengths)], body)


def sweeps(f: Frontier, lengths: list[int]) -> list[str]:
    """Each sweep's tuning validation loss per lr and budget; the chosen lr's in bold."""
    lines = ["### The sweeps: mean validation loss over the tuning seeds", ""]
    for arm in f.args.arms:
        s = f.plan.sweeps[f.config, arm]
        lrs = sorted({u.lr for u in s.units})
        body = []
        for lr in lrs:
            cells = []
            for T in lengths:
                loss = tuning_loss(f.rows, f.config, arm, lr, T)
                text = f"{loss:.4f}" if math.isfinite(loss) else ("diverged" if s.chosen else "—")
                cells.append(f"**{text}**" if s.chosen and math.isclose(s.chosen[T], lr) else text)
            body.append([f"{lr:.3g}", *cells])
        lines += [f"**{arm}**", "", *table(["lr", *(f"{T}" for T in lengths)], body)]
    return lines


def plot(f: Frontier, lengths: list[int], out_dir: Path) -> Path | None:
    """FD against budget (steps) and against training wall seconds, each arm mean ± 2 SE, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    drawn = False
    for arm in f.args.arms:
        points = []
        for T in lengths:
            fd = f.values(arm, T, "fd")
            if fd:
                m, se = mean_se(fd)
                points.append((T, f.seconds(arm, T, "wall_seconds"), m, 2 * se))
        if not points:
            continue
        drawn = True
        steps, wall, fd, err = zip(*points)
        style = {"marker": "o", "capsize": 3, "label": arm, "lw": 2.0 if arm in ("adamw", "muon") else 1.2}
        axes[0].errorbar(steps, fd, yerr=err, **style)
        axes[1].errorbar(wall, fd, yerr=err, **style)
    if not drawn:
        plt.close(fig)
        return None
    seconds = "training seconds" + (" (side by side)" if f.pace else "")
    for ax, xlabel in zip(axes, ("budget (optimizer steps)", seconds)):
        ax.set(xscale="log", yscale="log", xlabel=xlabel, ylabel="FD at the budget's end")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{f.config}: quality against compute, each budget at its own lr (WSD)")
    fig.tight_layout()
    path = out_dir / f"frontier_{f.config}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
