"""Image folders: training data for the recipes and reference sets for the evaluation."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
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
