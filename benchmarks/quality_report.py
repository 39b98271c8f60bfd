"""The quality study's report: ``quality_study.md`` and its plots from the CSV (``benchmarks/quality_study.py`` runs
the study and calls :func:`report`). Means ± standard errors over seeds; "beyond 2 SE": whether a difference of means
exceeds two standard errors of that difference."""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from quality_study import MUON, PAPER_GAMMA, PLOTS, Arm, Plan, budget, lowest_val_loss, periodic, run_key
from study import as_float

#: time-to-target: the targets are these multiples of Muon's mean best FD (on the descent; within 10% of the best)
TARGETS_OF_MUON = (2.0, 1.1)


# ------------------------------------------------------------------------------------------------------ numbers
def mean_se(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, sd / math.sqrt(len(xs))


def fmt(m: float, se: float, digits: int = 3) -> str:
    return f"{m:.{digits}f} ± {se:.{digits}f}" if not math.isnan(m) else "—"


def change(ours: float, base: float) -> str:
    """``ours`` relative to ``base``: "12.3% lower" / "4.5% higher"."""
    if math.isnan(ours) or math.isnan(base):
        return "—"
    pct = 100 * (ours - base) / base
    return f"{abs(pct):.1f}% {'lower' if pct < 0 else 'higher'}"


def beyond_2se(a: list[float], b: list[float]) -> str:
    """Whether mean(a) − mean(b) exceeds 2 standard errors of the difference."""
    a, b = [x for x in a if not math.isnan(x)], [x for x in b if not math.isnan(x)]
    if len(a) < 2 or len(b) < 2:
        return "n/a (< 2 seeds)"
    (ma, sa), (mb, sb) = mean_se(a), mean_se(b)
    se = math.sqrt(sa**2 + sb**2)
    return "yes" if se > 0 and abs(ma - mb) > 2 * se else "no"


def runs_of(rows: list[dict[str, Any]]) -> dict[tuple, list[dict[str, Any]]]:
    """Each run's rows by (config, arm, lr, seed), in step order."""
    runs: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        runs[run_key(r)].append(r)
    for v in runs.values():
        v.sort(key=lambda r: int(r["step"]))
    return runs


def first_reaching(run_rows: list[dict[str, Any]], target: float, clock: str) -> float:
    """``clock`` (a CSV column) at the first evaluation whose FD is at most ``target``; NaN if none is."""
    return next((as_float(r[clock]) for r in run_rows if as_float(r["fd"]) <= target), math.nan)


def fd_at(run_rows: list[dict[str, Any]], wall: float) -> float:
    """FD at ``wall`` training seconds, linear between evaluations (NaN outside the run)."""
    points = [(as_float(r["wall_seconds"]), as_float(r["fd"])) for r in run_rows]
    for (t0, f0), (t1, f1) in zip(points, points[1:]):
        if t0 <= wall <= t1:
            return f0 + (f1 - f0) * (wall - t0) / (t1 - t0) if t1 > t0 else f1
    return math.nan


def summarize(run_rows: list[dict[str, Any]]) -> dict[str, float]:
    best = min(run_rows, key=lambda r: as_float(r["fd"]) if math.isfinite(as_float(r["fd"])) else math.inf)
    last, steps = run_rows[-1], int(run_rows[-1]["step"])
    val_loss = lowest_val_loss(run_rows)
    return {
        "best_fd": as_float(best["fd"]),
        "best_step": int(best["step"]),
        "last_step": steps,
        "val_loss": val_loss if math.isfinite(val_loss) else math.nan,
        "precision": as_float(best["precision"]),
        "recall": as_float(best["recall"]),
        "wall_to_best": as_float(best["wall_seconds"]),
        "opt_to_best": as_float(best["optimizer_seconds"]),
        "wall": as_float(last["wall_seconds"]),
        "opt_ms": 1000 * as_float(last["optimizer_seconds"]) / steps,
        "step_ms": 1000 * as_float(last["wall_seconds"]) / steps,
        "refreshes": as_float(last["refreshes"]) / steps,
        "gamma_descent": as_float(last["gamma_descent"]),
        "gamma_rms": as_float(last["gamma_rms"]),
    }


class Study:
    """The finished runs of one configuration, looked up by arm at its chosen learning rate."""

    def __init__(self, rows: list[dict[str, Any]], plan: Plan, config: str, args: argparse.Namespace):
        self.config, self.plan, self.args = config, plan, args
        self.runs = {key: v for key, v in runs_of(rows).items() if key[0] == config}

    def lr(self, arm: Arm) -> float | None:
        sweep = self.plan.sweeps.get((self.config, arm.name))
        return sweep.chosen if sweep else None

    def seeds(self, arm: Arm, lr: float | None = None) -> dict[int, list[dict[str, Any]]]:
        """The runs of ``arm`` at ``lr`` (default: its chosen lr) by seed."""
        lr = self.lr(arm) if lr is None else lr
        if lr is None:
            return {}
        return {k[3]: v for k, v in self.runs.items() if k[1] == arm.name and k[2] == round(lr, 10)}

    def stats(self, arm: Arm, lr: float | None = None) -> list[dict[str, float]]:
        return [summarize(v) for v in self.seeds(arm, lr).values()]

    def column(self, arm: Arm, name: str) -> list[float]:
        return [s[name] for s in self.stats(arm)]


# ------------------------------------------------------------------------------------------------------- report
def report(rows: list[dict[str, Any]], plan: Plan, args: argparse.Namespace, out_dir: Path) -> str:
    """quality_study.md and the PNG plots, from the CSV rows and the plan they give."""
    done = {run_key(r) for r in rows}
    planned = {run.key for run in plan.runs}
    lines = [
        "# Quality study",
        "",
        f"Command: `{args.command}`. Machine: {args.machine}. Regenerate this page: "
        "`python benchmarks/quality_study.py --report-only`. Mean ± standard error over seeds; 'beyond 2 SE': "
        "whether a difference of means exceeds two standard errors of that difference. Protocol: the docstring of "
        "`benchmarks/quality_study.py`.",
        "",
        f"Runs in the CSV: {len(done & planned)} of the {len(planned)} planned so far"
        + ("." if planned <= done else " (partial: run the command again to train the rest)."),
        "",
    ]
    for config in args.configs:
        study = Study(rows, plan, config, args)
        steps, every = budget(config, args)
        lines += [
            f"## {config}",
            "",
            f"{steps} optimizer steps per run at a constant learning rate after warm-up, evaluated every {every} "
            f"({args.samples} samples, {args.inference_steps} sampler steps).",
            "",
        ]
        lines += sweep_table(study)
        lines += main_table(study)
        lines += time_tables(study)
        lines += gamma_section(study, out_dir)
        lines += period_table(study)
        plot_curves(study, out_dir)
        plot_ablations(study, out_dir)
        lines += [
            f"![FD vs step]({PLOTS}{config}_fd_vs_step.png) ![FD vs wall]({PLOTS}{config}_fd_vs_wall.png)",
            f"![best FD against γ and K]({PLOTS}{config}_ablations.png)",
            "",
        ]
    text = "\n".join(lines) + "\n"
    (out_dir / "quality_study.md").write_text(text)
    return text


def sweep_table(study: Study) -> list[str]:
    lines = [
        "### Learning-rate sweeps (seed 0; lowest validation loss reached, * chosen)",
        "",
        "| arm | validation loss per lr | chosen lr | interior of its grid |",
        "|---|---|---:|---|",
    ]
    for (config, name), sweep in study.plan.sweeps.items():
        if config != study.config:
            continue
        cells = []
        for run in sweep.runs:
            v = study.runs.get(run.key)
            lowest = lowest_val_loss(v) if v else math.nan
            loss = "not run yet" if not v else f"{lowest:.4f}" if math.isfinite(lowest) else "diverged"
            cells.append(f"{run.lr:g}: {loss}{'*' if run.lr == sweep.chosen else ''}")
        interior = "—" if sweep.chosen is None else ("no (grid extensions ran out)" if sweep.at_edge else "yes")
        chosen = f"{sweep.chosen:g}" if sweep.chosen is not None else "sweep not finished"
        lines.append(f"| {name} | {', '.join(cells)} | {chosen} | {interior} |")
    return lines + [""]


def main_table(study: Study) -> list[str]:
    muon_fd, muon_vl = study.column(MUON, "best_fd"), study.column(MUON, "val_loss")
    lines = [
        "### Each arm at its own best learning rate",
        "",
        "| arm | lr | seeds | best FD | vs Muon | beyond 2 SE | best val loss | vs Muon | beyond 2 SE | "
        "step of best FD (last eval) | precision | recall | optimizer ms/step | step ms |",
        "|---|---:|---:|---:|---:|---|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    not_before_last, shown = [], 0
    for arm in study.plan.reported[study.config]:
        s = study.stats(arm)
        if not s:
            continue
        shown += 1
        col = {key: mean_se([x[key] for x in s]) for key in s[0]}
        fd, vl = [x["best_fd"] for x in s], [x["val_loss"] for x in s]
        at_last = [x for x in s if x["best_step"] == x["last_step"]]
        if at_last:
            not_before_last.append(f"{arm.name} ({len(at_last)} of {len(s)} seeds)")
        best_steps = "/".join(str(x["best_step"]) for x in s) + f" ({s[0]['last_step']})"
        lines.append(
            f"| {arm.name} | {study.lr(arm):g} | {len(s)} | {fmt(*col['best_fd'])} | "
            f"{change(col['best_fd'][0], mean_se(muon_fd)[0])} | {beyond_2se(fd, muon_fd)} | "
            f"{fmt(*col['val_loss'], 4)} | {change(col['val_loss'][0], mean_se(muon_vl)[0])} | "
            f"{beyond_2se(vl, muon_vl)} | {best_steps} | {fmt(*col['precision'])} | {fmt(*col['recall'])} | "
            f"{fmt(*col['opt_ms'], 1)} | {fmt(*col['step_ms'], 1)} |"
        )
    lines.append("")
    if not_before_last:
        too_short = ", ".join(not_before_last)
        lines.append(f"Best FD at the last evaluation (the budget may be too short for them): {too_short}.")
    elif shown:
        lines.append("Every arm above reached its best FD before the last evaluation.")
    return lines + [""]


def time_tables(study: Study) -> list[str]:
    """Time to target FDs (multiples TARGETS_OF_MUON of Muon's mean best: the descent and the plateau) and to each
    run's own best, in training wall and optimizer seconds; FD at the wall time every run reached."""
    muon_best = mean_se(study.column(MUON, "best_fd"))[0]
    if math.isnan(muon_best):
        return []
    targets = [m * muon_best for m in TARGETS_OF_MUON]
    head = " | ".join(f"wall s to ≤ {t:.3f} | optimizer s to ≤ {t:.3f} | reached" for t in targets)
    lines = [
        "### Time to quality (first evaluation at or below a target FD: "
        + " and ".join(f"{m:g}× Muon's mean best FD" for m in TARGETS_OF_MUON)
        + ")",
        "",
        f"| arm | {head} | wall s to own best | optimizer s to own best |",
        "|---|" + "---:|---:|---:|" * len(targets) + "---:|---:|",
    ]
    arms = [a for a in study.plan.reported[study.config] if study.stats(a)]
    for arm in arms:
        seeds, s = list(study.seeds(arm).values()), study.stats(arm)
        cells = []
        for target in targets:
            wall = [first_reaching(v, target, "wall_seconds") for v in seeds]
            opt = [first_reaching(v, target, "optimizer_seconds") for v in seeds]
            reached = sum(not math.isnan(w) for w in wall)
            cells.append(f"{fmt(*mean_se(wall), 1)} | {fmt(*mean_se(opt), 1)} | {reached} of {len(seeds)}")
        lines.append(
            f"| {arm.name} | {' | '.join(cells)} | {fmt(*mean_se([x['wall_to_best'] for x in s]), 1)} | "
            f"{fmt(*mean_se([x['opt_to_best'] for x in s]), 1)} |"
        )
    equal = min(min(study.column(a, "wall")) for a in arms)
    lines += [
        "",
        f"FD at equal training wall time ({equal:.0f} s, the shortest run's; linear between evaluations):",
        "",
        "| arm | FD | vs Muon | beyond 2 SE |",
        "|---|---:|---:|---|",
    ]
    muon_at = [fd_at(v, equal) for v in study.seeds(MUON).values()]
    for arm in arms:
        at = [fd_at(v, equal) for v in study.seeds(arm).values()]
        lines.append(
            f"| {arm.name} | {fmt(*mean_se(at))} | {change(mean_se(at)[0], mean_se(muon_at)[0])} | "
            f"{beyond_2se(at, muon_at)} |"
        )
    return lines + [""]


def gamma_section(study: Study, out_dir: Path) -> list[str]:
    """The γ × lr grid at K=3 (seed 0) as a heat map, each γ at its own best lr, and auto-γ beside them."""
    gammas = study.args.gammas
    lines = [
        "### γ at K=3, each at its own learning rate (and the calibrated γ)",
        "",
        "| γ | lr | lr·(1+2γ)/3 | seeds | best FD | vs γ=0.15 | beyond 2 SE | best val loss | mean calibrated γ "
        "(descent / RMS) |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    paper = periodic(3, PAPER_GAMMA)
    base = study.column(paper, "best_fd")
    for scale in [*gammas, *study.args.auto]:
        arm = periodic(3, scale)
        s, lr = study.stats(arm), study.lr(arm)
        if not s or lr is None:
            continue
        fd = [x["best_fd"] for x in s]
        mean_step = f"{lr * (1 + 2 * scale) / 3:.4f}" if isinstance(scale, float) else "—"
        calibrated = "—"
        if isinstance(scale, str):
            descent, rms = (mean_se([x[key] for x in s])[0] for key in ("gamma_descent", "gamma_rms"))
            calibrated = f"{descent:.3f} / {rms:.3f}"
        best = " (best on val loss)" if scale == study.plan.best_gamma.get(study.config) else ""
        lines.append(
            f"| {scale}{best} | {lr:g} | {mean_step} | {len(s)} | {fmt(*mean_se(fd))} | "
            f"{change(mean_se(fd)[0], mean_se(base)[0])} | {beyond_2se(fd, base)} | "
            f"{fmt(*mean_se([x['val_loss'] for x in s]), 4)} | {calibrated} |"
        )
    plot_heatmap(study, out_dir)
    return lines + ["", f"![γ × lr]({PLOTS}{study.config}_gamma_lr.png)", ""]


def plot_ablations(study: Study, out_dir: Path) -> None:
    """Best FD (mean ± 2 SE over seeds) against γ at K=3 and against K at the best γ, each at its own lr."""
    gamma = study.plan.best_gamma.get(study.config)
    if gamma is None:
        return
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=120)
    panels = (
        (
            "γ (K=3)",
            [(f"{g:g}", periodic(3, g)) for g in study.args.gammas] + [(s, periodic(3, s)) for s in study.args.auto],
        ),
        (
            f"K (γ={gamma:g})",
            [(str(k), MUON if k == 1 else periodic(k, gamma)) for k in sorted({1, *study.args.periods})],
        ),
    )
    for ax, (name, arms) in zip(axes, panels):
        points = [(label, mean_se(study.column(arm, "best_fd"))) for label, arm in arms if study.stats(arm)]
        ax.errorbar(
            [p[0] for p in points], [p[1][0] for p in points], yerr=[2 * p[1][1] for p in points], fmt="o", capsize=3
        )
        ax.set(xlabel=name, ylabel="best digits FD at its own lr", title=f"{study.config}: {name}")
    fig.tight_layout()
    fig.savefig(out_dir / f"{PLOTS}{study.config}_ablations.png")
    plt.close(fig)


def period_table(study: Study) -> list[str]:
    gamma = study.plan.best_gamma.get(study.config)
    if gamma is None:
        return []
    lines = [
        f"### K at γ = {gamma:g} (the best γ of the K=3 grid), each at its own learning rate",
        "",
        "| K | lr | seeds | best FD | vs K=3 | beyond 2 SE | best val loss | NS5 refreshes per matrix per step | "
        "optimizer ms/step |",
        "|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    k3 = study.column(periodic(3, gamma), "best_fd")
    for k in sorted({1, *study.args.periods}):
        arm = MUON if k == 1 else periodic(k, gamma)
        s, lr = study.stats(arm), study.lr(arm)
        if not s or lr is None:
            continue
        fd = [x["best_fd"] for x in s]
        lines.append(
            f"| {k} | {lr:g} | {len(s)} | {fmt(*mean_se(fd))} | {change(mean_se(fd)[0], mean_se(k3)[0])} | "
            f"{beyond_2se(fd, k3)} | {fmt(*mean_se([x['val_loss'] for x in s]), 4)} | "
            f"{mean_se([x['refreshes'] for x in s])[0]:.3f} | {fmt(*mean_se([x['opt_ms'] for x in s]), 1)} |"
        )
    return lines + [""]


# -------------------------------------------------------------------------------------------------------- plots
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_heatmap(study: Study, out_dir: Path) -> None:
    """Seed 0's best validation loss and best FD on the γ × lr grid (blank: not run); boxes: each γ's chosen lr."""
    import numpy as np

    gammas = study.args.gammas
    lrs = sorted({k[2] for k in study.runs if any(k[1] == periodic(3, g).name for g in gammas)})
    if not lrs:
        return
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), dpi=120)
    for ax, (key, title) in zip(axes, (("val_loss", "best validation loss"), ("best_fd", "best FD"))):
        grid = np.full((len(gammas), len(lrs)), np.nan)
        for i, g in enumerate(gammas):
            for j, lr in enumerate(lrs):
                run = study.runs.get((study.config, periodic(3, g).name, lr, study.args.seed0))
                if run:
                    grid[i, j] = summarize(run)[key]
        image = ax.imshow(grid, cmap="viridis_r", aspect="auto")
        fig.colorbar(image, ax=ax)
        low, high = np.nanmin(grid), np.nanmax(grid)
        for i, g in enumerate(gammas):
            for j in range(len(lrs)):
                if not np.isnan(grid[i, j]):
                    light = (grid[i, j] - low) < 0.5 * (high - low)  # viridis_r: low values are yellow
                    ax.text(
                        j, i, f"{grid[i, j]:.3g}", ha="center", va="center", fontsize=7, color="k" if light else "w"
                    )
            chosen = study.lr(periodic(3, g))
            if chosen is not None and round(chosen, 10) in lrs:
                j = lrs.index(round(chosen, 10))
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=2))
        ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs], rotation=45)
        ax.set_yticks(range(len(gammas)), [f"{g:g}" for g in gammas])
        ax.set(xlabel="learning rate", ylabel="γ (K=3)", title=f"{study.config}: {title} (seed 0)")
    fig.tight_layout()
    fig.savefig(out_dir / f"{PLOTS}{study.config}_gamma_lr.png")
    plt.close(fig)


def plot_curves(study: Study, out_dir: Path) -> None:
    plt = _pyplot()
    arms = [a for a in study.plan.reported[study.config] if a.period in (1, 3) and study.stats(a)]
    for x, name, xlabel in (("step", "fd_vs_step", "step"), ("wall_seconds", "fd_vs_wall", "training wall seconds")):
        fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
        for arm in arms:
            runs = list(study.seeds(arm).values())
            n = min(len(v) for v in runs)
            xs = [mean_se([as_float(v[i][x]) for v in runs])[0] for i in range(n)]
            ys = [mean_se([as_float(v[i]["fd"]) for v in runs]) for i in range(n)]
            mean = [m for m, _ in ys]
            ax.plot(xs, mean, marker="o", ms=2, label=f"{arm.name}, lr {study.lr(arm):g} (n={len(runs)})")
            ax.fill_between(xs, [m - 2 * s for m, s in ys], [m + 2 * s for m, s in ys], alpha=0.2)
        ax.set(xlabel=xlabel, ylabel="digits FD (lower is better)", title=f"{study.config}: mean ± 2 SE over seeds")
        ax.set_yscale("log")
        ax.legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(out_dir / f"{PLOTS}{study.config}_{name}.png")
        plt.close(fig)
