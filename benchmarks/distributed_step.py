"""Sharded optimizer step on FSDP2 DTensor params, side by side: time, bytes, collectives, NS5 FLOPs and peak extra
memory per rank, for each implementation, at each world size.

Spawns W processes (gloo on 127.0.0.1 on CPU, NCCL with ``--device cuda``), shards the matrices of ``--blocks`` DiT
blocks with ``fully_shard`` and times optimizer steps averaged over whole periods (3 steps: one K=3 period, three
K=1 steps):

- PeriodicRowwiseMuon K=1 (vanilla Muon) and K=3 (the paper), each with ``refresh="gather"`` and ``"scatter"``,
- ``torch.optim.Muon`` stepping the same DTensor params (DTensor ops distribute its Newton–Schulz matmuls).

Bytes and collectives are the optimizer's own per-rank counts (``comm_stats()``, which the tests check against the
profiler's c10d events); torch.optim.Muon's collectives are DTensor's implicit ones (``CommDebugMode``). Peak extra
memory: on CPU the rise of the resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)
over the resident set before each step, with glibc's mmap threshold fixed so freed buffers leave the process; on
CUDA ``max_memory_allocated`` over the allocation before the step. A second pass at ``4 × --blocks`` checks that
the refresh's extra memory is bounded by buckets, not by the model. Prints tables and writes JSON.

    python benchmarks/distributed_step.py --worlds 2 4 --hidden 1024
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
from lightning_muon.parallelize import free_port

VARIANTS = {
    "torch.optim.Muon": None,
    "periodic K=1 gather": dict(period=1, refresh="gather"),
    "periodic K=1 scatter": dict(period=1, refresh="scatter"),
    "periodic K=3 gather": dict(period=3, refresh="gather"),
    "periodic K=3 scatter": dict(period=3, refresh="scatter"),
}


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


class PeakMemory:
    """Peak extra bytes of one step over what was allocated before it (see the module docstring)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def start(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
            self.base = _status_kib("VmRSS") * 1024

    def stop(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _status_kib("VmHWM") * 1024 - self.base


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def count_c10d(fn) -> int:
    from torch.profiler import profile

    with profile() as prof:
        fn()
    kinds = ("allreduce", "allgather", "alltoall", "reduce_scatter", "broadcast")
    return sum(any(k in e.name for k in kinds) and "c10d" in e.name.lower() for e in prof.events())


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
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    mesh = init_device_mesh(args.device, (world,))
    memory = PeakMemory(cuda)
    results = {}
    for blocks, timed in ((args.blocks, True), (4 * args.blocks, False)):
        shapes = [s for _ in range(blocks) for s in block_shapes(args.hidden).values()]
        for name, kwargs in VARIANTS.items():
            if not timed and (kwargs is None or kwargs["period"] == 1):
                continue  # the 4x pass measures the refresh memory of the Periodic variants only
            g = torch.Generator().manual_seed(0)
            module = nn.Module()
            module.weights = nn.ParameterList(
                [nn.Parameter(torch.randn(s, generator=g).to(device) * 0.02) for s in shapes]
            )
            fully_shard(module, mesh=mesh)
            params = list(module.weights)
            grads = [distribute_tensor(torch.randn(s, generator=g).to(device), mesh, [Shard(0)]) for s in shapes]
            common = dict(lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.01)
            if kwargs is None:
                opt = torch.optim.Muon(params, **common)
            else:
                opt = PeriodicRowwiseMuon(params, ns_dtype=args.ns_dtype, bucket_mb=args.bucket_mb, **common, **kwargs)

            def one_step(params=params, grads=grads, opt=opt):
                for p, gr in zip(params, grads):
                    p.grad = gr.clone()  # step() may consume .grad
                opt.step()

            one_step()  # warm-up (allocations, first collectives); a refresh for K=3
            if kwargs is not None:
                opt.comm_stats()
            times, flops, implicit, c10d = [], 0, 0, 0
            periods = args.periods if timed else 0
            for _ in range(periods):
                dist.barrier()
                if cuda:
                    torch.cuda.synchronize()
                elapsed = 0.0
                with CommDebugMode() as comm:
                    for _ in range(3):  # one whole period of K=3, three steps of K=1
                        for p, gr in zip(params, grads):
                            p.grad = gr.clone()
                        start = time.perf_counter()
                        c10d += count_c10d(opt.step)
                        if cuda:
                            torch.cuda.synchronize()
                        elapsed += time.perf_counter() - start
                        flops += getattr(opt, "last_ns_flops", 0)
                times.append(elapsed / 3)
                implicit += comm.get_total_counts()
            steps = max(1, 3 * periods)
            stats = opt.comm_stats() if kwargs is not None else None
            peaks, refresh_peaks = [], []
            for _ in range(3):  # memory: one more whole period, outside the profiler and CommDebugMode
                for p, gr in zip(params, grads):
                    p.grad = gr.clone()
                dist.barrier()
                memory.start()
                opt.step()
                peaks.append(memory.stop())
                if kwargs is not None and opt.last_branches["refresh"]:
                    refresh_peaks.append(peaks[-1])
            key = name if timed else f"{name} @4x"
            results[key] = {
                "seconds_per_step": statistics.median(times) if times else None,
                "ns_flops_per_step": flops / steps,
                "comm": {b: {k: v / steps for k, v in d.items()} for b, d in stats.items()} if stats else None,
                "collectives_per_step": (sum(d["collectives"] for d in stats.values()) / steps)
                if stats
                else implicit / steps,
                "profiled_c10d_events_per_step": c10d / steps,
                "small_allreduce_per_step": (stats["rownorm"]["collectives"] / steps) if stats else None,
                "peak_extra_bytes": max(peaks),
                "refresh_peak_extra_bytes": max(refresh_peaks) if refresh_peaks else None,
                "blocks": blocks,
            }
            del opt, module, params, grads
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        per_rank = {
            name: {
                k: max(r[name][k] for r in gathered) if isinstance(v, (int, float)) else v
                for k, v in gathered[0][name].items()
            }
            for name in gathered[0]
        }
        Path(out).write_text(json.dumps(per_rank))
    dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        result_file = f"{tmp}/rank0.json"
        mp.spawn(worker, args=(world, port, args, result_file), nprocs=world)
        return json.loads(Path(result_file).read_text())


def report(world: int, results: dict, args: argparse.Namespace) -> dict[str, bool]:
    torch_muon = results["torch.optim.Muon"]
    print(
        f"\nworld={world} device={args.device} hidden={args.hidden} blocks={args.blocks} ns_dtype={args.ns_dtype} "
        f"cpu={_cpu_name()} (per rank, per optimizer "
        f"step, {args.periods} whole periods; slowest rank)"
    )
    print(
        "| implementation | ms/step | x torch Muon | refresh MB recv | NS5 GFLOP | collectives | small all-reduce "
        "| peak extra MB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        if "@4x" in name:
            continue
        c = r["comm"]
        recv = f"{c['refresh']['bytes_received'] / 2**20:.2f}" if c else "-"
        small = f"{r['small_allreduce_per_step']:.2f}" if r["small_allreduce_per_step"] is not None else "-"
        print(
            f"| {name} | {r['seconds_per_step'] * 1e3:.1f} | "
            f"{r['seconds_per_step'] / torch_muon['seconds_per_step']:.2f} | {recv} | "
            f"{r['ns_flops_per_step'] / 1e9:.1f} | {r['collectives_per_step']:.2f} | {small} | "
            f"{r['peak_extra_bytes'] / 2**20:.1f} |"
        )
    print("| refresh peak extra memory | 1x blocks MB | 4x blocks MB | ratio |")
    print("|---|---:|---:|---:|")
    ratios = {}
    for mode in ("gather", "scatter"):
        one, four = results[f"periodic K=3 {mode}"], results[f"periodic K=3 {mode} @4x"]
        ratios[mode] = four["refresh_peak_extra_bytes"] / one["refresh_peak_extra_bytes"]
        print(
            f"| K=3 {mode} | {one['refresh_peak_extra_bytes'] / 2**20:.1f} | "
            f"{four['refresh_peak_extra_bytes'] / 2**20:.1f} | {ratios[mode]:.2f} |"
        )
    best_k1 = min(results[f"periodic K=1 {m}"]["seconds_per_step"] for m in ("gather", "scatter"))
    k3s, k3g = results["periodic K=3 scatter"], results["periodic K=3 gather"]
    gather_flops = results["periodic K=1 gather"]["ns_flops_per_step"]
    targets = {
        f"W={world}: K=3 scatter <= 0.35 x torch.optim.Muon": k3s["seconds_per_step"]
        <= 0.35 * torch_muon["seconds_per_step"],
        f"W={world}: scatter NS5 FLOPs/rank <= (1/W + 5%) x gather": results["periodic K=1 scatter"][
            "ns_flops_per_step"
        ]
        <= (1 / world + 0.05) * gather_flops,
        f"W={world}: refresh peak extra memory at 4x <= 1.5 x at 1x": max(ratios.values()) <= 1.5,
        f"W={world}: small all-reduces per step at K=3 <= 0.67": max(
            k3g["small_allreduce_per_step"], k3s["small_allreduce_per_step"]
        )
        <= 0.67,
    }
    if world == 2:
        targets["W=2: best K=1 <= 0.8 x torch.optim.Muon"] = best_k1 <= 0.8 * torch_muon["seconds_per_step"]
    for name, ok in targets.items():
        print(f"target {name}: {'met' if ok else 'MISSED'}")
    return targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=1)
    parser.add_argument("--periods", type=int, default=2, help="timed periods of 3 steps each")
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=16.0,
        help="refresh bucket; keep it below one block's matrices so the 4x pass spans many buckets",
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--ns-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="our NS5 dtype; bfloat16 is what torch.optim.Muon always uses (a like-for-like row)",
    )
    parser.add_argument("--out", default="benchmarks/results/distributed_step.json")
    args = parser.parse_args()
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # freed large buffers leave the process
    all_results, all_targets = {}, {}
    for world in args.worlds:
        all_results[world] = run_world(world, args)
        all_targets.update(report(world, all_results[world], args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args), "results": all_results, "targets": all_targets}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
