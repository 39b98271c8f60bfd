"""PeriodicRowwiseMuon refuses bad input with a message naming it: hyperparameters, groups, gradients."""

import pytest
import torch

from lightning_muon import PeriodicRowwiseMuon


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"period": 0}, "period"),
        ({"period": 1.5}, "period"),
        ({"lr": -1.0}, "lr must be"),
        ({"rownorm_scale": -0.1}, "rownorm_scale"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"adjust_lr": "spectral"}, "adjust_lr"),
        ({"ns_dtype": "float16"}, "ns_dtype"),
        ({"ns_steps": 0}, "positive integer"),
        ({"betas": (0.9, 1.0)}, None),  # only checked on AdamW groups: Muon group builds fine
    ],
)
def test_bad_hyperparameters(kwargs, message):
    params = [torch.nn.Parameter(torch.randn(4, 4))]
    if message is None:
        PeriodicRowwiseMuon(params, **kwargs)
        with pytest.raises(ValueError, match="betas"):
            PeriodicRowwiseMuon([{"params": params, "use_muon": False}], **kwargs)
        return
    with pytest.raises(ValueError, match=message):
        PeriodicRowwiseMuon(params, **kwargs)


def test_unknown_group_option_and_duplicates():
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match="Unknown option"):
        PeriodicRowwiseMuon([{"params": [p], "use_muon": False, "period": 3}])
    with pytest.raises(ValueError, match="appears twice"):
        PeriodicRowwiseMuon([p, p])
    with pytest.raises(ValueError, match="more than one parameter group"):
        PeriodicRowwiseMuon([{"params": [p]}, {"params": [p]}])


def test_non_matrix_in_muon_group_names_the_parameter():
    with pytest.raises(ValueError, match=r"'block.bias' \(4,\) is in a Muon group but is not a 2-D matrix"):
        PeriodicRowwiseMuon(
            [
                ("block.weight", torch.nn.Parameter(torch.randn(4, 4))),
                ("block.bias", torch.nn.Parameter(torch.randn(4))),
            ]
        )


def test_sparse_and_complex_gradients_are_rejected():
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = PeriodicRowwiseMuon([p])
    p.grad = torch.randn(4, 4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    q = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    opt = PeriodicRowwiseMuon([q])
    q.grad = torch.randn(4, 4, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="complex"):
        opt.step()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_raises_with_name_or_skips(bad):
    good, broken = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.randn(3))
    groups = [{"params": [("w", good)]}, {"params": [("norm.bias", broken)], "use_muon": False}]
    opt = PeriodicRowwiseMuon(groups, nonfinite="raise")
    good.grad, broken.grad = torch.randn(4, 4), torch.tensor([0.0, bad, 1.0])
    before, before_b = good.detach().clone(), broken.detach().clone()
    with pytest.raises(FloatingPointError, match="'norm.bias'"):
        opt.step()
    assert torch.equal(good, before)  # nothing was updated, not even the finite group

    opt = PeriodicRowwiseMuon(groups)  # default: skipped on the device, every write an identity
    opt.step()
    assert opt.nonfinite_steps_skipped == 1 and torch.equal(good, before) and torch.equal(broken, before_b)
    assert all(torch.equal(t, torch.zeros_like(t)) for s in opt.state.values() for k, t in s.items() if k != "step")
    broken.grad = torch.ones(3)
    good.grad = torch.randn(4, 4)
    opt.step()
    assert not torch.equal(good, before) and opt.nonfinite_steps_skipped == 1
    assert [g["step"] for g in opt.param_groups] == [2, 2]  # a skipped step still counts in the schedule

    opt = PeriodicRowwiseMuon(groups, nonfinite="ignore")  # checks nothing, as torch's optimizers
    broken.grad = torch.tensor([0.0, bad, 1.0])
    opt.step()
    assert not broken.isfinite().all()


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_nonfinite_gradient_on_a_rownorm_step_leaves_state_untouched(mode):
    """RowNorm steps detect NaN through their row statistics, before momentum or weights are written."""
    wide, tall = torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(8, 4))
    opt = PeriodicRowwiseMuon([("wide", wide), ("tall", tall)], period=3, nonfinite=mode, weight_decay=0.1)
    wide.grad, tall.grad = torch.randn(4, 8), torch.randn(8, 4)
    opt.step()  # refresh
    snapshot = [t.clone() for t in (wide, tall, opt.state[tall]["momentum_buffer"], opt.state[wide]["momentum_buffer"])]
    wide.grad, tall.grad = torch.randn(4, 8), torch.randn(8, 4)
    tall.grad[5, 2] = float("nan")
    if mode == "raise":
        with pytest.raises(FloatingPointError, match="'tall'"):
            opt.step()
    else:
        opt.step()
        assert opt.nonfinite_steps_skipped == 1
    after = (wide, tall, opt.state[tall]["momentum_buffer"], opt.state[wide]["momentum_buffer"])
    for before, now in zip(snapshot, after):
        assert torch.equal(before, now)
