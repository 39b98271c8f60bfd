"""Metric classes: batching invariance, DDP == single process, reference caching, extractors, missing weights."""

import pytest
import torch
from helpers import (
    ddp_metric_worker,
    digits_images,
    digits_metrics,
    metric_values,
    random_inception_state_dict,
    run_distributed,
    tiny_open_clip_config,
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
