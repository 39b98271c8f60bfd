"""How often a finished 3-rank gloo job aborts at exit (the cause: :func:`~lightning_muon.optim.transport.
release_gloo_workers_at_exit`): ``--runs`` torchrun launches of a step-and-exit harness (two
FSDP2-sharded matrices stepped by ``PeriodicRowwiseMuon`` at K = 1 and 3 in gather and scatter mode, or by
``torch.optim.AdamW``, gathered with ``full_tensor()``, then ``barrier()`` and ``destroy_process_group()`` — as a
user's script does; the exit hook still gives the grace, because the optimizer's collectives noted the gloo group,
:func:`~lightning_muon.optim.transport.note_gloo_collectives`), counting
the runs in which a rank died by a signal ("terminate called without an active exception", SIGABRT) instead of
exiting 0. Prints a table and writes JSON.

    python benchmarks/exit_aborts.py --runs 100
    python benchmarks/exit_aborts.py --runs 100 --optimizer adamw
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

CASES = ((1, "gather"), (3, "gather"), (1, "scatter"), (3, "scatter"))


def worker(optimizer: str, without_grace: bool) -> None:
    """One rank of the harness (run by torchrun)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_muon import PeriodicRowwiseMuon

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for period, refresh in CASES if optimizer == "muon" else CASES[:1]:
        module = nn.Module()
        g = torch.Generator().manual_seed(0)
        module.w = nn.ParameterList([nn.Parameter(torch.randn(64, 32, generator=g)) for _ in range(2)])
        fully_shard(module, mesh=mesh)
        params = list(module.w)
        if optimizer == "muon":
            opt = PeriodicRowwiseMuon(params, period=period, refresh=refresh, bucket_mb=0.001)
        else:
            opt = torch.optim.AdamW(params)
        for _ in range(10):
            for p in params:
                p.grad = distribute_tensor(torch.randn(p.shape, generator=g), mesh, [Shard(0)])
            opt.step()
        [p.full_tensor() for p in params]
    dist.barrier()
    dist.destroy_process_group()
    if without_grace:  # the state before the fix
        import atexit

        from lightning_muon.optim import transport

        atexit.unregister(transport.release_gloo_workers_at_exit)


def launch(optimizer: str, ranks: int, without_grace: bool) -> tuple[int, str]:
    """One torchrun launch: (return code, output)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr",
           "127.0.0.1", "--master-port", str(port), __file__, "--worker", "--optimizer", optimizer]  # fmt: skip
    cmd += ["--without-grace"] if without_grace else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stdout + proc.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--optimizer", default="muon", choices=["muon", "adamw"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--without-grace", action="store_true", help="unregister the exit hook (the count before the fix)"
    )
    parser.add_argument("--out", default="benchmarks/results/exit_aborts.json")
    args = parser.parse_args()
    if args.worker:
        return worker(args.optimizer, args.without_grace)
    from tqdm.auto import tqdm

    aborted, failed, start = [], [], time.perf_counter()
    for run in tqdm(range(args.runs), desc=f"{args.ranks}-rank runs", unit="run"):
        code, output = launch(args.optimizer, args.ranks, args.without_grace)
        if "terminate called" in output or re.search(r"exitcode\s*:\s*-\d+", output):
            aborted.append(run)
        elif code != 0:
            failed.append((run, output[-2000:]))
    import torch

    row = {
        "optimizer": args.optimizer,
        "exit hook": not args.without_grace,
        "ranks": args.ranks,
        "runs": args.runs,
        "aborted": len(aborted),
        "failed otherwise": len(failed),
        "seconds": time.perf_counter() - start,
        "torch": torch.__version__,
    }
    hook = "no (before the fix)" if args.without_grace else "yes"
    print("| optimizer | exit hook | ranks | runs | aborted at exit | failed otherwise | torch |")
    print("|---|---|---:|---:|---:|---:|---|")
    cells = (args.optimizer, hook, args.ranks, args.runs, len(aborted), len(failed), torch.__version__)
    print("| " + " | ".join(map(str, cells)) + " |")
    for run, output in failed[:3]:
        print(f"run {run} failed:\n{output}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = json.loads(out.read_text()) if out.is_file() else {}
    results[f"{args.optimizer}{' without exit hook' if args.without_grace else ''}"] = {**row, "aborted runs": aborted}
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
