"""How a transformer is parallelized (torchtitan's split): what a block is, the FSDP2 sharding plan and the mixed
precision policy. One definition of a block serves the sharding, the Muon/AdamW parameter grouping
(:mod:`lightning_muon.param_groups`) and the memory estimate (:mod:`lightning_muon.recipes.memory`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

__all__ = [
    "BLOCK_MODULE_PATTERN",
    "BLOCK_PARAM_PATTERN",
    "MixedPrecision",
    "block_modules",
    "default_mp_policy",
    "rank_and_world",
    "shard_transformer",
]

#: A transformer block's name: diffusers ``transformer_blocks.i`` / ``single_transformer_blocks.i``, timm ``blocks.i``.
_BLOCK = r"(^|\.)(transformer_blocks|single_transformer_blocks|blocks)\.\d+"
#: Transformer blocks, each sharded as its own FSDP2 unit.
BLOCK_MODULE_PATTERN = _BLOCK + "$"
#: Parameters inside a transformer block (the Muon candidates of :func:`~lightning_muon.muon_param_groups`).
BLOCK_PARAM_PATTERN = _BLOCK + r"\."


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size of the default process group; ``(0, 1)`` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def block_modules(module: nn.Module) -> list[nn.Module]:
    """The transformer blocks of ``module`` (modules named like :data:`BLOCK_MODULE_PATTERN`), in order."""
    return [m for name, m in module.named_modules() if re.search(BLOCK_MODULE_PATTERN, name)]


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
    """
    from torch.distributed.fsdp import fully_shard

    kwargs = dict(mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy(), reshard_after_forward=reshard_after_forward)
    blocks = block_modules(module)
    if not blocks:
        raise ValueError(
            f"No transformer blocks (modules named like {BLOCK_MODULE_PATTERN!r}) in "
            f"{type(module).__name__}; shard it yourself in configure_model()."
        )
    for block in blocks:
        for name, sub in block.named_modules():
            if re.search(EMBEDDER_MODULE_PATTERN, name):
                fully_shard(sub, **kwargs)
        fully_shard(block, **kwargs)
    for child in module.children():
        if _is_frozen(child):
            continue  # a frozen encoder stays replicated: no FSDP unit, no hooks that decode()/encode() would skip
        if any(not isinstance(p, DTensor) for p in child.parameters()):
            fully_shard(child, **kwargs)
    return module


def _is_frozen(module: nn.Module) -> bool:
    """No parameter trains and no transformer block inside (an EMA copy has blocks and is sharded like the model)."""
    params = list(module.parameters())
    return bool(params) and not block_modules(module) and not any(p.requires_grad for p in params)


def default_mp_policy(precision: str | None) -> MixedPrecisionPolicy:
    """torchtitan's choice: bf16 parameters and activations, fp32 gradient reduction, when training in bf16;
    otherwise FSDP2's default (no casting)."""
    if precision is not None and str(precision).startswith("bf16"):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()
