"""What a DiTModule checkpoint is trusted for: :func:`checked_checkpoint` reads its hyper-parameters and checks, before
anything is built from them, that the file is complete, that they are plain data of DiTModule's types, and that the
sizes they declare are the sizes of the weights the file holds.

Sizes are data like any other.
A checkpoint whose ``model_config`` asks for 200,000 layers (or 64 heads of 128 where the file holds 4 of 32) is
refused with one line naming the key, in milliseconds and without memory growth: the layer count is compared with the
file's blocks first, then the network is built on the meta device under a budget of as many tensors as the file holds
(:func:`planned_shapes`; no storage, and the build stops as soon as it outgrows the file), and every shape, the
derived tables that are not saved (sin-cos position tables, sized by ``sample_size``), the class table and the caption
length are checked against it.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from jsonargparse import ArgumentParser
from torch import nn

from lightning_muon.checkpoint import META_FILE, checkpoint_problem, is_distributed_checkpoint, read_metadata
from lightning_muon.recipes.networks import TINY_DIT, build_transformer

__all__ = [
    "SizeMismatch",
    "check_sizes",
    "checked_checkpoint",
    "checked_hparams",
    "checkpoint_meta",
    "planned_shapes",
    "saved_shapes",
]

Shape = tuple[int, ...]
_BLOCK = re.compile(r"^transformer_blocks\.(\d+)\.")


class SizeMismatch(ValueError):
    """A checkpoint's hyper-parameters do not describe the tensors it holds."""


def saved_shapes(path: str | os.PathLike) -> dict[str, Shape]:
    """The shape of every tensor under ``state_dict`` of a checkpoint, without reading tensor bytes: a single file
    memory-mapped (``torch.load(weights_only=True, mmap=True)``), a distributed checkpoint from its metadata."""
    path = Path(path)
    if is_distributed_checkpoint(path):
        metadata = read_metadata(path).state_dict_metadata
        tensors = {k.removeprefix("state_dict."): v for k, v in metadata.items() if k.startswith("state_dict.")}
        return {k: tuple(v.size) for k, v in tensors.items() if hasattr(v, "size")}
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("state_dict") or {}
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


class _Outgrown(Exception):
    pass


def planned_shapes(
    architecture: str, model_config: dict[str, Any], max_tensors: int
) -> tuple[dict[str, Shape], dict[str, int]]:
    """``({name: shape} of the state dict, {name: numel} of the buffers not saved)`` of the network the config builds,
    built on the meta device (no storage).

    Raises:
        SizeMismatch: the build registered more than ``max_tensors`` parameters and buffers (it stops there: a
            config that asks for millions of modules costs no more than the file's own count).
    """
    registered = 0

    def count(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
        nonlocal registered
        registered += tensor is not None
        if registered > max_tensors:
            raise _Outgrown

    hooks = [
        nn.modules.module.register_module_parameter_registration_hook(count),
        nn.modules.module.register_module_buffer_registration_hook(count),
    ]
    try:
        with torch.device("meta"):
            net = build_transformer(architecture, model_config)
    except _Outgrown:
        raise SizeMismatch(f"model_config builds more than {max_tensors} tensors") from None
    finally:
        for hook in hooks:
            hook.remove()
    state = {k: tuple(v.shape) for k, v in net.state_dict().items()}
    derived = {name: b.numel() for name, b in net.named_buffers() if name not in state}  # not saved
    return state, derived


def check_sizes(hparams: dict[str, Any], shapes: dict[str, Shape], path: str | os.PathLike) -> None:
    """Refuse ``hparams`` (already :func:`checked_hparams`) that do not describe the
    ``model.*`` tensors of ``shapes`` (:func:`saved_shapes` of ``path``), before anything is built for real.

    Checked: ``model_config.num_layers`` against the file's blocks; every tensor name and shape of the network on the
    meta device; tables derived from the config and not saved (position tables: ``sample_size``) no larger than the
    weights; ``num_classes`` against the class table (its last row is the null class).

    Raises:
        SizeMismatch: one line naming the file and the key.
    """

    def refuse(reason: str) -> SizeMismatch:
        return SizeMismatch(f"Checkpoint {path}: {reason}; its hyper-parameters do not describe its weights.")

    saved = {k.removeprefix("model."): s for k, s in shapes.items() if k.startswith("model.")}
    if not saved:
        raise refuse("it holds no model.* weights (not a DiTModule checkpoint)")
    config = dict(hparams.get("model_config") or TINY_DIT)
    blocks = len({int(m.group(1)) for k in saved if (m := _BLOCK.match(k))})
    layers = config.get("num_layers")
    if isinstance(layers, int) and layers != blocks:
        raise refuse(f"model_config.num_layers is {layers}, the file holds {blocks} transformer blocks")
    weights = sum(torch.Size(s).numel() for s in saved.values())
    # the position table is computed in the constructor — by numpy, ignoring the meta device, in diffusers < 0.32 —
    # so its size is checked from the config before anything is built
    heads, head_dim = config.get("num_attention_heads", 16), config.get("attention_head_dim", 72)
    size, patch = config.get("sample_size", 32), config.get("patch_size", 2)
    if all(isinstance(v, int) and v > 0 for v in (heads, head_dim, size, patch)):
        if (size // patch) ** 2 * heads * head_dim > weights:
            raise refuse(f"model_config.sample_size {size} derives a position table larger than its weights")
    try:
        planned, derived = planned_shapes(hparams.get("architecture", "dit"), config, 2 * len(saved) + 16)
    except SizeMismatch as err:  # budget: twice the file's tensors (room for the tables that are not saved)
        raise refuse(f"{err}, the file holds {len(saved)}") from None
    except (TypeError, ValueError) as err:  # a config the diffusers class itself refuses
        raise refuse(f"model_config does not build: {err}") from None
    for name in sorted(planned.keys() ^ saved.keys()):
        where = "builds" if name in planned else "does not build"
        raise refuse(f"model_config {where} model.{name}, which the file {'lacks' if name in planned else 'holds'}")
    for name, shape in planned.items():
        if shape != saved[name]:
            raise refuse(f"model.{name} is {list(saved[name])} in the file, model_config builds {list(shape)}")
    for name, numel in derived.items():
        if numel > weights:
            raise refuse(f"model_config derives a {numel}-element table {name} (sample_size), more than its weights")
    rows = [s[0] for k, s in saved.items() if k.endswith("class_embedder.embedding_table.weight")]
    classes = hparams.get("num_classes", 10)
    if rows and classes != rows[0] - 1:
        raise refuse(f"num_classes is {classes}, the class table holds {rows[0] - 1} classes and the null class")


def checkpoint_meta(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's ``hyper_parameters``, ``global_step`` and the rest, without its tensors: ``meta.pt`` beside a
    distributed checkpoint's shards, or the single file memory-mapped (``torch.load(weights_only=True)``)."""
    path = Path(path)
    if is_distributed_checkpoint(path):
        return torch.load(path / META_FILE, map_location="cpu", weights_only=True)
    checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path} holds a {type(checkpoint).__name__}, not a Lightning checkpoint (a dict).")
    return {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}


#: Keys Lightning adds to saved hyper-parameters; ``_class_path`` may only name the module class itself.
_LIGHTNING_KEYS = ("_instantiator", "_class_path")


def checked_hparams(hparams: object, module_class: type) -> dict[str, Any]:
    """A checkpoint's ``hyper_parameters``, checked against ``module_class``'s typed signature (``DiTModule``'s)
    before anything is built from them. Every value is parsed as its annotation, which is plain data
    (:data:`~lightning_muon.recipes.networks.PlainValue`): nothing named in the file is imported or instantiated.
    Lightning's own keys are dropped (``_class_path`` must name ``module_class``) and keys it does not take are
    dropped with a warning; missing ones stay missing. An older version's keys are upgraded first
    (``module_class.upgrade_hparams``, e.g. :meth:`~lightning_muon.recipes.DiTModule.upgrade_hparams`).

    Raises:
        ValueError: the hyper-parameters are not a mapping, name another class, or hold a value of the wrong type.
    """
    name = module_class.__name__
    if not isinstance(hparams, Mapping) or not all(isinstance(k, str) for k in hparams):
        raise ValueError(f"Checkpoint hyper-parameters must be a mapping of names, got {type(hparams).__name__}.")
    hparams = getattr(module_class, "upgrade_hparams", dict)(hparams)  # written by an older version: today's form
    own = (f"{module_class.__module__}.{name}", f"lightning_muon.recipes.{name}")
    class_path = hparams.get("_class_path", own[0])
    if class_path not in own:
        raise ValueError(f"The checkpoint was saved for {class_path!r}, not {name}: it cannot be loaded here.")
    accepted = inspect.signature(module_class.__init__).parameters
    unknown = sorted(k for k in hparams if k not in accepted and k not in _LIGHTNING_KEYS)
    if unknown:
        logging.getLogger(__name__).warning("Ignoring hyper-parameters %s does not take: %s", name, ", ".join(unknown))
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(module_class)
    try:
        parsed = parser.parse_object({k: v for k, v in hparams.items() if k in accepted}, defaults=True)
    except Exception as err:  # jsonargparse's ArgumentError: a value that does not fit its type
        reason = " ".join(str(err).split())
        raise ValueError(f"Checkpoint hyper-parameters do not fit {name}: {reason}") from None
    return {k: v for k, v in parsed.as_dict().items() if k in hparams}


def checked_checkpoint(
    path: str | os.PathLike, module_class: type, meta: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The hyper-parameters of the checkpoint at ``path`` (its :func:`checkpoint_meta` ``meta`` when already read),
    once the file is complete (:func:`~lightning_muon.checkpoint.checkpoint_problem`), they are plain data of
    DiTModule's types (:func:`checked_hparams`) and they describe its weights
    (:func:`check_sizes`). Tensor bytes are not read.

    Raises:
        FileNotFoundError: there is no such file.
        ValueError: one line naming the file and what is wrong.
    """
    if not Path(path).exists():
        raise FileNotFoundError(f"Checkpoint {path} does not exist.")
    if problem := checkpoint_problem(path):
        raise ValueError(f"Checkpoint {path} is truncated, damaged or not a checkpoint ({problem}).")
    meta = checkpoint_meta(path) if meta is None else meta
    if not meta.get("hyper_parameters"):
        raise ValueError(f"Checkpoint {path} has no hyper_parameters: it was not written by DiTModule.")
    try:
        hparams = checked_hparams(meta["hyper_parameters"], module_class)
    except ValueError as err:
        raise ValueError(f"Checkpoint {path}: {err}") from None
    check_sizes(hparams, saved_shapes(path), path)
    return hparams
