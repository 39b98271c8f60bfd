"""Fixed-seed optimizer runs whose final weights and state were recorded before the optimizer's redesign (#25).

``python tests/optim/recorded_runs.py`` rewrites ``recorded_runs.pt``; run it only to record a deliberate change of
the optimizer's arithmetic, and say so in the commit. ``test_recorded_runs.py`` replays every run and compares.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_muon import PeriodicRowwiseMuon

RECORDED = Path(__file__).with_name("recorded_runs.pt")
SHAPES = ((24, 16), (16, 24), (20, 20))

#: name -> (optimizer options, parameter dtype, steps, step whose gradient is NaN (None: all finite))
RUNS: dict[str, tuple[dict, torch.dtype, int, int | None]] = {
    "fixed_k3_skip": (
        dict(lr=0.02, period=3, rownorm_scale=0.15, weight_decay=0.01, ns_dtype="float32"),
        torch.float32,
        8,
        4,
    ),
    "adaptive": (
        dict(lr=0.02, period=3, schedule="adaptive", drift_threshold=0.1, max_period=4, ns_dtype="float32"),
        torch.float32,
        9,
        None,
    ),
    "k1_variants_foreach_off": (
        dict(
            lr=torch.tensor(0.01),
            period=1,
            nesterov=False,
            ns_coefficients="polar_express",
            ns_normalize="aol",
            ns_method="gram",
            adjust_lr="match_rms_adamw",
            foreach=False,
            ns_dtype="float32",
            betas=(0.8, 0.99),
        ),
        torch.float32,
        5,
        None,
    ),
    "k2_bf16_params": (
        dict(
            lr=0.02,
            period=2,
            rownorm_scale=0.3,
            weight_decay=0.1,
            ns_dtype="bfloat16",
            adamw_lr=0.003,
            adamw_weight_decay=0.0,
        ),
        torch.bfloat16,
        6,
        None,
    ),
}


def run(name: str) -> dict[str, torch.Tensor]:
    """Final weights and optimizer state of one recorded run, flattened into named tensors."""
    options, dtype, steps, nan_step = RUNS[name]
    gen = torch.Generator().manual_seed(0)
    matrices = [torch.randn(s, generator=gen).to(dtype).requires_grad_() for s in SHAPES]
    bias = torch.randn(16, generator=gen).to(dtype).requires_grad_()
    opt = PeriodicRowwiseMuon([{"params": matrices}, {"params": [bias], "use_muon": False}], **options)
    for t in range(1, steps + 1):
        for p in [*matrices, bias]:
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
        if t == nan_step:
            matrices[1].grad[0, 0] = float("nan")
        opt.step()
    out = {f"weight{i}": p.detach().clone() for i, p in enumerate([*matrices, bias])}
    for i, p in enumerate([*matrices, bias]):
        for key, value in opt.state[p].items():
            out[f"state{i}.{key}"] = value.detach().clone()
    out["skipped"] = torch.tensor(opt.nonfinite_steps_skipped)
    return out


if __name__ == "__main__":
    torch.save(
        {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "runs": {name: run(name) for name in RUNS}},
        RECORDED,
    )
    print(f"wrote {RECORDED}")
