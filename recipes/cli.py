"""``lightning-muon``: LightningCLI over :class:`DiTModule` and the data modules.

``lightning-muon fit`` with no arguments trains the tiny digits DiT with Periodic Row-wise Muon on the CPU
(``recipes/configs/digits_tiny.yaml``); ``lightning-muon fit --config recipes/configs/t2i_base.yaml --config
recipes/configs/t2i_1p3b.yaml`` runs a paper-scale config. ``lightning-muon fit --help`` lists every option;
``lightning-muon evaluate --help`` the checkpoint evaluation.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.cli import LightningCLI

import lightning_muon  # noqa: F401  (registers strategy="muon_fsdp")
from lightning_muon.recipes.module import DiTModule

CONFIGS = Path(__file__).parent / "configs"
DEFAULT_CONFIG = CONFIGS / "digits_tiny.yaml"
#: Every shipped run, as the ``--config`` files it stacks (later files override earlier ones).
SHIPPED_CONFIGS = {
    "digits_tiny": [DEFAULT_CONFIG],
    "dit_xl2_imagenet256": [CONFIGS / "dit_xl2_imagenet256.yaml"],
    **{f"t2i_{s}": [CONFIGS / "t2i_base.yaml", CONFIGS / f"t2i_{s}.yaml"] for s in ("1p3b", "4b", "9b", "15b")},
}


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(*paths: str | Path) -> dict:
    """Stacked YAML configs as one dict, the way ``--config a --config b`` merges them (mappings merge, lists and
    values of later files replace)."""
    import yaml

    config: dict = {}
    for path in paths:
        config = _merge(config, yaml.safe_load(Path(path).read_text()) or {})
    return config


class MuonCLI(LightningCLI):
    """LightningCLI where ``fit --ckpt_path DIR`` resumes from the newest complete checkpoint under ``DIR``."""

    def before_fit(self) -> None:
        from lightning_muon.checkpoint import resolve_checkpoint

        config = self.config_init[self.subcommand]
        if config.get("ckpt_path") not in (None, "last", "best", "hpc"):
            config["ckpt_path"] = str(resolve_checkpoint(config["ckpt_path"]))


def main(args: list[str] | None = None) -> None:
    """``lightning-muon evaluate ...`` evaluates checkpoints; every other subcommand is LightningCLI's."""
    import sys

    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["evaluate"]:
        from lightning_muon.recipes.evaluate import main as evaluate

        return evaluate(argv[1:])
    MuonCLI(
        DiTModule,
        L.LightningDataModule,
        subclass_mode_data=True,
        parser_kwargs={
            "fit": {"default_config_files": [str(DEFAULT_CONFIG)]},
            "description": "Train Diffusion Transformers with Periodic Row-wise Muon.",
        },
        args=args,
    )


if __name__ == "__main__":
    main()
