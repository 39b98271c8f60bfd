"""The quality study's report: tables (``quality_study.md``) and plots from its CSV (``benchmarks/quality_study.py``
runs the study and calls :func:`report`)."""

from __future__ import annotations

import argparse
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from quality_study import ARMS, PLOTS, VARIANTS, budget, chosen_lr, run_key


# ------------------------------------------------------------------------------------------------------- report
def _f(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def mean_std(xs: list[float]) -> tuple[float, float]:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)


def per_run(rows: list[dict[str, Any]], variant: str = "ns5") -> dict[tuple, list[dict[str, Any]]]:
    """Rows of each run of ``variant``, by (config, optimizer, K, γ, lr, seed), in step order."""
    runs: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        key = run_key(r)
        if key[6] == variant:
            runs[key[:6]].append(r)
    for v in runs.values():
        v.sort(key=lambda r: int(r["step"]))
    return runs


def summarize(run_rows: list[dict[str, Any]]) -> dict[str, float]:
    """Best FD (and its step, wall time to reach it), final validation loss, optimizer-time share, step time."""
    best = min(run_rows, key=lambda r: _f(r["fd"]))
    last = run_rows[-1]
    steps = int(last["step"])
    return {
        "best_fd": _f(best["fd"]),
        "time_to_best": _f(best["wall_seconds"]),
        "val_loss": _f(last["val_loss"]),
        "precision": _f(best["precision"]),
        "recall": _f(best["recall"]),
        "opt_share": _f(last["optimizer_seconds"]) / _f(last["wall_seconds"]),
        "opt_ms": 1000 * _f(last["optimizer_seconds"]) / steps,
        # runs from before the column: a fixed schedule refreshes at steps 1, K+1, 2K+1, ...
        "refreshes": _f(last.get("refreshes")) if last.get("refreshes") else -(-steps // int(last["period"])),
        "step_ms": 1000 * _f(last["wall_seconds"]) / steps,
    }


def arm_stats(
    rows: list[dict[str, Any]],
    config: str,
    optimizer: str,
    period: int,
    scale: float,
    lr: float | None,
    variant: str = "ns5",
):
    """Per-seed summaries of one arm at one learning rate (default: every seed at the chosen rate)."""
    out = []
    for key, run_rows in per_run(rows, variant).items():
        c, o, k, g, run_lr, _ = key
        if (c, o, k, g) == (config, optimizer, period, round(scale, 6)) and (lr is None or run_lr == lr):
            out.append(summarize(run_rows))
    return out


def fmt(m: float, s: float, digits: int = 3) -> str:
    return f"{m:.{digits}f} ± {s:.{digits}f}" if not math.isnan(m) else "—"


def change(ours: float, base: float) -> str:
    """``ours`` relative to ``base``: "12.3% lower" / "4.5% higher"."""
    pct = 100 * (ours - base) / base
    return f"{abs(pct):.1f}% {'lower' if pct < 0 else 'higher'}"


def two_se_differs(a: list[float], b: list[float]) -> str:
    """Whether mean(a) − mean(b) exceeds 2 standard errors of the difference."""
    if len(a) < 2 or len(b) < 2:
        return "n/a (< 2 seeds)"
    (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
    se = math.sqrt((sa**2) / max(len(a), 1) + (sb**2) / max(len(b), 1))
    return "yes" if se > 0 and abs(ma - mb) > 2 * se else "no"


def report(rows: list[dict[str, Any]], args: argparse.Namespace, out_dir: Path) -> str:
    """quality_study.md (tables in the paper's form) and the PNG plots, from the CSV rows."""
    done = {run_key(r) for r in rows}
    lines = [
        "# Quality study",
        "",
        f"Command: `{args.command}`. Machine: {args.machine}. Regenerate this page: "
        "`python benchmarks/quality_study.py --report-only`. Mean ± std over seeds; 'beyond 2 SE' says whether a "
        "difference exceeds two standard errors of the difference of means.",
        "",
        f"Runs in the CSV: {len(done)} of the {args.planned} these flags plan"
        + ("." if len(done) >= args.planned else " (partial: run the command again to train the rest)."),
        "",
    ]
    for config in args.configs:
        lrs = {arm: chosen_lr(rows, config, arm, args) for arm in ARMS}
        stats = {}
        for arm, (opt, k, g) in ARMS.items():
            opt = "muon" if opt == "periodic_muon" and k == 1 else opt
            stats[arm] = arm_stats(rows, config, opt, k, g if opt == "periodic_muon" else 0.0, lrs[arm])
        steps, every = budget(config, args)
        lines += [
            f"## {config}",
            "",
            f"{steps} optimizer steps per run, evaluated every {every} ({args.samples} samples, "
            f"{args.inference_steps} sampler steps). Learning rates chosen on the final validation loss (seed "
            f"{args.seed0}; swept: "
            + "; ".join(f"{arm} {', '.join(f'{x:g}' for x in args.lrs[arm])}" for arm in ARMS)
            + "): "
            + ", ".join(f"{arm} {lrs[arm]:g}" for arm in ARMS)
            + ".",
            "",
            "| optimizer | seeds | best FD | final val loss | precision | recall | optimizer ms/step | step ms | "
            "optimizer share | time to best FD (s) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for arm, s in stats.items():
            col = {key: mean_std([x[key] for x in s]) for key in s[0]} if s else {}
            if not col:
                continue
            lines.append(
                f"| {arm} | {len(s)} | {fmt(*col['best_fd'])} | {fmt(*col['val_loss'], 4)} | "
                f"{fmt(*col['precision'])} | {fmt(*col['recall'])} | {fmt(*col['opt_ms'], 1)} | "
                f"{fmt(*col['step_ms'], 1)} | {fmt(*col['opt_share'], 2)} | {fmt(*col['time_to_best'], 0)} |"
            )
        fd = {arm: [x["best_fd"] for x in s] for arm, s in stats.items()}
        vl = {arm: [x["val_loss"] for x in s] for arm, s in stats.items()}
        opt = {arm: [x["opt_ms"] for x in s] for arm, s in stats.items()}
        if all(fd.values()):
            m = {arm: mean_std(v)[0] for arm, v in fd.items()}
            o = {arm: mean_std(v)[0] for arm, v in opt.items()}
            v = {arm: mean_std(x)[0] for arm, x in vl.items()}
            lines += [
                "",
                "| comparison | ours | paper | beyond 2 SE |",
                "|---|---:|---:|---|",
                f"| Muon vs AdamW, best FD | {change(m['muon'], m['adamw'])} | 12.9–19.1% lower (FD-DINOv2) | "
                f"{two_se_differs(fd['muon'], fd['adamw'])} |",
                f"| Muon vs AdamW, final val loss | {change(v['muon'], v['adamw'])} | — | "
                f"{two_se_differs(vl['muon'], vl['adamw'])} |",
                f"| Periodic vs Muon, best FD | {change(m['periodic'], m['muon'])} | within 0.5% | "
                f"{two_se_differs(fd['periodic'], fd['muon'])} |",
                f"| Periodic vs Muon, optimizer time | {change(o['periodic'], o['muon'])} | 46.9–54.3% lower | "
                f"{two_se_differs(opt['periodic'], opt['muon'])} |",
                "",
            ]
        lines += [f"![FD vs step]({PLOTS}{config}_fd_vs_step.png) ![FD vs wall]({PLOTS}{config}_fd_vs_wall.png)", ""]
        plot_curves(rows, config, stats_keys(config, lrs), out_dir)
    if args.ablations:
        lines += ablation_tables(rows, args, out_dir)
    if args.variants:
        lines += variant_table(rows, args)
    text = "\n".join(lines) + "\n"
    (out_dir / "quality_study.md").write_text(text)
    return text


def stats_keys(config: str, lrs: dict[str, float]) -> dict[str, tuple]:
    keys = {}
    for arm, (opt, k, g) in ARMS.items():
        opt = "muon" if opt == "periodic_muon" and k == 1 else opt
        keys[arm] = (config, opt, k, round(g if opt == "periodic_muon" else 0.0, 6), lrs[arm])
    return keys


def curves(rows, match) -> dict[int, list[dict[str, Any]]]:
    """Rows of the runs ``match(key)`` accepts, per seed."""
    return {key[5]: v for key, v in per_run(rows).items() if match(key)}


def plot_band(ax, runs: dict[int, list[dict[str, Any]]], x: str, label: str) -> None:
    if not runs:
        return
    n = min(len(v) for v in runs.values())
    xs = [mean_std([_f(v[i][x]) for v in runs.values()])[0] for i in range(n)]
    ys = [mean_std([_f(v[i]["fd"]) for v in runs.values()]) for i in range(n)]
    mean = [m for m, _ in ys]
    ax.plot(xs, mean, marker="o", ms=3, label=f"{label} (n={len(runs)})")
    ax.fill_between(xs, [m - s for m, s in ys], [m + s for m, s in ys], alpha=0.2)


def plot_curves(rows, config: str, keys: dict[str, tuple], out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for x, name, xlabel in (("step", "fd_vs_step", "step"), ("wall_seconds", "fd_vs_wall", "training wall seconds")):
        fig, ax = plt.subplots(figsize=(5, 3.4), dpi=120)
        for arm, key in keys.items():
            plot_band(ax, curves(rows, lambda k, key=key: k[:5] == key), x, arm)
        ax.set(xlabel=xlabel, ylabel="digits FD (lower is better)", title=f"{config}: mean ± std over seeds")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / f"{PLOTS}{config}_{name}.png")
        plt.close(fig)


def ablation_tables(rows, args: argparse.Namespace, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    config = args.configs[0]
    lr = chosen_lr(rows, config, "periodic", args)
    lines = [f"## Ablations ({config}, lr {lr:g}, seeds {args.seed0}…{args.seed0 + args.ablation_seeds - 1})", ""]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=120)
    for ax, (name, values, key_of) in zip(
        axes,
        (
            ("K (γ = 0.15)", args.periods, lambda v: ("muon", 1, 0.0) if v == 1 else ("periodic_muon", v, 0.15)),
            ("γ (K = 3)", args.scales, lambda v: ("periodic_muon", 3, round(v, 6))),
        ),
    ):
        lines += [f"| {name} | seeds | best FD | vs the default (K=3, γ=0.15) | beyond 2 SE | optimizer ms/step |"]
        lines += ["|---|---:|---:|---:|---|---:|"]
        base = [
            summarize(v)["best_fd"]
            for key, v in per_run(rows).items()
            if key[:5] == (config, "periodic_muon", 3, 0.15, lr) and key[5] < args.seed0 + args.ablation_seeds
        ]
        means, stds = [], []
        for value in values:
            opt, k, g = key_of(value)
            s = [
                summarize(v)
                for key, v in per_run(rows).items()
                if key[:5] == (config, opt, k, g, lr) and key[5] < args.seed0 + args.ablation_seeds
            ]
            fd = [x["best_fd"] for x in s]
            (m, sd), (b, _) = mean_std(fd), mean_std(base)
            means.append(m)
            stds.append(sd)
            lines.append(
                f"| {value:g} | {len(s)} | {fmt(m, sd)} | {change(m, b)} | {two_se_differs(fd, base)} | "
                f"{fmt(*mean_std([x['opt_ms'] for x in s]), 1)} |"
            )
        lines.append("")
        ax.errorbar([str(v) for v in values], means, yerr=stds, marker="o", capsize=3)
        ax.set(xlabel=name, ylabel="best digits FD", title=f"{config}: {name}")
    fig.tight_layout()
    fig.savefig(out_dir / f"{PLOTS}ablations.png")
    plt.close(fig)
    lines += [f"![K and γ ablations]({PLOTS}ablations.png)", ""]
    return lines


def variant_table(rows, args: argparse.Namespace) -> list[str]:
    """Each optimizer variant against ``baseline`` (the default trained beside them) at the same arm, learning rate
    and seeds."""
    config = args.configs[0]
    lines = [
        f"## Variants: orthogonalizers and refresh schedules ({config}, the chosen learning rates, seeds "
        f"{args.seed0}…{args.seed0 + args.seeds - 1})",
        "",
        "| arm | variant | seeds | best FD | vs baseline | beyond 2 SE | final val loss | vs baseline | beyond 2 SE | "
        "optimizer ms/step | refreshes per matrix |",
        "|---|---|---:|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    for arm in ("muon", "periodic"):
        opt, k, g = ARMS[arm]
        opt = "muon" if k == 1 else opt
        lr, scale = chosen_lr(rows, config, arm, args), g if opt == "periodic_muon" else 0.0
        seeds = range(args.seed0, args.seed0 + args.seeds)

        def stats(variant: str, opt=opt, k=k, scale=scale, lr=lr, seeds=seeds) -> list[dict[str, float]]:
            return [
                summarize(v)
                for key, v in per_run(rows, variant).items()
                if key[:5] == (config, opt, k, round(scale, 6), lr) and key[5] in seeds
            ]

        base = stats("baseline")
        base_fd, base_vl = [x["best_fd"] for x in base], [x["val_loss"] for x in base]
        for variant in [v for v in args.variants if arm in VARIANTS[v][0]]:
            s = stats(variant)
            if not s:
                continue
            fd, vl = [x["best_fd"] for x in s], [x["val_loss"] for x in s]
            (m_fd, s_fd), (m_vl, s_vl) = mean_std(fd), mean_std(vl)
            vs_fd = change(m_fd, mean_std(base_fd)[0]) if base else "—"
            vs_vl = change(m_vl, mean_std(base_vl)[0]) if base else "—"
            lines.append(
                f"| {arm} | {variant} | {len(s)} | {fmt(m_fd, s_fd)} | {vs_fd} | {two_se_differs(fd, base_fd)} | "
                f"{fmt(m_vl, s_vl, 4)} | {vs_vl} | {two_se_differs(vl, base_vl)} | "
                f"{fmt(*mean_std([x['opt_ms'] for x in s]), 1)} | {fmt(*mean_std([x['refreshes'] for x in s]), 1)} |"
            )
    return lines + [""]
