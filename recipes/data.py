"""Data modules: sklearn digits (the offline default), image folders, and pre-encoded latent shards.

Every batch is a dict: ``{"images": float (B, C, H, W) in [-1, 1]}`` (or ``"latents"``), plus ``"labels"`` (long) for
class-conditional data or ``"caption_embeds"`` / ``"caption_mask"`` for text-conditional data. Distributed sampling
is Lightning's (it inserts a ``DistributedSampler``).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_muon.metrics.images import ImageFolder
from lightning_muon.recipes.latents import GlobalBatchSampler, LatentShards, write_latent_shard, write_manifest

__all__ = [
    "DigitsDataModule",
    "ImageFolder",
    "ImageFolderDataModule",
    "LatentShardsDataModule",
    "write_latent_shard",
    "write_manifest",
]


class _DictDataset(Dataset):
    def __init__(self, **tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.tensors.items()}


class SeededShuffleSampler(torch.utils.data.Sampler):
    """A fresh permutation per epoch from ``seed + epoch`` (Lightning calls ``set_epoch``)."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        return iter(torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist())


class ResumableDataLoader(DataLoader):
    """A DataLoader that Lightning checkpoints: ``state_dict()`` holds the epoch and the batches consumed in it, and
    after ``load_state_dict()`` that epoch, when Lightning iterates it again, skips those batches: a run resumed
    mid-epoch or at an epoch boundary sees exactly the batches of an uninterrupted one. Shuffles with
    :class:`SeededShuffleSampler` unless a sampler is given (Lightning passes a distributed one).

    Why not torchdata's ``StatefulDataLoader`` here: it fast-forwards when Lightning creates the first iterator,
    which Lightning does before setting the sampler's epoch (Lightning #21938), so under the default strategies a
    run resumed mid-epoch replays epoch 0's order; and its own ``shuffle=True`` sampler is wrapped by Lightning in
    distributed runs into one that draws from the global RNG. This loader compares the saved epoch with the
    sampler's at iteration time, so neither matters. (``muon_fsdp`` works around both, and the latent shards use
    ``StatefulDataLoader`` with their own world-size-independent sampler.)"""

    def __init__(self, dataset: Dataset, batch_size: int, sampler=None, seed: int = 0, **kwargs) -> None:
        kwargs.setdefault("drop_last", True)
        super().__init__(
            dataset, batch_size=batch_size, sampler=sampler or SeededShuffleSampler(len(dataset), seed), **kwargs
        )
        self.consumed = 0
        self._resume: dict[str, int] | None = None

    def _epoch(self) -> int:
        return getattr(self.sampler, "epoch", 0)

    def __iter__(self):
        resume, self._resume, self.consumed = self._resume, None, 0
        skip = resume["consumed"] if resume and resume["epoch"] == self._epoch() else 0
        for i, batch in enumerate(super().__iter__()):
            self.consumed = i + 1
            if i >= skip:
                yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch(), "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = dict(state)


class DigitsDataModule(L.LightningDataModule):
    """sklearn's 8×8 handwritten digits (1,797 images, 10 classes), scaled to [-1, 1], one channel.

    A fixed split: a seeded permutation puts ``val_size`` images in validation, the rest in training.

    Args:
        batch_size: per-device batch size.
        val_size: images held out for the validation loss.
        num_workers: DataLoader workers.
        predict_samples: samples ``lightning-muon predict`` generates.
        image_size: 8, or a multiple of 8 the digits are upscaled to (bicubic, clamped): a harder, larger task.
        seed: the training order's seed (epoch e is a permutation seeded ``seed + e``); the split stays fixed.
    """

    num_classes, channels = 10, 1

    def __init__(
        self,
        batch_size: int = 64,
        val_size: int = 256,
        num_workers: int = 0,
        predict_samples: int = 100,
        image_size: int = 8,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if image_size < 8 or image_size % 8:
            raise ValueError(f"image_size must be 8 or a multiple of 8, got {image_size}.")
        _check_counts(batch_size=batch_size, num_workers=num_workers)
        self.batch_size, self.val_size, self.num_workers = batch_size, val_size, num_workers
        self.predict_samples, self.image_size, self.seed = predict_samples, image_size, seed

    def _pixels(self, digits_images) -> torch.Tensor:
        """sklearn's ``(N, 8, 8)`` digit images (0–16) as floats in [0, 1], ``(N, 1, image_size, image_size)``."""
        x = torch.tensor(digits_images / 16.0, dtype=torch.float32)[:, None]
        if self.image_size != 8:
            x = torch.nn.functional.interpolate(x, size=(self.image_size,) * 2, mode="bicubic").clamp(0, 1)
        return x

    def setup(self, stage: str | None = None) -> None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = self._pixels(digits.images) * 2 - 1
        labels = torch.tensor(digits.target, dtype=torch.long)
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
        val, train = order[: self.val_size], order[self.val_size :]
        self.train_set = _DictDataset(images=images[train], labels=labels[train])
        self.val_set = _DictDataset(images=images[val], labels=labels[val])

    def real_images(self) -> torch.Tensor:
        """All digits as uint8 ``(N, 1, image_size, image_size)``: the reference set of the generation metrics."""
        from sklearn.datasets import load_digits

        return (self._pixels(load_digits().images) * 255).round().to(torch.uint8)

    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(
            self.train_set, self.batch_size, num_workers=self.num_workers, seed=self.seed, pin_memory=pin_memory(self)
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, self.batch_size, num_workers=self.num_workers, pin_memory=pin_memory(self))

    def test_dataloader(self) -> DataLoader:
        """The held-out split (digits has no separate test set)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """Sample indices ``0 .. predict_samples - 1`` for ``DiTModule.predict_step``."""
        indices = torch.utils.data.TensorDataset(torch.arange(self.predict_samples))
        return DataLoader(indices, batch_size=min(self.batch_size, self.predict_samples))


class ImageFolderDataModule(L.LightningDataModule):
    """:class:`~lightning_muon.metrics.images.ImageFolder` for training (class-conditional or captioned).

    Args:
        root: class sub-folders (``root/<class>/*.png``) or a captions file (``root/captions.jsonl``).
        image_size: the side images are resized and center-cropped to.
        batch_size: samples per rank and step.
        num_workers: loader processes per rank.
        skip_corrupt: replace an unreadable image by the next readable one (counted) instead of failing.
    """

    def __init__(
        self, root: str, image_size: int = 256, batch_size: int = 32, num_workers: int = 4, skip_corrupt: bool = False
    ) -> None:
        super().__init__()
        _check_counts(batch_size=batch_size, num_workers=num_workers)
        self.root, self.image_size, self.batch_size = root, image_size, batch_size
        self.num_workers, self.skip_corrupt = num_workers, skip_corrupt

    def setup(self, stage: str | None = None) -> None:
        self.train_set = ImageFolder(self.root, self.image_size, self.skip_corrupt)

    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(
            self.train_set, self.batch_size, num_workers=self.num_workers, pin_memory=pin_memory(self)
        )


class LatentShardsDataModule(L.LightningDataModule):
    """Pre-encoded latents (and caption embeddings or labels) streamed from a latent directory (see
    :mod:`lightning_muon.recipes.latents`): each rank reads only its rows of each global batch, the position in the
    epoch is checkpointed (``StatefulDataLoader``) and resumes exactly, also on another number of ranks.

    Args:
        root: the training latent directory (shards + ``manifest.json``).
        batch_size: samples per rank and step.
        num_workers: reader processes per rank.
        val_root: a held-out latent directory for the validation loss, or
        val_fraction: the fraction of ``root`` held out instead (a fixed seeded choice of samples).
        seed: shuffling seed (epoch e uses ``seed + e``).
    """

    def __init__(
        self,
        root: str,
        batch_size: int = 32,
        num_workers: int = 2,
        val_root: str | None = None,
        val_fraction: float = 0.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        _check_counts(batch_size=batch_size, num_workers=num_workers)
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}.")
        if val_root and val_fraction:
            raise ValueError("Pass val_root or val_fraction, not both.")
        self.root, self.batch_size, self.num_workers = Path(root), batch_size, num_workers
        self.val_root, self.val_fraction, self.seed = val_root, val_fraction, seed

    def setup(self, stage: str | None = None) -> None:
        self.train_set = LatentShards(self.root)  # validates the manifest and every shard header
        ids = torch.arange(len(self.train_set))
        self.val_set, self.val_ids = None, None
        if self.val_root:
            self.val_set = LatentShards(self.val_root)
            self.val_ids = torch.arange(len(self.val_set))
        elif self.val_fraction:
            held = torch.randperm(len(ids), generator=torch.Generator().manual_seed(12345))
            n_val = max(1, round(self.val_fraction * len(ids)))
            self.val_set, self.val_ids = self.train_set, held[:n_val].sort().values
            ids = held[n_val:].sort().values
        self.train_ids = ids

    def _loader(self, dataset: LatentShards, ids: torch.Tensor, shuffle: bool) -> DataLoader:
        from torchdata.stateful_dataloader import StatefulDataLoader

        sampler = GlobalBatchSampler(ids, self.batch_size, shuffle=shuffle, seed=self.seed)
        return StatefulDataLoader(
            dataset,
            batch_size=None,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=pin_memory(self),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.train_ids, shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        return [] if self.val_set is None else self._loader(self.val_set, self.val_ids, shuffle=False)


def pin_memory(datamodule: L.LightningDataModule) -> bool:
    """Whether batches go to a CUDA device: then they are collated into pinned host memory, so Lightning's
    ``non_blocking`` copy is asynchronous (from pageable memory every batch is a synchronous copy)."""
    trainer = datamodule.trainer
    return trainer is not None and trainer.strategy.root_device.type == "cuda"


def _check_counts(batch_size: int, num_workers: int) -> None:
    """``batch_size`` >= 1 and ``num_workers`` >= 0, or a ValueError naming the option."""
    for name, value, low in (("batch_size", batch_size, 1), ("num_workers", num_workers, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
