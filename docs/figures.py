"""The guide's pictures, drawn from the library itself: ``python docs/figures.py`` writes ``docs/figures/*.png``.

- ``refresh_schedule.png``: which steps refresh (NS5) and which take the RowNorm step, recorded from
  ``PeriodicRowwiseMuon.last_branches`` over real steps: K = 1, K = 3, K = 3 after a refresh warm-up, and the
  adaptive schedule on three matrices (each refreshes when its momentum direction drifted).
- ``refresh_modes.png``: how a refresh of FSDP2 row-sharded matrices moves them across 4 ranks, gather (every rank
  orthogonalizes every matrix) against scatter (each matrix once, on its owner), with the per-rank NS5 work.

The γ × learning-rate picture comes from the quality study (``benchmarks/quality_report.py``).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from lightning_muon import PeriodicRowwiseMuon  # noqa: E402

OUT = Path(__file__).parent / "figures"
STEPS = 24
SCHEDULES = {
    "K = 1 (Muon)": {"period": 1},
    "K = 3": {"period": 3},
    "K = 3, refresh_warmup = 6": {"period": 3, "refresh_warmup": 6},
    "adaptive, K ≤ 6\n(3 matrices)": {"period": 6, "schedule": "adaptive", "drift_threshold": 0.02},
}


def branches(options: dict, steps: int = STEPS, matrices: int = 3) -> list[list[bool]]:
    """Per step, per matrix: did it refresh? Recorded from the optimizer stepping random gradients whose direction
    wanders, matrix j faster than matrix j - 1, so the adaptive schedule has something to react to."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32, 32)) for _ in range(matrices)]
    optimizer = PeriodicRowwiseMuon(params, lr=0.01, **options)
    direction = [torch.randn(32, 32) for _ in params]
    out = []
    for _ in range(steps):
        for j, (p, d) in enumerate(zip(params, direction)):
            d.add_(torch.randn_like(d), alpha=0.1 * (j + 1))
            p.grad = d + 0.1 * torch.randn_like(d)
        counts_before = optimizer.refresh_counts()
        optimizer.step()
        counts = optimizer.refresh_counts()
        out.append([counts[name] > counts_before[name] for name in counts if "." in name])  # "group0.<i>": matrix i
    return out


def refresh_schedule(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 3.4))
    rows = list(SCHEDULES)
    y = 0
    ticks = []
    for name in reversed(rows):
        record = branches(SCHEDULES[name])
        lanes = len(record[0]) if name.startswith("adaptive") else 1
        for lane in range(lanes):
            for step, refreshed in enumerate(record):
                color = "#d62728" if refreshed[lane] else "#9ecae1"
                ax.add_patch(Rectangle((step + 1 - 0.45, y + lane * 0.3), 0.9, 0.26, color=color))
        ticks.append((y + 0.15 * lanes, name))
        y += 0.3 * lanes + 0.35
    ax.set_xlim(0.3, STEPS + 0.7)
    ax.set_ylim(-0.1, y)
    ax.set_yticks([t for t, _ in ticks], [n for _, n in ticks])
    ax.set_xlabel("optimizer step t")
    ax.set_xticks(range(1, STEPS + 1, 3))
    ax.add_patch(Rectangle((0, 0), 0, 0, color="#d62728", label="NS5 refresh"))
    ax.add_patch(Rectangle((0, 0), 0, 0, color="#9ecae1", label="RowNorm step (scaled by γ)"))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, 1.2), ncol=2, frameon=False)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def refresh_modes(path: Path, ranks: int = 4) -> None:
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, mode in zip(axes, ("gather", "scatter")):
        for r in range(ranks):
            x = r * 2.2
            ax.text(x + 0.5, 4.55, f"rank {r}", ha="center", fontsize=9)
            for m in range(ranks):  # before: each rank holds rows r of every matrix m
                ax.add_patch(Rectangle((x + 0.25 * m, 3.6), 0.22, 0.5, color=colors[m], alpha=0.45))
            held = range(ranks) if mode == "gather" else [r]  # after the transport: full matrices
            for i, m in enumerate(held):
                ax.add_patch(Rectangle((x + 0.25 * i, 1.6), 0.22, 1.4, color=colors[m]))
            ax.text(x + 0.5, 1.25, f"NS5 × {len(held)}", ha="center", fontsize=9)
            for m in range(ranks):  # after: each rank keeps its rows of the update
                ax.add_patch(Rectangle((x + 0.25 * m, 0.2), 0.22, 0.5, color=colors[m], alpha=0.45))
        ax.text(-0.3, 3.85, "row shards", ha="right", va="center", fontsize=8)
        ax.text(-0.3, 2.3, "full matrices", ha="right", va="center", fontsize=8)
        ax.text(-0.3, 0.45, "update rows", ha="right", va="center", fontsize=8)
        transport = "all-gather" if mode == "gather" else "all-to-all to the owner"
        back = "keep own rows" if mode == "gather" else "all-to-all back"
        ax.annotate("", (ranks * 1.1, 3.05), (ranks * 1.1, 3.55), arrowprops={"arrowstyle": "->"})
        ax.text(ranks * 1.1 + 0.1, 3.3, transport, fontsize=8)
        ax.annotate("", (ranks * 1.1, 0.75), (ranks * 1.1, 1.2), arrowprops={"arrowstyle": "->"})
        ax.text(ranks * 1.1 + 0.1, 0.95, back, fontsize=8)
        title = (
            f'refresh="gather" (the paper): every rank runs NS5 on all {ranks} matrices'
            if mode == "gather"
            else f'refresh="scatter" (default): NS5 once per matrix, 1/{ranks} per rank'
        )
        ax.set_title(title, fontsize=9)
        ax.set_xlim(-2.2, ranks * 2.2)
        ax.set_ylim(0, 4.9)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    OUT.mkdir(exist_ok=True)
    refresh_schedule(OUT / "refresh_schedule.png")
    refresh_modes(OUT / "refresh_modes.png")
    print("\n".join(str(p) for p in sorted(OUT.glob("*.png"))))


if __name__ == "__main__":
    main()
