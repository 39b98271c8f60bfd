"""The README's default run (``lightning-muon fit``) timed: wall and CPU seconds per phase and its final FD, alone
and beside a concurrent CPU load. Prints a table and writes JSON.

Each run is a fresh process with a fresh cache (so the digits classifier and the reference features are computed,
as on a new machine) and a fresh log directory. The load is ``--load`` single-threaded Python spinners started
before the run and stopped after it. Phases, timed inside the run process (wall: ``perf_counter``; CPU:
``process_time``, all threads of the process):

- ``classifier``: training the digits feature classifier (once per machine, then cached),
- ``references``: features of the real digits (once per cache),
- ``evaluations``: generating and scoring samples at every evaluation, the first one listed apart,
- ``rest``: start-up, training steps, validation and checkpoints (the total minus the above).

The CPU ratio under load against alone is the thread-oversubscription check: the same work should cost about the
same CPU time however busy the machine is. Each run is done as shipped (``lightning_muon`` sets
``OMP_WAIT_POLICY=PASSIVE`` before torch loads OpenMP) and with torch's default (spinning: torch imported first, the
variable unset), side by side.

    python benchmarks/default_run.py                       # alone, then beside 4 spinners
    python benchmarks/default_run.py --max-steps 300       # a shorter run (the FD is then not the README's)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("classifier", "references", "first evaluation", "later evaluations", "rest")


def child(out: Path, max_steps: int | None, spinning: bool) -> None:
    """Run the default fit in this process with phase timers around the functions that make up each phase."""
    if spinning:
        import torch  # noqa: F401  (loads OpenMP before lightning_muon can set its wait policy)

    from lightning_muon.callbacks import generation
    from lightning_muon.metrics import features
    from lightning_muon.recipes import cli

    clock: dict[str, list[float]] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.setdefault(name, []).append((time.perf_counter() - wall, time.process_time() - cpu))

        return wrapper

    features._train_digits_classifier = timed("classifier", features._train_digits_classifier)
    generation.prepare_references = timed("references", generation.prepare_references)
    generation.GenerationEvaluation.evaluate = timed("evaluation", generation.GenerationEvaluation.evaluate)
    args = ["fit", "--trainer.default_root_dir", str(out)]
    if max_steps:
        args += ["--trainer.max_steps", str(max_steps), "--trainer.val_check_interval", str(min(500, max_steps))]
    wall, cpu = time.perf_counter(), time.process_time()
    cli.main(args)
    total = (time.perf_counter() - wall, time.process_time() - cpu)
    (out / "phases.json").write_text(json.dumps({"total": total, **clock}))


def _sum(pairs: list) -> tuple[float, float]:
    """Wall and CPU seconds of several timed calls, summed."""
    return (sum(w for w, _ in pairs), sum(c for _, c in pairs))


def phases(clock: dict[str, list]) -> dict[str, tuple[float, float]]:
    """Wall and CPU seconds per phase; each evaluation's reference time (every evaluation prepares its references
    first) is counted under ``references``."""
    refs = clock.get("references", [])
    evals = [(w - rw, c - rc) for (w, c), (rw, rc) in zip(clock["evaluation"], refs, strict=True)]
    out = {
        "classifier": _sum(clock.get("classifier", [])),
        "references": _sum(refs),
        "first evaluation": evals[0],
        "later evaluations": _sum(evals[1:]),
    }
    out["rest"] = tuple(t - sum(v[i] for v in out.values()) for i, t in enumerate(clock["total"]))
    return out


def run(load: int, max_steps: int | None, spinning: bool) -> dict:
    """One default fit in a fresh process and cache, beside ``load`` spinners; wall, CPU (the child's rusage),
    phases and the last ``eval/fd_digits``."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            env["LIGHTNING_MUON_CACHE"] = str(Path(tmp) / "cache")
            cmd = [sys.executable, __file__, "--child", tmp] + (["--max-steps", str(max_steps)] if max_steps else [])
            cmd += ["--spinning"] if spinning else []
            start = time.perf_counter()
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            _, status, usage = os.wait4(proc.pid, 0)
            wall = time.perf_counter() - start
            if status:
                raise RuntimeError(f"the default run failed:\n{proc.stderr.read()[-4000:]}")
            clock = json.loads((Path(tmp) / "phases.json").read_text())
            metrics = next(Path(tmp).rglob("metrics.jsonl")).read_text().splitlines()
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    return {
        "load": load,
        "spinning": spinning,
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "phases": phases(clock),
        "final_fd": json.loads(metrics[-1])["eval/fd_digits"],
        "steps": json.loads(metrics[-1])["step"],
    }


def table(rows: list[dict]) -> str:
    alone = rows[0]
    head = ["run", "wall", "CPU", "CPU ÷ alone", *PHASES, "final FD"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        name = "alone" if not r["load"] else f"beside {r['load']} spinners"
        name += ", spinning (torch's default)" if r["spinning"] else ""
        cells = [name, f"{r['wall_s']:.0f} s", f"{r['cpu_s']:.0f} s", f"{r['cpu_s'] / alone['cpu_s']:.2f}×"]
        cells += [f"{r['phases'][p][0]:.0f} s / {r['phases'][p][1]:.0f} s" for p in PHASES]
        lines.append("| " + " | ".join(cells + [f"{r['final_fd']:.4f}"]) + " |")
    return "\n".join(lines) + "\n(phases: wall / CPU seconds)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", type=int, default=4, help="spinner processes beside the loaded run (0: none)")
    parser.add_argument("--max-steps", type=int, default=None, help="shorter than the default 1500 steps")
    parser.add_argument("--spinning", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="benchmarks/results/default_run.json")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(Path(args.child), args.max_steps, args.spinning)
    rows = [run(load, args.max_steps, spinning) for load in sorted({0, args.load}) for spinning in (False, True)]
    print(table(rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cores": os.cpu_count(), "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
