"""Peak resident memory per rank of ``LatentShardsDataModule`` over one epoch at 1×, 10× and 100× the dataset size,
beside the old approach (every shard loaded and concatenated on every rank), and an exact mid-epoch resume from
2 to 3 ranks. Ranks are real gloo processes on 127.0.0.1. Prints a table and writes JSON.

    python benchmarks/data_scale.py --base 1000
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp


def make_latents(root: Path, n: int, shard_size: int) -> None:
    """``n`` t2i-like samples: 4×16×16 fp32 latents, 8×32 bf16 caption embeddings, a mask, and their index."""
    from lightning_muon.recipes.data import write_latent_shard, write_manifest

    root.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for k, start in enumerate(range(0, n, shard_size)):
        m = min(shard_size, n - start)
        write_latent_shard(
            root / f"shard_{k:05d}.safetensors",
            torch.randn(m, 4, 16, 16, generator=g),
            caption_embeds=torch.randn(m, 8, 32, generator=g).to(torch.bfloat16),
            caption_mask=torch.ones(m, 8, dtype=torch.long),
            index=torch.arange(start, start + m),
        )
    write_manifest(root)


def _max_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rank(rank: int, world: int, port: int, mode: str, root: str, batch: int, steps, state, out: str) -> None:
    import torch.distributed as dist

    from lightning_muon.recipes.data import LatentShardsDataModule

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    baseline = _max_rss_mib()
    start = time.perf_counter()
    seen = []
    if mode == "concat":  # what LatentShardsDataModule did before: every shard in RAM on every rank
        from safetensors.torch import load_file

        parts = [load_file(str(p)) for p in sorted(Path(root).glob("*.safetensors"))]
        full = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        order = torch.randperm(len(full["index"]), generator=torch.Generator().manual_seed(0))[rank::world]
        for i in range(0, len(order) - batch + 1, batch):
            seen.append(full["index"][order[i : i + batch]].tolist())
    else:
        dm = LatentShardsDataModule(root, batch_size=batch, num_workers=0)
        dm.setup()
        loader = dm.train_dataloader()
        loader.sampler.set_epoch(0)
        if state is not None:
            loader.load_state_dict(state)
        for i, b in enumerate(loader):
            seen.append(b["index"].tolist())
            if steps is not None and i + 1 == steps:
                break
        state = loader.state_dict()
    result = {
        "baseline_mib": baseline,
        "peak_mib": _max_rss_mib(),
        "seconds": time.perf_counter() - start,
        "seen": seen,
        "state": state,
    }
    torch.save(result, f"{out}/{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def ranks(world: int, mode: str, root: Path, batch: int, steps=None, state=None) -> list[dict]:
    from lightning_muon.parallelize import free_port  # the launcher stays light: torch loads in the ranks

    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_rank, args=(world, port, mode, str(root), batch, steps, state, out), nprocs=world)
        return [torch.load(f"{out}/{r}.pt", weights_only=False) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=int, default=1000, help="samples of the 1x dataset")
    parser.add_argument("--shard-size", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--out", default="benchmarks/results/data_scale.json")
    args = parser.parse_args()
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for scale in (1, 10, 100):
            root = Path(tmp) / f"x{scale}"
            make_latents(root, scale * args.base, args.shard_size)
            disk = sum(p.stat().st_size for p in root.glob("*.safetensors")) / 2**20
            for mode in ("stream", "concat"):
                if mode == "concat" and scale == 100:
                    continue  # the old loader at 100x: every rank would hold the whole set (disk column)
                r = ranks(2, mode, root, args.batch_size)
                peak = max(x["peak_mib"] for x in r)
                delta = max(x["peak_mib"] - x["baseline_mib"] for x in r)
                results[f"{mode}_x{scale}"] = {
                    "peak_mib": peak,
                    "above_baseline_mib": delta,
                    "disk_mib": disk,
                    "seconds": max(x["seconds"] for x in r),
                }
                seconds = results[f"{mode}_x{scale}"]["seconds"]
                rows.append((mode, scale, scale * args.base, disk, peak, delta, seconds))
        root = Path(tmp) / "x1"
        first = ranks(2, "stream", root, args.batch_size, steps=5)
        rest = ranks(3, "stream", root, args.batch_size, state=first[0]["state"])
        seen = [i for r in first + rest for step in r["seen"] for i in step]
        exact = sorted(seen) == list(range(args.base))
    print(
        f"| {'loader':<7} | {'scale':>5} | {'samples':>8} | {'on disk':>10} | {'peak RSS/rank':>13} | "
        f"{'above imports':>13} | {'epoch s':>7} |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mode, scale, n, disk, peak, delta, sec in rows:
        print(
            f"| {mode:<7} | {scale:>4}x | {n:>8} | {disk:>6.1f} MiB | {peak:>9.0f} MiB | {delta:>9.1f} MiB | "
            f"{sec:>7.1f} |"
        )
    ratio = results["stream_x100"]["peak_mib"] / results["stream_x10"]["peak_mib"]
    print(f"streamed peak RSS 100x / 10x: {ratio:.3f} (target <= 1.2: {'met' if ratio <= 1.2 else 'MISSED'})")
    print(f"resume 2 -> 3 ranks after 5 steps: {len(seen)} samples seen, every sample exactly once: {exact}")
    results.update(
        ratio_100x_over_10x=ratio,
        resume_samples_seen=len(seen),
        resume_exactly_once=exact,
        base=args.base,
        batch_size=args.batch_size,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
