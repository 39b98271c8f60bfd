"""PNG figures of a finished run: its last sample grid (TensorBoard's ``eval/samples``) and every ``eval/*`` metric
of ``metrics.jsonl`` against the training step (the README's figures come from the default run):

    python examples/run_figures.py lightning_logs/version_0 --out docs
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run directory (lightning_logs/version_N)")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--metric", default="eval/fd_digits")
    args = parser.parse_args(argv)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lightning_muon.recipes.evaluate import plot

    args.out.mkdir(parents=True, exist_ok=True)
    events = EventAccumulator(str(args.run), size_guidance={"images": 0})
    events.Reload()
    grid = events.Images("eval/samples")[-1]
    (args.out / "samples.png").write_bytes(grid.encoded_image_string)
    rows = [json.loads(line) for line in next(args.run.rglob("metrics.jsonl")).read_text().splitlines()]
    rows = [{"run": args.run.name, **{k: v for k, v in r.items() if k in ("step", args.metric)}} for r in rows]
    for path in plot(rows, args.out):
        print(path)
    print(args.out / "samples.png", f"(step {grid.step + 1})")


if __name__ == "__main__":
    main()
