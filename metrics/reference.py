"""Real-image (reference) statistics of a metric, cached in a file tagged with what they depend on (the metric, the
extractor's settings and weights, the real images). Rank 0 alone decides whether a cache file is valid; recomputed
statistics are synced over ranks and written by rank 0, atomically."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics import Metric

from lightning_muon.checkpoint import atomic_save
from lightning_muon.metrics.features import FeatureExtractor, save_to_cache
from lightning_muon.parallelize import rank_and_world

__all__ = ["ReferenceCache", "ensure_reference", "ensure_references", "update_with_images", "write_reference"]


def distributed() -> bool:
    """A process group of more than one rank."""
    return rank_and_world()[1] > 1


def _rank_zero() -> bool:
    """True on rank 0 and outside DDP."""
    return rank_and_world()[0] == 0


class ReferenceCache:
    """Save / load the real-image statistics of a metric to a file tagged with the extractor that made them."""

    kind: str
    reference: dict[str, Tensor] | None

    def _extractor(self) -> FeatureExtractor:
        raise NotImplementedError

    def _reference_from_states(self) -> dict[str, Tensor]:
        raise NotImplementedError

    def reference_tag(self, data: Any = None) -> dict[str, Any]:
        """What the reference statistics depend on: the metric, the extractor (its settings and a digest of its
        weights) and, when given, a fingerprint of the real images."""
        return {"metric": self.kind, "extractor": self._extractor().fingerprint(), "data": data}

    def synced_reference(self) -> dict[str, Tensor]:
        """The real statistics accumulated so far over all ranks (every rank must call it)."""
        with self.sync_context(should_unsync=True):
            return {k: v.clone() for k, v in self._reference_from_states().items()}

    def save_reference(self, path: str | os.PathLike, data: Any = None) -> None:
        """Write the real statistics accumulated so far (all ranks take part in the sync; rank 0 writes)."""
        write_reference(path, self.reference_tag(data), self.synced_reference())

    def load_reference(self, path: str | os.PathLike) -> None:
        """Use the reference statistics in ``path`` instead of real images; ``update(..., real=True)`` is then an error.

        Raises:
            FileNotFoundError: no such file.
            ValueError: the file was made by another metric, extractor (or weights) or feature size.
        """
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"Reference statistics file {str(path)!r} does not exist; create it with "
                "save_reference() after updating the metric with real images."
            )
        saved = torch.load(path, map_location="cpu", weights_only=True)
        tag = self.reference_tag(saved.get("data"))
        if {k: saved.get(k) for k in tag} != tag:
            raise ValueError(
                f"Reference statistics in {str(path)!r} were made by {saved.get('metric')} with "
                f"{saved.get('extractor')}, but this metric is {tag['metric']} with {tag['extractor']}. Delete the "
                "file to recompute it with the current extractor."
            )
        self.set_reference(saved["reference"])

    def set_reference(self, reference: Mapping[str, Tensor]) -> None:
        self.reference = {k: v.to(self.device) for k, v in reference.items()}

    def _apply(self, fn, *args, **kwargs):
        """``.to(device)`` moves the reference with the states (kept outside them, see the module docstring)."""
        this = super()._apply(fn, *args, **kwargs)
        if getattr(self, "reference", None) is not None:  # also when a parent's __init__ moves the metric
            self.set_reference(self.reference)
        return this

    def _check_real_update(self, real: bool) -> None:
        if real and self.reference is not None:
            raise RuntimeError("Reference statistics are loaded: update with generated images only (real=False).")


def _reference_file(tag: dict[str, Any], reference: Mapping[str, Tensor]) -> dict[str, Any]:
    return {**tag, "reference": {k: v.cpu() for k, v in reference.items()}}


def write_reference(path: str | os.PathLike, tag: dict[str, Any], reference: Mapping[str, Tensor]) -> None:
    """Rank 0 writes ``tag`` and the reference tensors to ``path`` atomically."""
    if _rank_zero():
        atomic_save(_reference_file(tag, reference), path)


def update_with_images(
    metric: Metric | Mapping[str, Metric],
    batches: Iterable[Tensor],
    real: bool,
    progress: bool = True,
    desc: str | None = None,
) -> int:
    """Feed every image batch to ``metric.update(images, real=real)`` (or to each of several metrics, which then
    share one extractor pass per batch) under a tqdm bar; the number of images. A batch may be a pair
    ``(images, index)`` with the samples' global indices (see :class:`KernelInceptionDistance`)."""
    from tqdm.auto import tqdm

    metrics = list(metric.values()) if isinstance(metric, Mapping) else [metric]
    count = 0
    total = len(batches) if hasattr(batches, "__len__") else None
    bar = tqdm(
        batches,
        total=total,
        desc=desc or ("real" if real else "generated"),
        unit="batch",
        disable=not progress,
        leave=False,
    )
    for batch in bar:
        images, index = batch if isinstance(batch, (tuple, list)) else (batch, None)
        for m in metrics:
            m.update(images, real=real, index=index)
        count += len(images)
    return count


def _broadcast(obj: Any) -> Any:
    """``obj`` of rank 0 on every rank (itself outside DDP)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _read_reference(path: Path, tag: dict[str, Any]) -> dict[str, Tensor] | None:
    """The reference in ``path`` if it was made with exactly ``tag``, else None (missing, stale or unreadable)."""
    if not path.is_file():
        return None
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a damaged cache is rebuilt like a stale one
        return None
    return saved["reference"] if {k: saved.get(k) for k in tag} == tag else None


def ensure_references(
    metrics: Mapping[str, ReferenceCache],
    paths: Mapping[str, str | os.PathLike],
    real_batches: Callable[[], Iterable[Tensor]],
    data: Any = None,
    progress: bool = True,
) -> None:
    """Give every metric its reference statistics: from its cache file when that was made with the same metric,
    extractor (settings and weights) and real images (``data``, a fingerprint), else from ``real_batches()``
    (one pass, extractor runs shared between metrics) and then cached; a stale cache is rebuilt, never reused.

    Under DDP every rank must call this with its own shard of the real images. Rank 0 alone reads the cache files
    and broadcasts what it found, so ranks whose disks disagree (node-local caches, NFS lag) cannot take different
    paths; recomputed statistics are synced over ranks and rank 0 writes them.
    """
    tags = {name: m.reference_tag(data) for name, m in metrics.items()}
    rank0 = _rank_zero()
    cached = {name: _read_reference(Path(paths[name]), tags[name]) if rank0 else None for name in metrics}
    cached = _broadcast(cached)
    missing = {name: m for name, m in metrics.items() if cached[name] is None}
    if missing:
        for m in missing.values():
            m.reference = None
            m.reset()
        update_with_images(missing, real_batches(), real=True, progress=progress, desc="reference")
        for name, m in missing.items():
            cached[name] = m.synced_reference()
            if _rank_zero():  # a cache: a full disk or a read-only directory is a warning
                path = Path(paths[name])
                save_to_cache(_reference_file(tags[name], cached[name]), path, "Reference statistics")
    for name, m in metrics.items():
        m.set_reference(cached[name])
        m.reset()  # drop the per-rank real states; the reference replaces them


def ensure_reference(
    metric: ReferenceCache,
    path: str | os.PathLike,
    real_batches: Callable[[], Iterable[Tensor]],
    progress: bool = True,
    data: Any = None,
) -> None:
    """:func:`ensure_references` for one metric."""
    ensure_references({"metric": metric}, {"metric": path}, real_batches, data, progress)
