"""The reference recipes the metric tests and ``benchmarks/metric_fidelity.py`` compare with, written from each
reference's source: torch-fidelity and clean-fid called directly; dgm-eval, google-research/cmmd, hpsv2 and the
GenEval 2 reference re-typed (they cannot be installed beside this project's pins or need the network), cited per
function. Tests import them from here; a benchmark never imports the tests."""

import warnings

import numpy as np
import torch
from fixtures import random_inception_state_dict, tiny_open_clip_config
from PIL import Image

from lightning_muon.metrics import (
    FrechetDistance,
    InceptionFeatures,
    InceptionScore,
    KernelInceptionDistance,
)

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


NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def reference_probability(model, processor, image, question, answer):
    """One image, one question, as the reference asks it; P(answer) summed over its distinct one-token spellings."""
    from PIL import Image

    picture = Image.fromarray(image.permute(1, 2, 0).numpy())
    content = [{"type": "image", "image": picture}, {"type": "text", "text": f"{question} Answer in one word."}]
    inputs = processor.apply_chat_template(
        [{"role": "user", "content": content}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        probs = model(**inputs).logits[0, -1].float().softmax(-1)
    if question.startswith("How many"):
        digits = str(NUMBERS.index(answer) + 1)
        spellings = [answer, answer.capitalize(), " " + answer, " " + answer.capitalize(), digits, " " + digits]
    else:
        spellings = ["Yes", "yes", " yes", " Yes"]
    ids = {tuple(processor.tokenizer.encode(s, add_special_tokens=False)) for s in spellings}
    return float(sum(probs[i[0]] for i in ids if len(i) == 1))


def reference_report(score_lists, rows):
    """The reference's aggregation: mean of per-image gmean; skills pooled over atoms; atomicity mean of gmeans."""
    from scipy.stats import gmean

    report = {"geneval2": 100 * np.mean([gmean(s) for s in score_lists])}
    report["geneval2_am"] = 100 * np.mean([np.mean(s) for s in score_lists])
    for skill in ("object", "attribute", "count", "position", "verb"):
        pooled = [p for s, r in zip(score_lists, rows) for p, k in zip(s, r["skills"]) if k == skill]
        if pooled:
            report[f"geneval2_skill_{skill}"] = 100 * np.mean(pooled)
    for n in sorted({r["atom_count"] for r in rows}):
        gms = [gmean(s) for s, r in zip(score_lists, rows) if r["atom_count"] == n]
        report[f"geneval2_atoms_{n}"] = 100 * np.mean(gms)
    return report
