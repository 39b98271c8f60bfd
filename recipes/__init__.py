"""DiT training recipes: LightningModule, data modules, CLI and configs."""

# ruff: noqa: E402 (the extra is checked before the modules that need it are imported)
from lightning_muon.extras import require

require("recipe", "lightning_muon.recipes (the DiT recipe and the lightning-muon command)")

from lightning_muon.recipes.data import DigitsDataModule, ImageFolderDataModule, LatentShardsDataModule
from lightning_muon.recipes.module import DiTModule

__all__ = ["DiTModule", "DigitsDataModule", "ImageFolderDataModule", "LatentShardsDataModule"]
