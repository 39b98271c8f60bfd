"""Per-GPU memory of a config's model states under muon_fsdp, computed from the real parameter shapes.

    python -m lightning_muon.recipes.memory recipes/configs/t2i_*.yaml

Counts fp32 parameters, fp32 gradients and optimizer state (Muon: one momentum matrix; AdamW: two moments), all
sharded over every GPU, plus the largest unsharded bf16 block twice (FSDP2 prefetches the next block while one
runs) and the full-matrix NS5 working set of a refresh in gather mode (one bucket of bf16 momentum and its NS5
temporaries). Activations depend on batch size and checkpointing and are not included.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
import yaml

from lightning_muon import muon_param_groups
from lightning_muon.recipes.module import build_transformer
from lightning_muon.strategy import BLOCK_MODULE_PATTERN


def model_state_bytes(architecture: str, model_config: dict, gpus: int, bucket_mb: float = 64.0) -> dict[str, float]:
    """Bytes per GPU (GiB values) of params, grads, optimizer state and transient buffers for one model."""
    with torch.device("meta"):
        model = build_transformer(architecture, model_config)
    groups = muon_param_groups(model)
    muon = sum(p.numel() for g in groups if g["use_muon"] for p in g["params"])
    total = sum(p.numel() for p in model.parameters())
    block = max(sum(p.numel() for p in m.parameters()) for n, m in model.named_modules()
                if re.search(BLOCK_MODULE_PATTERN, n))  # fmt: skip
    largest_matrix = max(p.numel() for g in groups if g["use_muon"] for p in g["params"])
    gib = 2**30
    sharded = (4 * total + 4 * total + 4 * muon + 8 * (total - muon)) / gpus
    transient = 2 * 2 * block + max(bucket_mb * 2**20, 2 * largest_matrix) * 3
    return {"params_B": total / 1e9, "muon_share": muon / total, "sharded_states_GiB": sharded / gib,
            "transient_GiB": transient / gib, "total_GiB": (sharded + transient) / gib}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    print(f"| {'config':<26} | {'params':>7} | {'Muon share':>10} | {'GPUs':>5} | {'sharded states':>14} | "
          f"{'transient':>9} | {'per GPU':>8} |")  # fmt: skip
    print("|" + "|".join("-" * w for w in (28, 9, 12, 7, 16, 11, 10)) + "|")
    for path in args.configs:
        cfg = yaml.safe_load(path.read_text())
        gpus = cfg["trainer"].get("devices", 1) * cfg["trainer"].get("num_nodes", 1)
        r = model_state_bytes(cfg["model"].get("architecture", "dit"), cfg["model"]["model_config"], gpus)
        states, transient, total = r["sharded_states_GiB"], r["transient_GiB"], r["total_GiB"]
        print(f"| {path.name:<26} | {r['params_B']:>6.2f}B | {100 * r['muon_share']:>9.1f}% | {gpus:>5} | "
              f"{states:>10.2f} GiB | {transient:>5.2f} GiB | {total:>4.1f} GiB |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
