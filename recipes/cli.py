"""``lightning-muon``: LightningCLI over :class:`DiTModule` and the data modules.

``lightning-muon fit`` with no arguments trains the tiny digits DiT with Periodic Row-wise Muon on the CPU
(``recipes/configs/digits_tiny.yaml``); ``lightning-muon fit --config recipes/configs/t2i_1p3b.yaml`` runs a
paper-scale config. ``lightning-muon fit --help`` lists every option; ``lightning-muon evaluate --help`` the
checkpoint evaluation.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.cli import LightningCLI

import lightning_muon  # noqa: F401  (registers strategy="muon_fsdp")
from lightning_muon.recipes.module import DiTModule

CONFIGS = Path(__file__).parent / "configs"
DEFAULT_CONFIG = CONFIGS / "digits_tiny.yaml"


def main(args: list[str] | None = None) -> None:
    """``lightning-muon evaluate ...`` evaluates checkpoints; every other subcommand is LightningCLI's."""
    import sys

    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["evaluate"]:
        from lightning_muon.recipes.evaluate import main as evaluate

        return evaluate(argv[1:])
    LightningCLI(
        DiTModule,
        L.LightningDataModule,
        subclass_mode_data=True,
        parser_kwargs={
            "fit": {"default_config_files": [str(DEFAULT_CONFIG)]},
            "description": "Train Diffusion Transformers with Periodic Row-wise Muon.",
        },  # fmt: skip
        args=args,
    )


if __name__ == "__main__":
    main()
