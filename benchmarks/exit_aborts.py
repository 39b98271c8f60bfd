"""How often a finished 3-rank gloo job aborts at exit (the cause: :func:`~lightning_muon.optim.transport.
release_gloo_workers_at_exit`): ``--runs`` torchrun launches of a step-and-exit harness (two
FSDP2-sharded matrices stepped by ``PeriodicRowwiseMuon`` at K = 1 and 3 in gather and scatter mode, or by
``torch.optim.AdamW``, gathered with ``full_tensor()``, then ``barrier()`` and ``destroy_process_group()`` — as a
user's script does; the exit hook still gives the grace, because the optimizer's collectives noted the gloo group,
:func:`~lightning_muon.optim.transport.note_gloo_collectives`), counting
the runs in which a rank died by a signal ("terminate called without an active exception", SIGABRT) instead of
exiting 0. Each run is appended to ``exit_aborts.jsonl`` (so batches add up: run it again to add runs); prints the
totals and writes them to ``exit_aborts.json``.

    python benchmarks/exit_aborts.py --runs 100
    python benchmarks/exit_aborts.py --runs 100 --optimizer adamw
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

CASES = ((1, "gather"), (3, "gather"), (1, "scatter"), (3, "scatter"))
#: what the harness exercises; runs of another harness are not added up with these
HARNESS = "destroys its own group; the grace from note_gloo_collectives (the shipped path)"


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
    from lightning_muon.parallelize import free_port  # the launcher stays light: torch loads in the ranks

    port = free_port()
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
    import torch
    from tqdm.auto import tqdm

    key = {"optimizer": args.optimizer, "exit hook": not args.without_grace, "ranks": args.ranks,
           "torch": torch.__version__, "harness": HARNESS}  # fmt: skip
    log = Path(args.out).with_suffix(".jsonl")  # one line per run: resumable, batches add up
    log.parent.mkdir(parents=True, exist_ok=True)
    for _ in tqdm(range(args.runs), desc=f"{args.ranks}-rank runs", unit="run"):
        start = time.perf_counter()
        code, output = launch(args.optimizer, args.ranks, args.without_grace)
        aborted = "terminate called" in output or re.search(r"exitcode\s*:\s*-\d+", output) is not None
        run = {**key, "aborted": aborted, "failed": code != 0 and not aborted, "seconds": time.perf_counter() - start}
        with log.open("a") as f:
            f.write(json.dumps(run) + "\n")
        if run["failed"]:
            print(f"a run failed:\n{output[-2000:]}")
    summary = summarize([json.loads(line) for line in log.read_text().splitlines() if line.strip()])
    print("| optimizer | exit hook | ranks | torch | runs | aborted at exit | failed otherwise | hours |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    for row in summary:
        hook = "yes" if row["exit hook"] else "no (before the fix)"
        cells = (row["optimizer"], hook, row["ranks"], row["torch"], row["runs"], row["aborted"], row["failed"])
        print("| " + " | ".join(map(str, cells)) + f" | {row['seconds'] / 3600:.2f} |")
    Path(args.out).write_text(json.dumps({"harness": HARNESS, "rows": summary}, indent=1))


def summarize(runs: list[dict]) -> list[dict]:
    """Runs of the current harness added up per (optimizer, exit hook, ranks, torch)."""
    rows: dict[tuple, dict] = {}
    for r in runs:
        if r["harness"] != HARNESS:
            continue
        key = (r["optimizer"], r["exit hook"], r["ranks"], r["torch"])
        row = rows.setdefault(key, dict(zip(("optimizer", "exit hook", "ranks", "torch"), key, strict=True)))
        for name, value in (("runs", 1), ("aborted", r["aborted"]), ("failed", r["failed"]), ("seconds", r["seconds"])):
            row[name] = row.get(name, 0) + value
    return list(rows.values())


if __name__ == "__main__":
    main()
