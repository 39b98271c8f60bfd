"""Image folders: training data for the recipes and reference sets for the evaluation."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["IMAGE_SUFFIXES", "FolderImages", "ImageFolder", "folder_images", "image_set_fingerprint"]

log = logging.getLogger(__name__)
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


class ImageFolder(Dataset):
    """Images from class sub-folders (``root/<class>/*.png``) or a captions file (``root/captions.jsonl`` with
    ``{"file": ..., "caption": ...}`` lines). Resized (short side) and center-cropped to ``size``, in [-1, 1].

    A missing or corrupt image raises an error naming the file, or with ``skip_corrupt=True`` is replaced by the
    next readable one and counted in ``skipped``. Only regular files are read (a FIFO or device named ``*.png`` is
    skipped, never opened), and a captions file may name only files inside ``root``.
    """

    def __init__(self, root: str | Path, size: int, skip_corrupt: bool = False) -> None:
        self.root, self.size, self.skip_corrupt = Path(root), size, skip_corrupt
        captions = self.root / "captions.jsonl"
        if captions.is_file():
            rows = [_caption_row(captions, n, line) for n, line in enumerate(captions.read_text().splitlines(), 1)]
            rows = [r for r in rows if r is not None]
            self.files = [_inside(self.root, r["file"], captions) for r in rows]
            self.captions: list[str] | None = [r["caption"] for r in rows]
            self.classes: list[str] = []
            self.labels = [0] * len(rows)
        else:
            self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir()) if self.root.is_dir() else []
            if not self.classes:
                raise FileNotFoundError(f"{self.root} has neither class sub-folders nor a captions.jsonl file.")
            pairs = [
                (f, c)
                for c, name in enumerate(self.classes)
                for f in sorted((self.root / name).iterdir())
                if f.suffix.lower() in IMAGE_SUFFIXES and f.is_file()  # regular files only: a FIFO would hang
            ]
            self.files, self.labels = [f for f, _ in pairs], [c for _, c in pairs]
            self.captions = None
        self.skipped = 0

    def __len__(self) -> int:
        return len(self.files)

    def load(self, path: Path) -> torch.Tensor:
        from PIL import Image, UnidentifiedImageError
        from torchvision.transforms.functional import center_crop, pil_to_tensor, resize

        try:
            if not path.is_file():  # missing, or not a regular file (a FIFO would block the open)
                raise FileNotFoundError("not a regular file")
            with Image.open(path) as image:
                x = pil_to_tensor(image.convert("RGB"))
        except (FileNotFoundError, UnidentifiedImageError, OSError) as err:
            raise OSError(
                f"Cannot read image {path}: {err}. Fix or remove the file, or pass skip_corrupt=True."
            ) from err
        x = center_crop(resize(x, self.size, antialias=True), [self.size, self.size])
        return x.float() / 127.5 - 1

    def __getitem__(self, i: int) -> dict:
        for offset in range(len(self.files)):
            j = (i + offset) % len(self.files)
            try:
                item = {"images": self.load(self.files[j]), "labels": torch.tensor(self.labels[j])}
                break
            except OSError:
                if not self.skip_corrupt:
                    raise
                self.skipped += 1
                log.warning("Skipping unreadable image %s (%d skipped)", self.files[j], self.skipped)
        else:
            raise OSError(f"No readable image in {self.root}.")
        if self.captions is not None:
            item["caption"] = self.captions[j]
        return item


def _caption_row(path: Path, number: int, line: str) -> dict[str, str] | None:
    """One ``{"file": str, "caption": str}`` line of a captions file (None for a blank line)."""
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{number} is not JSON ({err.msg}).") from None
    if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("file", "caption")):
        raise ValueError(f'{path}:{number} must be {{"file": str, "caption": str}}, got {line.strip()[:200]!r}.')
    return row


def _inside(root: Path, name: str, listed_in: Path) -> Path:
    """``root / name``, which must stay inside ``root`` (no ``..`` or absolute path out of it)."""
    path = root / name
    if not path.resolve().is_relative_to(root.resolve()):
        raise ValueError(f"{listed_in} names {name!r}, outside {root}: list only files inside the folder.")
    return path


class FolderImages(Dataset):
    """The images of an :class:`ImageFolder` as uint8 ``(3, size, size)``, read lazily (a metric reference set)."""

    def __init__(self, root: str | os.PathLike, size: int) -> None:
        self.folder = ImageFolder(root, size)

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, i: int) -> torch.Tensor:
        return ((self.folder[i]["images"] + 1) * 127.5).round().to(torch.uint8)

    def fingerprint(self) -> str:
        """A digest of the folder's file names, sizes and modification times and the resolution: changes whenever
        an image is added, removed, replaced or resized, without decoding any."""
        digest = hashlib.blake2b(f"{self.folder.root.resolve()}:{self.folder.size}".encode(), digest_size=16)
        for f in self.folder.files:
            st = f.stat()
            digest.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        return digest.hexdigest()


def image_set_fingerprint(images: Any) -> str:
    """A digest that changes whenever the reference images do: the set's own ``fingerprint()`` if it has one
    (:class:`FolderImages`: file names, sizes, mtimes), else a hash of the pixels (a tensor, or every item of a
    dataset, decoded once: no extractor runs)."""
    if hasattr(images, "fingerprint"):
        return images.fingerprint()
    digest = hashlib.blake2b(digest_size=16)
    items = [images] if isinstance(images, torch.Tensor) else (images[i] for i in range(len(images)))
    for x in items:
        x = x.detach().cpu().contiguous()
        digest.update(f"{tuple(x.shape)}:{x.dtype};".encode())
        digest.update(x.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def folder_images(root: str | os.PathLike, size: int) -> FolderImages:
    """Every image of an :class:`ImageFolder` as a lazy dataset of uint8 ``(3, size, size)`` tensors; nothing is
    decoded until indexed, so a cached reference never reads the folder."""
    return FolderImages(root, size)


# ---------------------------------------------------------------------------------- image tensors for the networks
def check_images(images: Tensor) -> Tensor:
    """Raise unless ``images`` are ``(B, 1 or 3, H, W)`` uint8 in [0, 255] or float in [0, 1] (±1e-3); a float
    tensor outside that range is an error naming the range it looks like, never silently wrapped or rescaled."""
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"Expected images (B, 1 or 3, H, W), got shape {tuple(images.shape)}.")
    if images.shape[2] < 1 or images.shape[3] < 1:
        raise ValueError(f"Images need at least 1x1 pixels, got shape {tuple(images.shape)}.")
    if images.dtype == torch.uint8 or images.numel() == 0:
        return images
    if not images.is_floating_point():
        raise ValueError(f"Expected uint8 or float images, got {images.dtype}.")
    lo, hi = images.min().item(), images.max().item()
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError("Images contain NaN or inf values.")
    if lo < -1e-3 or hi > 1 + 1e-3:
        likely = "[-1, 1]: pass (x + 1) / 2" if lo < -1e-3 and hi <= 1 + 1e-3 else "[0, 255]: pass x / 255 or uint8"
        raise ValueError(
            f"Float images must lie in [0, 1], got values in [{lo:.4g}, {hi:.4g}]; this looks like {likely}."
        )
    return images


def to_unit_float(images: Tensor, channels: int = 3) -> Tensor:
    """uint8 [0, 255] or float [0, 1] images ``(B, C, H, W)`` → float32 in [0, 1] with ``channels`` channels."""
    x = check_images(images)
    x = x.float() / 255.0 if x.dtype == torch.uint8 else x.float().clamp(0, 1)
    if x.shape[1] == channels:
        return x
    return x.expand(-1, channels, -1, -1) if x.shape[1] == 1 else x.mean(1, keepdim=True)


def to_uint8(images: Tensor) -> Tensor:
    """Images as uint8 RGB ``(B, 3, H, W)``: floats in [0, 1] are quantized as a PNG writer would (round(255 x))."""
    x = check_images(images)
    if x.dtype != torch.uint8:
        x = (x.float().clamp(0, 1) * 255).round().to(torch.uint8)
    return x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x


def pil_resize(images: Tensor, size: int, center_crop: bool = False) -> Tensor:
    """uint8 images → float ``(B, 3, size, size)`` in [0, 1] through PIL's bicubic resize, image by image: what
    ``torchvision.transforms.Resize((size, size), BICUBIC)`` does to a PIL image in dgm-eval, and with
    ``center_crop`` (largest centered square first) what google-research/cmmd's ``_center_crop_and_resize`` does."""
    import numpy as np
    from PIL import Image

    out = []
    for image in to_uint8(images).permute(0, 2, 3, 1).cpu().numpy():
        pil = Image.fromarray(image)
        if center_crop:
            w, h = pil.size
            side = min(w, h)
            left, top = (w - side) // 2, (h - side) // 2
            pil = pil.crop((left, top, left + side, top + side))
        out.append(torch.from_numpy(np.asarray(pil.resize((size, size), Image.BICUBIC)).copy()))
    return torch.stack(out).permute(0, 3, 1, 2).float().div_(255).to(images.device)


def clean_resize(images: Tensor, size: int) -> Tensor:
    """clean-fid's "clean" resize: each channel as a float32 PIL image, bicubic to ``size``, clipped to [0, 255];
    returned as uint8 ``(B, 3, size, size)`` (rounded: the only difference to clean-fid, which keeps the floats)."""
    import numpy as np
    from PIL import Image

    out = []
    for image in to_uint8(images).float().cpu().numpy():
        channels = [np.asarray(Image.fromarray(c, mode="F").resize((size, size), Image.BICUBIC)) for c in image]
        out.append(torch.from_numpy(np.stack(channels).clip(0, 255)))
    return torch.stack(out).round().to(torch.uint8).to(images.device)


def normalize(x: Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> Tensor:
    """``(x - mean) / std`` per channel."""
    return (x - torch.tensor(mean, device=x.device).view(1, -1, 1, 1)) / torch.tensor(std, device=x.device).view(
        1, -1, 1, 1
    )
