"""Orthogonalizers side by side: time and FLOPs on DiT block matrices, and how close each lands to the polar factor.

Methods (all :class:`lightning_muon.optim.kernels.Orthogonalizer`, the optimizer's ``ns_*`` options): NS5 (the
default, torch.optim.Muon's), Polar Express (5 steps), Turbo-Muon (AOL + 4 Polar Express steps), and each of them
with the Gram-space iteration. Timing runs round-robin in one process (machine noise hits every method alike) on one
DiT block's matrices (fused qkv, attention out, MLP up/down, adaLN modulation), same-shape matrices batched as the
optimizer batches them. Error is measured against the float64 SVD polar factor UVᵀ on momentum matrices saved from
a digits run (Periodic Row-wise Muon) and on random 256×1024 matrices of condition number 10²–10⁶:
``orth`` = ‖OOᵀ − I‖_F / √p (p = min(m, n)), ``polar`` = ‖O − UVᵀ‖_F / ‖UVᵀ‖_F, and the singular values' range.

    python benchmarks/orthogonalize.py --hidden 1024 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from lightning_muon.optim.kernels import make_orthogonalizer

METHODS = {
    "ns5": dict(coefficients="jordan", steps=5),
    "polar_express": dict(coefficients="polar_express", steps=5),
    "turbo_muon": dict(coefficients="turbo_muon", steps=4, normalize="aol"),
    "gram ns5": dict(coefficients="jordan", steps=5, method="gram"),
    "gram polar_express": dict(coefficients="polar_express", steps=5, method="gram"),
    "gram turbo_muon": dict(coefficients="turbo_muon", steps=4, normalize="aol", method="gram"),
}


def block_shapes(hidden: int) -> list[tuple[int, int]]:
    """One DiT block's 2-D weights (out, in), as benchmarks/optimizer_step.py times them."""
    return [(3 * hidden, hidden), (hidden, hidden), (4 * hidden, hidden), (hidden, 4 * hidden), (6 * hidden, hidden)]


def timing(hidden: int, rounds: int, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """Median seconds per block and FLOPs per block of every method, round-robin."""
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(1, *s, generator=g).to(dtype) for s in block_shapes(hidden)]
    orthos = {name: make_orthogonalizer(dtype=dtype, **kw) for name, kw in METHODS.items()}
    times: dict[str, list[float]] = {name: [] for name in orthos}
    for r in range(rounds + 1):  # the first round warms up
        for name, ortho in orthos.items():
            start = time.perf_counter()
            for X in mats:
                ortho(X.clone())
            if r:
                times[name].append(time.perf_counter() - start)
    return {
        name: {"seconds": statistics.median(times[name]), "gflop": sum(o.flops(m.shape) for m in mats) / 1e9}
        for name, o in orthos.items()
    }


def errors(ortho: torch.Tensor, G: torch.Tensor) -> dict[str, float]:
    """Distances of ``ortho`` from orthogonality and from the float64 polar factor of ``G``."""
    ortho, G = ortho.double(), G.double()
    wide = ortho if ortho.shape[0] <= ortho.shape[1] else ortho.T
    p = wide.shape[0]
    U, _, Vh = torch.linalg.svd(G, full_matrices=False)
    polar = U @ Vh
    s = torch.linalg.svdvals(ortho)
    return {
        "orth": ((wide @ wide.T - torch.eye(p, dtype=ortho.dtype)).norm() / p**0.5).item(),
        "polar": ((ortho - polar).norm() / polar.norm()).item(),
        "smin": s.min().item(),
        "smax": s.max().item(),
    }


def ill_conditioned(cond: float, m: int = 256, n: int = 1024, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = min(m, n)
    U = torch.linalg.qr(torch.randn(m, p, generator=g, dtype=torch.float64))[0]
    V = torch.linalg.qr(torch.randn(n, p, generator=g, dtype=torch.float64))[0]
    sv = torch.logspace(0, -torch.tensor(cond).log10().item(), p, dtype=torch.float64)
    return (U * sv) @ V.T


def digits_momenta(steps: int, path: Path) -> list[torch.Tensor]:
    """Momentum buffers of every Muon matrix after ``steps`` steps of the default digits run (cached in ``path``)."""
    if path.is_file():
        return torch.load(path, weights_only=True)
    import lightning as L

    from lightning_muon.recipes.data import DigitsDataModule
    from lightning_muon.recipes.module import DiTModule

    L.seed_everything(0, verbose=False)
    module = DiTModule(optimizer="periodic_muon", ema_decay=0.0)
    trainer = L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, DigitsDataModule(batch_size=64))
    opt = trainer.optimizers[0]
    momenta = [opt.state[p]["momentum_buffer"].clone() for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(momenta, path)
    return momenta


def accuracy(
    momenta: list[torch.Tensor], conds: list[float], dtype: torch.dtype
) -> dict[str, dict[str, dict[str, float]]]:
    """Per method, computing in ``dtype``: mean errors over the digits momenta, and errors per condition number."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, kw in METHODS.items():
        ortho = make_orthogonalizer(dtype=dtype, **kw)
        rows = [errors(ortho(M.to(dtype)[None].clone())[0], M) for M in momenta]
        out[name] = {"digits momenta": {k: statistics.mean(r[k] for r in rows) for k in rows[0]}}
        out[name]["digits momenta"]["smin"] = min(r["smin"] for r in rows)
        out[name]["digits momenta"]["smax"] = max(r["smax"] for r in rows)
        for cond in conds:
            G = ill_conditioned(cond)
            out[name][f"cond {cond:.0e}"] = errors(ortho(G.to(dtype)[None].clone())[0], G)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds at the first hidden size (1 above it)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--digits-steps", type=int, default=200, help="training steps before the momenta are saved")
    parser.add_argument("--conds", type=float, nargs="+", default=[1e2, 1e4, 1e6])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    out = Path(args.out)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, cpu, {args.dtype}"
    result: dict = {"machine": machine, "timing": {}, "accuracy": {}}
    lines = [f"machine: {machine}", "", "| hidden | method | ms/block | x ns5 | GFLOP/block | x ns5 FLOPs |"]
    lines.append("|---:|---|---:|---:|---:|---:|")
    for i, hidden in enumerate(args.hidden):
        t = timing(hidden, args.rounds if i == 0 else 1, dtype)
        result["timing"][hidden] = t
        base = t["ns5"]
        for name, r in t.items():
            lines.append(
                f"| {hidden} | {name} | {1000 * r['seconds']:.0f} | {r['seconds'] / base['seconds']:.2f} | "
                f"{r['gflop']:.1f} | {r['gflop'] / base['gflop']:.2f} |"
            )
    momenta = digits_momenta(args.digits_steps, out / ".orthogonalize_momenta.pt")
    acc = accuracy(momenta, args.conds, dtype)
    result["accuracy"] = acc
    sets = list(next(iter(acc.values())))
    lines += ["", f"orth = ‖OOᵀ − I‖_F/√p; polar = ‖O − UVᵀ‖_F/‖UVᵀ‖_F ({len(momenta)} digits momenta: means)", ""]
    lines += ["| method | " + " | ".join(f"{s}: orth / polar / σ range" for s in sets) + " |"]
    lines += ["|---|" + "---|" * len(sets)]
    for name, per_set in acc.items():
        cells = [f"{e['orth']:.3f} / {e['polar']:.3f} / [{e['smin']:.2f}, {e['smax']:.2f}]" for e in per_set.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    print("\n".join(lines))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"orthogonalize_{args.dtype}.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
