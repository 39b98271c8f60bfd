"""Sharded optimizer step on FSDP2 DTensor params: bytes moved per rank and wall time, per implementation.

Spawns ``--world`` processes (gloo on 127.0.0.1 on CPU, NCCL with ``--device cuda``), shards the matrices of
``--blocks`` DiT blocks with ``fully_shard`` and times optimizer steps averaged over whole periods:

- periodic K=1 gather (vanilla Muon), periodic K=3 gather (the paper), periodic K=3 scatter (owner NS5),
- ``torch.optim.Muon`` stepping the same DTensor params (DTensor ops gather each full matrix implicitly).

Bytes are the optimizer's own per-rank counts (``comm_stats()``); torch.optim.Muon's collectives are counted with
DTensor's ``CommDebugMode``. Prints a table and writes JSON.

    python benchmarks/distributed_step.py --world 2 --hidden 1024 --periods 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from optimizer_step import block_shapes  # noqa: E402

from lightning_muon import PeriodicRowwiseMuon  # noqa: E402

VARIANTS = {
    "periodic K=1 gather": dict(period=1, refresh="gather"),
    "periodic K=3 gather": dict(period=3, refresh="gather"),
    "periodic K=3 scatter": dict(period=3, refresh="scatter"),
    "torch.optim.Muon": None,
}


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(max(1, os.cpu_count() // world))
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    mesh = init_device_mesh(args.device, (world,))
    shapes = [s for _ in range(args.blocks) for s in block_shapes(args.hidden).values()]
    g = torch.Generator().manual_seed(0)
    results = {}
    for name, kwargs in VARIANTS.items():
        module = nn.Module()
        module.weights = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g, device="cpu").to(device) * 0.02)
                                           for s in shapes])  # fmt: skip
        fully_shard(module, mesh=mesh)
        params = list(module.weights)
        for p, s in zip(params, shapes):
            p.grad = distribute_tensor(torch.randn(s, generator=g).to(device), mesh, [Shard(0)])
        common = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01)
        if kwargs is None:
            opt = torch.optim.Muon(params, **common)
        else:
            opt = PeriodicRowwiseMuon(params, ns_dtype=torch.bfloat16, bucket_mb=args.bucket_mb, **common, **kwargs)
        grads = [p.grad.detach().clone() for p in params]

        def one_step(params=params, grads=grads, opt=opt):
            for p, gr in zip(params, grads):
                p.grad = gr.clone()  # step() may consume .grad (Nesterov look-ahead written in place)
            opt.step()

        one_step()  # warm-up (allocations, first collectives)
        if kwargs is not None:
            opt.comm_stats()
        times, flops, implicit = [], 0, 0
        for _ in range(args.periods):
            dist.barrier()
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with CommDebugMode() as comm:
                for _ in range(3):  # 3 steps: one whole period of K=3, three of K=1
                    one_step()
                    flops += getattr(opt, "last_ns_flops", 0)
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) / 3)
            implicit += comm.get_total_counts()
        steps = 3 * args.periods
        stats = opt.comm_stats() if kwargs is not None else None
        results[name] = {
            "seconds_per_step": statistics.median(times),
            "ns_flops_per_step": flops / steps,
            "comm": {b: {k: v / steps for k, v in d.items()} for b, d in stats.items()} if stats else None,
            "dtensor_implicit_collectives_per_step": implicit / steps,
        }
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--periods", type=int, default=2, help="timed periods of 3 steps each")
    parser.add_argument("--bucket-mb", type=float, default=16.0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default="benchmarks/results/distributed_step.json")
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        result_file = f"{tmp}/rank0.json"
        mp.spawn(worker, args=(args.world, port, args, result_file), nprocs=args.world)
        results = json.loads(Path(result_file).read_text())

    base = results["periodic K=1 gather"]
    allreduce_bytes = {n: (r["comm"]["rownorm"]["bytes_sent"] if r["comm"] else None) for n, r in results.items()}
    print(f"world={args.world} device={args.device} hidden={args.hidden} blocks={args.blocks} "
          f"(per rank, per optimizer step, averaged over {args.periods} whole periods)")  # fmt: skip
    print(f"| {'implementation':<22} | {'ms/step':>8} | {'x K=1':>6} | {'refresh MB recv':>15} | {'x K=1':>6} | "
          f"{'all-reduce KB':>13} | {'NS5 GFLOP':>9} | {'collectives':>11} |")  # fmt: skip
    print("|" + "|".join("-" * w for w in (24, 10, 8, 17, 8, 15, 11, 13)) + "|")
    for name, r in results.items():
        c = r["comm"]
        recv = c["refresh"]["bytes_received"] / 2**20 if c else float("nan")
        base_recv = base["comm"]["refresh"]["bytes_received"] / 2**20
        colls = sum(d["collectives"] for d in c.values()) if c else r["dtensor_implicit_collectives_per_step"]
        ar = allreduce_bytes[name] / 1024 if c else float("nan")
        print(f"| {name:<22} | {r['seconds_per_step'] * 1e3:>8.1f} | "
              f"{r['seconds_per_step'] / base['seconds_per_step']:>6.2f} | {recv:>15.2f} | {recv / base_recv:>6.2f} | "
              f"{ar:>13.1f} | {r['ns_flops_per_step'] / 1e9:>9.1f} | {colls:>11.2f} |")  # fmt: skip
    k3g, k3s = results["periodic K=3 gather"], results["periodic K=3 scatter"]
    ratio = k3g["comm"]["refresh"]["bytes_received"] / base["comm"]["refresh"]["bytes_received"]
    targets = {
        "K=3 refresh payload <= 0.34 x vanilla": ratio <= 0.34,
        "scatter NS5 FLOPs/rank <= 0.55 x gather": k3s["ns_flops_per_step"] <= 0.55 * k3g["ns_flops_per_step"],
        "K=3 step time < vanilla": k3g["seconds_per_step"] < base["seconds_per_step"],
    }
    for name, ok in targets.items():
        print(f"target {name}: {'met' if ok else 'MISSED'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "results": results, "targets": targets}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
