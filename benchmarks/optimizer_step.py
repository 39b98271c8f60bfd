"""Optimizer-step time on DiT block matrices: AdamW, torch.optim.Muon, PeriodicRowwiseMuon K=1 and K=3 (fixed and
auto γ), and the fused qkv orthogonalized per projection (pieces=3) or per head (pieces=3·heads, 64-wide heads).

Implementations run round-robin in one process (one step each per round) so machine noise hits all of them alike.
Periodic times are averaged over whole periods. Prints a table with ratios and writes JSON.

    python benchmarks/optimizer_step.py --hidden 1024 --blocks 1 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from lightning_muon import PeriodicRowwiseMuon


def block_shapes(hidden: int, mlp_ratio: int = 4) -> dict[str, tuple[int, int]]:
    """The 2-D weights of one DiT block (out, in): fused qkv, attention out, MLP up/down, adaLN-zero modulation."""
    return {
        "qkv": (3 * hidden, hidden),
        "attn_out": (hidden, hidden),
        "mlp_up": (mlp_ratio * hidden, hidden),
        "mlp_down": (hidden, mlp_ratio * hidden),
        "adaln": (6 * hidden, hidden),
    }


def make_params(shapes: list[tuple[int, int]], seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def qkv_pieces(shapes: list[tuple[int, int]], pieces: int) -> list[dict]:
    """Param groups with every fused qkv weight (3h, h) cut into ``pieces`` matrices (MatrixLayout), the rest whole."""
    params = make_params(shapes)
    fused = [p for p in params if p.shape[0] == 3 * p.shape[1]]
    return [{"params": fused, "pieces": pieces}, {"params": [p for p in params if all(p is not f for f in fused)]}]


def optimizers(shapes, ns_dtype: torch.dtype) -> dict[str, tuple[torch.optim.Optimizer, int]]:
    """name -> (optimizer, steps per timed unit)."""
    kw = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01)
    heads = 3 * max(1, shapes[0][1] // 64)
    return {
        "adamw (torch, foreach)": (torch.optim.AdamW(make_params(shapes), lr=1e-3, weight_decay=0.01, foreach=True), 1),
        "torch.optim.Muon (bf16)": (torch.optim.Muon(make_params(shapes), **kw), 1),
        "periodic K=1": (PeriodicRowwiseMuon(make_params(shapes), period=1, ns_dtype=ns_dtype, **kw), 1),
        "periodic K=3": (PeriodicRowwiseMuon(make_params(shapes), period=3, ns_dtype=ns_dtype, **kw), 3),
        "periodic K=3 auto-γ": (
            PeriodicRowwiseMuon(make_params(shapes), period=3, rownorm_scale="auto", ns_dtype=ns_dtype, **kw),
            3,
        ),
        "periodic K=1 qkv/proj": (PeriodicRowwiseMuon(qkv_pieces(shapes, 3), period=1, ns_dtype=ns_dtype, **kw), 1),
        "periodic K=1 qkv/head": (PeriodicRowwiseMuon(qkv_pieces(shapes, heads), period=1, ns_dtype=ns_dtype, **kw), 1),
        "periodic K=3 qkv/head": (PeriodicRowwiseMuon(qkv_pieces(shapes, heads), period=3, ns_dtype=ns_dtype, **kw), 3),
        "periodic K=3 fused": (
            PeriodicRowwiseMuon(make_params(shapes), period=3, ns_dtype=ns_dtype, fused=True, **kw),
            3,
        ),
    }


def measure(opts: dict, rounds: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds per optimizer step (a unit of `steps` steps, divided by `steps`)."""
    times: dict[str, list[float]] = {name: [] for name in opts}
    for r in range(warmup + rounds):
        for name, (opt, steps) in opts.items():
            start = time.perf_counter()
            for _ in range(steps):
                opt.step()
            elapsed = (time.perf_counter() - start) / steps
            if r >= warmup:
                times[name].append(elapsed)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024, help="DiT hidden size")
    parser.add_argument("--blocks", type=int, default=1, help="number of transformer blocks (same-shape batching)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (K=3 rounds are whole periods)")
    parser.add_argument("--ns-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--no-fused", action="store_true", help="leave out the fused arm (its compile takes minutes)")
    parser.add_argument("--out", default="benchmarks/results/optimizer_step.json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [s for _ in range(args.blocks) for s in block_shapes(args.hidden).values()]
    ns_dtype = getattr(torch, args.ns_dtype)
    opts = optimizers(shapes, ns_dtype)
    if args.no_fused:
        del opts["periodic K=3 fused"]
    med = measure(opts, args.rounds)

    base_muon, k1 = med["torch.optim.Muon (bf16)"], med["periodic K=1"]
    rows = [(name, t * 1e3, t / med["adamw (torch, foreach)"], t / base_muon, t / k1) for name, t in med.items()]
    numel = sum(a * b for a, b in shapes) / 1e6
    print(
        f"hidden={args.hidden} blocks={args.blocks} params={numel:.1f}M fp32, NS dtype {args.ns_dtype}, "
        f"threads={torch.get_num_threads()}, median of {args.rounds} rounds"
    )
    print(f"| {'optimizer':<24} | {'ms/step':>9} | {'x AdamW':>8} | {'x torch Muon':>12} | {'x K=1':>6} |")
    print(f"|{'-' * 26}|{'-' * 11}|{'-' * 10}|{'-' * 14}|{'-' * 8}|")
    for name, ms, ra, rm, rk in rows:
        print(f"| {name:<24} | {ms:>9.1f} | {ra:>8.2f} | {rm:>12.2f} | {rk:>6.2f} |")
    targets = {
        "periodic K=1 <= 1.0 x torch.optim.Muon": k1 / base_muon <= 1.0,
        "periodic K=3 <= 0.40 x periodic K=1": med["periodic K=3"] / k1 <= 0.40,
        "periodic K=3 auto-γ <= 1.05 x periodic K=3": med["periodic K=3 auto-γ"] / med["periodic K=3"] <= 1.05,
    }
    if "periodic K=3 fused" in med:
        targets["periodic K=3 fused <= 0.40 x periodic K=1"] = med["periodic K=3 fused"] / k1 <= 0.40
    for name, ok in targets.items():
        print(f"target {name}: {'met' if ok else 'MISSED'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "config": vars(args),
        "threads": torch.get_num_threads(),
        "shapes": shapes,
        "median_seconds": med,
        "targets": targets,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
