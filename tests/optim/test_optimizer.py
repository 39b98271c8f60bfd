"""PeriodicRowwiseMuon against independent references: torch.optim.Muon, torch.optim.AdamW, a float64 loop."""

import copy
import io
import math

import pytest
import torch
from helpers import tiny_dit

from lightning_muon import PeriodicRowwiseMuon, muon_param_groups
from lightning_muon.optim.kernels import DEFAULT_NS_COEFFICIENTS

SHAPES = [(32, 16), (16, 32), (24, 24), (32, 16), (16, 32)]  # repeated shapes exercise the batched NS5


def make_params(shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def clone_params(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def run(optimizers_and_params, steps, seed=1):
    """Step every optimizer on the same gradient sequence."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=g) for p in optimizers_and_params[0][1]]
        for opt, params in optimizers_and_params:
            for p, gr in zip(params, grads):
                p.grad = gr.clone()
            opt.step()


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


# --------------------------------------------------------------------------------------------- vanilla Muon
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_period_one_matches_torch_muon(nesterov, adjust_lr):
    ours, theirs, wrong = make_params(), make_params(), make_params()
    kwargs = dict(lr=0.02, momentum=0.9, nesterov=nesterov, weight_decay=0.1)
    runs = [
        (PeriodicRowwiseMuon(ours, period=1, adjust_lr=adjust_lr, ns_dtype=torch.bfloat16, **kwargs), ours),
        (torch.optim.Muon(theirs, adjust_lr_fn=adjust_lr, **kwargs), theirs),
        # one coefficient off by 1%: the tolerance below must catch it, or the comparison proves nothing
        (
            torch.optim.Muon(wrong, adjust_lr_fn=adjust_lr, ns_coefficients=(3.4445, -4.7750 * 1.01, 2.0315), **kwargs),
            wrong,
        ),
    ]
    run(runs, steps=20)
    tol = 1e-5
    assert max_diff(ours, theirs) <= tol
    assert max_diff(wrong, theirs) > 10 * tol


# ------------------------------------------------------------------------------------- the periodic algorithm
def reference_step(W, G, M, t, *, lr, beta, nesterov, wd, K, gamma, adjust_lr, eps=1e-7):
    """The update rule (docs/optimizer.md) in float64 on one matrix, independent of the library's kernels."""
    M = beta * M + (1 - beta) * G
    N = beta * M + (1 - beta) * G if nesterov else M
    m, n = W.shape
    s = math.sqrt(max(1, m / n)) if adjust_lr == "original" else 0.2 * math.sqrt(max(m, n))
    if (t - 1) % K == 0:
        X = N.T if m > n else N
        X = X / X.norm().clamp_min(eps)
        for _ in range(5):
            a, b, c = DEFAULT_NS_COEFFICIENTS
            A = X @ X.T
            X = a * X + b * A @ X + c * A @ A @ X
        U = s * (X.T if m > n else X)
    else:
        if m <= n:
            U = gamma * s * N / N.norm(dim=1, keepdim=True)
        else:
            U = gamma * s * N / N.norm(dim=0, keepdim=True)
    return W * (1 - lr * wd) - lr * U, M


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("period", [2, 3])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_periodic_matches_float64_reference(nesterov, period, adjust_lr):
    check_against_reference(nesterov, period, adjust_lr, fused=False)


@pytest.mark.slow
@pytest.mark.parametrize("nesterov", [True, False])
def test_fused_rownorm_matches_float64_reference(nesterov):
    """The torch.compile kernels are shape- and scale-generic: one configuration per nesterov mode suffices."""
    check_against_reference(nesterov, period=3, adjust_lr="original", fused=True)


def check_against_reference(nesterov, period, adjust_lr, fused):
    hyper = dict(lr=0.05, nesterov=nesterov, wd=0.05, K=period, gamma=0.15, adjust_lr=adjust_lr)
    params = [p.double() for p in make_params()]
    params = [torch.nn.Parameter(p.detach()) for p in params]
    ref = [p.detach().clone() for p in params]
    moms = [torch.zeros_like(p) for p in ref]
    opt = PeriodicRowwiseMuon(
        params,
        lr=0.05,
        period=period,
        rownorm_scale=0.15,
        momentum=0.95,
        nesterov=nesterov,
        weight_decay=0.05,
        adjust_lr=adjust_lr,
        ns_dtype=torch.float64,
        fused=fused,
    )
    g = torch.Generator().manual_seed(5)
    for t in range(1, 13):
        grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params]
        for p, gr in zip(params, grads):
            p.grad = gr.clone()  # step() writes the Nesterov look-ahead into .grad
        opt.step()
        for i, gr in enumerate(grads):
            ref[i], moms[i] = reference_step(ref[i], gr, moms[i], t, beta=0.95, **hyper)
        torch.testing.assert_close([p.detach() for p in params], ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("period", [1, 2, 3, 5])
def test_branch_sequence(period):
    params = make_params()
    opt = PeriodicRowwiseMuon(params, lr=0.01, period=period)
    seen = []
    g = torch.Generator().manual_seed(0)
    for _ in range(12):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        seen.append(dict(opt.last_branches))
    expected = [(t - 1) % period == 0 for t in range(1, 13)]
    assert [b["refresh"] == len(params) and b["rownorm"] == 0 for b in seen] == expected
    assert [b["rownorm"] == len(params) and b["refresh"] == 0 for b in seen] == [not e for e in expected]


@pytest.mark.parametrize("shape", [(48, 16), (16, 48)])
@pytest.mark.parametrize("adjust_lr", ["original", "match_rms_adamw"])
def test_rownorm_step_has_the_predicted_frobenius_norm(shape, adjust_lr):
    """‖ΔW‖_F = lr·γ·s(m,n)·√min(m,n) on a RowNorm step (weight decay 0, no zero rows)."""
    (p,) = make_params([shape])
    lr, gamma = 0.03, 0.2
    opt = PeriodicRowwiseMuon([p], lr=lr, period=2, rownorm_scale=gamma, adjust_lr=adjust_lr)
    p.grad = torch.randn(shape)
    opt.step()  # refresh
    before = p.detach().clone()
    p.grad = torch.randn(shape)
    opt.step()  # RowNorm
    assert opt.last_branches == {"refresh": 0, "rownorm": 1}
    m, n = shape
    s = math.sqrt(max(1, m / n)) if adjust_lr == "original" else 0.2 * math.sqrt(max(m, n))
    expected = lr * gamma * s * math.sqrt(min(m, n))
    assert (p.detach() - before).norm().item() == pytest.approx(expected, rel=1e-5)


# -------------------------------------------------------------------------------------------------- AdamW
@pytest.mark.parametrize("foreach", [True, False])
def test_adamw_groups_match_torch_adamw_exactly(foreach):
    shapes = [(7,), (3, 5), (2, 3, 4), (11,)]
    ours, theirs = make_params(shapes), make_params(shapes)
    hyper = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.02)
    opt = PeriodicRowwiseMuon([{"params": ours, "use_muon": False, **hyper}], foreach=foreach)
    ref = torch.optim.AdamW(theirs, foreach=foreach, **hyper)
    run([(opt, ours), (ref, theirs)], steps=15)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_mixed_groups_and_adamw_defaults():
    muon_p, adam_p = make_params([(8, 4)]), make_params([(4,)])
    opt = PeriodicRowwiseMuon(
        [{"params": muon_p}, {"params": adam_p, "use_muon": False}],
        lr=0.02,
        adamw_lr=1e-3,
        weight_decay=0.1,
        adamw_weight_decay=0.0,
    )
    assert opt.param_groups[1]["lr"] == 1e-3 and opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.param_groups[0]["lr"] == 0.02 and "betas" not in opt.param_groups[0]
    run([(opt, muon_p + adam_p)], steps=2)
    assert set(opt.state[adam_p[0]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert set(opt.state[muon_p[0]]) == {"momentum_buffer"} and [g["step"] for g in opt.param_groups] == [2, 2]


# ------------------------------------------------------------------------------------------------- resume
def _dit_optimizer(model):
    groups = muon_param_groups(model, adamw={"lr": 1e-3})
    return PeriodicRowwiseMuon(groups, lr=0.02, period=3, weight_decay=0.01, ns_dtype="bfloat16")


def _train(model, opt, steps, start):
    for t in range(start, start + steps):
        g = torch.Generator().manual_seed(t)
        torch.manual_seed(t)  # diffusers drops class labels at random in train mode (classifier-free guidance)
        x = torch.randn(4, 4, 8, 8, generator=g)
        timestep = torch.randint(0, 1000, (4,), generator=g)
        labels = torch.randint(0, 10, (4,), generator=g)
        loss = model(x, timestep=timestep, class_labels=labels).sample.square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_resume_is_bit_identical():
    straight = tiny_dit()
    opt = _dit_optimizer(straight)
    _train(straight, opt, 20, start=0)

    first = tiny_dit()
    opt1 = _dit_optimizer(first)
    _train(first, opt1, 10, start=0)
    buffer = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": opt1.state_dict()}, buffer)
    buffer.seek(0)
    ckpt = torch.load(buffer, weights_only=True)

    resumed = tiny_dit(seed=123)  # different init: everything must come from the checkpoint
    resumed.load_state_dict(ckpt["model"])
    opt2 = _dit_optimizer(resumed)
    opt2.load_state_dict(ckpt["optimizer"])
    assert opt2.param_groups[0]["ns_dtype"] == "bfloat16"
    _train(resumed, opt2, 10, start=10)
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


def test_load_state_dict_from_other_layout_is_an_error():
    a = PeriodicRowwiseMuon([torch.nn.Parameter(torch.randn(8, 4))])
    a.param_groups[0]["params"][0].grad = torch.randn(8, 4)
    a.step()
    b = PeriodicRowwiseMuon([torch.nn.Parameter(torch.randn(4, 8))])
    with pytest.raises(ValueError, match=r"has shape \(8, 4\), expected \(4, 8\)"):
        b.load_state_dict(a.state_dict())
    c = PeriodicRowwiseMuon([{"params": [torch.nn.Parameter(torch.randn(8, 4))], "use_muon": False}])
    with pytest.raises(ValueError, match="use_muon"):
        c.load_state_dict(a.state_dict())
    d = PeriodicRowwiseMuon([torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8, 4))])
    with pytest.raises(ValueError, match="2 parameters, the saved one 1"):
        d.load_state_dict(a.state_dict())


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda sd: sd["param_groups"][0].update(period=0), "period"),
        (lambda sd: sd["param_groups"][0].update(ns_eps=0.0), "ns_eps"),
        (lambda sd: sd["param_groups"][0].update(step=-1), "step=-1"),
        (lambda sd: sd["param_groups"][0].update(step=2.5), "step=2.5"),
        (lambda sd: sd["state"][0]["momentum_buffer"].fill_(float("nan")), "not finite"),
        (lambda sd: None, None),  # control: the untouched state loads
    ],
)
def test_loaded_state_is_validated_before_use(corrupt, message):
    p = torch.nn.Parameter(torch.randn(8, 4))
    a = PeriodicRowwiseMuon([p])
    p.grad = torch.randn(8, 4)
    a.step()
    state = copy.deepcopy(a.state_dict())
    corrupt(state)
    b = PeriodicRowwiseMuon([torch.nn.Parameter(torch.randn(8, 4))])
    if message is None:
        b.load_state_dict(state)
        return
    with pytest.raises(ValueError, match=message):
        b.load_state_dict(state)


# ---------------------------------------------------------------------------------------------- schedulers
SCHEDULERS = {
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.05, 1e-3], total_steps=10),
    "CyclicLR": lambda opt: torch.optim.lr_scheduler.CyclicLR(
        opt, base_lr=[0.01, 1e-4], max_lr=[0.05, 1e-3], step_size_up=3
    ),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
    "LinearLR": lambda opt: torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_torch_lr_schedulers_drive_both_branches(name):
    """Cyclic schedulers with cycle_momentum write group["momentum"]: Muon's β and AdamW's β1 both follow it."""
    muon_p, adam_p = make_params([(8, 4)]), make_params([(4,)])
    opt = PeriodicRowwiseMuon([{"params": muon_p}, {"params": adam_p, "use_muon": False}], lr=0.02, adamw_lr=1e-3)
    scheduler = SCHEDULERS[name](opt)
    seen = []
    for _ in range(6):
        for p in muon_p + adam_p:
            p.grad = torch.randn(p.shape)
        opt.step()  # AdamW's betas[0] is set to the momentum it used
        seen.append([(g["lr"], g["momentum"], tuple(g.get("betas", (None,)))[0]) for g in opt.param_groups])
        scheduler.step()
    assert len({s[0][0] for s in seen}) > 1  # the Muon lr moved
    if name in ("OneCycleLR", "CyclicLR"):
        assert len({s[0][1] for s in seen}) > 1 and all(s[1][1] == s[1][2] for s in seen)  # momentum cycled
    assert all(torch.isfinite(p).all() for p in muon_p + adam_p)


def test_tensor_lr_equals_float_lr():
    a, b = make_params([(8, 4), (4,)]), make_params([(8, 4), (4,)])
    opts = [
        PeriodicRowwiseMuon(
            [{"params": ps[:1]}, {"params": ps[1:], "use_muon": False}],
            lr=lr,
            adamw_lr=lr,
            weight_decay=0.1,
            ns_dtype=torch.float32,
        )
        for ps, lr in ((a, 0.02), (b, torch.tensor(0.02)))
    ]
    run([(opts[0], a), (opts[1], b)], steps=4)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="lr must be a finite number"):
        PeriodicRowwiseMuon(make_params([(4, 4)]), lr=torch.tensor(-1.0))


# ------------------------------------------------------------------------------------------------ the edges
@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda sd: sd["param_groups"][0].update(period=0), "period"),
        (lambda sd: sd["param_groups"][0].update(lr=-1.0), "lr must be"),
        (lambda sd: sd["param_groups"][0].update(ns_steps=100), "below 100"),
        (lambda sd: sd["param_groups"][1].update(betas=(0.9, 1.5)), "betas"),
        (lambda sd: sd["param_groups"][0].pop("rownorm_scale"), "not saved by PeriodicRowwiseMuon"),
    ],
)
def test_a_rejected_state_dict_changes_nothing(corrupt, message):
    w, b = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))
    opt = PeriodicRowwiseMuon([{"params": [w]}, {"params": [b], "use_muon": False}], period=3, lr=0.02)
    w.grad, b.grad = torch.randn(8, 4), torch.randn(4)
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    state = copy.deepcopy(before)
    corrupt(state)
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(state)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]  # period 3, lr 0.02: nothing was written
    opt.step()  # and it still steps


def test_a_torch_muon_state_dict_is_a_clear_error():
    theirs, mine = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8, 4))
    torch_muon = torch.optim.Muon([theirs])
    theirs.grad = torch.randn(8, 4)
    torch_muon.step()
    opt = PeriodicRowwiseMuon([mine])
    with pytest.raises(ValueError, match=r"lacks \['adjust_lr', 'period', 'rownorm_scale'\].*not saved by"):
        opt.load_state_dict(torch_muon.state_dict())
    mine.grad = torch.randn(8, 4)
    opt.step()  # the optimizer is not left broken


@pytest.mark.parametrize("nonfinite", ["skip", "raise", "ignore"])
def test_bf16_weights_decay_as_torch_muon_never_faster(nonfinite):
    """100 zero-gradient steps at lr 0.02, wd 0.1: the factor 0.998 is applied in float32 and each product rounded
    to bf16, as torch.optim.Muon does (small decays are lost to rounding); a bf16-rounded factor (0.99609375) would
    shrink the weights to ~0.58."""
    w0 = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    ours, theirs = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    opt = PeriodicRowwiseMuon([ours], lr=0.02, weight_decay=0.1, ns_dtype=torch.bfloat16, nonfinite=nonfinite)
    ref = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1)
    for _ in range(100):
        ours.grad, theirs.grad = torch.zeros_like(w0), torch.zeros_like(w0)
        opt.step()
        ref.step()
    assert torch.equal(ours, theirs)
    control = w0.clone()
    for _ in range(100):
        control.mul_(torch.tensor(0.998).bfloat16())
    ratio = (control.float().norm() / w0.float().norm()).item()
    assert ratio < 0.7 and (ours.float().norm() / w0.float().norm()).item() > 0.99  # the guard is what differs


def test_overflowing_gradients_count_as_nonfinite_and_raise_names_them():
    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = PeriodicRowwiseMuon([("w", w)], period=2, nonfinite="raise")
    w.grad = torch.full((4, 4), 1e20)  # finite, but its squares overflow float32
    with pytest.raises(FloatingPointError, match="'w'.*finite, but its squares overflow"):
        opt.step()
    w.grad = torch.full((4, 4), 1e15)  # control: large but representable statistics step normally
    opt.step()
    assert w.isfinite().all()
    skip = PeriodicRowwiseMuon([w], period=2)
    w.grad = torch.full((4, 4), 1e20)
    skip.step()
    assert skip.nonfinite_steps_skipped == 1


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"ns_coefficients": (3.4, -4.7)}, "exactly 3 values"),
        ({"ns_coefficients": [(3.4, -4.7, 2.0), (3.4, -4.7)]}, "exactly 3 values"),
        ({"ns_steps": 100}, "below 100"),
        ({"betas": (0.9, torch.tensor(0.99))}, "both floats or both Tensors"),
    ],
)
def test_torch_validation_errors(kwargs, error):
    params = [{"params": [torch.nn.Parameter(torch.randn(4, 4))]}, {"params": [torch.randn(3)], "use_muon": False}]
    with pytest.raises(ValueError, match=error):
        PeriodicRowwiseMuon(params, **kwargs)


def test_tensor_betas_equal_float_betas():
    shapes = [(4,), (3, 2)]
    a, b = make_params(shapes), make_params(shapes)
    runs = [
        (PeriodicRowwiseMuon([{"params": a, "use_muon": False}], betas=(torch.tensor(0.8), torch.tensor(0.9))), a),
        (PeriodicRowwiseMuon([{"params": b, "use_muon": False}], betas=(0.8, 0.9)), b),
    ]
    run(runs, steps=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
