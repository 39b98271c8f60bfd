"""The networks a :class:`~lightning_muon.recipes.DiTModule` trains and conditions on: diffusers transformers built
from plain config values, and frozen models loaded from local directories only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["ARCHITECTURES", "TINY_DIT", "PlainValue", "PromptEncoder", "build_transformer", "cast", "load_local"]

#: A value of a config mapping (``model_config``, ``param_overrides``): plain data only, so neither a YAML file nor a
#: checkpoint's hyper-parameters can name a class for jsonargparse to import and instantiate.
PlainValue = int | float | str | bool | None | list[int | float | str | bool | None] | list[list[float]]
Architecture = Literal["dit", "pixart"]
ARCHITECTURES = get_args(Architecture)

#: the default network: a ~2M-parameter class-conditional DiT on 8×8 one-channel digits
TINY_DIT = dict(
    num_attention_heads=4,
    attention_head_dim=32,
    in_channels=1,
    num_layers=4,
    sample_size=8,
    patch_size=2,
    num_embeds_ada_norm=10,
)


def build_transformer(architecture: str, config: dict[str, PlainValue]) -> nn.Module:
    """A diffusers ``DiTTransformer2DModel`` (``"dit"``) or ``PixArtTransformer2DModel`` (``"pixart"``) from kwargs."""
    from diffusers import DiTTransformer2DModel, PixArtTransformer2DModel

    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture must be one of {ARCHITECTURES}, got {architecture!r}.")
    cls = DiTTransformer2DModel if architecture == "dit" else PixArtTransformer2DModel
    model = cls(**config)
    for m in model.modules():  # label dropout is done by DiTModule with its own generator
        if hasattr(m, "dropout_prob"):
            m.dropout_prob = 0.0
    return model


def cast(model: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
    """``model.to(*args, **kwargs)``, past diffusers' ``ModelMixin.to`` when the model keeps no module in float32:
    that override warns "modules … should be kept in float32: []" on every dtype cast, even with the list empty."""
    if getattr(model, "_keep_in_fp32_modules", None):
        return model.to(*args, **kwargs)
    return nn.Module.to(model, *args, **kwargs)


def load_local(cls: Any, path: str, argument: str) -> Any:
    """``cls.from_pretrained(path, local_files_only=True)``; a missing directory is an error naming the argument."""
    try:
        return cls.from_pretrained(path, local_files_only=True)
    except OSError as err:
        raise FileNotFoundError(
            f"Cannot load {cls.__name__} from {path!r} ({argument}): not a local directory nor a "
            "cached hub id, and nothing is downloaded. Pass a directory made with "
            "save_pretrained()."
        ) from err


#: the caption length allowed when neither the tokenizer nor the encoder declares one (PixArt-Sigma uses 300)
MAX_CAPTION_TOKENS = 4096


class PromptEncoder(nn.Module):
    """A frozen transformers text encoder (``T5EncoderModel`` for T5 checkpoints) with its tokenizer, from a local
    directory: prompts → ``{"caption_embeds": (B, L, d), "caption_mask": (B, L)}``, padded to ``max_length``."""

    def __init__(self, path: str, max_length: int = 120) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModel, AutoTokenizer, T5EncoderModel

        config = load_local(AutoConfig, path, "text_encoder_path")
        encoder_cls = T5EncoderModel if config.model_type == "t5" else AutoModel
        self.encoder = load_local(encoder_cls, path, "text_encoder_path").eval().requires_grad_(False)
        self.tokenizer = load_local(AutoTokenizer, path, "text_encoder_path")
        # a caption length read from a checkpoint is a size like any other: at most the tokens the tokenizer (or the
        # encoder's config) declares, else MAX_CAPTION_TOKENS (T5 has relative positions and declares none itself)
        declared = (getattr(self.tokenizer, "model_max_length", None), getattr(config, "n_positions", None))
        limit = min((n for n in declared if isinstance(n, int) and 0 < n < 1 << 20), default=MAX_CAPTION_TOKENS)
        if not 1 <= max_length <= limit:
            raise ValueError(
                f"max_caption_length must be in [1, {limit}] (the positions of the text encoder at {path!r}), "
                f"got {max_length}."
            )
        self.max_length = max_length

    @torch.no_grad()
    def forward(self, prompts: Sequence[str]) -> dict[str, Tensor]:
        device = next(self.encoder.parameters()).device
        tokens = self.tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(device)
        embeds = self.encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).last_hidden_state
        return {"caption_embeds": embeds.float(), "caption_mask": tokens.attention_mask}

    def train(self, mode: bool = True) -> PromptEncoder:
        return super().train(False)  # frozen: no dropout whatever the parent does


@torch.no_grad()
def restore_initialization(model: nn.Module) -> None:
    """After a meta-device build and ``reset_parameters()`` of the shards: restore what that reset does not — the
    sin-cos position embeddings and PixArt's ``scale_shift_table`` (randn / √d, as diffusers; each shard its part of
    one seeded full table)."""
    from diffusers.models.embeddings import PatchEmbed, get_2d_sincos_pos_embed

    g = torch.Generator().manual_seed(0)
    for module in model.modules():
        if isinstance(module, PatchEmbed) and module.pos_embed is not None:
            grid = int(module.pos_embed.shape[1] ** 0.5)
            table = get_2d_sincos_pos_embed(
                module.pos_embed.shape[-1],
                grid,
                base_size=module.base_size,
                interpolation_scale=module.interpolation_scale,
                output_type="pt",
            )
            module.pos_embed.copy_(table.float().unsqueeze(0).to(module.pos_embed.device))
    for name, p in model.named_parameters():
        if name.endswith("scale_shift_table"):
            full = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full)
