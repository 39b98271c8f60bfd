"""DiT training recipes: LightningModule, data modules, CLI and configs."""

from lightning_muon.recipes.data import DigitsDataModule, ImageFolderDataModule, LatentShardsDataModule
from lightning_muon.recipes.module import DiTModule

__all__ = ["DiTModule", "DigitsDataModule", "ImageFolderDataModule", "LatentShardsDataModule"]
