"""Project the optimizer time per step to the paper's scale, on paper: vanilla Muon vs Periodic Row-wise Muon (K=3)
at 8–256 H100s for every shipped config, gather vs owner (scatter) refresh.

No GPU cluster is at hand, so the inputs are: the real parameter shapes of each config (meta device), the NS5
FLOPs per matrix (``ns_flops``), and the bytes and collectives per rank that ``comm_stats()`` counts — computed here
by :func:`comm_per_rank` with the optimizer's own bucketing and owner assignment, and checked against measured
``comm_stats()`` at 2 and 3 gloo ranks by ``tests/optim/test_distributed_optimizer.py``. Hardware (flags): H100 SXM
bf16 dense 989 TFLOP/s at ``--mfu`` for NS5, HBM 3.35 TB/s at 80 % for elementwise passes, NVLink 450 GB/s per
direction within a node of 8, InfiniBand 50 GB/s per GPU (400 Gb/s NDR) across nodes, collective latency α per hop.

Per rank and step: refresh = max(NS5 compute, refresh traffic) + one bucket's traffic (the pipeline's fill) +
elementwise passes; RowNorm = elementwise passes + one small all-reduce (2·log2(W)·α) when rows are split.
Vanilla = refresh every step; Periodic = (refresh + (K-1)·RowNorm) / K. For the paper's normalized step times the
forward/backward is modelled as 6·P·tokens·batch FLOPs at ``--train-mfu``. Prints a table and writes JSON.

    python benchmarks/scale_model.py
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import torch

from lightning_muon import muon_param_groups
from lightning_muon.optim.kernels import ns_flops, row_norm_dim
from lightning_muon.optim.shards import RowShard, assign_owners, bucket_indices
from lightning_muon.recipes.networks import build_transformer
from lightning_muon.recipes.shipped import SHIPPED_CONFIGS, load_config

#: The paper's profiler, normalized step time (1.3B AdamW step = 1): Muon -> Periodic.
PAPER = {"t2i_1p3b": (5.59, 4.20), "t2i_4b": (7.26, 5.68), "t2i_9b": (12.47, 10.26)}


def muon_shapes(config: dict) -> tuple[list[tuple[int, int]], int, int]:
    """Muon matrix shapes, total and Muon parameter counts of a config's transformer."""
    with torch.device("meta"):
        model = build_transformer(config["model"].get("architecture", "dit"), config["model"]["model_config"])
    groups = muon_param_groups(model)
    shapes = [tuple(p.shape) for g in groups if g["use_muon"] for p in g["params"]]
    return shapes, sum(p.numel() for p in model.parameters()), sum(math.prod(s) for s in shapes)


def comm_per_rank(
    shapes, world: int, rank: int, mode: str, itemsize: int = 2, bucket_bytes: int = 64 * 2**20, flag: bool = True
) -> dict:
    """What ``comm_stats()`` of ``rank`` reports for one refresh step and one RowNorm step, and its NS5 FLOPs."""
    shards = [RowShard(s, world, rank) for s in shapes]
    refresh = {"bytes_sent": 0, "bytes_received": 0, "collectives": 0}
    flops = 0
    owner_of = assign_owners([ns_flops(s.shape) for s in shards], world)
    dtype = {2: torch.bfloat16, 4: torch.float32}[itemsize]
    for b, index in enumerate(bucket_indices(shards, [dtype] * len(shards), bucket_bytes)):
        extra = int(flag and b == 0)
        if mode == "gather":
            send = sum(shards[i].chunk * shards[i].shape[1] for i in index) + extra
            refresh["bytes_sent"] += send * itemsize
            refresh["bytes_received"] += (world - 1) * send * itemsize
            refresh["collectives"] += 1
            flops += sum(ns_flops(shards[i].shape) for i in index)
            continue
        owned = defaultdict(list)
        for i in index:
            owned[owner_of[i]].append(i)
        fwd_sent = sum(sum(shards[i].numel(rank) for i in owned[d]) + extra for d in range(world) if d != rank)
        fwd_recv = sum(sum(shards[i].numel(src) for i in owned[rank]) + extra for src in range(world) if src != rank)
        back_sent = sum(sum(shards[i].numel(d) for i in owned[rank]) for d in range(world) if d != rank)
        back_recv = sum(sum(shards[i].numel(rank) for i in owned[src]) for src in range(world) if src != rank)
        refresh["bytes_sent"] += (fwd_sent + back_sent) * itemsize
        refresh["bytes_received"] += (fwd_recv + back_recv) * itemsize
        refresh["collectives"] += 2
        flops += sum(ns_flops(shards[i].shape) for i in owned[rank])
    split = [s.shape[1] for s in shards if row_norm_dim(s.shape) == -2 and s.sharded]
    reduce_bytes = 4 * (sum(split) + flag) if (split or flag) and world > 1 else 0
    rownorm = {"bytes_sent": reduce_bytes, "bytes_received": reduce_bytes, "collectives": int(reduce_bytes > 0)}
    return {"refresh": refresh, "rownorm": rownorm, "ns_flops": flops}


def project(config: dict, world: int, mode: str, args: argparse.Namespace) -> dict:
    """Seconds per step of vanilla Muon and Periodic K=3 on the slowest rank, and the forward/backward estimate."""
    shapes, total, muon = muon_shapes(config)
    ranks = range(world) if world <= 16 else (0, world - 1)  # sharding is symmetric up to the last, shorter shards
    per_rank = [comm_per_rank(shapes, world, r, mode, bucket_bytes=int(args.bucket_mb * 2**20)) for r in ranks]
    c = max(per_rank, key=lambda r: r["ns_flops"] + r["refresh"]["bytes_received"])
    inter = 0.0 if world <= 8 else (world - 8) / (world - 1)  # share of peers in other nodes
    bw = 1 / ((1 - inter) / (args.nvlink_gbs * 1e9) + inter / (args.ib_gbs * 1e9))
    alpha = args.alpha_us * 1e-6
    traffic = max(c["refresh"]["bytes_sent"], c["refresh"]["bytes_received"]) / bw
    traffic += c["refresh"]["collectives"] * alpha * (2 if world > 8 else 1)
    compute = c["ns_flops"] / (args.tflops * 1e12 * args.mfu)
    fill = min(args.bucket_mb * 2**20, 2 * muon) / bw
    hbm = args.hbm_tbs * 1e12 * 0.8
    local = 4 * muon / world
    refresh = max(compute, traffic) + fill + 10 * local / hbm
    rownorm = 8 * local / hbm + (2 * math.log2(world) * alpha * (2 if world > 8 else 1) if world > 1 else 0)
    adamw_rest = 12 * 4 * (total - muon) / world / hbm
    tokens = (config["model"]["model_config"]["sample_size"] // config["model"]["model_config"]["patch_size"]) ** 2
    batch = config["data"]["init_args"]["batch_size"]
    fwd_bwd = 6 * total * tokens * batch / (args.tflops * 1e12 * args.train_mfu)
    adamw_opt = 12 * 4 * total / world / hbm
    return {
        "muon": refresh + adamw_rest,
        "periodic": (refresh + 2 * rownorm) / 3 + adamw_rest,
        "adamw": adamw_opt,
        "fwd_bwd": fwd_bwd,
        "refresh_recv_MB": c["refresh"]["bytes_received"] / 2**20,
        "ns_tflop_rank": c["ns_flops"] / 1e12,
        "params_B": total / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 32, 64, 256])
    parser.add_argument("--tflops", type=float, default=989.0, help="bf16 dense peak per GPU (H100 SXM)")
    parser.add_argument("--mfu", type=float, default=0.6, help="achieved fraction of peak in NS5 matmuls")
    parser.add_argument("--train-mfu", type=float, default=0.4, help="achieved fraction in forward/backward")
    parser.add_argument("--hbm-tbs", type=float, default=3.35)
    parser.add_argument("--nvlink-gbs", type=float, default=450.0)
    parser.add_argument("--ib-gbs", type=float, default=50.0)
    parser.add_argument("--alpha-us", type=float, default=10.0, help="collective latency per hop")
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--out", default="benchmarks/results/scale_model.json")
    args = parser.parse_args()
    rows = []
    print(
        "| config | GPUs | refresh | Muon opt ms | Periodic opt ms | opt time cut | Muon step (norm.) | "
        "Periodic step (norm.) | Periodic/Muon step | paper Periodic/Muon |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    base = None
    for name, stack in SHIPPED_CONFIGS.items():
        if name == "digits_tiny":
            continue
        config = load_config(*stack)
        for world in args.worlds:
            for mode in ("gather", "scatter"):
                r = project(config, world, mode, args)
                if name == "t2i_1p3b" and world == 256 and mode == "gather":
                    base = r["fwd_bwd"] + r["adamw"]  # the paper's unit: the 1.3B AdamW step
                rows.append({"config": name, "world": world, "mode": mode, **r})
    for row in rows:
        unit = base or 1.0
        muon_step, periodic_step = (row["fwd_bwd"] + row["muon"]) / unit, (row["fwd_bwd"] + row["periodic"]) / unit
        paper = PAPER.get(row["config"]) if row["world"] == 256 else None
        row.update(muon_step_norm=muon_step, periodic_step_norm=periodic_step)
        print(
            f"| {row['config']} | {row['world']} | {row['mode']} | {1e3 * row['muon']:.1f} | "
            f"{1e3 * row['periodic']:.1f} | {100 * (1 - row['periodic'] / row['muon']):.1f}% | {muon_step:.2f} | "
            f"{periodic_step:.2f} | {periodic_step / muon_step:.3f} | "
            f"{f'{paper[1] / paper[0]:.3f} ({paper[0]} -> {paper[1]})' if paper else '-'} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
