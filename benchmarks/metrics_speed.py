"""Metric formula speed and memory on CPU: frechet_distance vs scipy sqrtm, prdc vs a prdc-package-style reference.

The reference PRDC is the prdc package's algorithm (sklearn ``pairwise_distances`` on full matrices, NumPy
``argpartition`` for the k-th neighbour). Peak memory of ``prdc`` is measured in a fresh subprocess as the growth of
the resident-set high-water mark, next to what one dense n×n float32 distance matrix would take.

    python benchmarks/metrics_speed.py --n 10000 --dim 1024 --memory-n 20000
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import scipy.linalg
import torch
from sklearn.metrics import pairwise_distances

from lightning_muon.metrics.functional import frechet_distance, prdc


def scipy_frechet(mu1, s1, mu2, s2) -> float:
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


def reference_prdc(real: np.ndarray, fake: np.ndarray, k: int) -> dict[str, float]:
    def kth(d, kk):
        idx = np.argpartition(d, kk - 1, axis=-1)[..., :kk]
        return np.take_along_axis(d, idx, axis=-1).max(axis=-1)

    r_real = kth(pairwise_distances(real, real), k + 1)
    r_fake = kth(pairwise_distances(fake, fake), k + 1)
    d = pairwise_distances(real, fake)
    return {
        "precision": float((d < r_real[:, None]).any(0).mean()),
        "recall": float((d < r_fake[None, :]).any(1).mean()),
        "density": float((d < r_real[:, None]).sum(0).mean() / k),
        "coverage": float((d.min(1) < r_real).mean()),
    }


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def features(n: int, dim: int, seed: int, shift: float = 0.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(n, dim)) + shift).astype(np.float32)


def peak_memory_mb(n: int, dim: int, chunk: int) -> float:
    """Peak RSS growth (MiB) of one prdc call in a fresh process: high-water mark after minus resident before."""
    code = f"""
import os, resource, torch
from lightning_muon.metrics.functional import prdc
g = torch.Generator().manual_seed(0)
real, fake = torch.randn({n}, {dim}, generator=g), torch.randn({n}, {dim}, generator=g).add_(0.1)  # no temporaries
prdc(real[:2048], fake[:2048], chunk_size={chunk})  # warm up BLAS workspaces and allocator arenas
resident = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1024
prdc(real, fake, chunk_size={chunk})
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - resident) / 1024)
"""
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10000, help="samples per set for the timings")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--memory-n", type=int, default=20000, help="samples per set for the memory measurement")
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--out", default="benchmarks/results/metrics_speed.json")
    args = parser.parse_args()

    real, fake = features(args.n, args.dim, 0), features(args.n, args.dim, 1, shift=0.05)
    mu1, s1 = real.mean(0).astype(np.float64), np.cov(real, rowvar=False)
    mu2, s2 = fake.mean(0).astype(np.float64), np.cov(fake, rowvar=False)
    t_args = [torch.from_numpy(a) for a in (mu1, s1, mu2, s2)]
    fd_ours, t_fd_ours = timed(lambda: frechet_distance(*t_args).item())
    fd_ref, t_fd_ref = timed(lambda: scipy_frechet(mu1, s1, mu2, s2))
    pr_ours, t_pr_ours = timed(lambda: prdc(torch.from_numpy(real), torch.from_numpy(fake), args.k, args.chunk))
    pr_ref, t_pr_ref = timed(lambda: reference_prdc(real, fake, args.k))
    mem = peak_memory_mb(args.memory_n, args.dim, args.chunk)
    dense_mb = args.memory_n**2 * 4 / 2**20

    print(f"n={args.n} d={args.dim} k={args.k} threads={torch.get_num_threads()}")
    print(f"| {'formula':<16} | {'ours s':>8} | {'reference s':>11} | {'speed-up':>8} | {'agreement':<28} |")
    print(f"|{'-' * 18}|{'-' * 10}|{'-' * 13}|{'-' * 10}|{'-' * 30}|")
    print(
        f"| {'frechet_distance':<16} | {t_fd_ours:>8.2f} | {t_fd_ref:>11.2f} | {t_fd_ref / t_fd_ours:>7.1f}x | "
        f"{f'rel diff {abs(fd_ours - fd_ref) / abs(fd_ref):.1e}':<28} |"
    )
    worst = max(abs(float(pr_ours[key]) - pr_ref[key]) for key in pr_ref)
    print(
        f"| {'prdc':<16} | {t_pr_ours:>8.2f} | {t_pr_ref:>11.2f} | {t_pr_ref / t_pr_ours:>7.1f}x | "
        f"{f'max abs diff {worst:.1e}':<28} |"
    )
    print(
        f"prdc peak memory at n={args.memory_n}, d={args.dim}, chunk={args.chunk}: {mem:.0f} MiB "
        f"(one dense n x n float32 distance matrix: {dense_mb:.0f} MiB)"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "config": vars(args),
                "frechet_distance": {"ours_s": t_fd_ours, "scipy_s": t_fd_ref, "ours": fd_ours, "scipy": fd_ref},
                "prdc": {
                    "ours_s": t_pr_ours,
                    "reference_s": t_pr_ref,
                    "ours": {k: float(v) for k, v in pr_ours.items()},
                    "reference": pr_ref,
                },
                "prdc_peak_memory_mib": mem,
                "dense_matrix_mib": dense_mb,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
