"""Each metric against the implementation users compare with, on the same random-init weights and uint8 images.

The reference recipes (``benchmarks/metric_references.py``, which ``benchmarks/metric_fidelity.py`` shares) are
written from each reference's source, cited per function. Each test has a deliberate-break
control: the step it guards, changed, moves the result outside the tolerance.
"""

import warnings

import numpy as np
import pytest
import torch
from metric_references import (
    SIZES,
    cmmd_embeddings,
    dgm_eval_dinov2,
    hpsv2_scores,
    make_clip_files,
    make_dinov2,
    make_inception_weights,
    our_inception_metrics,
    smooth_images,
    torch_fidelity_metrics,
)

from lightning_muon.metrics import (
    ClipFeatures,
    DinoV2Features,
    FrechetDistance,
    HPSv2Score,
    InceptionFeatures,
    KernelInceptionDistance,
)
from lightning_muon.metrics.images import clean_resize

# ------------------------------------------------------------------------------------ FID / KID / IS: torch-fidelity


@pytest.fixture(scope="module")
def inception_path(tmp_path_factory):
    return make_inception_weights(tmp_path_factory.mktemp("inception") / "pt_inception-2015-12-05-6726825d.pth")


@pytest.mark.parametrize("size", [SIZES[0], *(pytest.param(s, marks=pytest.mark.slow) for s in SIZES[1:])])
def test_fid_kid_is_equal_torch_fidelity(inception_path, size):
    real, fake = smooth_images(10, size, 0), smooth_images(10, size, 1)
    ref = torch_fidelity_metrics(inception_path, real, fake)
    ours = our_inception_metrics(inception_path, real, fake)
    assert ref["frechet_inception_distance"] > 1.0 and ref["inception_score_mean"] > 2.0  # informative, not ~0 / ~1
    assert ours["fid"] == pytest.approx(ref["frechet_inception_distance"], rel=1e-4)
    # torch-fidelity's kernel runs in float32 numpy, ours in float64: a few 1e-6 apart relative to the kernel's size
    assert ours["kid"] == pytest.approx(ref["kernel_inception_distance_mean"], rel=1e-4, abs=1e-6)
    assert ours["kid_std"] == pytest.approx(ref["kernel_inception_distance_std"], rel=1e-3, abs=1e-6)
    assert ours["is"] == pytest.approx(ref["inception_score_mean"], rel=1e-5)
    assert ours["is_std"] == pytest.approx(ref["inception_score_std"], rel=1e-3, abs=1e-7)
    # control: clean-fid's resize instead of torch-fidelity's TF1 bilinear changes FID beyond the tolerance
    clean = our_inception_metrics(inception_path, real, fake, resize="clean")
    assert clean["fid"] != pytest.approx(ref["frechet_inception_distance"], rel=1e-3)
    assert clean["is"] != pytest.approx(ref["inception_score_mean"], rel=1e-4)
    # control: another subset draw (seed) changes KID, so the draw order above is what matched
    other = KernelInceptionDistance(InceptionFeatures(inception_path), subsets=7, subset_size=6, seed=1)
    other.update(real, real=True)
    other.update(fake, real=False)
    assert other.compute()["kid"].item() != pytest.approx(ref["kernel_inception_distance_mean"], rel=1e-3)


def test_clean_resize_equals_clean_fid():
    from cleanfid.resize import make_resizer

    resizer = make_resizer("PIL", False, "bicubic", (299, 299))  # clean-fid's "clean" mode
    for size in SIZES:
        g = torch.Generator().manual_seed(size)
        images = torch.randint(0, 256, (3, 3, size, size), generator=g, dtype=torch.uint8)  # sharp: resizers differ
        expected = np.stack([resizer(x) for x in images.permute(0, 2, 3, 1).numpy()])
        ours = clean_resize(images, 299).permute(0, 2, 3, 1).numpy()
        # ours rounds clean-fid's floats to uint8 (the network takes uint8): at most half a grey level apart
        assert np.abs(ours.astype(np.float64) - expected).max() <= 0.5 + 1e-4
        np.testing.assert_array_equal(ours, np.round(expected).astype(np.uint8))
        # control: a plain bilinear resize (pytorch-fid's) is far from clean-fid's
        tv = torch.nn.functional.interpolate(images.float(), size=(299, 299), mode="bilinear", antialias=False)
        assert np.abs(tv.permute(0, 2, 3, 1).numpy() - expected).mean() > 1.0


def test_sfid_features_are_mixed_6d_1x1_first_7_channels_hwc(inception_path):
    """ADM's evaluator takes ``mixed_6/conv`` (``Mixed_6d.branch1x1``) ``[..., :7]`` in NHWC and flattens it."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    images = smooth_images(4, 64, 3)
    net = FeatureExtractorInceptionV3(
        "inception-v3-compat", ["2048"], feature_extractor_weights_path=str(inception_path)
    )
    seen = {}
    net.Mixed_6d.branch1x1.register_forward_hook(lambda m, a, out: seen.update(x=out))
    with torch.no_grad():
        net(images)
    expected = seen["x"][:, :7].permute(0, 2, 3, 1).reshape(4, -1)  # NHWC flatten, 17·17·7 = 2023
    spatial = InceptionFeatures(inception_path).view("spatial")
    torch.testing.assert_close(spatial(images), expected, rtol=0, atol=0)
    assert spatial.num_features == 2023
    # the reference-cache key: the weights' digest covers 0-d buffers (BatchNorm counts), the layer its size
    assert (
        spatial.fingerprint()["num_features"] == 2023 != InceptionFeatures(inception_path).fingerprint()["num_features"]
    )
    # control: channel-first flattening (a natural PyTorch slip) does not match
    assert not torch.allclose(spatial(images), seen["x"][:, :7].reshape(4, -1))


@pytest.mark.slow
def test_adm_reference_batch_npz(inception_path, tmp_path):
    inception = InceptionFeatures(inception_path)
    real, fake = smooth_images(12, 64, 4), smooth_images(12, 64, 5)
    direct = FrechetDistance(inception)
    direct.update(real, real=True)
    direct.update(fake, real=False)
    pool, spatial = inception(real).double(), inception.view("spatial")(real).double()
    path = tmp_path / "VIRTUAL_ref.npz"
    np.savez(
        path,
        arr_0=real.permute(0, 2, 3, 1).numpy(),
        mu=pool.mean(0).numpy(),
        sigma=np.cov(pool.numpy(), rowvar=False),
        mu_s=spatial.mean(0).numpy(),
        sigma_s=np.cov(spatial.numpy(), rowvar=False),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for extractor, metric_real in ((inception, direct), (inception.view("spatial"), None)):
            metric = FrechetDistance(extractor)
            metric.load_adm_reference(path)
            metric.update(fake, real=False)
            if metric_real is None:
                metric_real = FrechetDistance(extractor)
                metric_real.update(real, real=True)
                metric_real.update(fake, real=False)
            assert metric.compute().item() == pytest.approx(metric_real.compute().item(), rel=1e-6)
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, mu=np.array([{"x": 1}], dtype=object), sigma=np.zeros((2048, 2048)))
    with pytest.raises(ValueError, match="allow_pickle"):
        FrechetDistance(inception).load_adm_reference(pickled)
    with pytest.raises(ValueError, match="no \\['mu', 'sigma'\\]"):
        np.savez(tmp_path / "other.npz", x=np.zeros(3))
        FrechetDistance(inception).load_adm_reference(tmp_path / "other.npz")


# ------------------------------------------------------------------------------------------- FD-DINOv2: dgm-eval


@pytest.mark.parametrize("size", SIZES)
def test_dinov2_features_equal_dgm_eval(tmp_path, size):
    from transformers import Dinov2Model

    model, weights = make_dinov2(tmp_path / "dinov2")
    images = smooth_images(5, size, 6, height=size * 3 // 4)  # not square: dgm-eval squashes to 224×224
    expected = dgm_eval_dinov2(weights, images)
    ours = DinoV2Features(weights, batch_size=2)(images)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    # control: transformers' own interpolation (size=(16, 16)) is what dgm-eval does not do
    from lightning_muon.metrics.features import IMAGENET_MEAN, IMAGENET_STD, hub_position_embeddings
    from lightning_muon.metrics.images import normalize, pil_resize

    x = normalize(pil_resize(images, 224), IMAGENET_MEAN, IMAGENET_STD)
    with torch.no_grad():
        plain = Dinov2Model.from_pretrained(weights).eval()(pixel_values=x).pooler_output
    assert not torch.allclose(plain, expected, rtol=1e-5, atol=1e-5)
    pos = model.embeddings.position_embeddings
    hub, hf = (
        hub_position_embeddings(pos, 16, 16),
        model.embeddings.interpolate_pos_encoding(torch.zeros(1, 257, 32), 224, 224),
    )
    assert (hub - hf).norm() / hf.norm() > 1e-3  # the two interpolation rules differ by the 0.1-patch offset


# ---------------------------------------------------------------------------------------------- CMMD: cmmd's CLIP


@pytest.fixture(scope="module")
def clip_files(tmp_path_factory):
    return make_clip_files(tmp_path_factory.mktemp("clip"))


@pytest.mark.parametrize("size", SIZES)
def test_cmmd_clip_embeddings_equal_cmmd_recipe_with_quick_gelu(clip_files, size):
    import open_clip

    reference = open_clip.create_model("tiny-test-clip", pretrained=None, force_quick_gelu=True)
    reference.load_state_dict(ClipFeatures(clip_files["checkpoint"], "tiny-test-clip").model.state_dict())
    images = smooth_images(4, size, 7, height=size // 2)  # cmmd center-crops
    expected = cmmd_embeddings(reference, images, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.load is deprecated
        for kind, path in clip_files.items():
            ours = ClipFeatures(path, "tiny-test-clip", batch_size=3)(images)
            torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5, msg=lambda m, kind=kind: f"{kind}: {m}")
    # control: the same weights with GELU (what open_clip's plain "ViT-L-14-336" builds) give other embeddings
    gelu = ClipFeatures(clip_files["checkpoint"], "tiny-test-clip", quick_gelu=False)(images)
    assert (gelu - expected).norm() / expected.norm() > 1e-3


def test_open_clip_unreadable_or_mismatched_weights(tmp_path, clip_files):
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="Cannot read open_clip weights .*safetensors"):
        ClipFeatures(bad, "tiny-test-clip")
    with pytest.raises(ValueError, match="does not hold ViT-B-32 weights"):
        ClipFeatures(clip_files["safetensors"], "ViT-B-32")


# ------------------------------------------------------------------------------------------------- HPSv2.1: hpsv2


@pytest.mark.parametrize("size", SIZES)
def test_hpsv2_equals_hpsv2_recipe(clip_files, size):
    import open_clip

    prompts = ["a cat", "a dog", "a red car", "two birds"]
    images = smooth_images(4, size, 8, height=size * 2 // 3)  # letterboxed: padded top and bottom
    hps = HPSv2Score(clip_files["checkpoint"], model_name="tiny-test-clip", batch_size=3)
    reference = open_clip.create_model("tiny-test-clip", pretrained=None)
    reference.load_state_dict(hps.model.state_dict())
    expected = hpsv2_scores(reference, images, prompts, 32)
    torch.testing.assert_close(hps.scores(images, prompts), expected, rtol=1e-5, atol=1e-5)
    hps.update(images[:1], prompts[:1])
    hps.update(images[:0], [])  # an empty batch (a rank with nothing left to score) is a no-op
    hps.update(images[1:], prompts[1:])
    assert hps.compute().item() == pytest.approx(expected.mean().item(), rel=1e-5)
    # control: center-crop resizing (open_clip's default eval transform) instead of hpsv2's letterbox
    from torchvision.transforms.functional import center_crop, resize

    x = center_crop(resize(images.float() / 255, 32, antialias=True), [32, 32])
    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        img = torch.nn.functional.normalize(reference.encode_image((x - mean) / std), dim=-1)
        txt = torch.nn.functional.normalize(
            reference.encode_text(open_clip.get_tokenizer("tiny-test-clip")(prompts)), dim=-1
        )
    assert ((img * txt).sum(-1) - expected).abs().max() > 1e-4
