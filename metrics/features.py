"""Feature extractors for the generation metrics: DINOv2, InceptionV3 (FID), CLIP (CMMD) and a digits classifier.

Every extractor takes images ``(B, C, H, W)`` as ``uint8`` in [0, 255] or floats in [0, 1] (1 or 3 channels), runs
without gradients in chunks of ``batch_size``, and returns float32 features ``(B, num_features)``. Real weights come
from a local path or an already-cached hub id; nothing is downloaded. Missing weights fail at construction with a
message that names the file and the argument to pass.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import weakref
import zipfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_muon.checkpoint import StorageError, atomic_save, check_weights_file
from lightning_muon.metrics.images import check_images, clean_resize, normalize, pil_resize, to_uint8, to_unit_float

__all__ = [
    "ClipFeatures",
    "DigitsFeatures",
    "DinoV2Features",
    "FeatureExtractor",
    "InceptionFeatures",
    "check_images",
    "clean_resize",
    "hub_position_embeddings",
    "load_open_clip",
    "pil_resize",
    "to_uint8",
    "to_unit_float",
]

log = logging.getLogger(__name__)

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def cache_dir() -> Path:
    """``$LIGHTNING_MUON_CACHE`` or ``~/.cache/lightning_muon``."""
    return Path(os.environ.get("LIGHTNING_MUON_CACHE", Path.home() / ".cache" / "lightning_muon"))


def save_to_cache(obj: object, path: Path, what: str) -> None:
    """``atomic_save`` into the cache; a cache that cannot be written (a full disk, a read-only directory) is a
    warning, not a failure: ``what`` is then computed again next time."""
    try:
        atomic_save(obj, path)
    except StorageError as err:
        log.warning("%s not cached: %s", what, err.strerror)


def parameters_digest(module: nn.Module) -> str:
    """A hash of every parameter and buffer (names, shapes, dtypes, bytes): equal exactly when the weights are."""
    digest = hashlib.blake2b(digest_size=16)
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())  # reshape: 0-d buffers (BatchNorm counts)
    return digest.hexdigest()


class FeatureExtractor(nn.Module):
    """Base class: ``name`` and ``num_features`` (torchmetrics' FID reads it), chunked inference-mode ``forward``.

    Subclasses implement :meth:`features` on one chunk (a tensor, or a dict of tensors of which ``layer`` is
    returned). Runs in float32 like every reference implementation; ``autocast=True`` opts in to bf16 on CUDA.
    The features of the most recent input tensor are remembered, so metrics that share an extractor and are
    updated with the same batch run the network once. NaN/inf features are an error.

    Args:
        batch_size: images per forward pass.
        autocast: run in bf16 autocast on CUDA.
    """

    name: str = "features"
    num_features: int
    layer: str | None = None

    def __init__(self, batch_size: int = 64, autocast: bool = False) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.autocast = autocast
        self.memo: dict[str, Any] = {}  # shared by views of one network (InceptionFeatures.view)

    def features(self, images: Tensor) -> Tensor | dict[str, Tensor]:
        raise NotImplementedError

    def settings(self) -> dict[str, Any]:
        """What, besides the weights, decides the features (part of the reference-cache key)."""
        return {"class": type(self).__name__, "name": self.name, "layer": self.layer, "autocast": self.autocast}

    def fingerprint(self) -> dict[str, Any]:
        """:meth:`settings` plus a digest of the weights (computed once)."""
        if "digest" not in self.memo:
            self.memo["digest"] = parameters_digest(self)
        return {**self.settings(), "num_features": int(self.num_features), "weights": self.memo["digest"]}

    def forward(self, images: Tensor) -> Tensor:
        key = (id(images), _version(images), tuple(images.shape), images.dtype)
        seen = self.memo.get("input")
        if self.memo.get("key") != key or seen is None or seen() is not images:
            # a weak reference: the memo never keeps a batch of images alive
            self.memo.update(key=key, input=weakref.ref(images), output=self._extract(images))
        out = self.memo["output"]
        return out[self.layer] if isinstance(out, dict) else out

    def _extract(self, images: Tensor) -> Tensor | dict[str, Tensor]:
        device = next(self.parameters()).device
        use_bf16 = self.autocast and device.type == "cuda"
        check_images(images)
        chunks = []
        with torch.inference_mode(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
            for chunk in images.split(self.batch_size):
                chunks.append(self.features(chunk.to(device)))
        if not chunks:
            return torch.zeros((0, self.num_features), device=device)
        # clone: ordinary tensors, so metric states may be updated in place with them outside inference mode
        if isinstance(chunks[0], dict):
            out: Any = {k: _checked(torch.cat([c[k] for c in chunks]).float().clone(), self.name) for k in chunks[0]}
        else:
            out = _checked(torch.cat(chunks).float().clone(), self.name)
        return out

    def train(self, mode: bool = True) -> FeatureExtractor:
        """Extractors stay in eval mode (no dropout / batch-norm updates), whatever the parent module does."""
        return super().train(False)


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors have no version counter (and cannot be changed outside inference mode)
        return -1


def _checked(features: Tensor, name: str) -> Tensor:
    if not torch.isfinite(features).all():
        raise FloatingPointError(
            f"The {name} extractor produced NaN/inf features; check the images and the weights file (a corrupt or "
            "half-precision-overflowing checkpoint), or run without autocast."
        )
    return features


class DinoV2Features(FeatureExtractor):
    """DINOv2 CLS features (layer-normed, 1024-d for ViT-L/14) as dgm-eval computes them → "FD-DINOv2".

    dgm-eval's recipe (``dgm_eval/models/dinov2.py``): each image through PIL's bicubic resize to 224×224
    (aspect not kept), ``ToTensor``, ImageNet mean/std, then the ``torch.hub`` DINOv2 whose position embeddings
    (37×37 for the 518-px checkpoints) are resized with ``scale_factor=(16 + 0.1) / 37`` (facebookresearch/dinov2's
    ``interpolate_offset=0.1``, bicubic, no antialias). transformers' ``Dinov2Model`` interpolates to
    ``size=(16, 16)`` instead (a 4.6% feature difference on smooth weights), so the hub rule is installed on the
    loaded model. Float images are quantized to uint8 first, as dgm-eval reads PNG files.

    Args:
        weights: a directory with ``config.json`` + weights (``save_pretrained`` layout) or a hub id such as
            ``"facebook/dinov2-large"`` that is already in the Hugging Face cache. Never downloads.
        image_size: input resolution of the network.
        kwargs: :class:`~lightning_muon.metrics.FeatureExtractor`'s options (``batch_size``, ``autocast``).
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
        embeddings = self.model.embeddings
        embeddings.interpolate_pos_encoding = lambda x, h, w: hub_position_embeddings(
            embeddings.position_embeddings, h // self.model.config.patch_size, w // self.model.config.patch_size
        )
        self.image_size = image_size
        self.num_features = self.model.config.hidden_size

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "image_size": self.image_size}

    def features(self, images: Tensor) -> Tensor:
        x = normalize(pil_resize(images, self.image_size), IMAGENET_MEAN, IMAGENET_STD)
        return self.model(pixel_values=x).pooler_output


def hub_position_embeddings(pos: Tensor, rows: int, cols: int, offset: float = 0.1) -> Tensor:
    """facebookresearch/dinov2's ``interpolate_pos_encoding``: the ``M×M`` patch embeddings of ``pos``
    ``(1, 1 + M², d)`` resized bicubically (in float32, no antialias) by
    ``scale_factor=((rows + offset) / M, (cols + offset) / M)``, the class embedding kept; unchanged when the grid
    already matches."""
    m = math.isqrt(pos.shape[1] - 1)
    if (rows, cols) == (m, m):
        return pos
    grid = pos[:, 1:].float().reshape(1, m, m, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, scale_factor=((rows + offset) / m, (cols + offset) / m), mode="bicubic", antialias=False)
    if grid.shape[-2:] != (rows, cols):
        raise ValueError(f"Position-embedding grid {tuple(grid.shape[-2:])} does not match the {rows}x{cols} patches.")
    return torch.cat([pos[:, :1].float(), grid.permute(0, 2, 3, 1).reshape(1, rows * cols, -1)], 1).to(pos.dtype)


#: InceptionFeatures layers and their feature sizes ("spatial": ADM's sFID layer, 7 channels × 17 × 17).
INCEPTION_LAYERS = {"pool3": 2048, "logits": 1008, "spatial": 7 * 17 * 17}


class InceptionFeatures(FeatureExtractor):
    """torch-fidelity's FID InceptionV3 ("inception-v3-compat", the TF 2015 graph ported): FID, KID, IS, sFID.

    The network is torch-fidelity's own module, so with the default ``resize="tf1"`` (uint8 images resized to 299
    by its TensorFlow-1 bilinear rule) the features are torch-fidelity's exactly. ``resize="clean"`` applies
    clean-fid's PIL bicubic resize to 299 first (:func:`clean_resize`). One pass yields every layer:

    - ``"pool3"``: the 2048-d pool features (FID, KID, precision/recall);
    - ``"logits"``: the 1008 logits without bias (torch-fidelity's ``logits_unbiased``: Inception Score);
    - ``"spatial"``: the first 7 channels of ``Mixed_6d``'s 1×1 branch (TF ``mixed_6/conv``), 7×17×17 = 2023-d
      flattened in TF's (H, W, C) order, ADM's evaluator's sFID features.

    :meth:`view` gives another layer of the same network and the same one-pass memo.

    Args:
        weights: the torch-fidelity weights file ``pt_inception-2015-12-05-6726825d.pth``.
        layer: which layer ``forward`` returns.
        resize: ``"tf1"`` (torch-fidelity, pytorch-fid's FID weights) or ``"clean"`` (clean-fid).
        kwargs: :class:`~lightning_muon.metrics.FeatureExtractor`'s options (``batch_size``, ``autocast``).
    """

    name = "inception"

    def __init__(self, weights: str | os.PathLike, layer: str = "pool3", resize: str = "tf1", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if resize not in ("tf1", "clean"):
            raise ValueError(f"resize must be 'tf1' (torch-fidelity) or 'clean' (clean-fid), got {resize!r}.")
        path = Path(weights)
        if not path.is_file():
            raise FileNotFoundError(
                f"InceptionV3 weights file {str(path)!r} does not exist. Pass `weights=` the local torch-fidelity file "
                "pt_inception-2015-12-05-6726825d.pth (download it once on a machine online; this library never "
                "downloads)."
            )
        from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

        check_weights_file(path, "InceptionV3 weights")  # torch-fidelity unpickles it with weights_only=False
        self.net = FeatureExtractorInceptionV3(
            "inception-v3-compat", ["2048", "logits_unbiased"], feature_extractor_weights_path=str(path)
        )
        self.net.Mixed_6d.branch1x1.register_forward_hook(self._keep_spatial)
        self.resize = resize
        self._set_layer(layer)

    def _set_layer(self, layer: str) -> None:
        if layer not in INCEPTION_LAYERS:
            raise ValueError(f"layer must be one of {sorted(INCEPTION_LAYERS)}, got {layer!r}.")
        self.layer, self.num_features = layer, INCEPTION_LAYERS[layer]

    def _keep_spatial(self, module: nn.Module, args: Any, output: Tensor) -> None:
        self.memo["spatial"] = output[:, :7].permute(0, 2, 3, 1).flatten(1)

    def view(self, layer: str) -> InceptionFeatures:
        """The same network (and memo) returning ``layer``."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other._modules = self._modules  # the same submodules, not copies
        other._set_layer(layer)
        return other

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "layer": None, "resize": self.resize}  # the layer is keyed by num_features

    def features(self, images: Tensor) -> dict[str, Tensor]:
        x = clean_resize(images, 299) if self.resize == "clean" else to_uint8(images)
        pool3, logits = self.net(x)
        return {"pool3": pool3, "logits": logits, "spatial": self.memo.pop("spatial").float()}


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


def read_open_clip_state(path: Path) -> dict[str, Tensor]:
    """Weights from a ``.safetensors`` file, OpenAI's TorchScript release (``ViT-L-14-336px.pt``: a TorchScript
    archive, read with ``torch.jit.load``, no pickled Python objects) or a ``torch.save``d state dict / training
    checkpoint ``{"state_dict": ...}`` (HPS v2.1, read with ``weights_only=True``); ``module.`` prefixes removed."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(path)
    elif zipfile.is_zipfile(path) and any(n.endswith("/constants.pkl") for n in zipfile.ZipFile(path).namelist()):
        state = torch.jit.load(str(path), map_location="cpu").state_dict()
        state = {k: v for k, v in state.items() if k not in ("input_resolution", "context_length", "vocab_size")}
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:
            raise ValueError(
                f"Cannot read open_clip weights {str(path)!r} ({type(err).__name__}). Pass a .safetensors file, a "
                "state dict saved with torch.save, or OpenAI's TorchScript .pt release."
            ) from err
        state = state.get("state_dict", state)
    return {k.removeprefix("module."): v for k, v in state.items()}


def load_open_clip(model_name: str, weights: str | os.PathLike, quick_gelu: bool = False) -> nn.Module:
    """An open_clip model of architecture ``model_name`` (a name or a model-config JSON path) with weights from a
    local file (:func:`read_open_clip_state`). ``quick_gelu`` must be True for OpenAI's CLIP weights (trained with
    QuickGELU; open_clip's own ``pretrained="openai"`` entries force it) and False for LAION-trained ones (HPS v2.1)."""
    import open_clip

    path = Path(weights)
    if not path.is_file():
        raise FileNotFoundError(
            f"open_clip checkpoint {str(path)!r} for {model_name} does not exist. Pass `weights=` a local checkpoint "
            "file (this library never downloads)."
        )
    model = open_clip.create_model(open_clip_model_name(model_name), pretrained=None, force_quick_gelu=quick_gelu)
    state = read_open_clip_state(path)
    non_persistent = {name for name, _ in model.named_buffers()} - set(
        model.state_dict()
    )  # a TorchScript file has them
    try:
        model.load_state_dict({k: v for k, v in state.items() if k not in non_persistent})
    except RuntimeError as err:
        raise ValueError(f"{str(path)!r} does not hold {model_name} weights: {err}") from err
    return model.eval()


class ClipFeatures(FeatureExtractor):
    """L2-normalized CLIP image embeddings as google-research/cmmd computes them (ViT-L/14 @ 336 px, OpenAI weights).

    cmmd's recipe: the largest centered square of each image, PIL bicubic resize to 336, /255, OpenAI mean/std
    (``CLIPImageProcessor`` without resize/crop/rescale), the CLIP vision tower with projection, L2 norm.

    Args:
        weights: local file of ``model_name`` weights (``.safetensors``, state dict, or OpenAI's TorchScript ``.pt``).
        model_name: open_clip architecture.
        quick_gelu: the activation of OpenAI's weights (True, cmmd's); False for LAION-trained weights.
        kwargs: :class:`~lightning_muon.metrics.FeatureExtractor`'s options (``batch_size``, ``autocast``).
    """

    def __init__(
        self, weights: str | os.PathLike, model_name: str = "ViT-L-14-336", quick_gelu: bool = True, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.model = load_open_clip(model_name, weights, quick_gelu=quick_gelu)
        self.name = f"clip-{open_clip_model_name(model_name)}"
        self.image_size = clip_image_size(self.model)
        self.mean, self.std = clip_mean_std(self.model)
        self.num_features = self.model.visual.output_dim

    def settings(self) -> dict[str, Any]:
        return {**super().settings(), "image_size": self.image_size}

    def features(self, images: Tensor) -> Tensor:
        x = normalize(pil_resize(images, self.image_size, center_crop=True), self.mean, self.std)
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

    Args:
        path: the classifier's file (default: ``digits_classifier.pt`` in the library's cache directory).
        kwargs: :class:`FeatureExtractor`'s options.
    """

    name = "digits"
    num_features = 64

    def __init__(self, path: str | os.PathLike | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net = _DigitsNet()
        path = Path(path) if path is not None else cache_dir() / "digits_classifier.pt"
        if path.is_file():
            state = torch.load(path, map_location="cpu", weights_only=True)
        else:
            state = _train_digits_classifier()
            save_to_cache(state, path, "The digits feature classifier")
        self.net.load_state_dict(state)
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
