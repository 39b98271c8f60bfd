"""NS5, RowNorm and the shape factor against straightforward references."""

import math

import pytest
import torch
from references import reference_ns

from lightning_muon.optim.kernels import (
    DEFAULT_NS_COEFFICIENTS,
    newton_schulz,
    ns_flops,
    resolve_ns_coefficients,
    row_norm,
    shape_factor,
)


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32), (3, 7, 20)])
def test_newton_schulz_matches_reference(shape):
    torch.manual_seed(0)
    G = torch.randn(shape, dtype=torch.float64)
    out = newton_schulz(G, steps=5, dtype=torch.float64)
    assert out.shape == G.shape and out.dtype == torch.float64
    ref = torch.stack([reference_ns(g, [DEFAULT_NS_COEFFICIENTS] * 5) for g in G.reshape(-1, *shape[-2:])])
    torch.testing.assert_close(out.reshape(ref.shape), ref, rtol=1e-10, atol=1e-10)


def test_newton_schulz_custom_coefficient_sequence():
    torch.manual_seed(1)
    G = torch.randn(20, 30, dtype=torch.float64)
    coeffs = [(3.0, -3.2, 1.2), (2.0, -1.5, 0.5), (1.5, -0.5, 0.0)]
    torch.testing.assert_close(newton_schulz(G, 3, coeffs, dtype=torch.float64), reference_ns(G, coeffs))
    with pytest.raises(ValueError, match="3 Newton-Schulz coefficient triples for 5 steps"):
        newton_schulz(G, 5, coeffs)
    with pytest.raises(ValueError, match="positive integer"):
        resolve_ns_coefficients(DEFAULT_NS_COEFFICIENTS, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (128, 128)])
def test_newton_schulz_singular_values_in_keller_band(shape, dtype):
    """Keller's coefficients map singular values spread over two decades into roughly [0.68, 1.2] (not to 1)."""
    torch.manual_seed(2)
    m, n = shape
    p = min(m, n)
    U, V = torch.linalg.qr(torch.randn(m, p))[0], torch.linalg.qr(torch.randn(n, p))[0]
    G = U @ torch.diag(torch.logspace(-2, 0, p)) @ V.T
    S = torch.linalg.svdvals(newton_schulz(G, dtype=dtype).double())
    assert S.min() > 0.65 and S.max() < 1.25, (S.min().item(), S.max().item())


def test_newton_schulz_rejects_vectors():
    with pytest.raises(ValueError, match="needs matrices"):
        newton_schulz(torch.ones(5))


@pytest.mark.parametrize("shape", [(8, 20), (20, 8), (3, 5, 9), (3, 9, 5)])
def test_row_norm_matches_dense_formula(shape):
    torch.manual_seed(3)
    X = torch.randn(shape, dtype=torch.float64)
    out = row_norm(X)
    m, n = shape[-2:]
    dim = -1 if m <= n else -2  # the min(m, n) vectors run along the longer axis
    torch.testing.assert_close(out, X / X.norm(dim=dim, keepdim=True))
    torch.testing.assert_close(
        torch.linalg.matrix_norm(out), torch.full(shape[:-2], math.sqrt(min(m, n)), dtype=X.dtype)
    )


def test_row_norm_zero_rows_stay_zero():
    X = torch.randn(4, 10)
    X[1] = 0.0
    X[2] = 1e-12
    out = row_norm(X)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros(10))
    torch.testing.assert_close(out[0].norm(), torch.tensor(1.0))
    Xt = X.T.contiguous()  # tall: the zero vector is now a column
    assert torch.equal(row_norm(Xt)[:, 1], torch.zeros(10))


def test_shape_factor_and_flops():
    assert shape_factor((64, 16)) == 2.0 and shape_factor((16, 64)) == 1.0
    assert shape_factor((64, 16), "match_rms_adamw") == pytest.approx(0.2 * 8)
    with pytest.raises(ValueError, match="adjust_lr must be one of"):
        shape_factor((4, 4), "spectral")
    assert ns_flops((30, 10), steps=1) == 4 * 10 * 10 * 30 + 2 * 10**3 == ns_flops((10, 30), steps=1)


def compile_counts(monkeypatch, kernels, calls):
    """Graphs dynamo compiles for ``calls`` of ``kernels`` (the eager backend: dynamo's guards and recompiles are
    the same as inductor's, without a C++ compiler)."""
    import functools

    from torch._dynamo.utils import counters

    import lightning_muon.optim.fused as kernels_module

    torch._dynamo.reset()
    kernels_module.compiled_rownorm_kernels.cache_clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    counters.clear()
    try:
        calls(kernels())
    finally:
        kernels_module.compiled_rownorm_kernels.cache_clear()
    return counters["stats"]["unique_graphs"], counters["recompiles"]


def fused_steps(kernels):
    """What a run meets: wide and tall matrices of many sizes, empty and one-row shards, checked and unchecked steps,
    weight decay and none (a cosine schedule's end), changing and tensor lr, fixed and calibrated γ, cycled β."""
    from lightning_muon.optim.kernels import row_norm_dim

    sumsq_fn, update = kernels
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (32, 64), (48, 16), (40, 40), (0, 64), (1, 64), (2, 64), (96, 8)]
    for i in range(24):
        shape = shapes[i % len(shapes)]
        W, M, G = (torch.randn(shape, generator=g) for _ in range(3))
        beta = (0.95, 0.9)[i % 2]
        sumsq = sumsq_fn(M, G, beta, True, row_norm_dim(shape))
        ok = None if i % 3 else torch.tensor(True)
        decay = 1.0 if i % 4 == 0 else 1 - 0.01 * i
        scale = torch.tensor(-0.02) if i % 5 == 0 else -0.001 * (i + 1)
        gamma = torch.tensor(0.4) if i % 2 else 0.15
        update(W, M, G, sumsq, beta, True, decay, scale, 1e-7, ok, gamma)


def test_the_fused_kernels_compile_once_per_orientation_whatever_the_run_does(monkeypatch):
    """At most wide + tall for each kernel, no recompile beyond them, far inside torch's recompile limit (past it a
    step fails under ``fullgraph`` on torch 2.14, or falls back to eager silently on older torch). Control: the
    kernels compiled plainly recompile for sizes 0 and 1, the verdict, a decay of 1 and a tensor lr or γ — past the
    limit."""
    from lightning_muon.optim.fused import compiled_rownorm_kernels
    from lightning_muon.optim.kernels import rownorm_sumsq, rownorm_update_

    graphs, recompiles = compile_counts(monkeypatch, compiled_rownorm_kernels, fused_steps)
    assert graphs <= 4, recompiles
    plain = lambda: (  # noqa: E731
        torch.compile(rownorm_sumsq, dynamic=True, fullgraph=True),
        torch.compile(rownorm_update_, dynamic=True, fullgraph=True),
    )
    try:
        graphs, _ = compile_counts(monkeypatch, plain, fused_steps)
    except torch._dynamo.exc.FailOnRecompileLimitHit:  # torch 2.14 under fullgraph; older versions go eager
        graphs = float("inf")
    assert graphs > torch._dynamo.config.recompile_limit
