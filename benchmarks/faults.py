"""Failure propagation and crash consistency of ``muon_fsdp`` on CPU/gloo, as tables (the README's Reliability
figures): seconds from a rank raising to every rank exiting (2 and 3 ranks), and SIGKILL-and-resume trials.

    python benchmarks/faults.py --trials 20

Runs ``tests/faults/harness.py`` (forked ranks in torchrun's environment) and writes JSON to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "faults"))
import harness  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/faults.json")
    args = parser.parse_args()
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
