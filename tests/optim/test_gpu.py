"""The optimizer on CUDA (skipped without it): the same step as on the CPU, no host synchronization in a skipping
step, and the compiled (triton) RowNorm equal to the eager one."""

import pytest
import torch

from lightning_muon import PeriodicRowwiseMuon

pytestmark = pytest.mark.gpu
SHAPES = ((96, 64), (64, 96), (80, 80))


def prepare(device, steps=7, nan_step=None):
    """Parameters and every step's gradients on ``device`` (made before any step: copies from the host sync)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen).to(device).requires_grad_() for s in SHAPES]
    grads = [[torch.randn(s, generator=gen).to(device) for s in SHAPES] for _ in range(steps)]
    if nan_step is not None:
        grads[nan_step - 1][0][0, 0] = float("nan")
    return params, grads


def steps(params, grads, **options):
    opt = PeriodicRowwiseMuon(params, lr=0.02, period=3, weight_decay=0.01, ns_dtype="float32", **options)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return opt


def run(device, **options):
    params, grads = prepare(device)
    opt = steps(params, grads, **options)
    return [p.detach().cpu() for p in params], opt


@pytest.mark.parametrize("schedule", ["fixed", "adaptive"])
def test_a_cuda_step_equals_the_cpu_step(schedule):
    cpu, _ = run("cpu", schedule=schedule)
    cuda, _ = run("cuda", schedule=schedule)
    for a, b in zip(cpu, cuda):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_a_skipping_step_never_synchronizes_with_the_host():
    """nonfinite="skip" decides on the device: under CUDA's sync debug mode a NaN step raises nothing, is skipped,
    and the count is read only afterwards. Control: nonfinite="raise" reads the verdict on the host, which the
    debug mode reports."""
    run("cuda")  # warm-up outside the debug mode (allocator, kernels)
    for nonfinite in ("skip", "raise"):
        params, grads = prepare("cuda", steps=4, nan_step=2 if nonfinite == "skip" else None)
        torch.cuda.set_sync_debug_mode("error")
        try:
            if nonfinite == "skip":
                opt = steps(params, grads)
            else:
                with pytest.raises(RuntimeError, match="synchroniz"):
                    steps(params, grads, nonfinite="raise")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert opt.nonfinite_steps_skipped == 1


def test_the_compiled_rownorm_equals_the_eager_one_on_cuda():
    eager, _ = run("cuda")
    fused, _ = run("cuda", fused=True)
    for a, b in zip(eager, fused):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
