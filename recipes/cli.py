"""``lightning-muon``: LightningCLI over :class:`DiTModule` and the data modules.

``lightning-muon fit`` with no arguments trains the tiny digits DiT with Periodic Row-wise Muon on the CPU
(``recipes/configs/digits_tiny.yaml``); ``lightning-muon fit --config t2i_1p3b`` runs a paper-scale config by name.
``lightning-muon fit --help`` lists every option; ``lightning-muon evaluate --help`` the checkpoint evaluation.
"""

from __future__ import annotations

import logging
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import yaml
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_muon  # noqa: F401  (registers strategy="muon_fsdp")
from lightning_muon.callbacks import GenerationEvaluation, LineProgress, Preemption, StepProgressBar
from lightning_muon.checkpoint import AtomicCheckpointIO, resolve_checkpoint
from lightning_muon.recipes.module import LEGACY_MUON_KEYS, DiTModule
from lightning_muon.recipes.shipped import DEFAULT_CONFIG, shipped_config_paths
from lightning_muon.recipes.trust import checked_checkpoint
from lightning_muon.storage import check_writable, exit_on_storage_error


def upgraded_options(argv: list[str]) -> list[str]:
    """DiTModule's flat optimizer options (before they moved under ``muon``) in today's form, with a warning each:
    ``--model.period 3`` is ``--model.muon.period 3`` (:data:`~lightning_muon.recipes.module.LEGACY_MUON_KEYS`;
    ``--model.weight_decay`` sets both branches'), and a ``--config`` file with such keys under ``model`` is read
    through a converted copy (:meth:`DiTModule.upgrade_hparams`)."""
    out, i = [], 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        flag, eq, value = arg.partition("=")
        key = flag.removeprefix("--model.").removeprefix("init_args.") if flag.startswith("--model.") else None
        if key in LEGACY_MUON_KEYS or key == "weight_decay":
            value = value if eq else argv[i] if i < len(argv) else ""
            i += 0 if eq else 1
            new = [f"--model.muon.{LEGACY_MUON_KEYS.get(key, key)}", value]
            new += ["--model.adamw_weight_decay", value] if key == "weight_decay" else []
            warnings.warn(f"{flag} is now {' and '.join(new[::2])}.", FutureWarning, stacklevel=2)
            out += new
        elif arg in ("-c", "--config") and i < len(argv) and Path(argv[i]).is_file():
            out += [arg, upgraded_config(argv[i])]
            i += 1
        else:
            out.append(arg)
    return out


def upgraded_config(path: str) -> str:
    """``path``, or a converted copy of it when it was written before the options became objects (flat optimizer
    keys under ``model``, flat metric and sampling arguments of a ``GenerationEvaluation``)."""
    config = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(config, dict):
        return path
    changed = False
    model = config.get("model")
    section = model.get("init_args", model) if isinstance(model, dict) else None
    if isinstance(section, dict) and (upgraded := DiTModule.upgrade_hparams(section)) != section:
        section.clear()
        section.update(upgraded)
        changed = True
    trainer = config.get("trainer")
    for callback in (trainer.get("callbacks") or []) if isinstance(trainer, dict) else []:
        if isinstance(callback, dict) and str(callback.get("class_path", "")).endswith("GenerationEvaluation"):
            init_args = callback.get("init_args") or {}
            if (upgraded := GenerationEvaluation.upgrade_init_args(init_args)) != init_args:
                callback["init_args"] = upgraded
                changed = True
    if not changed:
        return path
    copy = Path(tempfile.mkdtemp(prefix="lightning_muon_config_")) / Path(path).name
    copy.write_text(yaml.safe_dump(config, sort_keys=False))
    warnings.warn(
        f"{path} was written before the options became objects (model.muon; a GenerationEvaluation's suite and "
        f"sampling); read through a converted copy ({copy}). `lightning-muon fit --config {path} --print_config` "
        "prints today's form.",
        FutureWarning,
        stacklevel=2,
    )
    return str(copy)


class ShortUsageParser(LightningArgumentParser):
    """A mistake on the command line prints one usage line, the ``--help`` tip and the error naming the option, not
    the whole option list (``--help`` still shows it)."""

    def print_usage(self, file: Any = None) -> None:
        (file or sys.stdout).write(f"usage: {self.prog} [options]\n")


EVALUATE_HELP = "Generation metrics for every checkpoint of one or several runs (see: evaluate --help)."
DOCTOR_HELP = "Pre-flight check of a GPU node: versions, bf16, optimizer, NS5, NCCL, one train step (doctor --help)."


class MuonCLI(LightningCLI):
    """LightningCLI with ``evaluate`` and ``doctor`` subcommands (:mod:`~lightning_muon.recipes.evaluate`,
    :mod:`~lightning_muon.recipes.doctor`) and a step progress
    bar, where ``fit --ckpt_path DIR`` resumes from the newest complete checkpoint under ``DIR`` and ``fit`` ends
    with a summary: evaluation results, checkpoints, and how to open the logs."""

    def _add_subcommands(self, parser, **kwargs) -> None:
        super()._add_subcommands(parser, **kwargs)
        # listed in --help; main() hands `evaluate ...` and `doctor ...` to their own parsers before LightningCLI
        for name, text in (("evaluate", EVALUATE_HELP), ("doctor", DOCTOR_HELP)):
            parser._subcommands_action.add_subcommand(name, self.init_parser(description=text), help=text)

    def _parse_ckpt_path(self) -> None:
        """``--ckpt_path``, under every subcommand, before anything is built: a directory that is not a checkpoint
        becomes the newest complete checkpoint under it; the checkpoint must be complete, its hyper-parameters plain
        data of DiTModule's types whose sizes are those of its weights
        (:func:`~lightning_muon.recipes.trust.checked_checkpoint`: no class is named, nothing sized by the file is
        allocated). They replace the configured model's, as Lightning does for single files (here also for
        distributed checkpoints). A file that fails is one line naming it and what is wrong (exit code 2)."""
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path in (None, "last", "best", "hpc", "registry"):
            return
        try:
            path = resolve_checkpoint(ckpt_path)
            hparams = checked_checkpoint(path, DiTModule)
        except (FileNotFoundError, ValueError) as err:
            sys.stderr.write(f"error: --ckpt_path: {err}\n")
            sys.exit(2)
        self.config[subcommand]["ckpt_path"] = str(path)
        self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)

    def before_instantiate_classes(self) -> None:
        """A read-only output directory is one line before anything is built, not a traceback at the first log."""
        if self.subcommand:
            check_writable(self.config[self.subcommand].trainer.get("default_root_dir") or ".")

    def instantiate_classes(self) -> None:
        """Build the configured objects; a value they refuse (``ValueError``, e.g. ``--model.period 0`` or
        ``--data.batch_size 0``) is a short parser error naming it, like a value of the wrong type, not a
        traceback."""
        try:
            super().instantiate_classes()
        except ValueError as err:
            self.parser.error(str(err))

    def instantiate_trainer(self, **kwargs):
        """The trainer, with step progress unless the progress bar is disabled or another one is configured: a
        :class:`~lightning_muon.callbacks.StepProgressBar` in a terminal,
        :class:`~lightning_muon.callbacks.LineProgress` lines when stdout is redirected (a log file, a Slurm job);
        :class:`~lightning_muon.callbacks.Preemption` (signals acted on between steps), and
        :class:`~lightning_muon.checkpoint.AtomicCheckpointIO` unless a ``CheckpointIO`` plugin is configured."""
        config = self._get(self.config_init, "trainer", default={})
        callbacks = list(config.get("callbacks") or [])
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(StepProgressBar() if sys.stdout.isatty() else LineProgress())
        if not any(isinstance(c, Preemption) for c in callbacks):  # SIGTERM / Slurm's requeue between steps
            callbacks.append(Preemption())
        config["callbacks"] = callbacks
        plugins = config.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):  # crash-consistent saves under every strategy
            config["plugins"] = [*plugins, AtomicCheckpointIO()]
        return super().instantiate_trainer(**kwargs)

    def after_fit(self) -> None:
        summary = fit_summary(self.trainer)  # on every rank: trainer.log_dir is a collective
        if self.trainer.is_global_zero:
            print(summary)


def fit_summary(trainer: L.Trainer) -> str:
    """Best and last evaluation values, the checkpoints, and the ``tensorboard`` command for the run's logs (every
    rank calls it: ``trainer.log_dir`` broadcasts)."""
    lines = [f"Trained {trainer.global_step} steps."]
    for evaluation in (c for c in trainer.callbacks if isinstance(c, GenerationEvaluation) and c.history):
        last = evaluation.history[-1]
        for key in (k for k in last if k in evaluation.higher_is_better):  # best by the metric's higher_is_better
            pick = max if evaluation.higher_is_better[key] else min
            best = pick(evaluation.history, key=lambda row: row.get(key, float("nan")))
            lines.append(
                f"  {key}: last {last[key]:.4g} (step {last['step']}), best {best[key]:.4g} (step {best['step']})"
            )
    for ckpt in (c for c in trainer.callbacks if isinstance(c, ModelCheckpoint)):
        if ckpt.monitor and ckpt.best_model_path:
            lines.append(f"  best checkpoint by {ckpt.monitor}: {ckpt.best_model_path}")
        elif ckpt.last_model_path or ckpt.best_model_path:
            lines.append(f"  last checkpoint: {ckpt.last_model_path or ckpt.best_model_path}")
    if trainer.log_dir:
        lines.append(f"  logs: tensorboard --logdir {trainer.log_dir}")
    return "\n".join(lines)


def _not_litlogger_tip(record: logging.LogRecord) -> bool:
    return "litlogger" not in record.getMessage()


def quiet_lightning_notices() -> None:
    """Drop three Lightning 2.6 notices that say nothing about the run: the ``LeafSpec`` deprecation its own pytree
    code triggers in torch ≥ 2.10, the advertisement for ``litlogger`` printed by every ``Trainer``, and the note that
    ``args`` differ from ``sys.argv`` (they do on purpose: configs by name, upgraded options)."""
    leafspec = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
    warnings.filterwarnings("ignore", message=leafspec, category=FutureWarning)
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within Python")
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logging.getLogger(name).addFilter(_not_litlogger_tip)  # added once, however often main() runs


def main(args: list[str] | None = None) -> None:
    """``lightning-muon evaluate ...`` evaluates checkpoints, ``lightning-muon doctor`` checks the machine; every other
    subcommand is LightningCLI's."""
    from jsonargparse import set_parsing_settings

    # Beside the typed signatures (nothing a checkpoint holds can name a class): a value typed Any is never
    # instantiated from a class_path, and class_paths into os, subprocess, eval and the rest of jsonargparse's
    # denylist are refused, so a config meant as data cannot reach them through a parameter we did not type.
    set_parsing_settings(instantiate_subclass_spec_in_any=False, import_path_denylist=[])
    quiet_lightning_notices()
    argv = sys.argv[1:] if args is None else args
    if argv[:1] == ["evaluate"]:
        from lightning_muon.recipes.evaluate import main as evaluate

        return evaluate(argv[1:])
    if argv[:1] == ["doctor"]:
        from lightning_muon.recipes.doctor import main as doctor

        sys.exit(doctor(argv[1:]))
    argv = upgraded_options(shipped_config_paths(argv))
    with exit_on_storage_error():  # a full disk, a read-only directory: the place and what to do, not a traceback
        MuonCLI(
            DiTModule,
            L.LightningDataModule,
            subclass_mode_data=True,
            # one optimizer path: --model.optimizer and DiTModule.configure_optimizers (muon_param_groups). With
            # LightningCLI's --optimizer / --lr_scheduler given, it would replace configure_optimizers without a word.
            auto_configure_optimizers=False,
            parser_class=ShortUsageParser,
            parser_kwargs={
                # no abbreviations: `--trainer.max_step 20` is an error, not max_steps
                **{
                    sub: {"default_config_files": [str(DEFAULT_CONFIG)], "allow_abbrev": False}
                    for sub in ("fit", "validate", "test", "predict")
                },
                "allow_abbrev": False,
                "description": "Train Diffusion Transformers with Periodic Row-wise Muon.",
            },
            args=argv,
        )


if __name__ == "__main__":
    main()
