"""Pure formulas of the generation-quality metrics: Fréchet distance, PRDC (Naeem et al. 2020), RBF MMD (CMMD),
KID, the Inception Score and GenEval 2's Soft-TIFA; the O(N²) ones split into shard-sized pieces whose sums make
the whole."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "GENEVAL2_SKILLS",
    "check_finite",
    "frechet_distance",
    "gaussian_from_sums",
    "inception_score",
    "kid_subsets",
    "knn_candidates",
    "merge_knn",
    "mmd",
    "mmd_from_sums",
    "mmd_kernel_sums",
    "polynomial_mmd2",
    "prdc",
    "prdc_counts",
    "prdc_from_counts",
    "soft_tifa_from_sums",
    "soft_tifa_gm",
    "soft_tifa_sums",
]


def check_finite(what: str, *tensors: Tensor) -> None:
    """Raise unless every entry is finite: NaN/inf features mean a broken extractor (weights, dtype overflow) or
    images, and would otherwise reach ``eigh`` or a kernel sum as a raw error or a silent NaN."""
    if not all(bool(torch.isfinite(t).all()) for t in tensors):
        raise ValueError(
            f"{what} contain NaN or inf: the feature extractor produced non-finite features. Check its weights, run "
            "it in float32, and check the images."
        )


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
    check_finite("Fréchet distance statistics", mu1, mu2, sigma1, sigma2)
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


def _block_pairs(n: int, chunk: int, shard: tuple[int, int]) -> list[tuple[int, int]]:
    """The upper-triangle blocks (i, j ≥ i) of an n×n distance matrix that shard ``(rank, world)`` computes:
    every ``world``-th block, so the ranks split the work and together cover every block once."""
    rank, world = shard
    pairs = [(i, j) for i in range(0, n, chunk) for j in range(i, n, chunk)]
    return pairs[rank::world]


def knn_candidates(x: Tensor, k: int, chunk: int, shard: tuple[int, int] = (0, 1)) -> Tensor:
    """Each row's ``k + 1`` smallest squared distances to rows of ``x`` (itself included, at 0) over this shard's
    blocks ``(n, k + 1)`` (``inf`` where the shard saw fewer). Merging the shards' candidates with
    :func:`merge_knn` gives the exact k-NN radii.

    Distances are symmetric, so only blocks (i, j ≥ i) are computed; each serves the rows of i (top-k along
    columns) and of j (top-k along rows), with running top-(k+1) lists merged per block: half the matmuls.
    """
    n, x_sq = len(x), x.square().sum(1)
    best = torch.full((n, k + 1), float("inf"), dtype=x.dtype, device=x.device)
    for i, j in _block_pairs(n, chunk, shard):
        d = _sq_dists(x[i : i + chunk], x[j : j + chunk], x_sq[i : i + chunk], x_sq[j : j + chunk])
        best[i : i + chunk] = _merge_smallest(
            best[i : i + chunk], d.topk(min(k + 1, d.shape[1]), dim=1, largest=False).values
        )
        if j != i:
            col = d.topk(min(k + 1, d.shape[0]), dim=0, largest=False).values.T
            best[j : j + chunk] = _merge_smallest(best[j : j + chunk], col)
    return best


def merge_knn(candidates: Tensor, k: int) -> Tensor:
    """Squared k-th-neighbour radii ``(n,)`` from shards' candidates concatenated along dim 1 ``(n, S·(k+1))``."""
    return candidates.topk(k + 1, dim=1, largest=False).values[:, k].clamp_min(0)


def prdc_counts(
    real: Tensor, fake: Tensor, real_radii: Tensor, fake_radii: Tensor, chunk: int, rows: range | None = None
) -> Tensor:
    """The sums PRDC is made of, over real rows ``rows`` (all by default), as one float64 vector
    ``[Σ_i 1[x̂_j ∈ B(x_i, r_i)] for j < M, 1[∃j: x_i ∈ B(x̂_j, r̂_j)] for i < N, 1[∃j: x̂_j ∈ B(x_i, r_i)] for i < N]``;
    shards over disjoint rows add up to the whole (one all-reduce)."""
    n, m = len(real), len(fake)
    rows = rows if rows is not None else range(n)
    out = torch.zeros(m + 2 * n, dtype=torch.float64, device=real.device)
    real_sq, fake_sq = real.square().sum(1), fake.square().sum(1)
    for i in range(rows.start, rows.stop, chunk):
        e = min(i + chunk, rows.stop)
        d = _sq_dists(real[i:e], fake, real_sq[i:e], fake_sq).clamp_min_(0)  # (chunk, M)
        inside = d < real_radii[i:e, None]
        out[:m] += inside.sum(0)
        out[m + i : m + e] = (d < fake_radii[None, :]).any(1).double()
        out[m + n + i : m + n + e] = inside.any(1).double()
    return out


def prdc_from_counts(counts: Tensor, n: int, m: int, k: int) -> dict[str, Tensor]:
    """Precision, recall, density and coverage from the :func:`prdc_counts` vector."""
    fake_in_real_balls, real_in_fake_ball, real_ball_has_fake = counts[:m], counts[m : m + n], counts[m + n :]
    return {
        "precision": (fake_in_real_balls > 0).double().mean(),
        "recall": real_in_fake_ball.mean(),
        "density": fake_in_real_balls.sum() / (k * m),
        "coverage": real_ball_has_fake.mean(),
    }


def check_prdc_inputs(real: Tensor, fake: Tensor, k: int) -> None:
    if real.ndim != 2 or fake.ndim != 2 or real.shape[1] != fake.shape[1]:
        raise ValueError(f"Expected (N, d) and (M, d) features, got {tuple(real.shape)} and {tuple(fake.shape)}.")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}.")
    if len(real) <= k or len(fake) <= k:
        raise ValueError(
            f"PRDC with k={k} needs more than {k} real and fake samples, got {len(real)} real and {len(fake)} fake."
        )
    check_finite("PRDC features", real, fake)


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

    Distances are computed ``chunk_size`` rows at a time, so memory is O(chunk·(N + M)), never O(N²). The metric
    class splits the same pieces (:func:`knn_candidates`, :func:`prdc_counts`) across DDP ranks.

    Args:
        real: ``(N, d)`` features of real images.
        fake: ``(M, d)`` features of generated images.
        k: neighbourhood size; both sets need more than ``k`` samples.
        chunk_size: rows per distance block.
        dtype: distance computation dtype (float64 for bit-level agreement with a float64 reference).
    """
    check_prdc_inputs(real, fake, k)
    real, fake = real.to(dtype), fake.to(dtype)
    real_radii = merge_knn(knn_candidates(real, k, chunk_size), k)
    fake_radii = merge_knn(knn_candidates(fake, k, chunk_size), k)
    return prdc_from_counts(prdc_counts(real, fake, real_radii, fake_radii, chunk_size), len(real), len(fake), k)


def mmd_kernel_sums(
    x: Tensor, y: Tensor, sigma: float = 10.0, chunk_size: int = 4096, rows: tuple[int, int] = (0, 1)
) -> Tensor:
    """``[Σ k(x, x'), Σ k(y, y'), Σ k(x, y)]`` (float64, RBF kernel) over shard ``rows = (rank, world)``'s
    contiguous ``1/world`` of the rows of the first argument; the shards' sums add up to the full sums."""
    x, y = x.double(), y.double()
    gamma = 1.0 / (2 * sigma**2)
    rank, world = rows

    def kernel_sum(a: Tensor, b: Tensor) -> Tensor:
        a_sq, b_sq = a.square().sum(1), b.square().sum(1)
        total = torch.zeros((), dtype=torch.float64, device=a.device)
        start, stop = rank * len(a) // world, (rank + 1) * len(a) // world
        for i in range(start, stop, chunk_size):
            e = min(i + chunk_size, stop)
            d = _sq_dists(a[i:e], b, a_sq[i:e], b_sq).clamp_min_(0)
            total += d.mul_(-gamma).exp_().sum()
        return total

    return torch.stack([kernel_sum(x, x), kernel_sum(y, y), kernel_sum(x, y)])


def mmd_from_sums(sums: Tensor, n: int, m: int, scale: float = 1000.0) -> Tensor:
    """``scale · (mean k(x, x') + mean k(y, y') − 2 mean k(x, y))`` from :func:`mmd_kernel_sums`."""
    return scale * (sums[0] / (n * n) + sums[1] / (m * m) - 2 * sums[2] / (n * m))


def check_mmd_inputs(x: Tensor, y: Tensor) -> None:
    if x.ndim != 2 or y.ndim != 2 or x.shape[1] != y.shape[1]:
        raise ValueError(f"Expected (N, d) and (M, d) features, got {tuple(x.shape)} and {tuple(y.shape)}.")
    if len(x) < 2 or len(y) < 2:
        raise ValueError(
            f"MMD needs at least 2 samples per set (with one, the within-set means are k(x, x) = 1 and the value "
            f"measures nothing), got {len(x)} and {len(y)}."
        )
    check_finite("MMD features", x, y)


def mmd(x: Tensor, y: Tensor, sigma: float = 10.0, scale: float = 1000.0, chunk_size: int = 4096) -> Tensor:
    r"""Maximum mean discrepancy with a Gaussian RBF kernel, as the CMMD reference (Jayasumana et al., 2024):

    .. math::
        \text{scale}\cdot\big(\overline{k(x, x')} + \overline{k(y, y')} - 2\,\overline{k(x, y)}\big),
        \qquad k(a, b) = \exp\!\big(-\lVert a-b\rVert^2 / (2\sigma^2)\big)

    with means over all pairs (diagonals included), accumulated in float64 ``chunk_size`` rows at a time.
    """
    check_mmd_inputs(x, y)
    return mmd_from_sums(mmd_kernel_sums(x, y, sigma, chunk_size), len(x), len(y), scale)


def kid_subsets(n_fake: int, n_real: int, subsets: int, subset_size: int, seed: int) -> list[tuple[Tensor, Tensor]]:
    """torch-fidelity's KID subsets as ``(fake_indices, real_indices)``: ``numpy.random.RandomState(seed)``, per
    subset ``choice(n_fake, size, replace=False)`` for the generated set (torch-fidelity's ``input1``) and then
    ``choice(n_real, ...)`` for the real one (``input2``)."""
    import numpy as np

    if n_fake < subset_size or n_real < subset_size:
        raise ValueError(
            f"KID with subset_size={subset_size} needs at least that many real and generated samples, got {n_real} "
            f"real and {n_fake} generated; lower subset_size or add samples."
        )
    rng = np.random.RandomState(seed)
    draws = []
    for _ in range(subsets):
        fake = torch.from_numpy(rng.choice(n_fake, subset_size, replace=False))
        draws.append((fake, torch.from_numpy(rng.choice(n_real, subset_size, replace=False))))
    return draws


def polynomial_mmd2(x: Tensor, y: Tensor, degree: int = 3, gamma: float | None = None, coef0: float = 1.0) -> Tensor:
    r"""Unbiased MMD² with the kernel :math:`k(a, b) = (\gamma\, a^\top b + c_0)^{d}`, :math:`\gamma = 1/\dim`
    by default (Bińkowski et al. 2018, KID): diagonal terms of :math:`K_{xx}, K_{yy}` left out, float64."""
    x, y = x.double(), y.double()
    gamma = 1.0 / x.shape[1] if gamma is None else gamma
    m = len(x)
    k_xx, k_yy, k_xy = ((a @ b.T * gamma + coef0) ** degree for a, b in ((x, x), (y, y), (x, y)))
    return (k_xx.sum() - k_xx.trace() + k_yy.sum() - k_yy.trace()) / (m * (m - 1)) - 2 * k_xy.sum() / (m * m)


def kid_subset_values(
    real: Tensor,
    fake: Tensor,
    subsets: int = 100,
    subset_size: int = 1000,
    degree: int = 3,
    gamma: float | None = None,
    coef0: float = 1.0,
    seed: int = 2020,
    shard: tuple[int, int] = (0, 1),
) -> Tensor:
    """KID's per-subset unbiased polynomial MMD² (float64, torch-fidelity's draws, :func:`kid_subsets`); with
    ``shard=(rank, world)`` only subsets ``i ≡ rank (mod world)`` are computed, the others are 0 (sum over ranks).
    KID is the mean of the values and its reported spread their population std."""
    draws = kid_subsets(len(fake), len(real), subsets, subset_size, seed)
    check_finite("KID features", real, fake)
    rank, world = shard
    values = torch.zeros(subsets, dtype=torch.float64, device=real.device)
    for i in range(rank, subsets, world):
        f, r = (idx.to(real.device) for idx in draws[i])
        values[i] = polynomial_mmd2(fake[f], real[r], degree, gamma, coef0)
    return values


def inception_score(logits: Tensor, splits: int = 10, seed: int | None = 2020) -> tuple[Tensor, Tensor]:
    r"""Inception Score (Salimans et al. 2016) as torch-fidelity computes it: rows shuffled by
    ``numpy.random.RandomState(seed).permutation`` (``seed=None``: not shuffled), ``splits`` contiguous splits,
    per split :math:`\exp\big(\mathbb E_x \mathrm{KL}(p(y|x)\,\|\,p(y))\big)`; mean and (population) std."""
    import numpy as np

    n = len(logits)
    if n < splits:
        raise ValueError(f"Inception Score with {splits} splits needs at least {splits} samples, got {n}.")
    check_finite("Inception Score logits", logits)
    if seed is not None:
        logits = logits[torch.from_numpy(np.random.RandomState(seed).permutation(n)).to(logits.device)]
    p, log_p = logits.double().softmax(1), logits.double().log_softmax(1)
    scores = []
    for i in range(splits):
        part, log_part = p[i * n // splits : (i + 1) * n // splits], log_p[i * n // splits : (i + 1) * n // splits]
        scores.append((part * (log_part - part.mean(0, keepdim=True).log())).sum(1).mean().exp())
    s = torch.stack(scores)
    return s.mean(), s.std(unbiased=False)


# -------------------------------------------------------------------------------------------------------- HPSv2
def letterbox(x: Tensor, size: int) -> Tensor:
    """hpsv2's ``ResizeMaxSize`` on float images ``(B, 3, H, W)``: scale the longer side to ``size`` (bicubic,
    antialiased; sides rounded), pad the shorter one with zeros (``pad // 2`` before); unchanged at ``size``."""
    from torchvision.transforms.functional import InterpolationMode, pad, resize

    h, w = x.shape[-2:]
    scale = size / max(h, w)
    if scale == 1.0:
        return x
    nh, nw = round(h * scale), round(w * scale)
    x = resize(x, [nh, nw], InterpolationMode.BICUBIC, antialias=True)
    ph, pw = size - nh, size - nw
    return pad(x, [pw // 2, ph // 2, pw - pw // 2, ph - ph // 2], fill=0)


def preference_scores(image_embeddings: Tensor, text_embeddings: Tensor) -> Tensor:
    """HPSv2's per-pair score: the cosine similarity of an image's and its prompt's embeddings (float32)."""
    image, text = (torch.nn.functional.normalize(e.float(), dim=-1) for e in (image_embeddings, text_embeddings))
    return (image * text).sum(-1)


# ------------------------------------------------------------------------------------------- GenEval 2 (Soft-TIFA)
#: GenEval 2's skills, in the order of the per-skill report
GENEVAL2_SKILLS = ("object", "attribute", "count", "position", "verb")
#: atom probabilities are clamped to this before the log of the geometric mean (a softmax is 0 only by underflow)
SOFT_TIFA_FLOOR = 1e-10


def soft_tifa_gm(probabilities: Tensor, floor: float = SOFT_TIFA_FLOOR) -> Tensor:
    r"""A prompt's Soft-TIFA GM: :math:`\exp\big(\frac1A\sum_a \log\max(p_a, \text{floor})\big)` over its atoms'
    probabilities of the right answer (float64)."""
    return probabilities.double().clamp_min(floor).log().mean().exp()


def soft_tifa_sums(
    probabilities: Tensor, skills: Tensor, atom_count: int, num_atom_counts: int, floor: float = SOFT_TIFA_FLOOR
) -> dict[str, Tensor]:
    """One image's additive Soft-TIFA statistics (float64): its GM and AM, the per-skill sums of atom probabilities
    and atom counts (``skills`` indexes :data:`GENEVAL2_SKILLS`), and its GM under its atomicity. Sums over images
    (and ranks) feed :func:`soft_tifa_from_sums`."""
    p = probabilities.double()
    gm, by_atoms = soft_tifa_gm(p, floor), torch.zeros(num_atom_counts, dtype=torch.float64, device=p.device)
    by_atoms[atom_count] = gm
    count = torch.zeros_like(by_atoms)
    count[atom_count] = 1
    skill_sum = torch.zeros(len(GENEVAL2_SKILLS), dtype=torch.float64, device=p.device).index_add_(0, skills, p)
    skill_count = torch.zeros_like(skill_sum).index_add_(0, skills, torch.ones_like(p))
    return {
        "gm": gm,
        "am": p.mean(),
        "images": torch.ones((), dtype=torch.float64, device=p.device),
        "skill_sum": skill_sum,
        "skill_count": skill_count,
        "atoms_gm": by_atoms,
        "atoms_count": count,
    }


def soft_tifa_from_sums(sums: dict[str, Tensor]) -> dict[str, Tensor]:
    """GenEval 2's report from summed :func:`soft_tifa_sums`, in percent as the reference prints it:

    - ``geneval2``: the mean over images of their Soft-TIFA GM (the benchmark's score);
    - ``geneval2_am``: the mean over images of their Soft-TIFA AM;
    - ``geneval2_skill_<skill>``: the mean probability of that skill's atoms, pooled over images (Soft-TIFA AM);
    - ``geneval2_atoms_<n>``: the mean GM of the images whose prompt has atomicity n.
    """
    images = sums["images"]
    if float(images) == 0:
        raise ValueError("GenEval2 has no scored images; update() it with generated images first.")
    out = {"geneval2": 100 * sums["gm"] / images, "geneval2_am": 100 * sums["am"] / images}
    for skill, total, count in zip(GENEVAL2_SKILLS, sums["skill_sum"], sums["skill_count"]):
        if count > 0:
            out[f"geneval2_skill_{skill}"] = 100 * total / count
    for n, (total, count) in enumerate(zip(sums["atoms_gm"], sums["atoms_count"])):
        if count > 0:
            out[f"geneval2_atoms_{n}"] = 100 * total / count
    return out
