"""Pure formulas of the generation-quality metrics: Fréchet distance, PRDC (Naeem et al. 2020) and RBF MMD (CMMD)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["frechet_distance", "gaussian_from_sums", "mmd", "prdc"]


def gaussian_from_sums(feature_sum: Tensor, outer_sum: Tensor, n: int | Tensor) -> tuple[Tensor, Tensor]:
    r"""Mean and unbiased covariance from :math:`\sum x` and :math:`\sum x x^\top` over ``n`` samples (float64)."""
    n = int(n)
    if n < 2:
        raise ValueError(f"A Fréchet distance needs at least 2 samples per distribution, got {n}.")
    mu = feature_sum.double() / n
    sigma = (outer_sum.double() - n * torch.outer(mu, mu)) / (n - 1)
    return mu, sigma


def frechet_distance(mu1: Tensor, sigma1: Tensor, mu2: Tensor, sigma2: Tensor) -> Tensor:
    r"""Fréchet distance between two Gaussians, in float64:

    .. math::
        d^2 = \lVert\mu_1-\mu_2\rVert^2 + \operatorname{tr}\Sigma_1 + \operatorname{tr}\Sigma_2
              - 2\operatorname{tr}\big(\Sigma_1^{1/2}\Sigma_2\Sigma_1^{1/2}\big)^{1/2}

    The trace term uses the symmetric PSD matrix :math:`\Sigma_1^{1/2}\Sigma_2\Sigma_1^{1/2}`, whose eigenvalues are
    those of :math:`\Sigma_1\Sigma_2`: two symmetric eigendecompositions, no complex ``eig``, no ``sqrtm``.
    Eigenvalues that round below zero are clamped.
    """
    mu1, mu2, sigma1, sigma2 = (t.double() for t in (mu1, mu2, sigma1, sigma2))
    if mu1.shape != mu2.shape or sigma1.shape != sigma2.shape or sigma1.shape != (mu1.numel(), mu1.numel()):
        raise ValueError(
            f"Shapes do not match: mu {tuple(mu1.shape)} / {tuple(mu2.shape)}, "
            f"sigma {tuple(sigma1.shape)} / {tuple(sigma2.shape)}."
        )
    evals1, evecs1 = torch.linalg.eigh(sigma1)
    root1 = (evecs1 * evals1.clamp_min(0).sqrt()) @ evecs1.T
    inner = root1 @ sigma2 @ root1
    trace_sqrt = torch.linalg.eigvalsh((inner + inner.T) / 2).clamp_min(0).sqrt().sum()
    return (mu1 - mu2).square().sum() + sigma1.trace() + sigma2.trace() - 2 * trace_sqrt


def _sq_dists(a: Tensor, b: Tensor, a_sq: Tensor, b_sq: Tensor) -> Tensor:
    """Squared Euclidean distances ``(len(a), len(b))`` as ‖b‖² − 2ab + ‖a‖²: one ``addmm`` and one in-place add."""
    return torch.addmm(b_sq[None, :], a, b.T, alpha=-2).add_(a_sq[:, None])


def _merge_smallest(best: Tensor, candidates: Tensor) -> Tensor:
    """Row-wise ``best.shape[1]`` smallest of ``best`` and ``candidates`` together."""
    return torch.cat([best, candidates], 1).topk(best.shape[1], dim=1, largest=False).values


def _kth_neighbour_sq_radii(x: Tensor, k: int, chunk: int) -> Tensor:
    """Squared distance of each row of ``x`` to its k-th nearest other row (the row itself is the 0-th).

    Distances are symmetric, so only blocks (i, j ≥ i) are computed; each serves the rows of i (top-k along
    columns) and of j (top-k along rows), with running top-(k+1) lists merged per block: half the matmuls.
    """
    n, x_sq = len(x), x.square().sum(1)
    best = torch.full((n, k + 1), float("inf"), dtype=x.dtype, device=x.device)
    for i in range(0, n, chunk):
        for j in range(i, n, chunk):
            d = _sq_dists(x[i : i + chunk], x[j : j + chunk], x_sq[i : i + chunk], x_sq[j : j + chunk])
            best[i : i + chunk] = _merge_smallest(
                best[i : i + chunk], d.topk(min(k + 1, d.shape[1]), dim=1, largest=False).values
            )
            if j != i:
                col = d.topk(min(k + 1, d.shape[0]), dim=0, largest=False).values.T
                best[j : j + chunk] = _merge_smallest(best[j : j + chunk], col)
    return best[:, k].clamp_min(0)


def prdc(
    real: Tensor, fake: Tensor, k: int = 5, chunk_size: int = 1024, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    r"""Precision, recall, density and coverage of ``fake`` against ``real`` features (Naeem et al., 2020).

    With :math:`r_i` the distance of real sample :math:`i` to its k-th nearest real neighbour (and :math:`\hat r_j`
    likewise among fakes), :math:`B(x, r)` the open ball:

    - precision :math:`= \frac1M \sum_j [\exists i: \hat x_j \in B(x_i, r_i)]`
    - recall :math:`= \frac1N \sum_i [\exists j: x_i \in B(\hat x_j, \hat r_j)]`
    - density :math:`= \frac{1}{kM} \sum_j \sum_i [\hat x_j \in B(x_i, r_i)]`
    - coverage :math:`= \frac1N \sum_i [\exists j: \hat x_j \in B(x_i, r_i)]`

    Distances are computed ``chunk_size`` rows at a time, so memory is O(chunk·(N + M)), never O(N²).

    Args:
        real: ``(N, d)`` features of real images.
        fake: ``(M, d)`` features of generated images.
        k: neighbourhood size; both sets need more than ``k`` samples.
        chunk_size: rows per distance block.
        dtype: distance computation dtype (float64 for bit-level agreement with a float64 reference).
    """
    if real.ndim != 2 or fake.ndim != 2 or real.shape[1] != fake.shape[1]:
        raise ValueError(f"Expected (N, d) and (M, d) features, got {tuple(real.shape)} and {tuple(fake.shape)}.")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}.")
    if len(real) <= k or len(fake) <= k:
        raise ValueError(
            f"PRDC with k={k} needs more than {k} real and fake samples, got {len(real)} real and {len(fake)} fake."
        )
    real, fake = real.to(dtype), fake.to(dtype)
    real_radii = _kth_neighbour_sq_radii(real, k, chunk_size)
    fake_radii = _kth_neighbour_sq_radii(fake, k, chunk_size)
    fake_in_real_balls = torch.zeros(len(fake), dtype=torch.long, device=fake.device)  # Σ_i [x̂_j ∈ B(x_i, r_i)]
    real_in_fake_ball = torch.zeros(len(real), dtype=torch.bool, device=real.device)
    real_ball_has_fake = torch.zeros(len(real), dtype=torch.bool, device=real.device)
    real_sq, fake_sq = real.square().sum(1), fake.square().sum(1)
    for i in range(0, len(real), chunk_size):
        d = _sq_dists(real[i : i + chunk_size], fake, real_sq[i : i + chunk_size], fake_sq).clamp_min_(0)  # (chunk, M)
        inside = d < real_radii[i : i + chunk_size, None]
        fake_in_real_balls += inside.sum(0)
        real_ball_has_fake[i : i + chunk_size] = inside.any(1)
        real_in_fake_ball[i : i + chunk_size] = (d < fake_radii[None, :]).any(1)
    return {
        "precision": (fake_in_real_balls > 0).double().mean(),
        "recall": real_in_fake_ball.double().mean(),
        "density": fake_in_real_balls.double().sum() / (k * len(fake)),
        "coverage": real_ball_has_fake.double().mean(),
    }


def mmd(x: Tensor, y: Tensor, sigma: float = 10.0, scale: float = 1000.0, chunk_size: int = 4096) -> Tensor:
    r"""Maximum mean discrepancy with a Gaussian RBF kernel, as the CMMD reference (Jayasumana et al., 2024):

    .. math::
        \text{scale}\cdot\big(\overline{k(x, x')} + \overline{k(y, y')} - 2\,\overline{k(x, y)}\big),
        \qquad k(a, b) = \exp\!\big(-\lVert a-b\rVert^2 / (2\sigma^2)\big)

    with means over all pairs (diagonals included), accumulated in float64 ``chunk_size`` rows at a time.
    """
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"Expected (N, d) and (M, d) features, got {tuple(x.shape)} and {tuple(y.shape)}.")
    if len(x) < 1 or len(y) < 1:
        raise ValueError(f"MMD needs at least one sample per set, got {len(x)} and {len(y)}.")
    x, y = x.double(), y.double()
    gamma = 1.0 / (2 * sigma**2)

    def mean_kernel(a: Tensor, b: Tensor) -> Tensor:
        a_sq, b_sq = a.square().sum(1), b.square().sum(1)
        blocks = (
            _sq_dists(a[i : i + chunk_size], b, a_sq[i : i + chunk_size], b_sq).clamp_min_(0)
            for i in range(0, len(a), chunk_size)
        )
        return sum(d.mul_(-gamma).exp_().sum() for d in blocks) / (len(a) * len(b))

    return scale * (mean_kernel(x, x) + mean_kernel(y, y) - 2 * mean_kernel(x, y))
