"""The Reliability tables (docs/reliability.md).

    python benchmarks/faults.py --matrix    # the fault matrix: fit, evaluate, 2-rank muon_fsdp under full disks,
                                            # read-only directories, SIGTERM, Slurm pre-emption, damaged checkpoints
    python benchmarks/faults.py --trials 20 # muon_fsdp on CPU/gloo: seconds from a rank raising to every rank
                                            # exiting (2 and 3 ranks), and SIGKILL-and-resume trials

``--matrix`` runs ``fault_injection/matrix.py`` (each row a real CLI run; full disks are small tmpfs mounts, so it
needs root) and writes ``benchmarks/results/fault_matrix.json``; the other tables run ``fault_injection/harness.py``
(forked ranks in torchrun's environment) and write ``benchmarks/results/faults.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "fault_injection"))
import harness  # noqa: E402
import matrix  # noqa: E402


def fault_matrix(out: Path) -> None:
    if not matrix.can_mount():
        raise SystemExit("The fault matrix mounts small tmpfs filesystems: run it as root (CAP_SYS_ADMIN).")
    with tempfile.TemporaryDirectory() as tmp:
        rows = matrix.Matrix(Path(tmp)).run_all()
    for row in rows:  # the temporary paths say nothing
        row["message"] = row["message"].replace(tmp, "…")
        row["on_disk"] = row["on_disk"].replace(tmp, "…")
    print(matrix.table(rows))
    print(f"\n{sum(r['ok'] for r in rows)} of {len(rows)} rows pass")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--matrix", action="store_true", help="the fault matrix instead of the muon_fsdp tables")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--out", default=None, help="JSON output (default: benchmarks/results/<table>.json)")
    args = parser.parse_args()
    if args.matrix:
        return fault_matrix(Path(args.out or "benchmarks/results/fault_matrix.json"))
    args.out = args.out or "benchmarks/results/faults.json"
    with tempfile.TemporaryDirectory() as tmp:
        raised = harness.raise_cases(Path(tmp) / "raise")
        killed = harness.kill_trials(Path(tmp) / "kill", args.trials)
    print("| ranks | failing rank | exit codes | all exited after | original error logged |")
    print("|---:|---:|---|---:|---|")
    for r in raised:
        print(
            f"| {r['world']} | {r['fail_rank']} | {r['codes']} | {r['seconds_to_all_exited']:.2f} s | "
            f"{r['original_error_logged']} |"
        )
    summary = {k: v for k, v in killed.items() if k != "rows"}
    print("\n| " + " | ".join(summary) + " |\n|" + "---|" * len(summary))
    print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in summary.values()) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"raise": raised, "kill": summary}, indent=1))


if __name__ == "__main__":
    main()
