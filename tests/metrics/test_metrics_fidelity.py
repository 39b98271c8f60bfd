"""Each metric against the implementation users compare with, on the same random-init weights and uint8 images.

Every reference recipe is written here from the reference's source (torch-fidelity and clean-fid are called
directly; dgm-eval, google-research/cmmd and hpsv2 cannot be installed beside this project's pins or need the
network, so their preprocessing is re-typed from their sources, cited per test). Each test has a deliberate-break
control: the step it guards, changed, moves the result outside the tolerance.
"""

import warnings

import numpy as np
import pytest
import torch
from helpers import random_inception_state_dict, tiny_open_clip_config
from PIL import Image

from lightning_muon.metrics import (
    ClipFeatures,
    DinoV2Features,
    FrechetDistance,
    HPSv2Score,
    InceptionFeatures,
    InceptionScore,
    KernelInceptionDistance,
)
from lightning_muon.metrics.images import clean_resize

SIZES = (64, 256, 512)


def smooth_images(n: int, size: int, seed: int, height: int | None = None) -> torch.Tensor:
    """uint8 ``(n, 3, height or size, size)``: random 8×8 colour fields upsampled, photo-like (not white noise)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.interpolate(
        torch.rand(n, 3, 8, 8, generator=g), size=(height or size, size), mode="bicubic"
    )
    return (x.clamp(0, 1) * 255).round().to(torch.uint8)


def pil_images(images: torch.Tensor) -> list[Image.Image]:
    return [Image.fromarray(x) for x in images.permute(0, 2, 3, 1).numpy()]


class Images(torch.utils.data.Dataset):
    """What torch-fidelity reads: uint8 ``(3, H, W)`` tensors."""

    def __init__(self, images: torch.Tensor) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.images[i]


# ------------------------------------------------------------------------------------ FID / KID / IS: torch-fidelity
def make_inception_weights(path):
    """torch-fidelity's layer layout with random weights that make every metric informative: conv weights scaled
    to keep activations O(1) through the 94 layers (PyTorch's default init shrinks them ~3× per layer: features,
    and FID, would be ~0), and classifier rows orthogonal to the mean pool3 feature and large, so the logits vary
    from image to image as a trained classifier's do (else every Inception Score would be 1.000)."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    state = {k: v * 6**0.5 if k.endswith("conv.weight") else v for k, v in random_inception_state_dict().items()}
    torch.save(state, path)
    net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(path))
    with torch.no_grad():
        (pool3,) = net(smooth_images(16, 64, 99))
    mean = torch.nn.functional.normalize(pool3.mean(0), dim=0)
    fc = state["fc.weight"] - (state["fc.weight"] @ mean)[:, None] * mean[None, :]
    torch.save({**state, "fc.weight": fc * 300 / (pool3 - pool3.mean(0)).norm(dim=1).mean()}, path)
    return path


@pytest.fixture(scope="module")
def inception_path(tmp_path_factory):
    return make_inception_weights(tmp_path_factory.mktemp("inception") / "pt_inception-2015-12-05-6726825d.pth")


def torch_fidelity_metrics(weights, real, fake, splits=2, subsets=7, subset_size=6):
    """``torch_fidelity.calculate_metrics`` (FID, KID, IS; generated = ``input1``) on uint8 image tensors."""
    import torch_fidelity

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch_fidelity.calculate_metrics(
            input1=Images(fake),
            input2=Images(real),
            fid=True,
            kid=True,
            isc=True,
            isc_splits=splits,
            kid_subsets=subsets,
            kid_subset_size=subset_size,
            feature_extractor_weights_path=str(weights),
            cuda=False,
            cache=False,
            verbose=False,
            batch_size=len(real),
        )


def our_inception_metrics(weights, real, fake, splits=2, subsets=7, subset_size=6, **kwargs):
    """Our FID, KID and IS on one shared InceptionFeatures pass per batch."""
    inception = InceptionFeatures(weights, batch_size=len(real), **kwargs)
    fid, kid = FrechetDistance(inception), KernelInceptionDistance(inception, subsets=subsets, subset_size=subset_size)
    isc = InceptionScore(inception.view("logits"), splits=splits)
    for metric in (fid, kid):
        metric.update(real, real=True)
    for metric in (fid, kid, isc):
        metric.update(fake, real=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # n < d
        return {"fid": fid.compute().item(), **{k: v.item() for k, v in {**kid.compute(), **isc.compute()}.items()}}


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
def dgm_eval_dinov2(weights_dir, images: torch.Tensor) -> torch.Tensor:
    """dgm-eval's recipe, re-typed from ``dgm_eval/models/dinov2.py`` and facebookresearch/dinov2's
    ``vision_transformer.interpolate_pos_encoding`` (``interpolate_offset=0.1``, bicubic, no antialias): each PIL
    image through ``Resize((224, 224), BICUBIC)``, ``ToTensor``, ImageNet ``Normalize``, then the hub model. The hub
    interpolation is applied here once, to build a 224-px model whose embeddings need no interpolation at all."""
    import math

    import torchvision.transforms as T
    from transformers import Dinov2Model

    transform = T.Compose(
        [
            T.Resize((224, 224), T.InterpolationMode.BICUBIC),
            T.ToTensor(),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    x = torch.stack([transform(im) for im in pil_images(images)])
    source = Dinov2Model.from_pretrained(weights_dir)
    pos = source.embeddings.position_embeddings.detach()
    m, w0 = math.isqrt(pos.shape[1] - 1), 224 // source.config.patch_size
    grid = pos[:, 1:].reshape(1, m, m, -1).permute(0, 3, 1, 2)
    grid = torch.nn.functional.interpolate(
        grid, scale_factor=((w0 + 0.1) / m, (w0 + 0.1) / m), mode="bicubic", antialias=False
    )
    config = source.config
    config.image_size = 224
    hub = Dinov2Model(config)
    state = source.state_dict()
    state["embeddings.position_embeddings"] = torch.cat(
        [pos[:, :1], grid.permute(0, 2, 3, 1).reshape(1, w0 * w0, -1)], 1
    )
    hub.load_state_dict(state)
    with torch.no_grad():
        return hub.eval()(pixel_values=x).pooler_output


def make_dinov2(path):
    """A DINOv2 with the real checkpoints' geometry (518 px, patch 14: a 37×37 position grid) at hidden size 32,
    its position embeddings a smooth O(1) field like trained ones (init's are 0.02 noise)."""
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, patch_size=14, image_size=518
    )
    model = Dinov2Model(config)
    with torch.no_grad():
        grid = torch.nn.functional.interpolate(torch.randn(1, 32, 5, 5), size=(37, 37), mode="bicubic")
        model.embeddings.position_embeddings[:, 1:] = grid.permute(0, 2, 3, 1).reshape(1, 37 * 37, 32)
    model.save_pretrained(path)
    return model, path


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
def cmmd_embeddings(model, images: torch.Tensor, size: int) -> torch.Tensor:
    """google-research/cmmd's recipe, re-typed from ``io_util.py`` / ``embedding.py``: the largest centered square,
    PIL bicubic resize to the model's size, /255, ``_resize_bicubic`` (torch bicubic to the same size: a no-op),
    ``CLIPImageProcessor`` normalization only (OpenAI mean/std), the vision tower + projection, L2 norm."""
    import open_clip

    def crop_resize(im: Image.Image) -> np.ndarray:
        w, h = im.size
        side = min(w, h)
        box = ((w - side) // 2, (h - side) // 2, (w - side) // 2 + side, (h - side) // 2 + side)
        return np.asarray(im.crop(box).resize((size, size), resample=Image.BICUBIC).convert("RGB")).astype(np.float32)

    batch = np.stack([crop_resize(im) for im in pil_images(images)]) / 255.0
    x = torch.from_numpy(batch.transpose(0, 3, 1, 2)).float()
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="bicubic")
    mean = torch.tensor(open_clip.OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(open_clip.OPENAI_DATASET_STD).view(1, 3, 1, 1)
    with torch.no_grad():
        emb = model.eval().encode_image((x - mean) / std)
    return emb / emb.norm(dim=-1, keepdim=True)


def make_clip_files(root):
    """The same tiny CLIP as a state-dict checkpoint, a .safetensors file and an OpenAI-style TorchScript archive."""
    import open_clip
    from safetensors.torch import save_file

    model, checkpoint = tiny_open_clip_config(root)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, root / "tiny.safetensors")
    images, text = torch.rand(1, 3, 32, 32), open_clip.get_tokenizer("tiny-test-clip")(["a cat"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.trace(model.eval(), (images, text), check_trace=False).save(str(root / "tiny-openai.pt"))
    return {"checkpoint": checkpoint, "safetensors": root / "tiny.safetensors", "torchscript": root / "tiny-openai.pt"}


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
def hpsv2_scores(model, images: torch.Tensor, prompts: list[str], size: int) -> torch.Tensor:
    """The ``hpsv2`` package's ``score``: ``preprocess_val`` = ``image_transform(..., resize_longest_max=True)``
    re-typed from ``hpsv2/src/open_clip/transform.py`` (RGB, ``ToTensor``, ``ResizeMaxSize(size, fill=0)``,
    ``Normalize`` with OpenAI mean/std), then ``model(image, text)`` and the diagonal of
    ``image_features @ text_features.T``."""
    import open_clip
    import torchvision.transforms.functional as F
    from torchvision.transforms import InterpolationMode, Normalize, ToTensor

    def resize_max_size(img: torch.Tensor) -> torch.Tensor:
        height, width = img.shape[1:]
        scale = size / float(max(height, width))
        if scale != 1.0:
            new_size = tuple(round(dim * scale) for dim in (height, width))
            img = F.resize(img, new_size, InterpolationMode.BICUBIC)
            pad_h, pad_w = size - new_size[0], size - new_size[1]
            img = F.pad(img, padding=[pad_w // 2, pad_h // 2, pad_w - pad_w // 2, pad_h - pad_h // 2], fill=0)
        return img

    norm = Normalize(open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD)
    scores = []
    tokenizer = open_clip.get_tokenizer("tiny-test-clip")
    for im, prompt in zip(pil_images(images), prompts):
        image = norm(resize_max_size(ToTensor()(im.convert("RGB")))).unsqueeze(0)
        with torch.no_grad():
            out = model.eval()(image, tokenizer([prompt]))
        logits = out["image_features"] @ out["text_features"].T if isinstance(out, dict) else out[0] @ out[1].T
        scores.append(torch.diagonal(logits))
    return torch.cat(scores)


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
