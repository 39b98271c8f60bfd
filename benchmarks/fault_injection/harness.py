"""Fault injection for ``Trainer(strategy="muon_fsdp")`` on CPU/gloo: ranks that raise, ranks killed by SIGKILL while
training and saving, and resume from what they left.

Ranks are forked from this process after Lightning is imported (a trial starts in ~1 s instead of ~10 s), each
with the environment torchrun gives its workers (``RANK``, ``LOCAL_RANK``, ``TORCHELASTIC_RUN_ID``, …), so Lightning
sees an externally launched job exactly as under torchrun. Each rank runs a real ``Trainer.fit`` with FSDP2 and
``PeriodicRowwiseMuon`` and writes its stdout/stderr to ``<out>/<trial>/rank<r>.log`` (a rank still running at its
deadline has its stacks dumped there before it is killed).

    cd benchmarks/fault_injection
    python harness.py raise --out DIR          # rank failure propagation, 2 and 3 ranks
    python harness.py kill --trials 20 --out DIR
    python harness.py chain --out DIR          # epoch-end resumes with/without repair; no checkpoint

Both write ``<out>/report.json`` (read by tests/faults/test_faults.py) and print a summary.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torchdata.stateful_dataloader import StatefulDataLoader

from lightning_muon import MuonFSDPStrategy, PeriodicRowwiseMuon, muon_param_groups
from lightning_muon.checkpoint import newest_checkpoint
from lightning_muon.parallelize import free_port

WIDTH, SAMPLES, BATCH = 32, 96, 8  # 6 steps per epoch with 2 ranks


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(3))  # FSDP2 units (``blocks.i``)
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).squeeze(-1)


class Regression(L.LightningModule):
    def __init__(self, fail_rank: int = -1, fail_step: int = -1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = Blocks()
        self.fail_rank, self.fail_step = fail_rank, fail_step

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fail_rank and self.global_step == self.fail_step:
            Path(os.environ["FAULT_DIR"], "failed_at").write_text(str(time.time()))
            raise RuntimeError(f"injected failure on rank {self.global_rank} at step {self.global_step}")
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        groups = muon_param_groups(self.net, adamw={"lr": 1e-3})
        return PeriodicRowwiseMuon(groups, lr=0.02, period=3, weight_decay=0.01, ns_dtype=torch.float32)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, WIDTH, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(-1).sin())
        # torch's RandomSampler, which Lightning turns into a DistributedSampler (seeded, reshuffled by set_epoch);
        # torchdata's own (shuffle=True) would be wrapped in a DistributedSamplerWrapper drawing a fresh order from
        # the global RNG each epoch, which a resumed run does not reproduce
        sampler = torch.utils.data.RandomSampler(data)
        return StatefulDataLoader(data, batch_size=BATCH, sampler=sampler, drop_last=True)


def full_state(module: L.LightningModule) -> torch.Tensor:
    """Every parameter and optimizer state tensor, gathered and flattened (a collective: every rank calls it)."""
    tensors = [p.full_tensor() for p in module.net.parameters()]
    optimizer = module.trainer.optimizers[0]
    for p in module.net.parameters():
        tensors += [v.full_tensor() for v in optimizer.state.get(p, {}).values() if hasattr(v, "full_tensor")]
    return torch.cat([t.detach().double().flatten() for t in tensors])


class Joined(Callback):
    """Writes ``joined<rank>`` once this rank's process group is formed (``setup`` runs after ``setup_environment``)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def setup(self, trainer, pl_module, stage):
        (self.out / f"joined{trainer.global_rank}").touch()


def wait_until_joined(out: Path, world: int, pids: dict[int, int], limit: float = 60) -> None:
    """Until every rank has formed the process group (or one has exited, or ``limit`` seconds passed)."""
    deadline = time.time() + limit
    while time.time() < deadline and not all((out / f"joined{r}").is_file() for r in range(world)):
        if any(os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) for pid in pids.values()):
            return  # a rank exited (not reaped here: wait() collects its status)
        time.sleep(0.02)


class Record(Callback):
    """Rank 0 appends ``{"step", "loss"}`` per step to ``losses.jsonl``; with ``reference`` it saves the full state
    after each step, without it it checks the state just resumed against the reference's."""

    def __init__(self, out: Path, reference: Path, write_reference: bool) -> None:
        self.out, self.reference, self.write_reference = out, reference, write_reference

    def on_train_start(self, trainer, pl_module):
        state = full_state(pl_module)
        if trainer.is_global_zero and not self.write_reference and trainer.global_step > 0:
            want = torch.load(self.reference / f"{trainer.global_step}.pt", weights_only=True)
            exact = bool(torch.equal(state, want))
            (self.out / "resumed.json").write_text(json.dumps({"step": trainer.global_step, "exact": exact}))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        state = full_state(pl_module) if self.write_reference else None
        if trainer.is_global_zero:
            with (self.out / "losses.jsonl").open("a") as f:
                f.write(json.dumps({"step": trainer.global_step, "loss": float(outputs["loss"])}) + "\n")
                f.flush()
            if state is not None:
                torch.save(state, self.reference / f"{trainer.global_step}.pt")


def _not_on_this_rank(path):
    raise AssertionError(f"rank {os.environ['RANK']} resolved {path} itself: only rank 0 may choose the checkpoint")


class UnrepairedEpochs(MuonFSDPStrategy):
    """Deliberate break: ``muon_fsdp`` without its repair of Lightning's epoch counters after a resume."""

    def on_train_start(self) -> None:
        self._resumed_epoch = None
        super().on_train_start()


def fit(out: Path, ckpt_dir: Path, reference: Path, args: dict) -> None:
    """``Trainer.fit`` on this rank (world from the environment), resuming from ``ckpt_dir`` when it has checkpoints."""
    from datetime import timedelta

    torch.set_num_threads(1)
    if int(os.environ["RANK"]) != 0:  # only rank 0 may pick the checkpoint; the others load what it broadcasts
        import lightning_muon.strategy

        lightning_muon.strategy.resolve_checkpoint = _not_on_this_rank
    resume = ckpt_dir if any(ckpt_dir.glob("*.ckpt")) else None
    strategy_class = MuonFSDPStrategy if args.get("repair_epochs", True) else UnrepairedEpochs
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=strategy_class(timeout=timedelta(seconds=args.get("timeout", 300))),
        max_steps=args["max_steps"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[
            ModelCheckpoint(
                dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=2, save_last=True, monitor="step", mode="max"
            ),
            Joined(out),
            Record(out, reference, args.get("write_reference", False)),
        ],
    )
    trainer.fit(Regression(args.get("fail_rank", -1), args.get("fail_step", -1)), ckpt_path=resume)


def worker(rank: int, world: int, port: int, out: Path, ckpt_dir: Path, reference: Path, args: dict) -> None:
    """A forked rank: torchrun's environment, output to ``rank<r>.log``, :func:`fit`, ``os._exit`` with its status."""
    log = open(out / f"rank{rank}.log", "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # wait() dumps a hung rank's stacks into its log
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        TORCHELASTIC_RUN_ID="faults",
    )
    status = 0
    try:
        fit(out, ckpt_dir, reference, args)
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def launch(world: int, out: Path, ckpt_dir: Path, reference: Path, **args) -> dict[int, int]:
    """Fork ``world`` ranks; their pids by rank."""
    out.mkdir(parents=True, exist_ok=True)
    os.environ["FAULT_DIR"] = str(out)
    port, pids = free_port(), {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            worker(rank, world, port, out, ckpt_dir, reference, args)
        pids[rank] = pid
    return pids


def wait(pids: dict[int, int], deadline: float) -> dict[int, dict]:
    """Exit status and exit time of each rank; ranks still running at ``deadline`` have their stacks written to their
    log (SIGUSR1, faulthandler) and are killed (status ``"hung"``)."""
    result: dict[int, dict] = {}
    while len(result) < len(pids):
        for rank, pid in pids.items():
            if rank in result:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                result[rank] = {"code": code, "time": time.time()}
            elif time.time() > deadline:
                os.kill(pid, signal.SIGUSR1)
                time.sleep(1)
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                result[rank] = {"code": "hung", "time": time.time()}
        time.sleep(0.02)
    return result


def raise_cases(out: Path) -> list[dict]:
    """A rank raises in ``training_step`` at step 2: every rank must exit non-zero, fast, the failing one with
    the original error, with the process-group timeout at 300 s."""
    report = []
    for world, fail_rank in ((2, 1), (2, 0), (3, 0), (3, 2)):
        case = out / f"raise_w{world}_r{fail_rank}"
        pids = launch(world, case, case / "ckpt", case, max_steps=6, fail_rank=fail_rank, fail_step=2)
        exits = wait(pids, time.time() + 240)
        failed_at = float((case / "failed_at").read_text()) if (case / "failed_at").is_file() else None
        logs = {r: (case / f"rank{r}.log").read_text() for r in range(world)}
        report.append(
            {
                "world": world,
                "fail_rank": fail_rank,
                "codes": [exits[r]["code"] for r in range(world)],
                "seconds_to_all_exited": None
                if failed_at is None
                else max(e["time"] for e in exits.values()) - failed_at,
                "original_error_logged": "injected failure on rank" in logs[fail_rank],
                "timeout_in_any_log": any("timed out" in t.lower() or "timeout" in t.lower() for t in logs.values()),
            }
        )
    return report


def kill_trials(out: Path, trials: int, seed: int = 0, max_steps: int = 40) -> dict:
    """An uninterrupted reference run, then ``trials`` runs that each resume from the newest complete checkpoint of
    the previous ones and have a random rank SIGKILLed at a random moment of training/saving, then a final run to
    the end. Every resumed state must equal the reference's at that step, and every logged loss the reference's."""
    rng = random.Random(seed)
    reference = out / "reference"
    reference.mkdir(parents=True, exist_ok=True)
    ref_run = out / "reference_run"
    launch_and_check(ref_run, ref_run / "ckpt", reference, max_steps=max_steps, write_reference=True)
    want = {r["step"]: r["loss"] for r in map(json.loads, (ref_run / "losses.jsonl").read_text().splitlines())}
    ckpt_dir = out / "chain_ckpt"
    rows = []
    for t in range(trials + 1):
        run = out / f"trial{t:02d}"
        final = t == trials
        kill_at = time.time() + rng.uniform(0.3, 2.5)
        pids = launch(2, run, ckpt_dir, reference, max_steps=max_steps)
        row: dict = {"trial": t}
        if not final:
            # a kill that would land before both ranks formed the group waits until they have: a rank whose peer
            # dies in rendezvous retries the store until the timeout (torch's TCPStore client, by design: a peer
            # may start late); the launcher stops it (torchrun, srun --kill-on-bad-exit), nothing of ours runs yet
            wait_until_joined(run, 2, pids)
            row["moved_past_rendezvous"] = time.time() > kill_at
            time.sleep(max(0.0, kill_at - time.time()))
            victim = rng.randrange(2)
            during_save = any(ckpt_dir.glob(".*.partial"))
            killed_at = time.time()
            try:
                os.kill(pids[victim], signal.SIGKILL)
            except ProcessLookupError:
                pass
            row.update(victim=victim, during_save=during_save)
        exits = wait(pids, time.time() + 120)
        if not final:
            row["seconds_to_all_exited"] = max(e["time"] for e in exits.values()) - killed_at
        row["codes"] = [exits[r]["code"] for r in range(2)]
        resumed = run / "resumed.json"
        row["resumed"] = json.loads(resumed.read_text()) if resumed.is_file() else None
        losses = (
            [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]
            if (run / "losses.jsonl").is_file()
            else []
        )
        row["steps"] = [r["step"] for r in losses]
        row["losses_match"] = all(r["loss"] == want[r["step"]] for r in losses)
        rows.append(row)
        newest = newest_checkpoint(ckpt_dir) if ckpt_dir.is_dir() else None
        if newest is not None and newest[1] >= max_steps and not final:  # the chain finished: start a new one
            ckpt_dir = out / f"chain_ckpt_{t}"
    resumed = [r for r in rows if r["resumed"] is not None]
    return {
        "control_mixed_detected": mixed_checkpoint_control(out, reference, max_steps),
        "trials": trials,
        "killed": sum(1 for r in rows[:-1] if -9 in r["codes"]),
        "killed_during_save": sum(1 for r in rows[:-1] if -9 in r["codes"] and r["during_save"]),
        "moved_past_rendezvous": sum(1 for r in rows[:-1] if r["moved_past_rendezvous"]),
        "resumed": len(resumed),
        "resumed_exactly": sum(1 for r in resumed if r["resumed"]["exact"]),
        "losses_match": all(r["losses_match"] for r in rows),
        "final_codes": rows[-1]["codes"],
        "final_reached_max_steps": max(rows[-1]["steps"], default=0) == max_steps,
        "max_seconds_to_all_exited": max(r.get("seconds_to_all_exited", 0) for r in rows),
        "hung": sum(1 for r in rows for c in r["codes"] if c == "hung"),
        # the chain the final run saved into: every killed save's leftovers there were cleared by a later save of
        # that name. A chain closed by a run killed during its last saves (its newest complete checkpoint already at
        # max_steps) is abandoned: nothing saves there again, so its leftovers are counted apart.
        "leftover_partial": sorted(str(p) for p in ckpt_dir.glob(".*.partial")),
        "abandoned_chain_partials": len([p for p in out.glob("chain_ckpt*/.*.partial") if p.parent != ckpt_dir]),
        "rows": rows,
    }


def resume_chain(out: Path, stops: list[int], repair_epochs: bool = True) -> dict:
    """Runs that each stop at the next of ``stops`` (``max_steps``) and resume from the previous one's checkpoints,
    against an uninterrupted run to ``stops[-1]`` (made once per ``out``): is every resumed state and every logged
    loss the uninterrupted run's?"""
    reference, ref_run = out / "reference", out / "reference_run"
    if not (ref_run / "losses.jsonl").is_file():
        reference.mkdir(parents=True, exist_ok=True)
        launch_and_check(ref_run, ref_run / "ckpt", reference, max_steps=stops[-1], write_reference=True)
    want = {r["step"]: r["loss"] for r in map(json.loads, (ref_run / "losses.jsonl").read_text().splitlines())}
    chain = out / f"chain_{'repaired' if repair_epochs else 'unrepaired'}"
    resumed, losses = [], []
    for stop in stops:
        run = chain / f"to{stop}"
        launch_and_check(run, chain / "ckpt", reference, max_steps=stop, repair_epochs=repair_epochs)
        if (run / "resumed.json").is_file():
            resumed.append(json.loads((run / "resumed.json").read_text()))
        losses += [json.loads(line) for line in (run / "losses.jsonl").read_text().splitlines()]
    return {
        "resumed_exactly": all(r["exact"] for r in resumed) and len(resumed) == len(stops) - 1,
        "steps": [r["step"] for r in losses],
        "mismatched_steps": [r["step"] for r in losses if r["loss"] != want[r["step"]]],
    }


def resume_from_nothing(out: Path) -> dict:
    """A resume from a directory whose only ``*.ckpt`` is incomplete: every rank must fail with the message."""
    ckpt_dir = out / "ckpt"
    (ckpt_dir / "epoch=0-step=3.ckpt").mkdir(parents=True)  # no .metadata, no meta.pt: a torn copy
    exits = wait(launch(2, out, ckpt_dir, out, max_steps=6), time.time() + 120)
    logs = [(out / f"rank{r}.log").read_text() for r in range(2)]
    return {
        "codes": [exits[r]["code"] for r in range(2)],
        "message_on_every_rank": all("No complete checkpoint" in log for log in logs),
    }


def launch_and_check(run: Path, ckpt_dir: Path, reference: Path, **args) -> None:
    """One 2-rank fit to its end; raises with rank 0's log when a rank fails."""
    exits = wait(launch(2, run, ckpt_dir, reference, **args), time.time() + 300)
    if any(e["code"] != 0 for e in exits.values()):
        raise RuntimeError(f"run {run} failed: {(run / 'rank0.log').read_text()[-3000:]}")


def mixed_checkpoint_control(out: Path, reference: Path, max_steps: int) -> bool:
    """Deliberate break: the reference run's last checkpoint with rank 1's shard from the step before (a mixed
    checkpoint, which the completeness check cannot see) must resume as not exact."""
    import shutil

    saved = sorted((out / "reference_run" / "ckpt").glob("epoch=*-step=*.ckpt"), key=lambda p: p.stat().st_mtime)
    older, newer = saved[-2], saved[-1]
    mixed = out / "control" / "ckpt"
    shutil.copytree(newer, mixed / newer.name)
    shutil.copy(older / "__1_0.distcp", mixed / newer.name / "__1_0.distcp")
    run = out / "control"
    wait(launch(2, run, mixed, reference, max_steps=max_steps + 1), time.time() + 120)
    resumed = run / "resumed.json"
    return resumed.is_file() and not json.loads(resumed.read_text())["exact"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["raise", "kill", "chain", "run"], help="run: one rank of a torchrun job")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fail-rank", type=int, default=-1, help="run: the rank that raises at step 2")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "run":
        os.environ["FAULT_DIR"] = str(args.out)
        return fit(args.out, args.out / "ckpt", args.out, {"max_steps": 6, "fail_rank": args.fail_rank, "fail_step": 2})
    if args.mode == "raise":
        report = raise_cases(args.out)
    elif args.mode == "kill":
        report = kill_trials(args.out, args.trials, args.seed)
    else:  # 6 steps per epoch: 30 and 36 end epochs 4 and 5, 44 is inside epoch 7
        report = {f"repair_epochs={r}": resume_chain(args.out, [30, 36, 44], r) for r in (True, False)}
        report["resume_from_nothing"] = resume_from_nothing(args.out / "nothing")
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "rows"} if args.mode == "kill" else report, indent=1))


if __name__ == "__main__":
    main()
