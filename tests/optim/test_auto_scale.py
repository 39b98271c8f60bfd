"""``rownorm_scale="auto"``: each matrix calibrates γ at its refreshes. The formula against an independent float64
computation, the step it drives, resume, skipped steps, and adaptive / layer-wise use, each with a control."""

import io

import numpy as np
import pytest
import torch
from references import reference_ns

from lightning_muon import PeriodicRowwiseMuon
from lightning_muon.optim.kernels import DEFAULT_NS_COEFFICIENTS, newton_schulz, refresh_scales

SHAPES = ((24, 16), (16, 24), (20, 20))


def numpy_scales(N: np.ndarray, U: np.ndarray) -> tuple[float, float]:
    """Descent- and RMS-matched γ in float64 numpy: oriented rows are the rows of the wide orientation."""
    wide_n, wide_u = (N.T, U.T) if N.shape[0] > N.shape[1] else (N, U)
    p = wide_n.shape[0]
    descent = float((wide_n * wide_u).sum() / np.linalg.norm(wide_n, axis=1).sum())
    return descent, float(np.linalg.norm(wide_u) / np.sqrt(p))


@pytest.mark.parametrize("shape", SHAPES)
def test_refresh_scales_equal_a_float64_numpy_computation(shape):
    N = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    U = newton_schulz(N, dtype=torch.float64)
    want = numpy_scales(N.numpy(), U.numpy())
    torch.testing.assert_close(
        refresh_scales(N, U).double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0
    )
    if shape[0] != shape[1]:  # control: rows of the other orientation give another descent γ
        wrong = float((N * U).sum() / torch.linalg.vector_norm(N, dim=0 if shape[0] < shape[1] else 1).sum())
        assert abs(wrong - want[0]) > 1e-3


def params_and_grads(steps, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in SHAPES]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in SHAPES] for _ in range(steps)]
    return params, grads


def run(steps, opt=None, params=None, grads=None, start=0, **options):
    if params is None:
        params, grads = params_and_grads(steps)
    options = {"lr": 0.02, "period": 3, "rownorm_scale": "auto", "ns_dtype": "float64", **options}
    opt = opt or PeriodicRowwiseMuon(params, **options)
    for step_grads in grads[start:steps]:
        for p, g in zip(params, step_grads):
            p.grad = g.clone()
        opt.step()
    return params, opt


@pytest.mark.parametrize("kind", ["auto", "auto_rms"])
def test_a_rownorm_step_uses_the_gamma_of_the_last_refresh(kind):
    """Step 1 refreshes and stores γ from its own look-ahead (float64 reference: Keller Jordan's loop); step 2 is
    RowNorm scaled by multiplier · γ. Control: the other candidate's γ does not reproduce step 2."""
    params, grads = params_and_grads(2, dtype=torch.float64)
    start = [p.detach().clone() for p in params]
    params, opt = run(1, params=params, grads=grads, rownorm_scale=kind, auto_scale_multiplier=0.5, momentum=0.9)
    after_refresh = [p.detach().clone() for p in params]
    run(2, opt=opt, params=params, grads=grads, start=1)
    column = {"auto": 0, "auto_rms": 1}[kind]
    for i, (w0, w1, p) in enumerate(zip(start, after_refresh, params)):
        g1, g2 = grads[0][i], grads[1][i]
        m1 = 0.1 * g1
        n1 = 0.9 * m1 + 0.1 * g1
        gamma = numpy_scales(n1.numpy(), reference_ns(n1, [DEFAULT_NS_COEFFICIENTS] * 5).numpy())
        torch.testing.assert_close(
            opt.state[p]["refresh_scales"].double(), torch.tensor(gamma).double(), rtol=1e-6, atol=0
        )
        m2 = 0.9 * m1 + 0.1 * g2
        n2 = 0.9 * m2 + 0.1 * g2
        dim = -1 if n2.shape[0] <= n2.shape[1] else -2
        rownorm = n2 / n2.norm(dim=dim, keepdim=True)
        s = max(1.0, n2.shape[0] / n2.shape[1]) ** 0.5
        stored = opt.state[p]["refresh_scales"].double()  # the float32 values the step reads, in float64 arithmetic
        want = w1 + rownorm * ((-0.02 * s) * (stored[column] * 0.5))
        torch.testing.assert_close(p.detach(), want, rtol=1e-9, atol=1e-12)
        other = w1 + rownorm * ((-0.02 * s) * (stored[1 - column] * 0.5))
        assert not torch.allclose(p.detach(), other, rtol=1e-6, atol=1e-9)
        assert not torch.equal(w0, w1)


def test_resume_from_a_state_dict_is_bit_identical():
    """A run saved after step 4 (mid-period, γ from the refresh at step 4) and resumed equals the uninterrupted run.
    Control: resuming without the calibrated γ (the state key dropped) does not."""
    straight, _ = run(8)

    def resumed(drop: bool):
        params, grads = params_and_grads(8)
        _, opt = run(4, params=params, grads=grads)
        buffer = io.BytesIO()
        torch.save(opt.state_dict(), buffer)
        state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        if drop:
            for s in state["state"].values():
                s.pop("refresh_scales")
        fresh = PeriodicRowwiseMuon(params, lr=0.02, period=3, rownorm_scale="auto", ns_dtype="float64")
        fresh.load_state_dict(state)
        return run(8, opt=fresh, params=params, grads=grads, start=4)[0]

    assert all(torch.equal(a, b) for a, b in zip(resumed(drop=False), straight))
    assert not all(torch.equal(a, b) for a, b in zip(resumed(drop=True), straight))


def test_a_skipped_refresh_keeps_the_previous_gamma():
    """A NaN gradient on a refresh step (step 4) leaves γ as the refresh of step 1 measured it. Control: the same
    step with finite gradients changes it."""
    params, grads = params_and_grads(4)
    _, opt = run(3, params=params, grads=grads)
    before = [opt.state[p]["refresh_scales"].clone() for p in params]
    grads[3][0][0, 0] = float("nan")
    run(4, opt=opt, params=params, grads=grads, start=3)
    assert opt.nonfinite_steps_skipped == 1
    assert all(torch.equal(opt.state[p]["refresh_scales"], b) for p, b in zip(params, before))
    params, grads = params_and_grads(4)
    _, opt = run(4, params=params, grads=grads)
    assert not any(torch.equal(opt.state[p]["refresh_scales"], b) for p, b in zip(params, before))


def test_auto_gamma_with_the_adaptive_schedule_and_layer_wise_groups():
    """Each matrix holds its own γ (adaptive: from its own refreshes); a fixed-γ group beside an auto one keeps its
    number and measures nothing. Control: measure_scales (what OptimizerTelemetry sets) makes it measure."""
    gen = torch.Generator().manual_seed(0)
    auto = [torch.randn(s, generator=gen).requires_grad_() for s in SHAPES]
    fixed = [torch.randn(16, 16, generator=gen).requires_grad_()]
    groups = [{"params": auto, "rownorm_scale": "auto", "schedule": "adaptive"}, {"params": fixed}]
    opt = PeriodicRowwiseMuon(groups, lr=0.02, period=3, ns_dtype="float32", drift_threshold=0.05, max_period=4)
    for _ in range(6):
        for p in auto + fixed:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    scales = [opt.state[p]["refresh_scales"] for p in auto]
    assert all(s.shape == (2,) and (s > 0).all() for s in scales) and len({tuple(s.tolist()) for s in scales}) == 3
    assert "refresh_scales" not in opt.state[fixed[0]]
    opt.measure_scales = True
    for _ in range(3):
        for p in auto + fixed:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    assert (opt.state[fixed[0]]["refresh_scales"] > 0).all()


def test_a_wrong_rownorm_scale_names_the_choices():
    with pytest.raises(ValueError, match="auto_rms"):
        PeriodicRowwiseMuon([torch.zeros(4, 4, requires_grad=True)], rownorm_scale="automatic")
    with pytest.raises(ValueError, match="auto_scale_multiplier"):
        PeriodicRowwiseMuon([torch.zeros(4, 4, requires_grad=True)], rownorm_scale="auto", auto_scale_multiplier=-1)
