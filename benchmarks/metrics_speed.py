"""Metric formula speed and memory on CPU: frechet_distance vs scipy sqrtm, prdc vs a prdc-package-style reference,
the PRDC / MMD metric classes with their O(N²) work split over 2 gloo ranks vs 1 process (time and peak memory
per rank; the same total of threads: 1 rank × T threads vs 2 ranks × T/2), and GenEval 2's Soft-TIFA judge
(images/s and questions/s, batched vs one chat per forward): the tiny random-init Qwen3-VL of the tests on CPU, or
the real one with ``--judge DIR`` (``--device cuda`` on a GPU).

The reference PRDC is the prdc package's algorithm (sklearn ``pairwise_distances`` on full matrices, NumPy
``argpartition`` for the k-th neighbour). Peak memory of ``prdc`` is measured in a fresh subprocess as the growth of
the resident-set high-water mark, next to what one dense n×n float32 distance matrix would take.

    python benchmarks/metrics_speed.py --n 10000 --dim 1024 --memory-n 20000 --sharded-n 10000
    python benchmarks/metrics_speed.py --sections judge --judge /models/Qwen3-VL-8B-Instruct --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
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


def rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_growth_mib(fn):
    """``fn()`` and the peak growth of the resident set while it ran (sampled every 2 ms by a thread)."""
    import threading

    base, peak, done = rss_mib(), [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib() - base)
            done.wait(0.002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        out = fn()
    finally:
        done.set()
        thread.join()
    return out, max(peak[0], rss_mib() - base)


def sharded_worker(rank: int, world: int, port: int, n: int, dim: int, threads: int, out_dir: str) -> None:
    """Rank ``rank`` holds samples i ≡ rank (mod world) of both sets; PRDC and MMD ``compute()`` (gather + its share
    of the distance work) timed, with the peak-RSS growth over the resident size before."""
    import torch.distributed as dist

    from lightning_muon.metrics.features import FeatureExtractor
    from lightning_muon.metrics.generation import MaximumMeanDiscrepancy, PrecisionRecallDensityCoverage

    class Precomputed(FeatureExtractor):
        num_features = dim

    warnings.filterwarnings("ignore", message=".*before the ``update``")  # states filled by update_features
    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    real, fake = torch.randn(n, dim, generator=g), torch.randn(n, dim, generator=g).add_(0.1)
    row = {}
    for name, cls in (("prdc", PrecisionRecallDensityCoverage), ("mmd", MaximumMeanDiscrepancy)):
        metric = cls(Precomputed())
        metric.update_features(real[rank::world].clone(), real=True)
        metric.update_features(fake[rank::world].clone(), real=False)
        if world > 1:
            dist.barrier()
        (value, seconds), peak = peak_rss_growth_mib(lambda metric=metric: timed(metric.compute))
        value = {k: float(v) for k, v in value.items()} if isinstance(value, dict) else float(value)
        row[name] = {"seconds": seconds, "peak_mib": max(peak, 0.0), "value": value}
    Path(out_dir, f"{world}_{rank}.json").write_text(json.dumps(row))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def sharded_rows(n: int, dim: int) -> list[dict]:
    """PRDC and MMD on 1 process with 1 and 2 threads and on 2 ranks with 1 thread each (spawned, gloo on
    127.0.0.1): a rank per core, as a rank per GPU would be."""
    import socket
    import tempfile

    import torch.multiprocessing as mp

    rows = []
    with tempfile.TemporaryDirectory() as out_dir:
        for world, threads in ((1, 1), (1, 2), (2, 1)):
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            mp.spawn(sharded_worker, args=(world, port, n, dim, threads, out_dir), nprocs=world)
            ranks = [json.loads(Path(out_dir, f"{world}_{r}.json").read_text()) for r in range(world)]
            for name in ("prdc", "mmd"):
                rows.append(
                    {
                        "metric": name,
                        "ranks": world,
                        "threads_per_rank": threads,
                        "seconds": max(r[name]["seconds"] for r in ranks),
                        "peak_mib_per_rank": max(r[name]["peak_mib"] for r in ranks),
                        "value": ranks[0][name]["value"],
                    }
                )
    return rows


def judge_rows(judge: str | None, device: str, images: int, size: int) -> list[dict]:
    """GenEval 2 scoring throughput of ``images`` generated-size images over the tests' small benchmark."""
    import tempfile

    from fixtures import geneval2_benchmark, tiny_vlm_judge

    from lightning_muon.metrics.geneval2 import GenEval2

    tmp = Path(tempfile.mkdtemp())
    judge = judge or str(tiny_vlm_judge(tmp / "judge"))
    metric = GenEval2(geneval2_benchmark(tmp / "geneval2_data.jsonl"), judge).to(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (images, 3, size, size), dtype=torch.uint8, generator=g).to(device)
    samples = [i % metric.num_samples for i in range(images)]
    questions = sum(len(metric.prompt_of(i).questions) for i in samples)
    rows = []
    for batch in (1, 16):
        metric.judge.batch_size = batch
        metric.reset()
        metric.update(x[:1], samples[:1])  # warm-up
        start = time.perf_counter()
        metric.update(x, samples)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        rows.append(
            {
                "judge": "tiny Qwen3-VL (random init)" if judge.startswith(str(tmp)) else judge,
                "device": device,
                "batch": batch,
                "images": images,
                "questions": questions,
                "seconds": seconds,
                "images_per_s": images / seconds,
                "questions_per_s": questions / seconds,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=10000, help="samples per set for the timings")
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--memory-n", type=int, default=20000, help="samples per set for the memory measurement")
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--sharded-n", type=int, default=10000, help="samples per set for the 1-vs-2-rank metrics")
    parser.add_argument("--sections", nargs="+", default=["formulas", "sharded", "judge"])
    parser.add_argument("--judge", default=None, help="GenEval 2 judge weights (default: the tests' tiny Qwen3-VL)")
    parser.add_argument("--device", default="cpu", help="device of the judge")
    parser.add_argument("--judge-images", type=int, default=32)
    parser.add_argument("--judge-image-size", type=int, default=64)
    parser.add_argument("--out", default="benchmarks/results/metrics_speed.json")
    args = parser.parse_args()
    results: dict = {"config": vars(args)}
    if "formulas" in args.sections:
        results.update(formula_rows(args))
    if "sharded" in args.sections:
        results["sharded"] = print_sharded(args)
    if "judge" in args.sections:
        rows = judge_rows(args.judge, args.device, args.judge_images, args.judge_image_size)
        print(f"\nGenEval 2 Soft-TIFA judge, {args.judge_images} images of {args.judge_image_size}px:")
        print(f"| {'judge':<28} | {'device':<6} | {'batch':>5} | {'images/s':>8} | {'questions/s':>11} |")
        print(f"|{'-' * 30}|{'-' * 8}|{'-' * 7}|{'-' * 10}|{'-' * 13}|")
        for r in rows:
            print(
                f"| {r['judge'][:28]:<28} | {r['device']:<6} | {r['batch']:>5} | {r['images_per_s']:>8.2f} | "
                f"{r['questions_per_s']:>11.2f} |"
            )
        results["judge"] = rows
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


def formula_rows(args: argparse.Namespace) -> dict:
    """frechet_distance vs scipy, prdc vs the prdc-package algorithm, prdc's peak memory (printed)."""

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
    return {
        "frechet_distance": {"ours_s": t_fd_ours, "scipy_s": t_fd_ref, "ours": fd_ours, "scipy": fd_ref},
        "prdc": {
            "ours_s": t_pr_ours,
            "reference_s": t_pr_ref,
            "ours": {k: float(v) for k, v in pr_ours.items()},
            "reference": pr_ref,
        },
        "prdc_peak_memory_mib": mem,
        "dense_matrix_mib": dense_mb,
    }


def print_sharded(args: argparse.Namespace) -> list[dict]:
    """PRDC / MMD on 2 gloo ranks vs 1 process (printed); the rows."""
    sharded = sharded_rows(args.sharded_n, args.dim)
    base = {row["metric"]: row for row in sharded if (row["ranks"], row["threads_per_rank"]) == (1, 1)}
    print(f"\nPRDC / MMD metric classes, n={args.sharded_n} per set, d={args.dim}: 2 gloo ranks vs 1 process")
    print("(speed-up vs 1 process x 1 thread; compute() includes the feature all-gather)")
    print(
        f"| {'metric':<6} | {'ranks':>5} | {'threads/rank':>12} | {'compute s':>9} | {'speed-up':>8} | "
        f"{'peak MiB/rank':>13} | {'same value':<10} |"
    )
    print(f"|{'-' * 8}|{'-' * 7}|{'-' * 14}|{'-' * 11}|{'-' * 10}|{'-' * 15}|{'-' * 12}|")
    for row in sharded:
        ref = base[row["metric"]]
        same = row["value"] == ref["value"] or (
            not isinstance(row["value"], dict) and abs(row["value"] - ref["value"]) <= 1e-6 * abs(ref["value"])
        )
        print(
            f"| {row['metric']:<6} | {row['ranks']:>5} | {row['threads_per_rank']:>12} | {row['seconds']:>9.2f} | "
            f"{ref['seconds'] / row['seconds']:>7.2f}x | {row['peak_mib_per_rank']:>13.0f} | {str(same):<10} |"
        )
    return sharded


if __name__ == "__main__":
    main()
