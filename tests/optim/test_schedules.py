"""Refresh schedules beyond one global K: layer-wise periods through param groups, and the adaptive (momentum-drift)
schedule — equivalences with fixed K, resume, rank agreement, and its telemetry."""

import io

import pytest
import torch
from dist_workers import SHAPES, full_grads, full_params, sharded_run
from helpers import run_distributed, tiny_dit

from lightning_muon import PeriodicRowwiseMuon, muon_param_groups

F64 = torch.float64


def dense_steps(shapes, steps, params=None, opt_state=None, start=0, **kwargs):
    """Dense optimizer on the shared parameters and gradients: (params, per-step refresh counts, drifts, optimizer)."""
    params = params or [torch.nn.Parameter(p.double()) for p in full_params(shapes)]
    opt = PeriodicRowwiseMuon(params, lr=0.02, weight_decay=0.01, ns_dtype=F64, **kwargs)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    refreshes, drifts = [], []
    for grads in full_grads(shapes, steps)[start:]:
        for p, g in zip(params, grads):
            p.grad = g.double()
        opt.step()
        refreshes.append(opt.last_branches["refresh"])
        drifts.append([float(opt.state[p].get("refresh_drift", torch.tensor(0.0))) for p in params])
    return params, refreshes, drifts, opt


def test_adaptive_that_never_triggers_is_fixed_k():
    """max_period=K and a threshold no drift reaches: the same branch sequence and bit-identical weights as fixed K;
    the control, a threshold that triggers, refreshes earlier."""
    fixed, fixed_refreshes, _, _ = dense_steps(SHAPES, 10, period=3)
    never, never_refreshes, drifts, _ = dense_steps(SHAPES, 10, period=3, schedule="adaptive", drift_threshold=1.99)
    assert never_refreshes == fixed_refreshes == [len(SHAPES), 0, 0] * 3 + [len(SHAPES)]
    assert max(max(d) for d in drifts) < 1.99
    assert all(torch.equal(a, b) for a, b in zip(fixed, never))
    _, triggered, _, _ = dense_steps(SHAPES, 10, period=3, schedule="adaptive", drift_threshold=0.05)
    assert triggered != fixed_refreshes


def named_grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    for _, p in sorted(model.named_parameters()):
        p.grad = torch.randn(p.shape, generator=g)


def layerwise_weights(overrides, steps=7, **kwargs):
    model = tiny_dit()
    groups = muon_param_groups(model, adamw={"lr": 1e-3}, overrides=overrides)
    opt = PeriodicRowwiseMuon(groups, lr=0.02, period=3, ns_dtype=torch.float32, **kwargs)
    for t in range(steps):
        named_grads(model, t)
        opt.step()
    return [p.detach().clone() for _, p in sorted(model.named_parameters())], opt


def test_layerwise_periods_all_at_k_equal_fixed_k():
    """K by layer type (attention, feed-forward, adaLN modulation) through muon_param_groups: all at K is fixed K bit
    for bit; attention at K=2 (the control) changes the weights and refreshes attention more often."""
    fixed, _ = layerwise_weights({})
    every = {layer: {"period": 3} for layer in ("attention", "feed_forward", "modulation")}
    same, opt = layerwise_weights(every)
    assert len([g for g in opt.param_groups if g["use_muon"]]) == 1  # identical options: one group, as fixed K
    assert all(torch.equal(a, b) for a, b in zip(fixed, same))
    changed, opt = layerwise_weights({"attention": {"period": 2}})
    assert any(not torch.equal(a, b) for a, b in zip(fixed, changed))
    counts = opt.refresh_counts()
    assert counts["transformer_blocks.0.attn1.to_q.weight"] == 4 and counts["transformer_blocks.0.ff.net.2.weight"] == 3
    muon = [g for g in opt.param_groups if g["use_muon"]]
    assert sum(counts[f"group{opt.param_groups.index(g)}"] for g in muon) == sum(
        counts[n] for g in muon for n in g["param_names"]
    )


def test_unknown_layer_type_or_bad_adaptive_options_are_named():
    with pytest.raises(ValueError, match="matched no parameter"):
        muon_param_groups(tiny_dit(), overrides={"attn_typo_xyz": {"period": 2}})
    p = [torch.nn.Parameter(torch.zeros(4, 4))]
    with pytest.raises(ValueError, match="schedule must be one of"):
        PeriodicRowwiseMuon(p, schedule="cosine")
    with pytest.raises(ValueError, match="1 <= min_period <= max_period"):
        PeriodicRowwiseMuon(p, schedule="adaptive", min_period=4, max_period=2)
    with pytest.raises(ValueError, match="drift_threshold must be in"):
        PeriodicRowwiseMuon(p, schedule="adaptive", drift_threshold=0.0)


def assert_ranks_follow_dense(results, refreshes, dense):
    """Every case on every rank: the dense refresh sequence, at most one all-reduce per step, the dense weights."""
    for rank_results in results:
        for case in rank_results:
            assert [s["branches"]["refresh"] for s in case["steps"]] == refreshes
            assert all(s["profiled"]["allreduce"] <= 1 for s in case["steps"])
            for got, want in zip(case["params"], dense):
                torch.testing.assert_close(got.double(), want.detach(), rtol=1e-4, atol=1e-5)


ADAPTIVE = dict(period=3, schedule="adaptive", drift_threshold=0.5, min_period=1, max_period=4)


def test_adaptive_resume_is_bit_identical():
    """Save after 5 steps (through torch.save / weights_only load), resume for 5 more: weights, momenta, references,
    ages, drifts and decisions equal the uninterrupted run bit for bit. Control: a resume that loses the ages
    (fresh counters) decides differently."""
    straight, straight_refreshes, _, straight_opt = dense_steps(SHAPES, 10, **ADAPTIVE)
    assert len(set(straight_refreshes)) > 2  # some matrices refresh alone: decisions really are per matrix
    first, first_refreshes, _, first_opt = dense_steps(SHAPES, 5, **ADAPTIVE)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "opt": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    params = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    resumed, resumed_refreshes, _, resumed_opt = dense_steps(
        SHAPES, 10, params=params, opt_state=saved["opt"], start=5, **ADAPTIVE
    )
    assert first_refreshes + resumed_refreshes == straight_refreshes
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    for p, q in zip(straight, resumed):
        for key, value in straight_opt.state[p].items():
            assert torch.equal(value, resumed_opt.state[q][key]), key
    assert resumed_opt.refresh_counts() == straight_opt.refresh_counts()

    for state in saved["opt"]["state"].values():
        state["refresh_age"] = torch.tensor(-1)
    params = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
    _, control, _, _ = dense_steps(SHAPES, 10, params=params, opt_state=saved["opt"], start=5, **ADAPTIVE)
    assert first_refreshes + control != straight_refreshes


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_adaptive_decisions_agree_across_ranks_with_no_extra_collective(world):
    """FSDP2 shards (uneven; an empty one at 3 ranks) in both refresh modes: every rank takes the dense run's
    per-matrix decisions and ends with its weights; RowNorm statistics, drift sums and the NaN flag share ONE
    all-reduce per step (none is added for the schedule)."""
    cases = [(3, mode, torch.float32, {k: v for k, v in ADAPTIVE.items() if k != "period"}) for mode in ("gather",)]
    cases.append((3, "scatter", torch.float32, cases[0][3]))
    results = run_distributed(sharded_run, world, SHAPES, cases, 8)
    dense, refreshes, drifts, _ = dense_steps(SHAPES, 8, **ADAPTIVE)
    margin = min(abs(d - ADAPTIVE["drift_threshold"]) for step in drifts for d in step if d)
    assert margin > 1e-3  # no decision is a rounding coin-flip between the dense and the sharded sums
    assert_ranks_follow_dense(results, refreshes, dense)


WARMUP = dict(period=3, refresh_warmup=4)


@pytest.mark.parametrize("schedule", ["fixed", "adaptive"])
def test_refresh_warmup_refreshes_every_step_then_hands_over_to_the_schedule(schedule):
    """The first ``refresh_warmup`` steps all refresh and are vanilla Muon (K = 1) bit for bit; then the schedule
    takes over — fixed K keeps its phase ((t − 1) mod K = 0: steps 7 and 10), adaptive goes on from age 1.
    ``refresh_counts`` follows. Control: without the warm-up, the first steps are not Muon's."""
    n = len(SHAPES)
    options = dict(WARMUP, schedule=schedule) | (
        {"max_period": 3, "drift_threshold": 1.99} if schedule == "adaptive" else {}
    )
    warm, refreshes, _, opt = dense_steps(SHAPES, 10, **options)
    assert refreshes == [n] * 4 + [0, 0, n, 0, 0, n]
    assert opt.refresh_counts()["group0"] == 6 * n
    muon, _, _, _ = dense_steps(SHAPES, 4, period=1)
    first, _, _, _ = dense_steps(SHAPES, 4, **options)
    assert all(torch.equal(a, b) for a, b in zip(muon, first))
    cold, _, _, _ = dense_steps(SHAPES, 4, period=3, schedule=schedule)
    assert not all(torch.equal(a, b) for a, b in zip(muon, cold))


def test_refresh_warmup_resumes_from_its_checkpoint():
    """Saved inside the warm-up (step 2 of 4), resumed for 8 more: the refresh sequence, weights and refresh counts
    of the uninterrupted run. The warm-up is the checkpoint's (a group option, like K): control — a state dict whose
    groups lost ``refresh_warmup`` resumes without it and differs."""
    straight, straight_refreshes, _, straight_opt = dense_steps(SHAPES, 10, **WARMUP)
    first, first_refreshes, _, first_opt = dense_steps(SHAPES, 2, **WARMUP)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "opt": first_opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    def resume(opt_state):
        params = [torch.nn.Parameter(p.clone()) for p in saved["params"]]
        return dense_steps(SHAPES, 10, params=params, opt_state=opt_state, start=2, **WARMUP)

    resumed, resumed_refreshes, _, resumed_opt = resume(saved["opt"])
    assert first_refreshes + resumed_refreshes == straight_refreshes
    assert all(torch.equal(a, b) for a, b in zip(straight, resumed))
    assert resumed_opt.refresh_counts() == straight_opt.refresh_counts()
    for group in saved["opt"]["param_groups"]:
        del group["refresh_warmup"]
    control, control_refreshes, _, _ = resume(saved["opt"])
    assert first_refreshes + control_refreshes != straight_refreshes
    assert not all(torch.equal(a, b) for a, b in zip(straight, control))


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3])
def test_refresh_warmup_sharded_equals_dense_with_no_extra_collective(world):
    """FSDP2 shards (uneven; an empty one at 3 ranks), fixed and adaptive, gather and scatter: every rank takes the
    dense run's refresh sequence (warm-up included) with at most one all-reduce per step, and ends with its weights.
    Control: the dense run without the warm-up is not within the tolerance."""
    adaptive = {"refresh_warmup": 4, "schedule": "adaptive", "drift_threshold": 1.99, "max_period": 3}
    cases = [
        (3, mode, torch.float32, extra) for mode in ("gather", "scatter") for extra in ({"refresh_warmup": 4}, adaptive)
    ]
    results = run_distributed(sharded_run, world, SHAPES, cases, 8)
    dense, refreshes, _, _ = dense_steps(SHAPES, 8, **WARMUP)
    assert refreshes == [len(SHAPES)] * 4 + [0, 0, len(SHAPES), 0]
    cold, _, _, _ = dense_steps(SHAPES, 8, period=3)
    assert not all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(cold, dense))
    assert_ranks_follow_dense(results, refreshes, dense)


def test_refresh_warmup_must_be_a_whole_number_of_steps():
    p = [torch.nn.Parameter(torch.zeros(4, 4))]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="refresh_warmup .* must be an integer >= 0"):
            PeriodicRowwiseMuon(p, refresh_warmup=bad)
