"""Feature extractors for the generation metrics: DINOv2, InceptionV3 (FID), CLIP (CMMD) and a digits classifier.

Every extractor takes images ``(B, C, H, W)`` as ``uint8`` in [0, 255] or floats in [0, 1] (1 or 3 channels), runs
without gradients in chunks of ``batch_size``, and returns float32 features ``(B, num_features)``. Real weights come
from a local path or an already-cached hub id; nothing is downloaded. Missing weights fail at construction with a
message that names the file and the argument to pass.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ClipFeatures",
    "DigitsFeatures",
    "DinoV2Features",
    "FeatureExtractor",
    "InceptionFeatures",
    "load_open_clip",
    "resize_normalize",
    "to_unit_float",
]

log = logging.getLogger(__name__)

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def cache_dir() -> Path:
    """``$LIGHTNING_MUON_CACHE`` or ``~/.cache/lightning_muon``."""
    return Path(os.environ.get("LIGHTNING_MUON_CACHE", Path.home() / ".cache" / "lightning_muon"))


def to_unit_float(images: Tensor, channels: int = 3) -> Tensor:
    """uint8 [0, 255] or float [0, 1] images ``(B, C, H, W)`` → float32 in [0, 1] with ``channels`` channels."""
    if images.ndim != 4:
        raise ValueError(f"Expected images (B, C, H, W), got shape {tuple(images.shape)}.")
    x = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    if x.shape[1] == channels:
        return x
    if x.shape[1] == 1:
        return x.expand(-1, channels, -1, -1)
    if channels == 1 and x.shape[1] == 3:
        return x.mean(1, keepdim=True)
    raise ValueError(f"Expected 1 or {channels} channels, got {x.shape[1]}.")


def resize_normalize(x: Tensor, size: int, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """Bicubic (antialiased) resize of the short side to ``size``, center crop, then ``(x - mean) / std``."""
    h, w = x.shape[-2:]
    if (h, w) != (size, size):
        scale = size / min(h, w)
        x = F.interpolate(
            x,
            size=(max(size, round(h * scale)), max(size, round(w * scale))),
            mode="bicubic",
            antialias=True,
            align_corners=False,
        )
        top, left = (x.shape[-2] - size) // 2, (x.shape[-1] - size) // 2
        x = x[..., top : top + size, left : left + size]
    mean_t = torch.tensor(mean, device=x.device).view(1, -1, 1, 1)
    std_t = torch.tensor(std, device=x.device).view(1, -1, 1, 1)
    return (x - mean_t) / std_t


class FeatureExtractor(nn.Module):
    """Base class: ``name`` and ``num_features`` (torchmetrics' FID reads it), chunked inference-mode ``forward``.

    Subclasses implement :meth:`features` on one chunk. ``autocast`` runs the network in bf16 on CUDA.
    """

    name: str = "features"
    num_features: int

    def __init__(self, batch_size: int = 64, autocast: bool = True) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.autocast = autocast

    def features(self, images: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, images: Tensor) -> Tensor:
        device = next(self.parameters()).device
        use_bf16 = self.autocast and device.type == "cuda"
        out = []
        with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            for chunk in images.split(self.batch_size):
                out.append(self.features(chunk.to(device)).float())
        # clone: an ordinary tensor, so metric states may be updated in place with it outside inference mode
        return torch.cat(out).clone() if out else torch.zeros((0, self.num_features), device=device)

    def train(self, mode: bool = True) -> FeatureExtractor:
        """Extractors stay in eval mode (no dropout / batch-norm updates), whatever the parent module does."""
        return super().train(False)


class DinoV2Features(FeatureExtractor):
    """DINOv2 CLS features (layer-normed, 1024-d for ViT-L/14): bicubic 224 resize, ImageNet mean/std → "FD-DINOv2".

    Args:
        weights: a directory with ``config.json`` + weights (``save_pretrained`` layout) or a hub id such as
            ``"facebook/dinov2-large"`` that is already in the Hugging Face cache. Never downloads.
        image_size: input resolution of the network.
    """

    name = "dinov2"

    def __init__(self, weights: str | os.PathLike = "facebook/dinov2-large", image_size: int = 224, **kwargs) -> None:
        super().__init__(**kwargs)
        from transformers import Dinov2Model

        try:
            self.model = Dinov2Model.from_pretrained(str(weights), local_files_only=True)
        except OSError as err:
            raise FileNotFoundError(
                f"DINOv2 weights not found at {str(weights)!r}: neither a local directory nor a cached hub id (this "
                "library never downloads). Pass `weights=` a directory holding config.json and model.safetensors, "
                "e.g. made with `huggingface-cli download facebook/dinov2-large --local-dir DIR` on a machine online."
            ) from err
        self.model.eval()
        self.image_size = image_size
        self.num_features = self.model.config.hidden_size

    def features(self, images: Tensor) -> Tensor:
        x = resize_normalize(to_unit_float(images), self.image_size, IMAGENET_MEAN, IMAGENET_STD)
        return self.model(pixel_values=x).pooler_output


class InceptionFeatures(FeatureExtractor):
    """InceptionV3 pool3 features (2048-d) with torch-fidelity's FID network → "FID".

    Args:
        weights: the torch-fidelity weights file ``pt_inception-2015-12-05-6726825d.pth``.
    """

    name = "inception"
    num_features = 2048

    def __init__(self, weights: str | os.PathLike, **kwargs) -> None:
        super().__init__(**kwargs)
        path = Path(weights)
        if not path.is_file():
            raise FileNotFoundError(
                f"InceptionV3 weights file {str(path)!r} does not exist. Pass `weights=` the local torch-fidelity file "
                "pt_inception-2015-12-05-6726825d.pth (download it once on a machine online; this library never "
                "downloads)."
            )
        from torchmetrics.image.fid import NoTrainInceptionV3

        from lightning_muon.checkpoint import check_weights_file

        check_weights_file(path, "InceptionV3 weights")  # torch-fidelity unpickles it with weights_only=False
        self.model = NoTrainInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=str(path))

    def features(self, images: Tensor) -> Tensor:
        x = (to_unit_float(images) * 255).round().to(torch.uint8)  # the FID network takes uint8 and resizes to 299
        return self.model(x).reshape(len(x), -1)


def open_clip_model_name(model_name: str | os.PathLike) -> str:
    """An open_clip architecture name; a path to an open_clip model-config JSON file is registered under its stem
    (a custom or shrunken architecture), so it can be named in YAML configs and subprocesses alike."""
    import open_clip

    path = Path(model_name)
    if path.suffix == ".json":
        if not path.is_file():
            raise FileNotFoundError(f"open_clip model config {str(path)!r} does not exist.")
        open_clip.add_model_config(path)
        return path.stem
    return str(model_name)


def load_open_clip(model_name: str, weights: str | os.PathLike) -> nn.Module:
    """An open_clip model of architecture ``model_name`` (a name or a model-config JSON path) with weights from a
    local checkpoint file.

    Accepts plain state dicts and training checkpoints ``{"state_dict": ...}`` (HPS v2.1), ``module.`` prefixes removed.
    """
    import open_clip

    path = Path(weights)
    if not path.is_file():
        raise FileNotFoundError(
            f"open_clip checkpoint {str(path)!r} for {model_name} does not exist. Pass `weights=` a local checkpoint "
            "file (this library never downloads)."
        )
    model = open_clip.create_model(open_clip_model_name(model_name), pretrained=None)
    state = torch.load(path, map_location="cpu", weights_only=True)
    state = state.get("state_dict", state)
    model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    return model.eval()


class ClipFeatures(FeatureExtractor):
    """L2-normalized CLIP image embeddings (open_clip), as CMMD uses (ViT-L/14 @ 336 px).

    Args:
        weights: local open_clip checkpoint of ``model_name``.
        model_name: open_clip architecture.
    """

    def __init__(self, weights: str | os.PathLike, model_name: str = "ViT-L-14-336", **kwargs) -> None:
        super().__init__(**kwargs)
        self.model = load_open_clip(model_name, weights)
        self.name = f"clip-{open_clip_model_name(model_name)}"
        self.image_size = clip_image_size(self.model)
        self.mean, self.std = clip_mean_std(self.model)
        self.num_features = self.model.visual.output_dim

    def features(self, images: Tensor) -> Tensor:
        x = resize_normalize(to_unit_float(images), self.image_size, self.mean, self.std)
        return F.normalize(self.model.encode_image(x).float(), dim=-1)


def clip_image_size(model: nn.Module) -> int:
    size = model.visual.image_size
    return size[0] if isinstance(size, (tuple, list)) else int(size)


def clip_mean_std(model: nn.Module) -> tuple[tuple[float, ...], tuple[float, ...]]:
    import open_clip

    mean = getattr(model.visual, "image_mean", None) or open_clip.OPENAI_DATASET_MEAN
    std = getattr(model.visual, "image_std", None) or open_clip.OPENAI_DATASET_STD
    return tuple(mean), tuple(std)


class _DigitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh())
        self.head = nn.Linear(64, 10)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


class DigitsFeatures(FeatureExtractor):
    """64-d penultimate features of a small classifier of sklearn's 8×8 digits, for the offline default run.

    Trained once with a fixed seed (full-batch Adam, ~2 s on a CPU, ~99% train accuracy) and cached as
    ``<cache>/digits_classifier.pt``; later constructions load the file. Images are converted to grayscale in
    [0, 1] and resized to 8×8 (digits pixel value v ↔ v / 16).
    """

    name = "digits"
    num_features = 64

    def __init__(self, path: str | os.PathLike | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net = _DigitsNet()
        path = Path(path) if path is not None else cache_dir() / "digits_classifier.pt"
        if not path.is_file():
            atomic_save(_train_digits_classifier(), path)
            log.info("Trained the digits feature classifier and cached it at %s", path)
        self.net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        self.net.eval()

    def features(self, images: Tensor) -> Tensor:
        x = to_unit_float(images, channels=1)
        if x.shape[-2:] != (8, 8):
            x = F.interpolate(x, size=(8, 8), mode="bilinear", antialias=True, align_corners=False)
        return self.net.body(x.flatten(1))


def _train_digits_classifier(epochs: int = 300, seed: int = 0) -> dict[str, Tensor]:
    """Weights of the digits classifier, full-batch Adam from a seeded init (the global RNG is left untouched)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        torch.manual_seed(seed)
        net = _DigitsNet()
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        for _ in range(epochs):
            loss = F.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return net.state_dict()


def atomic_save(obj: object, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file beside ``path``, then rename: readers never see a half-written file."""
    from lightning_muon.checkpoint import atomic_write

    atomic_write(path, lambda tmp: torch.save(obj, tmp))
