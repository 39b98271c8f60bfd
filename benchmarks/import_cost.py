"""What starting costs: ``import torch`` / ``lightning`` / ``lightning_muon`` and each ``lightning-muon`` help, side by
side in fresh processes — median wall seconds over ``--repeats`` and the modules loaded. Prints a table and writes
``benchmarks/results/import_cost.json``.

    python benchmarks/import_cost.py --repeats 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: probe -> the code a fresh interpreter runs (a CLI probe calls the console script's function, as the script does)
PROBES = {
    "import torch": "import torch",
    "import lightning": "import lightning",
    "import lightning_muon": "import lightning_muon",
    "lightning-muon --version": "import lightning_muon_cli as c; c.main(['--version'])",
    "lightning-muon --help": "import lightning_muon_cli as c; c.main(['--help'])",
    "lightning-muon fit --help": "import lightning_muon_cli as c; c.main(['fit', '--help'])",
    "lightning-muon evaluate --help": "import lightning_muon_cli as c; c.main(['evaluate', '--help'])",
    "lightning-muon doctor --help": "import lightning_muon_cli as c; c.main(['doctor', '--help'])",
}
COUNT = "\nimport sys; sys.stderr.write(f'\\nMODULES {len(sys.modules)}\\n')"


def measure(code: str) -> tuple[float, int]:
    """Wall seconds of a fresh ``python -c`` running ``code``, and how many modules it had loaded at the end."""
    wrapped = f"try:\n    {code}\nexcept SystemExit:\n    pass{COUNT}"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    counts = [line for line in proc.stderr.splitlines() if line.startswith("MODULES ")]
    if not counts:
        raise RuntimeError(f"probe failed: {code}\n{proc.stderr[-2000:]}")
    return seconds, int(counts[-1].split()[1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per probe (the median is reported)")
    parser.add_argument("--out", default="benchmarks/results/import_cost.json")
    args = parser.parse_args(argv)
    measure("import torch")  # warm the file cache once
    results = {}
    for name, code in PROBES.items():
        runs = [measure(code) for _ in range(args.repeats)]
        results[name] = {"seconds": statistics.median(s for s, _ in runs), "modules": runs[-1][1]}
    base = results["import torch"]["seconds"]
    print(f"| probe | median s ({args.repeats} fresh processes) | vs import torch | modules |")
    print("|---|---:|---:|---:|")
    for name, r in results.items():
        print(f"| `{name}` | {r['seconds']:.2f} | {r['seconds'] / base:.2f}× | {r['modules']} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"repeats": args.repeats, "probes": results}, indent=1))


if __name__ == "__main__":
    main()
