"""Opt-in orthogonalizers (Polar Express schedules, AOL preconditioning, Gram-space Newton–Schulz) against
independent float64 references, their FLOP counts against counted matmuls, and the optimizer options."""

import pytest
import torch
from references import reference_ns as reference
from torch.utils.flop_counter import FlopCounterMode

from lightning_muon import PeriodicRowwiseMuon
from lightning_muon.optim.kernels import (
    DEFAULT_NS_COEFFICIENTS,
    POLAR_EXPRESS_COEFFICIENTS,
    make_orthogonalizer,
    newton_schulz,
    ns_flops,
)

F64 = torch.float64


def ill_conditioned(m, n, cond, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = min(m, n)
    U = torch.linalg.qr(torch.randn(m, p, generator=g, dtype=F64))[0]
    V = torch.linalg.qr(torch.randn(n, p, generator=g, dtype=F64))[0]
    return U @ torch.diag(torch.logspace(0, -torch.tensor(cond).log10().item(), p, dtype=F64)) @ V.T


SHAPES = [(16, 64), (64, 16), (24, 144), (3, 20, 120)]
RECIPES = {
    "jordan": dict(steps=5, coefficients="jordan"),
    "polar_express": dict(steps=5, coefficients="polar_express"),
    "turbo_muon": dict(steps=4, coefficients="turbo_muon", normalize="aol"),
}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_recipes_match_independent_reference(recipe, shape):
    """Each recipe equals the textbook loop with its coefficients, safety factor and AOL; a wrong safety factor or
    no AOL (the control) does not."""
    kw = RECIPES[recipe]
    G = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    triples = {
        "jordan": [DEFAULT_NS_COEFFICIENTS] * 5,
        "polar_express": POLAR_EXPRESS_COEFFICIENTS,
        "turbo_muon": POLAR_EXPRESS_COEFFICIENTS[1:],
    }[recipe]
    safety, aol = (1.0, False) if recipe == "jordan" else (1.02, recipe == "turbo_muon")
    out = newton_schulz(G, dtype=F64, **kw).reshape(-1, *shape[-2:])
    want = torch.stack([reference(g, triples, safety, aol) for g in G.reshape(-1, *shape[-2:])])
    torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
    control = torch.stack([reference(g, triples, 1.0 if safety != 1.0 else 1.02, aol) for g in G.reshape(out.shape)])
    assert (out - control).abs().max() > 1e-4


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gram_iteration_equals_standard(recipe, shape):
    """Gram-space Newton–Schulz (with its restart) is the same polynomial of X: equal in float64 to 1e-9, on shapes
    where it is really used; perturbing one coefficient by 1e-4 (the control) is seen."""
    kw = RECIPES[recipe]
    assert make_orthogonalizer(method="gram", steps=kw["steps"]).uses_gram(shape)
    G = torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(2))
    gram = newton_schulz(G, dtype=F64, method="gram", **kw)
    torch.testing.assert_close(gram, newton_schulz(G, dtype=F64, **kw), rtol=1e-9, atol=1e-9)
    ortho = make_orthogonalizer(kw["coefficients"], kw["steps"], dtype=F64, normalize=kw.get("normalize", "frobenius"))
    (a, b, c), *rest = ortho.coefficients
    perturbed = type(ortho)(((a, b, c + 1e-4), *rest), ortho.eps, F64, ortho.normalize, "gram", ortho.safety)
    assert (perturbed(G.reshape(-1, *shape[-2:]).clone()).reshape(shape) - gram).abs().max() > 1e-7


def test_gram_only_where_it_saves_flops():
    gram = make_orthogonalizer(method="gram")
    assert not gram.uses_gram((64, 64)) and not gram.uses_gram((64, 80))  # near-square: standard is cheaper
    assert gram.uses_gram((64, 256)) and gram.uses_gram((384, 64))
    assert gram.flops((1024, 4096)) / ns_flops((1024, 4096)) == pytest.approx(60 / 90)  # (8r + 28) / (20r + 10)
    G = torch.randn(48, 48, dtype=F64)
    assert torch.equal(newton_schulz(G, dtype=F64, method="gram"), newton_schulz(G, dtype=F64))


@pytest.mark.parametrize("method", ["standard", "gram"])
@pytest.mark.parametrize("normalize", ["frobenius", "aol"])
@pytest.mark.parametrize("shape", [(32, 128), (192, 32), (40, 40)], ids=str)
def test_flops_equal_counted_matmuls(method, normalize, shape):
    """``Orthogonalizer.flops`` is what torch's FLOP counter sees (AOL reuses the first Gram: no extra matmul)."""
    for steps in (4, 5):
        ortho = make_orthogonalizer("polar_express", steps, dtype=torch.float32, normalize=normalize, method=method)
        with FlopCounterMode(display=False) as counter:
            ortho(torch.randn(1, *shape))
        assert counter.get_total_flops() == ortho.flops(shape)


def test_aol_bounds_the_spectral_norm_and_turbo_muon_is_as_orthogonal_as_ns5():
    """AOL's rescaling has spectral norm <= 1 (its point: no overshoot, small singular values moved up); Turbo-Muon
    (AOL + 4 Polar Express iterations) is at least as close to orthogonal as 5 Jordan iterations on matrices whose
    rows have very different norms, in float32."""
    g = torch.Generator().manual_seed(3)
    G = torch.randn(96, 384, generator=g, dtype=F64) * torch.logspace(0, -3, 96, dtype=F64)[:, None]
    X = G / G.norm()
    D = (X @ X.T).abs().sum(1).rsqrt()
    assert torch.linalg.matrix_norm(D[:, None] * X, ord=2) <= 1 + 1e-12
    eye = torch.eye(96, dtype=F64)

    def error(ortho):
        return ((ortho @ ortho.T - eye).norm() / 96**0.5).item()

    ns5 = error(newton_schulz(G, dtype=torch.float32).double())
    turbo = error(newton_schulz(G, 4, "turbo_muon", dtype=torch.float32, normalize="aol", method="gram").double())
    assert turbo <= ns5, (turbo, ns5)
    assert error(newton_schulz(G, 4, "turbo_muon", dtype=torch.float32).double()) > turbo  # without AOL: worse


def test_optimizer_step_with_each_recipe_matches_the_formula():
    """One K=1 step: W ← W(1 - lr·wd) - lr·s·O(N) with the recipe's orthogonalizer, for gram and standard alike."""
    torch.manual_seed(4)
    W0, grad = torch.randn(24, 96, dtype=F64), torch.randn(24, 96, dtype=F64)
    for kw in RECIPES.values():
        options = dict(ns_steps=kw["steps"], ns_coefficients=kw["coefficients"], ns_normalize=kw.get("normalize"))
        options = {k: v for k, v in options.items() if v is not None}
        results = []
        for method in ("standard", "gram"):
            p = torch.nn.Parameter(W0.clone())
            p.grad = grad.clone()
            opt = PeriodicRowwiseMuon(
                [p], lr=0.1, period=1, weight_decay=0.01, ns_dtype=F64, ns_method=method, **options
            )
            opt.step()
            results.append((p.detach().clone(), opt.last_ns_flops))
        N = 0.05 * grad * 0.95 + 0.05 * grad  # β·M_1 + (1-β)·G with M_1 = (1-β)·G, β = 0.95
        want = W0 * (1 - 0.1 * 0.01) - 0.1 * newton_schulz(N, dtype=F64, **kw)
        torch.testing.assert_close(results[0][0], want, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(results[1][0], want, rtol=1e-9, atol=1e-9)
        assert results[1][1] < results[0][1]  # the gram step counted fewer FLOPs


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ns_method": "fast"}, "ns_method must be one of"),
        ({"ns_normalize": "spectral"}, "ns_normalize must be one of"),
        ({"ns_coefficients": "polar"}, "Unknown ns_coefficients preset"),
    ],
)
def test_bad_orthogonalizer_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        PeriodicRowwiseMuon([torch.nn.Parameter(torch.zeros(4, 4))], **options)


def test_preset_schedules_truncate_and_extend():
    short = make_orthogonalizer("polar_express", 3)
    assert short.coefficients == POLAR_EXPRESS_COEFFICIENTS[:3] and short.safety == 1.02
    long = make_orthogonalizer("turbo_muon", 6)
    assert long.coefficients == POLAR_EXPRESS_COEFFICIENTS[1:] + POLAR_EXPRESS_COEFFICIENTS[-1:] * 2
    assert make_orthogonalizer("jordan", 5) == make_orthogonalizer(DEFAULT_NS_COEFFICIENTS, 5)  # batched together


def test_gram_iteration_stays_bounded_in_bf16():
    """In bf16 the Gram iteration's p×p state runs in float32 unless AOL bounds the input: singular values stay below
    1.5 on an ill-conditioned matrix (with the p×p iteration in bf16 they reached 2.0 here, ~250 on digits momenta)."""
    G = ill_conditioned(128, 512, 1e4)
    for steps, coefficients, normalize in (
        (5, "jordan", "frobenius"),
        (5, "polar_express", "frobenius"),
        (4, "turbo_muon", "aol"),
    ):
        out = newton_schulz(G, steps, coefficients, dtype=torch.bfloat16, method="gram", normalize=normalize)
        assert torch.linalg.svdvals(out.double()).max() < 1.5, coefficients
