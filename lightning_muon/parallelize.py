"""How a transformer is parallelized (torchtitan's split): what a block is, the FSDP2 sharding plan and the mixed
precision policy. One definition of a block serves the sharding, the Muon/AdamW parameter grouping
(:mod:`lightning_muon.param_groups`) and the memory estimate (:mod:`lightning_muon.recipes.memory`)."""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

__all__ = [
    "BLOCK_MODULE_PATTERN",
    "Blocks",
    "MixedPrecision",
    "block_modules",
    "find_blocks",
    "default_mp_policy",
    "rank_and_world",
    "shard_transformer",
]

#: Transformer blocks named as diffusers (``transformer_blocks.i``, ``single_transformer_blocks.i``) and timm
#: (``blocks.i``) name them (found without this pattern too: :func:`find_blocks`).
BLOCK_MODULE_PATTERN = r"(^|\.)(transformer_blocks|single_transformer_blocks|blocks)\.\d+$"

#: What a transformer block is, one definition for the parameter grouping, the FSDP2 plan and the memory estimate:
#: ``None`` (found: :func:`find_blocks`), a class name or a regular expression matched with :func:`re.search` against
#: module names (``"GPT2Block"``, ``r"layers\.\d+$"``), module classes or class names (``[LlamaDecoderLayer]``, as
#: Lightning's ``auto_wrap_policy={Block}``), or a predicate ``(name, module) -> bool``.
Blocks = str | Sequence[type[nn.Module] | str] | Callable[[str, nn.Module], bool] | None


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size of the default process group; ``(0, 1)`` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a local process group's rendezvous (the doctor's, the tests' and the
    benchmarks' multi-process runs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_blocks(module: nn.Module, blocks: Blocks = None) -> dict[str, nn.Module]:
    """The transformer blocks of ``module`` by name, in order, outermost only (a block inside a block is not one).

    With ``blocks=None`` a block is a module named like :data:`BLOCK_MODULE_PATTERN`, or an item of an
    ``nn.ModuleList`` / ``nn.Sequential`` whose items are all of one class and each hold submodules — the repeated
    layers of transformers (``model.layers.i``, ``transformer.h.i``, ``encoder.layer.i``), of timm and diffusers, and
    of reference MMDiT code (``double_blocks.i``, ``single_blocks.i``). A plain MLP has none.
    """
    is_block = _block_predicate(blocks)
    found: dict[str, nn.Module] = {}
    for name, sub in module.named_modules():
        if name and is_block(name, sub) and not any(name.startswith(outer + ".") for outer in found):
            found[name] = sub
    return found


def block_modules(module: nn.Module, blocks: Blocks = None) -> list[nn.Module]:
    """The transformer blocks of ``module`` (:func:`find_blocks`), in order."""
    return list(find_blocks(module, blocks).values())


def _block_predicate(blocks: Blocks) -> Callable[[str, nn.Module], bool]:
    if blocks is None:
        repeated = set()

        def is_block(name: str, sub: nn.Module) -> bool:
            if isinstance(sub, (nn.ModuleList, nn.Sequential)) and _repeats_one_composite(sub):
                repeated.update(f"{name}.{child}" if name else child for child, _ in sub.named_children())
            return name in repeated or re.search(BLOCK_MODULE_PATTERN, name) is not None

        return is_block
    if isinstance(blocks, str):
        try:
            pattern = re.compile(blocks)
        except re.error as err:
            raise ValueError(f"blocks={blocks!r} is not a valid regular expression: {err}.") from err
        return lambda name, sub: blocks in _class_names(sub) or pattern.search(name) is not None
    if callable(blocks) and not isinstance(blocks, type):
        return blocks
    kinds = [blocks] if isinstance(blocks, type) else list(blocks)
    if not kinds or not all(isinstance(k, str) or (isinstance(k, type) and issubclass(k, nn.Module)) for k in kinds):
        raise ValueError(
            f"blocks must be a regular expression, module classes or class names, or a predicate; got {blocks!r}."
        )
    names = {k for k in kinds if isinstance(k, str)}
    classes = tuple(k for k in kinds if isinstance(k, type))
    return lambda name, sub: isinstance(sub, classes) or not names.isdisjoint(_class_names(sub))


def _class_names(module: nn.Module) -> set[str]:
    """Names of the module's classes: ``fully_shard`` swaps a block's class for a subclass (``FSDPLlamaDecoderLayer``),
    and a block named by its class must stay one after sharding."""
    return {c.__name__ for c in type(module).__mro__}


def _repeats_one_composite(container: nn.Module) -> bool:
    """Items all of one class, each holding submodules with parameters (a block, not a list of plain layers)."""
    items = list(container.children())
    return (
        bool(items)
        and len({type(item) for item in items}) == 1
        and all(any(any(True for _ in child.parameters()) for child in item.children()) for item in items)
    )


DtypeName = Literal["bfloat16", "float16", "float32"]


@dataclass(frozen=True)
class MixedPrecision:
    """A ``MixedPrecisionPolicy`` by dtype names, as a YAML config writes it
    (``mp_policy: {param_dtype: bfloat16, reduce_dtype: float32}``): plain data, never a class to instantiate."""

    param_dtype: DtypeName | None = None
    reduce_dtype: DtypeName | None = None
    output_dtype: DtypeName | None = None
    cast_forward_inputs: bool = True

    def policy(self) -> MixedPrecisionPolicy:
        """The FSDP2 policy with these dtypes."""
        dtype = {None: None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
        return MixedPrecisionPolicy(
            param_dtype=dtype[self.param_dtype],
            reduce_dtype=dtype[self.reduce_dtype],
            output_dtype=dtype[self.output_dtype],
            cast_forward_inputs=self.cast_forward_inputs,
        )


#: Conditioning embedders inside a block get a unit of their own: diffusers' DiT calls
#: ``transformer_blocks[0].norm1.emb`` again from the root after the blocks ran (for the final modulation), when the
#: block's own parameters are resharded; as a separate unit it gathers its parameters on every call.
EMBEDDER_MODULE_PATTERN = r"(^|\.)emb$"


def shard_transformer(
    module: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    blocks: Blocks = None,
) -> nn.Module:
    """Apply ``fully_shard`` to every transformer block (its conditioning embedder first, as a unit of its own), then
    to each direct child that still holds parameters.

    The children (e.g. a LightningModule's ``self.model``) are the roots that ``training_step`` calls, so their
    forward hooks gather the remaining parameters (embeddings, final layer). The module itself is not wrapped.

    Args:
        module: the network or LightningModule.
        mesh: 1-D data-parallel mesh, or 2-D (replicate, shard) for HSDP.
        mp_policy: an optional ``torch.distributed.fsdp.MixedPrecisionPolicy`` (e.g. bf16 params, fp32 reduce).
        reshard_after_forward: free gathered block parameters after forward (ZeRO-3) or keep them (ZeRO-2).
        blocks: what a block is (:data:`Blocks`; ``None``: found by :func:`find_blocks`).
    """
    from torch.distributed.fsdp import fully_shard

    kwargs = dict(mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy(), reshard_after_forward=reshard_after_forward)
    frozen = _frozen_children(module)
    found = [b for name, b in find_blocks(module, blocks).items() if name.partition(".")[0] not in frozen]
    if not found:
        raise ValueError(
            f"No transformer blocks in {type(module).__name__} (blocks={blocks!r}; by default the items of a "
            "ModuleList/Sequential that repeat one class of layer, or modules named like "
            f"{BLOCK_MODULE_PATTERN!r}). Say what a block is with blocks= (a class, a class name, a name pattern), "
            "or shard the model yourself in configure_model()."
        )
    for block in found:
        for name, sub in block.named_modules():
            if re.search(EMBEDDER_MODULE_PATTERN, name):
                fully_shard(sub, **kwargs)
        fully_shard(block, **kwargs)
    for name, child in module.named_children():
        if name in frozen:
            continue  # a frozen encoder stays replicated: no FSDP unit, no hooks that decode()/encode() would skip
        if any(not isinstance(p, DTensor) for p in child.parameters()):
            fully_shard(child, **kwargs)
    return module


def _frozen_children(module: nn.Module) -> set[str]:
    """Children none of whose parameters trains, unless of the class of a child that trains (an EMA copy of the
    model trains none, and is sharded like the model)."""
    trains = {name: any(p.requires_grad for p in c.parameters()) for name, c in module.named_children()}
    trained = {type(c) for name, c in module.named_children() if trains[name]}
    return {
        name
        for name, c in module.named_children()
        if not trains[name] and type(c) not in trained and any(True for _ in c.parameters())
    }


def default_mp_policy(precision: str | None) -> MixedPrecisionPolicy:
    """torchtitan's choice: bf16 parameters and activations, fp32 gradient reduction, when training in bf16;
    otherwise FSDP2's default (no casting)."""
    if precision is not None and str(precision).startswith("bf16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()
