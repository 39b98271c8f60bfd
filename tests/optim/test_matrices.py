"""Matrices that are not nn.Linear's (out, in): a transformers Conv1D's (in, out) weight, fused projections cut into
pieces, 3-D expert weights — each equal to the same steps on the plain matrices it stands for, dense and sharded."""

import pytest
import torch
from dist_workers import LAYOUT_CASES, layout_dense_run, layout_sharded_run
from helpers import run_distributed
from torch import nn
from transformers.pytorch_utils import Conv1D

from lightning_muon import PeriodicRowwiseMuon, muon_param_groups
from lightning_muon.optim.matrices import MatrixLayout

STEPS = 4  # K = 3: refresh, RowNorm, RowNorm, refresh
OPTIONS = dict(lr=0.05, period=3, weight_decay=0.01, ns_dtype=torch.float32)


def run(groups, grads_of, steps=STEPS, **options):
    """Step ``groups`` (param groups with their tensors) with ``grads_of(t)`` -> one gradient per parameter."""
    params = [p for g in groups for p in g["params"]]
    opt = PeriodicRowwiseMuon(groups, **{**OPTIONS, **options})
    for t in range(steps):
        for p, g in zip(params, grads_of(t)):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params]


def gradients(shapes, seed=1):
    g = torch.Generator().manual_seed(seed)
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(STEPS)]
    return lambda t: grads[t]


@pytest.mark.parametrize("shape", [(6, 6), (12, 8), (8, 12)], ids=["square", "tall", "wide"])
@pytest.mark.parametrize("adjust_lr", ["original", "spectral_unclamped"])
def test_conv1d_equals_linear_on_the_transpose(shape, adjust_lr):
    """A Conv1D holding W^T takes the steps an nn.Linear holding W takes (gradients transposed); control: the same
    Conv1D taken as the (in, out) matrix it stores — the shape factor of (in, out), RowNorm across the wrong axis of a
    square weight — does not."""
    out, inp = shape
    linear, conv = nn.Linear(inp, out, bias=False), Conv1D(out, inp)
    with torch.no_grad():
        conv.weight.copy_(linear.weight.T)
    grads = gradients([shape])
    options = dict(adjust_lr=adjust_lr)
    (want,) = run([{"params": [linear.weight]}], grads, **options)
    groups = muon_param_groups(conv, select="hidden", require_muon=False, overrides={"weight": {"use_muon": True}})
    groups = [g for g in groups if g["use_muon"]]  # the bias has no gradient here
    assert groups[0]["transposed"] is True and groups[0]["param_names"] == ["weight"]
    (got,) = run(groups, lambda t: [grads(t)[0].T], **options)
    torch.testing.assert_close(got.T, want, rtol=1e-5, atol=1e-6)
    conv_as_stored = nn.Parameter(linear.weight.detach().T.clone())
    (wrong,) = run([{"params": [conv_as_stored]}], lambda t: [grads(t)[0].T], **options)
    if shape != (8, 12) or adjust_lr != "original":  # a wide Linear is a tall Conv1D: s = 1 both ways
        assert not torch.allclose(wrong.T, want, rtol=1e-3, atol=1e-4)


def split_run(weight, grads, cut, **options):
    """The reference: each piece an independent matrix (its own param, its own gradient slices)."""
    pieces = [nn.Parameter(p.clone()) for p in cut(weight)]
    stepped = run([{"params": pieces}], lambda t: cut(grads(t)[0]), **options)
    return stepped


@pytest.mark.parametrize(
    ("shape", "layout", "cut"),
    [
        ((12, 4), MatrixLayout(pieces=3), lambda w: list(w.chunk(3, 0))),  # fused QKV (3d, d)
        ((12, 8), MatrixLayout(pieces=6), lambda w: list(w.chunk(6, 0))),  # per head: 3 x 2 heads of (2, 8)
        ((4, 12), MatrixLayout(True, 3), lambda w: [c.T for c in w.chunk(3, 1)]),  # GPT-2 c_attn (d, 3d)
        ((3, 6, 4), MatrixLayout(), lambda w: list(w.unbind(0))),  # experts (E, out, in), tall
        ((2, 3, 5), MatrixLayout(), lambda w: list(w.unbind(0))),  # experts, wide
        ((2, 6, 4), MatrixLayout(pieces=2), lambda w: [p for e in w.unbind(0) for p in e.chunk(2, 0)]),
    ],
    ids=["qkv", "heads", "conv1d-qkv", "experts-tall", "experts-wide", "experts-pieces"],
)
@pytest.mark.parametrize("extra", [{}, {"rownorm_scale": 0.3, "adjust_lr": "spectral_unclamped"}], ids=["default", "s"])
def test_pieces_and_experts_equal_separate_matrices(shape, layout, cut, extra):
    """NS5 per piece, RowNorm per piece (rows of each piece; columns of each tall expert), the shape factor of a
    piece. Control: the same weight as one matrix (no pieces; experts flattened to one (E·out, in) matrix)."""
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    grads = gradients([shape])
    want = split_run(weight, grads, cut, **extra)
    fused = nn.Parameter(weight.clone())
    group = {"params": [fused], "transposed": layout.transposed, "pieces": layout.pieces}
    (got,) = run([group], grads, **extra)
    for g, w in zip(cut(got), want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    whole = nn.Parameter(weight.clone().reshape(-1, shape[-1]))
    (one,) = run([{"params": [whole]}], lambda t: [grads(t)[0].reshape(-1, shape[-1])], **extra)
    assert not all(torch.allclose(g, w, rtol=1e-3, atol=1e-4) for g, w in zip(cut(one.reshape(shape)), want))


def test_layout_errors_name_the_parameter_and_the_fix():
    with pytest.raises(ValueError, match=r"not divisible into pieces=3"):
        PeriodicRowwiseMuon([{"params": [nn.Parameter(torch.randn(8, 4))], "pieces": 3}])
    with pytest.raises(ValueError, match=r"taller than wide.*use pieces=1"):
        PeriodicRowwiseMuon([{"params": [nn.Parameter(torch.randn(16, 4))], "pieces": 2}])
    with pytest.raises(ValueError, match=r"Unknown option\(s\) \['pieces'\] for a AdamW group"):
        PeriodicRowwiseMuon([{"params": [nn.Parameter(torch.randn(4))], "use_muon": False, "pieces": 2}])
    with pytest.raises(ValueError, match=r"is not a 2-D matrix \(4-D\)"):
        PeriodicRowwiseMuon([nn.Parameter(torch.randn(2, 2, 2, 2))])


def test_a_state_dict_from_another_layout_is_refused():
    """The layout is the model's fact: a state saved for a Conv1D grouping does not load into a Linear one."""
    w = nn.Parameter(torch.randn(6, 6))
    saved = PeriodicRowwiseMuon([{"params": [w], "transposed": True}])
    w.grad = torch.randn(6, 6)
    saved.step()
    fresh = PeriodicRowwiseMuon([{"params": [w]}])
    with pytest.raises(ValueError, match=r"saved with \{'transposed': True\}.*another parameter grouping"):
        fresh.load_state_dict(saved.state_dict())
    same = PeriodicRowwiseMuon([{"params": [w], "transposed": True}])
    same.load_state_dict(saved.state_dict())
    assert same.param_groups[0]["transposed"] is True


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def sharded_layouts(request):
    return run_distributed(layout_sharded_run, request.param)


@pytest.mark.distributed
@pytest.mark.parametrize("case", range(len(LAYOUT_CASES)), ids=lambda c: "-".join(LAYOUT_CASES[c]))
def test_layouts_sharded_equal_dense(sharded_layouts, case):
    """FSDP2 shards stored dim 0 — a Conv1D's inputs (its RowNorm sums then cross ranks), a fused weight's rows across
    piece boundaries, an MoE weight's experts (3 over 2 ranks: uneven; 2 over 3: an empty shard) — and the sharded
    steps equal the dense ones, gather and scatter, fixed and auto γ."""
    dense = layout_dense_run(*LAYOUT_CASES[case])
    for rank_results in sharded_layouts:
        for got, want in zip(rank_results[case], dense):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
