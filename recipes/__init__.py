"""DiT training recipes: LightningModule, data modules, CLI and configs."""
