"""``PeriodicRowwiseMuon(period=1)`` against torch's own optimizer test matrix (``optim_db``): every sample input of
``torch.optim.Muon`` and ``torch.optim.AdamW`` that has an equivalent gives bit-identical weights — at the usual
gradient scale and at 1e-9 — and every error input raises the same exception type, except the differences listed
(and reasoned) below; the test fails if that list is wrong in either direction."""

import inspect

import pytest
import torch

pytest.importorskip("expecttest")  # torch.testing._internal needs it
from torch.testing._internal.common_optimizers import OptimizerErrorEnum, optim_db  # noqa: E402

from lightning_muon import PeriodicRowwiseMuon  # noqa: E402

INFO = {info.optim_cls: info for info in optim_db if info.optim_cls in (torch.optim.Muon, torch.optim.AdamW)}
#: AdamW options PeriodicRowwiseMuon's AdamW branch does not implement: its inputs have no equivalent.
NO_EQUIVALENT = ("amsgrad", "maximize", "capturable", "differentiable", "fused")
#: sample inputs equal to rounding rather than bit for bit, with the reason
WITHIN_ROUNDING = {
    "Tensor lr": "a tensor lr stays on the device (no host synchronization per step): decay and scale are rounded "
    "in float32 there, where torch reads lr.item() and applies it as a Python scalar",
}
#: error inputs where we differ from torch on purpose, with the reason
DIFFERENCES = {
    "a param group cannot have duplicate parameters": "torch warns (UserWarning); we raise ValueError: a duplicate "
    "would be stepped twice per step",
    "lr as Tensor doesn't work with foreach & not capturable": "accepted: our foreach path takes a tensor lr",
    r"betas\[0\] as a Tensor is not supported for capturable=False and foreach=True": "accepted: tensor betas are "
    "read as Python numbers once per step",
    "only support 2D parameters": "accepted: a 3-D weight is E expert matrices (E, out, in), one NS5 and one RowNorm "
    "per expert (lightning_muon.optim.matrices.MatrixLayout)",
}
SHAPES = [(8, 4), (4, 8), (6, 6), (8, 4), (0, 5)]  # a repeated shape (batched NS) and an empty matrix


def defaults(cls):
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items() if p.default is not p.empty}


def ours(cls, params, kwargs):
    """The PeriodicRowwiseMuon equivalent of ``cls(params, **kwargs)``: vanilla Muon (K=1, bf16 NS as torch's) or
    AdamW groups."""
    k = {**defaults(cls), **kwargs}
    if cls is torch.optim.Muon:
        return PeriodicRowwiseMuon(
            params,
            period=1,
            lr=k["lr"],
            weight_decay=k["weight_decay"],
            momentum=k["momentum"],
            nesterov=k["nesterov"],
            ns_coefficients=k["ns_coefficients"],
            ns_eps=k["eps"],
            ns_steps=k["ns_steps"],
            adjust_lr=k["adjust_lr_fn"] or "original",
            ns_dtype=torch.bfloat16,
        )
    if isinstance(params, list):  # anything else (a bare tensor) goes in as given, to be refused as torch does
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        params = [{**g, "use_muon": False} for g in groups]
    return PeriodicRowwiseMuon(
        params, lr=k["lr"], betas=k["betas"], eps=k["eps"], weight_decay=k["weight_decay"], foreach=k["foreach"]
    )


def sample_inputs(cls):
    inputs = INFO[cls].optim_inputs_func("cpu", torch.float32)
    assert inputs, "optim_db gave no input: the test would pass vacuously"
    return [pytest.param(cls, i, id=f"{cls.__name__}-{i.desc}") for i in inputs]


def equivalent(cls, optim_input):
    return cls is torch.optim.Muon or not any(optim_input.kwargs.get(k) for k in NO_EQUIVALENT)


@pytest.mark.parametrize("scale", [1.0, 1e-9])
@pytest.mark.parametrize(("cls", "optim_input"), sample_inputs(torch.optim.Muon) + sample_inputs(torch.optim.AdamW))
def test_every_optim_db_sample_input_is_bit_identical(cls, optim_input, scale):
    if not equivalent(cls, optim_input):
        pytest.skip(f"no equivalent: {sorted(k for k in NO_EQUIVALENT if optim_input.kwargs.get(k))}")
    shapes = SHAPES if cls is torch.optim.Muon else [*SHAPES, (7,)]
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) for s in shapes]
    theirs, mine = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    reference = cls(theirs, **optim_input.kwargs)
    optimizer = ours(cls, mine, optim_input.kwargs)
    for _ in range(6):
        for a, b in zip(theirs, mine):
            a.grad = torch.randn(a.shape, generator=g) * scale
            b.grad = a.grad.clone()
        reference.step()
        optimizer.step()
    for a, b in zip(theirs, mine):
        if optim_input.desc in WITHIN_ROUNDING:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a, b), (optim_input.desc, tuple(a.shape), (a - b).abs().max().item())
    assert any(not torch.equal(a, s) for a, s in zip(theirs, start))  # the steps moved something


def test_a_one_percent_coefficient_change_breaks_bit_identity():
    """The control: the comparison above sees a change far smaller than any bug would make."""
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=g) for s in SHAPES]
    theirs, mine = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    reference = torch.optim.Muon(theirs)
    optimizer = ours(torch.optim.Muon, mine, {"ns_coefficients": (3.4445, -4.7750, 2.0315 * 1.0001)})
    for a, b in zip(theirs, mine):
        a.grad = torch.randn(a.shape, generator=g)
        b.grad = a.grad.clone()
    reference.step()
    optimizer.step()
    assert not all(torch.equal(a, b) for a, b in zip(theirs, mine))


def error_inputs(cls):
    inputs = INFO[cls].optim_error_inputs_func("cpu", torch.float32)
    return [pytest.param(cls, e, id=f"{cls.__name__}-{e.optimizer_error_input.desc}") for e in inputs]


def raised(fn):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "error" of the duplicate-parameter input is a UserWarning
        try:
            fn()
        except Exception as err:
            return type(err)
    return None


@pytest.mark.parametrize(("cls", "error_input"), error_inputs(torch.optim.Muon) + error_inputs(torch.optim.AdamW))
def test_every_optim_db_error_input_raises_the_same_type(cls, error_input):
    optim_input = error_input.optimizer_error_input
    kwargs = optim_input.kwargs

    def params():
        return optim_input.params if optim_input.params is not None else [torch.nn.Parameter(torch.randn(2, 3))]

    def construct_and_step(build):
        optimizer = build()
        for group in optimizer.param_groups:
            for p in group["params"]:
                p = p[1] if isinstance(p, tuple) else p
                if p.grad is None:
                    p.grad = torch.rand_like(p)
        optimizer.step()

    theirs = raised(lambda: construct_and_step(lambda: cls(params(), **kwargs)))
    assert theirs is not None and issubclass(theirs, error_input.error_type)
    mine = raised(lambda: construct_and_step(lambda: ours(cls, params(), kwargs)))
    if optim_input.desc in DIFFERENCES:
        assert mine is not theirs, f"no longer differs: remove it from DIFFERENCES ({DIFFERENCES[optim_input.desc]})"
    else:
        assert mine is theirs, optim_input.desc
    assert error_input.error_on in (OptimizerErrorEnum.CONSTRUCTION_ERROR, OptimizerErrorEnum.STEP_ERROR)
