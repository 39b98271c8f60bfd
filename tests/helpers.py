"""Test helpers: tiny random-init diffusers models built from configs (nothing is downloaded)."""

import torch


def tiny_dit(num_layers: int = 2, num_classes: int = 10, seed: int = 0):
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(seed)
    return DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=num_layers, sample_size=8,
        patch_size=2, num_embeds_ada_norm=num_classes,
    )  # fmt: skip


def tiny_pixart(num_layers: int = 2, seed: int = 0):
    from diffusers import PixArtTransformer2DModel

    torch.manual_seed(seed)
    return PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=num_layers,
        cross_attention_dim=16, sample_size=8, patch_size=2, caption_channels=12,
    )  # fmt: skip
