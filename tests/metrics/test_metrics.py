"""Metric classes: batching invariance, DDP == single process, reference caching, extractors, missing weights."""

import pytest
import torch
from fixtures import random_inception_state_dict, tiny_open_clip_config
from helpers import (
    ddp_metric_worker,
    digits_images,
    digits_metrics,
    metric_values,
    run_distributed,
)

from lightning_muon.metrics import (
    ClipFeatures,
    DigitsFeatures,
    DinoV2Features,
    FrechetDistance,
    HPSv2Score,
    InceptionFeatures,
    MaximumMeanDiscrepancy,
    PrecisionRecallDensityCoverage,
    ensure_reference,
    update_with_images,
)
from lightning_muon.metrics.functional import frechet_distance, mmd, prdc


@pytest.fixture(scope="session")
def classifier_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("cache") / "digits_classifier.pt"
    DigitsFeatures(path)  # trains once, caches
    return path


def test_digits_features_cached_and_deterministic(classifier_path, tmp_path):
    a, b = DigitsFeatures(classifier_path), DigitsFeatures(classifier_path)
    x = digits_images(10)
    feats = a(x)
    assert feats.shape == (10, 64) and feats.dtype == torch.float32
    assert torch.equal(feats, b(x))
    assert torch.allclose(a(x.float() / 255), feats, atol=1e-6)  # uint8 and float inputs agree
    assert a(torch.cat([x, x, x], 1)).shape == (10, 64)  # RGB is converted to gray


def test_batched_updates_equal_one_update(classifier_path):
    real, fake = digits_images(300), digits_images(200, noise=0.2)
    one = metric_values(digits_metrics(classifier_path), real, fake, batch_size=1000)
    batched = metric_values(digits_metrics(classifier_path), real, fake, batch_size=7)
    assert one.keys() == batched.keys() and len(one) == 6
    for key in one:
        assert batched[key] == pytest.approx(one[key], rel=1e-6, abs=1e-9), key
    assert one["fd"] > 0 and 0 < one["prdc/precision"] < 1


def test_metric_classes_equal_functional_formulas(classifier_path):
    real, fake = digits_images(200), digits_images(150, noise=0.3)
    extractor = DigitsFeatures(classifier_path)
    fr, ff = extractor(real).double(), extractor(fake).double()
    values = metric_values(digits_metrics(classifier_path), real, fake, batch_size=32)
    expected_fd = frechet_distance(fr.mean(0), torch.cov(fr.T), ff.mean(0), torch.cov(ff.T)).item()
    assert values["fd"] == pytest.approx(expected_fd, rel=1e-5)
    assert values["prdc/recall"] == pytest.approx(prdc(fr, ff, k=5)["recall"].item(), rel=1e-6)
    assert values["mmd"] == pytest.approx(mmd(fr, ff, sigma=1.0).item(), rel=1e-5)


@pytest.mark.distributed
def test_ddp_two_processes_equal_single_process(classifier_path):
    n_real, n_fake = 201, 151  # not divisible by 2: uneven shards
    single = metric_values(digits_metrics(classifier_path), digits_images(n_real), digits_images(n_fake, noise=0.2), 16)
    results = run_distributed(ddp_metric_worker, 2, classifier_path, n_real, n_fake)
    for rank_result in results:
        for key, value in single.items():
            assert rank_result[key] == pytest.approx(value, rel=1e-5, abs=1e-9), key


def test_reference_save_load_and_reset(classifier_path, tmp_path):
    real, fake = digits_images(200), digits_images(120, noise=0.2)
    for cls in (FrechetDistance, PrecisionRecallDensityCoverage, MaximumMeanDiscrepancy):
        fresh = cls(DigitsFeatures(classifier_path))
        fresh.update(real, real=True)
        fresh.update(fake, real=False)
        expected = fresh.compute()
        fresh.save_reference(tmp_path / f"{cls.__name__}.pt")

        cached = cls(DigitsFeatures(classifier_path))
        cached.load_reference(tmp_path / f"{cls.__name__}.pt")
        cached.update(fake, real=False)
        got = cached.compute()
        cached.reset()  # keeps the loaded reference
        cached.update(fake, real=False)
        for value in (got, cached.compute()):
            for a, b in zip(*(v.values() if isinstance(v, dict) else [v] for v in (value, expected))):
                assert float(a) == pytest.approx(float(b), rel=1e-6)
        with pytest.raises(RuntimeError, match="real=False"):
            cached.update(real, real=True)


def test_ensure_reference_computes_once_then_loads(classifier_path, tmp_path):
    real, fake = digits_images(120), digits_images(80, noise=0.2)
    path = tmp_path / "ref.pt"
    first = PrecisionRecallDensityCoverage(DigitsFeatures(classifier_path))
    ensure_reference(first, path, lambda: real.split(32), progress=False)
    assert path.is_file()

    def must_not_run():
        raise AssertionError("the cached reference must be used")

    second = PrecisionRecallDensityCoverage(DigitsFeatures(classifier_path))
    ensure_reference(second, path, must_not_run, progress=False)
    assert update_with_images(second, fake.split(32), real=False, progress=False) == 80
    direct = PrecisionRecallDensityCoverage(DigitsFeatures(classifier_path))
    direct.update(real, real=True)
    direct.update(fake, real=False)
    assert {k: float(v) for k, v in second.compute().items()} == {k: float(v) for k, v in direct.compute().items()}


def test_reference_from_another_metric_or_missing_file_is_an_error(classifier_path, tmp_path):
    metric = FrechetDistance(DigitsFeatures(classifier_path))
    metric.update(digits_images(50), real=True)
    metric.save_reference(tmp_path / "fd.pt")
    other = PrecisionRecallDensityCoverage(DigitsFeatures(classifier_path))
    with pytest.raises(ValueError, match="were made by"):
        other.load_reference(tmp_path / "fd.pt")
    with pytest.raises(FileNotFoundError, match="save_reference"):
        other.load_reference(tmp_path / "missing.pt")


def test_too_few_samples(classifier_path):
    fd = FrechetDistance(DigitsFeatures(classifier_path))
    fd.update(digits_images(10), real=True)
    fd.update(digits_images(1), real=False)
    with pytest.raises(ValueError, match="at least 2 samples"):
        fd.compute()
    pr = PrecisionRecallDensityCoverage(DigitsFeatures(classifier_path), k=5)
    pr.update(digits_images(10), real=True)
    pr.update(digits_images(4), real=False)
    with pytest.raises(ValueError, match="needs more than 5"):
        pr.compute()


# ------------------------------------------------------------------------------------ real network extractors
def test_dinov2_from_local_directory(tmp_path):
    from transformers import Dinov2Config, Dinov2Model

    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, patch_size=14, image_size=56
    )
    Dinov2Model(config).save_pretrained(tmp_path / "dinov2")
    extractor = DinoV2Features(tmp_path / "dinov2", image_size=56, batch_size=3)
    out = extractor(torch.randint(0, 256, (5, 3, 40, 48), dtype=torch.uint8))
    assert out.shape == (5, 32) and out.dtype == torch.float32 and torch.isfinite(out).all()
    metric = FrechetDistance(extractor)
    metric.update(torch.rand(8, 3, 32, 32), real=True)
    metric.update(torch.rand(8, 3, 32, 32), real=False)
    assert metric.compute() > 0


def test_dinov2_missing_weights_names_the_argument(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"DINOv2 weights not found at .*Pass `weights=`"):
        DinoV2Features(tmp_path / "nope")


@pytest.mark.slow
def test_inception_from_local_weights_file(tmp_path):
    path = tmp_path / "pt_inception-2015-12-05-6726825d.pth"
    torch.save(random_inception_state_dict(), path)
    extractor = InceptionFeatures(path, batch_size=2)
    out = extractor(torch.rand(3, 3, 32, 32))
    assert out.shape == (3, 2048) and out.dtype == torch.float32 and torch.isfinite(out).all()
    assert not torch.equal(out[0], out[1])


def test_inception_missing_weights_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="pt_inception-2015-12-05"):
        InceptionFeatures(tmp_path / "missing.pth")


def test_clip_features_and_hps_wiring(tmp_path):
    model, path = tiny_open_clip_config(tmp_path)
    extractor = ClipFeatures(path, model_name="tiny-test-clip")
    images = torch.randint(0, 256, (4, 3, 40, 40), dtype=torch.uint8)
    feats = extractor(images)
    assert feats.shape == (4, 16)
    torch.testing.assert_close(feats.norm(dim=-1), torch.ones(4))

    hps = HPSv2Score(path, model_name="tiny-test-clip", batch_size=3)
    prompts = ["a cat", "a dog", "a red car", "two birds"]
    scores = hps.scores(images, prompts)
    # independent: the same open_clip model scoring each pair by cosine similarity
    import open_clip

    x = torch.nn.functional.interpolate(images.float() / 255, size=(32, 32), mode="bicubic", antialias=True)
    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        img = torch.nn.functional.normalize(model.eval().encode_image((x - mean) / std), dim=-1)
        txt = torch.nn.functional.normalize(
            model.encode_text(open_clip.get_tokenizer("tiny-test-clip")(prompts)), dim=-1
        )
    torch.testing.assert_close(scores, (img * txt).sum(-1), rtol=1e-4, atol=1e-5)
    hps.update(images[:2], prompts[:2])
    hps.update(images[2:], prompts[2:])
    assert hps.compute().item() == pytest.approx(scores.mean().item(), rel=1e-5)
    with pytest.raises(ValueError, match="one prompt per image"):
        hps.update(images, prompts[:3])


def test_open_clip_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="Pass `weights=`"):
        HPSv2Score(tmp_path / "HPS_v2.1_compressed.pt")


# ---------------------------------------------------------------------------------- DDP: empty ranks, shared cache
@pytest.mark.distributed
@pytest.mark.parametrize("world_size,empty_rank", [(2, 1), (3, 0)])
def test_every_metric_works_with_a_rank_given_nothing(classifier_path, tmp_path, world_size, empty_rank):
    from helpers import all_metrics, ddp_empty_rank_worker, feed_and_compute

    _, clip_path = tiny_open_clip_config(tmp_path)
    clip_model = tmp_path / "tiny-test-clip.json"
    n_real, n_fake = 61, 47
    prompts = [("a cat", "a dog", "two birds")[i % 3] for i in range(n_fake)]
    single = feed_and_compute(
        all_metrics(classifier_path, clip_model, clip_path),
        digits_images(n_real),
        digits_images(n_fake, noise=0.2),
        prompts,
    )
    args = (classifier_path, clip_model, clip_path, empty_rank, n_real, n_fake)
    for rank_result in run_distributed(ddp_empty_rank_worker, world_size, *args):
        assert rank_result.keys() == single.keys()
        for key, value in single.items():
            assert rank_result[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


@pytest.mark.distributed
def test_rank_zero_decides_whether_the_reference_cache_is_valid(classifier_path, tmp_path):
    from helpers import ddp_reference_cache_worker, digits_metrics

    from lightning_muon.metrics import ensure_references

    n_real, n_fake = 80, 60
    dirs = [tmp_path / f"node{r}" for r in range(3)]
    for d in dirs:
        d.mkdir()
    real = digits_images(n_real)

    def make_cache(data):
        metrics = {k: v for k, v in digits_metrics(classifier_path).items() if k in ("fd", "prdc")}
        ensure_references(metrics, {n: dirs[0] / f"{n}.pt" for n in metrics}, lambda: [real], data=data, progress=False)

    make_cache({"images": "digits", "n": n_real})  # only rank 0's disk has it
    cached = run_distributed(ddp_reference_cache_worker, 3, classifier_path, [str(d) for d in dirs], n_real, n_fake)
    assert [r["real_calls"] for r in cached] == [0, 0, 0]  # rank 0 found it and broadcast it; nobody recomputed
    assert len({r["fd"] for r in cached}) == 1 and not (dirs[1] / "fd.pt").exists()

    make_cache({"images": "other digits", "n": n_real})  # stale: made from other images
    rebuilt = run_distributed(ddp_reference_cache_worker, 3, classifier_path, [str(d) for d in dirs], n_real, n_fake)
    assert all(r["real_calls"] > 0 for r in rebuilt)  # every rank took the same path: recompute its shard
    for a, b in zip(cached, rebuilt):
        assert a["fd"] == pytest.approx(b["fd"], rel=1e-6) and a["recall"] == b["recall"]
    saved = torch.load(dirs[0] / "fd.pt", weights_only=True)
    assert saved["data"] == {"images": "digits", "n": n_real}  # the stale file was replaced


def test_stale_reference_cache_is_rebuilt_never_reused(classifier_path, tmp_path):
    from lightning_muon.metrics.evaluation import prepare_references
    from lightning_muon.metrics.images import folder_images, image_set_fingerprint

    real, fake = digits_images(100), digits_images(70, noise=0.2)

    def fd(images, extractor=None):
        metric = FrechetDistance(extractor or DigitsFeatures(classifier_path))
        prepare_references({"fd": metric}, lambda: images, tmp_path, "digits", 32)
        metric.update(fake, real=False)
        return metric.compute().item()

    first = fd(real)
    changed = real.clone()
    changed[0, 0, 0, 0] ^= 255  # one pixel of one image: same name, same count, other images
    fresh = FrechetDistance(DigitsFeatures(classifier_path))
    fresh.update(changed, real=True)
    fresh.update(fake, real=False)
    assert fd(changed) == pytest.approx(fresh.compute().item(), rel=1e-6) != first
    # other weights of the same width: the extractor's digest differs, the cache is rebuilt
    other = DigitsFeatures(classifier_path)
    with torch.no_grad():
        other.net.body[0].weight.mul_(1.5)
    direct = FrechetDistance(other)
    direct.update(changed, real=True)
    direct.update(fake, real=False)
    assert fd(changed, other) == pytest.approx(direct.compute().item(), rel=1e-6)
    # image folders are fingerprinted by name, size and mtime, and by the resolution they are read at
    from helpers import image_folder

    root = image_folder(tmp_path / "folder", 4, size=20)
    a, b = image_set_fingerprint(folder_images(root, 16)), image_set_fingerprint(folder_images(root, 24))
    first_file = sorted(p for p in root.rglob("*.png"))[0]
    first_file.write_bytes(first_file.read_bytes())  # rewritten: new mtime
    import os

    os.utime(first_file, ns=(1, 1))
    assert len({a, b, image_set_fingerprint(folder_images(root, 16))}) == 3


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "images,match",
    [
        (torch.rand(2, 3, 8, 8) * 255, r"\[0, 255\]"),
        (torch.rand(2, 3, 8, 8) * 2 - 1, r"\[-1, 1\]: pass \(x \+ 1\) / 2"),
        (torch.full((2, 3, 8, 8), float("nan")), "NaN or inf"),
        (torch.rand(2, 2, 8, 8), r"\(B, 1 or 3, H, W\)"),
        (torch.rand(3, 8, 8), r"\(B, 1 or 3, H, W\)"),
        (torch.randint(0, 255, (2, 3, 8, 8)), "uint8 or float"),
    ],
)
def test_images_outside_the_accepted_ranges_are_errors(classifier_path, images, match):
    with pytest.raises(ValueError, match=match):
        FrechetDistance(DigitsFeatures(classifier_path)).update(images, real=True)


def test_float_images_within_rounding_of_the_range_are_accepted(classifier_path):
    features = DigitsFeatures(classifier_path)
    x = digits_images(4).float() / 255
    wiggle = (x - 5e-4).clamp_min(-5e-4)
    torch.testing.assert_close(features(wiggle), features(wiggle.clamp(0, 1)))  # clamped, never wrapped to 255


def test_nan_features_and_too_few_samples_for_fd(classifier_path):
    broken = DigitsFeatures(classifier_path)
    with torch.no_grad():
        broken.net.body[0].weight[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match="NaN/inf features"):
        broken(digits_images(4))
    metric = FrechetDistance(DigitsFeatures(classifier_path))
    metric.update(digits_images(200), real=True)
    metric.update(digits_images(20, noise=0.2), real=False)
    with pytest.warns(UserWarning, match="fewer samples than dimensions"):
        metric.compute()
    empty = PrecisionRecallDensityCoverage(DigitsFeatures(classifier_path))
    empty.update(digits_images(0), real=False)  # an empty batch is a no-op, not an error


def test_shared_extractor_runs_once_per_batch(classifier_path):
    features = DigitsFeatures(classifier_path)
    calls = []
    features.net.register_forward_hook(lambda *a: calls.append(1))
    features.net.body.register_forward_hook(lambda *a: calls.append(1))
    fd, pr = FrechetDistance(features), PrecisionRecallDensityCoverage(features)
    update_with_images({"fd": fd, "prdc": pr}, [digits_images(30)], real=True, progress=False)
    assert len(calls) == 1  # body ran once for both metrics
    batch = digits_images(30)
    fd.update(batch, real=False)
    batch.add_(1)  # changed in place: not the same images any more
    pr.update(batch, real=False)
    assert len(calls) == 3
