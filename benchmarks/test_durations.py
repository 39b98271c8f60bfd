"""Where the test suite's time goes: the README's test command (or any pytest arguments) with a plugin that records
each test's wall time and what it started, then the time per file and per kind of test, as a table and JSON.

Kinds, from what each test did (``tests/durations_plugin.py`` counts the real calls): ``multi-process`` (spawned gloo
ranks), ``subprocess`` (a CLI run, a script, Lightning's launcher), ``training`` (an in-process ``Trainer.fit``),
``unit`` (none of these).

    python benchmarks/test_durations.py                 # the default suite (not slow)
    python benchmarks/test_durations.py -- -m slow      # any pytest arguments after --
    python benchmarks/test_durations.py --report FILE   # the table of an earlier run's records
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

KINDS = ("multi-process", "subprocess", "training", "unit")


def kind(row: dict) -> str:
    if row["spawn"] or "distributed" in row["markers"]:
        return "multi-process"
    if row["popen"]:
        return "subprocess"
    return "training" if row["fit"] else "unit"


def run(pytest_args: list[str], records: Path) -> tuple[float, int]:
    tests = str(Path(__file__).parents[1] / "tests")  # where the plugin lives (pytest reads -p before its pythonpath)
    env = {
        **os.environ,
        "TEST_DURATIONS_OUT": str(records),
        "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])),
    }
    start = time.perf_counter()
    code = subprocess.call([sys.executable, "-m", "pytest", "-p", "durations_plugin", *pytest_args], env=env)
    return time.perf_counter() - start, code


def report(rows: list[dict], wall: float | None = None, top: int = 30) -> dict:
    per_file: dict[str, dict] = defaultdict(lambda: {"seconds": 0.0, "tests": 0, **dict.fromkeys(KINDS, 0.0)})
    per_kind = {k: {"seconds": 0.0, "tests": 0} for k in KINDS}
    for row in rows:
        file, k = row["nodeid"].split("::")[0], kind(row)
        per_file[file]["seconds"] += row["seconds"]
        per_file[file]["tests"] += 1
        per_file[file][k] += row["seconds"]
        per_kind[k]["seconds"] += row["seconds"]
        per_kind[k]["tests"] += 1
    total = sum(r["seconds"] for r in rows)
    print(f"{len(rows)} tests, {total:.0f} s in tests" + (f", {wall:.0f} s wall" if wall else ""))
    print(f"| {'kind':<14} | {'tests':>5} | {'seconds':>8} | {'share':>6} |")
    print(f"|{'-' * 16}|{'-' * 7}|{'-' * 10}|{'-' * 8}|")
    for k, v in per_kind.items():
        print(f"| {k:<14} | {v['tests']:>5} | {v['seconds']:>8.1f} | {v['seconds'] / max(total, 1e-9):>6.1%} |")
    print()
    print(f"| {'file':<48} | {'tests':>5} | {'seconds':>8} | " + " | ".join(f"{k:>13}" for k in KINDS) + " |")
    print(f"|{'-' * 50}|{'-' * 7}|{'-' * 10}|" + "|".join("-" * 15 for _ in KINDS) + "|")
    for file, v in sorted(per_file.items(), key=lambda kv: -kv[1]["seconds"])[:top]:
        cells = " | ".join(f"{v[k]:>13.1f}" for k in KINDS)
        print(f"| {file:<48} | {v['tests']:>5} | {v['seconds']:>8.1f} | {cells} |")
    slowest = sorted(rows, key=lambda r: -r["seconds"])[:15]
    print("\nslowest tests:")
    for r in slowest:
        print(f"  {r['seconds']:7.1f} s  {kind(r):<13}  {r['nodeid']}")
    return {"wall_seconds": wall, "test_seconds": total, "per_kind": per_kind, "per_file": dict(per_file)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--report", type=Path, help="records (JSON lines) of an earlier run: print their table")
    parser.add_argument("--out", default="benchmarks/results/test_durations.json")
    parser.add_argument("--records", type=Path, help="keep the per-test records here (JSON lines)")
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    args = parser.parse_args()
    wall, code = None, 0
    if args.report:
        records = args.report
    else:
        records = args.records or Path(tempfile.mkstemp(suffix=".jsonl")[1])
        records.write_text("")
        wall, code = run(args.pytest_args, records)
    rows = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    result = report(rows, wall)
    result.update(pytest_args=args.pytest_args, exit_code=code, tests=rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    sys.exit(code)


if __name__ == "__main__":
    main()
