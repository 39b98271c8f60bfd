"""Functional metric formulas vs independent references: scipy sqrtm, a direct NumPy PRDC, a direct MMD."""

import numpy as np
import pytest
import scipy.linalg
import torch

from lightning_muon.metrics.functional import frechet_distance, gaussian_from_sums, mmd, prdc


def scipy_frechet(mu1, s1, mu2, s2):
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


def numpy_prdc(real, fake, k):
    """Naeem et al.'s definitions, written directly with full distance matrices."""
    d_rr = np.sqrt(((real[:, None] - real[None]) ** 2).sum(-1))
    d_ff = np.sqrt(((fake[:, None] - fake[None]) ** 2).sum(-1))
    d_rf = np.sqrt(((real[:, None] - fake[None]) ** 2).sum(-1))
    r_real = np.sort(d_rr, axis=1)[:, k]  # column 0 is the point itself
    r_fake = np.sort(d_ff, axis=1)[:, k]
    inside = d_rf < r_real[:, None]
    return {
        "precision": inside.any(0).mean(),
        "recall": (d_rf < r_fake[None, :]).any(1).mean(),
        "density": inside.sum() / (k * len(fake)),
        "coverage": (d_rf.min(1) < r_real).mean(),
    }


def direct_mmd(x, y, sigma, scale):
    def k(a, b):
        return np.exp(-((a[:, None] - b[None]) ** 2).sum(-1) / (2 * sigma**2)).mean()

    return scale * (k(x, x) + k(y, y) - 2 * k(x, y))


def random_gaussian(n, d, seed, shift=0.0):
    g = np.random.default_rng(seed)
    A = g.normal(size=(d, d)) / np.sqrt(d)
    return g.normal(size=(n, d)) @ A + shift


@pytest.mark.parametrize("d", [8, 64])
def test_frechet_distance_matches_scipy(d):
    x, y = random_gaussian(500, d, 0), random_gaussian(400, d, 1, shift=0.3)
    mu1, s1, mu2, s2 = x.mean(0), np.cov(x, rowvar=False), y.mean(0), np.cov(y, rowvar=False)
    ours = frechet_distance(*(torch.from_numpy(a) for a in (mu1, s1, mu2, s2))).item()
    assert ours == pytest.approx(scipy_frechet(mu1, s1, mu2, s2), rel=1e-6)


def test_frechet_distance_known_values():
    d = 16
    x = random_gaussian(300, d, 2)
    mu, s = torch.from_numpy(x.mean(0)), torch.from_numpy(np.cov(x, rowvar=False))
    assert abs(frechet_distance(mu, s, mu, s).item()) < 1e-8  # identical distributions
    shift = torch.full((d,), 0.5, dtype=torch.float64)
    assert frechet_distance(mu, s, mu + shift, s).item() == pytest.approx(d * 0.25, rel=1e-8)  # pure mean shift
    eye = torch.eye(d, dtype=torch.float64)
    assert frechet_distance(mu, eye, mu, 4 * eye).item() == pytest.approx(d * (1 + 4 - 2 * 2), rel=1e-10)


def test_gaussian_from_sums_matches_numpy_and_rejects_one_sample():
    x = random_gaussian(50, 6, 3)
    t = torch.from_numpy(x)
    mu, sigma = gaussian_from_sums(t.sum(0), t.T @ t, len(t))
    np.testing.assert_allclose(mu.numpy(), x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(sigma.numpy(), np.cov(x, rowvar=False), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="at least 2 samples"):
        gaussian_from_sums(t[:1].sum(0), t[:1].T @ t[:1], 1)
    with pytest.raises(ValueError, match="Shapes do not match"):
        frechet_distance(mu, sigma, mu[:3], sigma)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("k", [3, 5])
def test_prdc_matches_numpy_reference(k, dtype):
    real, fake = random_gaussian(300, 16, 4), random_gaussian(250, 16, 5, shift=0.4)
    ref = numpy_prdc(real, fake, k)
    ours = prdc(torch.from_numpy(real), torch.from_numpy(fake), k=k, chunk_size=64, dtype=dtype)
    for key, value in ref.items():
        assert ours[key].item() == pytest.approx(value, rel=1e-6), key
    assert 0.0 < ref["precision"] < 1.0 and 0.0 < ref["recall"] < 1.0  # the shift makes every metric informative


def test_prdc_identical_sets_and_too_few_samples():
    x = torch.from_numpy(random_gaussian(200, 8, 6))
    same = prdc(x, x.clone(), k=5)
    assert same["precision"] == 1.0 and same["recall"] == 1.0 and same["coverage"] == 1.0
    with pytest.raises(ValueError, match="needs more than 5 real and fake samples"):
        prdc(x, x[:5], k=5)
    with pytest.raises(ValueError, match=r"Expected \(N, d\)"):
        prdc(x, x[:, :3])


@pytest.mark.parametrize("sigma", [10.0, 1.0])
def test_mmd_matches_direct_formula(sigma):
    x, y = random_gaussian(120, 12, 7), random_gaussian(90, 12, 8, shift=0.5)
    ours = mmd(torch.from_numpy(x), torch.from_numpy(y), sigma=sigma, scale=1000.0, chunk_size=32).item()
    assert ours == pytest.approx(direct_mmd(x, y, sigma, 1000.0), rel=1e-6)
    assert ours > 0


def test_mmd_identical_is_zero_and_fewer_than_two_samples_is_an_error():
    x = torch.from_numpy(random_gaussian(50, 4, 9))
    assert abs(mmd(x, x.clone()).item()) < 1e-9
    for few in (x[:0], x[:1]):  # one sample: k(x, x) = 1 is the whole within-set mean
        with pytest.raises(ValueError, match="at least 2 samples"):
            mmd(x, few)
    assert mmd(x, x[:2]).isfinite()  # control


@pytest.mark.parametrize(
    ("formula", "args"),
    [
        ("frechet", lambda x: (x.mean(0), x.T.cov(), x.mean(0), x.T.cov())),
        ("mmd", lambda x: (x, x)),
        ("prdc", lambda x: (x, x, 3)),
        ("inception_score", lambda x: (x, 2)),
    ],
)
def test_nonfinite_features_are_a_clear_error(formula, args):
    from lightning_muon.metrics.functional import frechet_distance, inception_score, prdc

    fn = {"frechet": frechet_distance, "mmd": mmd, "prdc": prdc, "inception_score": inception_score}[formula]
    x = torch.from_numpy(random_gaussian(20, 4, 1))
    fn(*args(x))  # control: finite features compute
    x[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf.*feature extractor"):
        fn(*args(x))


def test_zero_size_images_are_a_clear_error():
    from lightning_muon.metrics.images import check_images

    check_images(torch.zeros(2, 1, 1, 1, dtype=torch.uint8))  # control: 1x1 is an image
    check_images(torch.zeros(0, 3, 8, 8, dtype=torch.uint8))  # an empty batch (an empty rank) is fine
    with pytest.raises(ValueError, match="at least 1x1 pixels"):
        check_images(torch.zeros(2, 1, 0, 0, dtype=torch.uint8))


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_sharded_prdc_and_mmd_pieces_add_up_to_the_whole(world):
    """The per-rank pieces the metric classes run under DDP: every shard's k-NN candidates merged, every shard's
    count and kernel sums added, equal the one-process values; dropping one shard (the control) does not."""
    from lightning_muon.metrics.functional import (
        knn_candidates,
        merge_knn,
        mmd_from_sums,
        mmd_kernel_sums,
        prdc_counts,
        prdc_from_counts,
    )

    g = torch.Generator().manual_seed(0)
    real, fake = torch.randn(230, 6, generator=g, dtype=torch.float64), torch.randn(170, 6, generator=g).double() + 0.3
    k, chunk = 4, 32
    expected = prdc(real, fake, k, chunk, dtype=torch.float64)
    shards = [(r, world) for r in range(world)]
    radii = [merge_knn(torch.cat([knn_candidates(x, k, chunk, s) for s in shards], 1), k) for x in (real, fake)]
    rows = [range(r * len(real) // world, (r + 1) * len(real) // world) for r in range(world)]
    counts = sum(prdc_counts(real, fake, *radii, chunk, rows=rr) for rr in rows)
    for key, value in prdc_from_counts(counts, len(real), len(fake), k).items():
        assert value.item() == expected[key].item(), key
    sums = sum(mmd_kernel_sums(real, fake, 1.0, chunk, s) for s in shards)
    assert mmd_from_sums(sums, len(real), len(fake)).item() == pytest.approx(mmd(real, fake, 1.0).item(), rel=1e-12)
    if world > 1:  # control: a shard missing from the merge changes the radii and the sums
        partial = merge_knn(torch.cat([knn_candidates(real, k, chunk, s) for s in shards[1:]], 1), k)
        assert not torch.equal(partial, radii[0])
        assert not torch.allclose(sum(mmd_kernel_sums(real, fake, 1.0, chunk, s) for s in shards[1:]), sums)
