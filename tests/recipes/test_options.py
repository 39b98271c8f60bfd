"""One source of every default: the optimizer's keyword defaults are ``MuonConfig``'s and ``AdamWConfig``'s,
``DiTModule`` takes the Muon options whole (``muon=``, ``--model.muon.period``), ``GenerationEvaluation`` its metric
suite and sampling options (``suite=``, ``sampling=``), and what was written before — a checkpoint, each shipped
config, a command line — still loads, in today's form."""

import contextlib
import dataclasses
import inspect
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

from lightning_muon.optim import AdamWConfig, MuonConfig, PeriodicRowwiseMuon
from lightning_muon.recipes.data import DigitsDataModule
from lightning_muon.recipes.module import DiTModule
from lightning_muon.recipes.trust import checked_hparams

LEGACY = Path(__file__).parent / "legacy"  # written by the code before the change (commit 1b01f37)


def differing_defaults(signature: inspect.Signature, config: type, only: tuple[str, ...] = ()) -> dict[str, tuple]:
    """``{name: (signature default, config default)}`` for the config's fields (``only`` these) the signature takes."""
    fields = {f.name: f.default for f in dataclasses.fields(config) if not only or f.name in only}
    params = signature.parameters
    return {k: (params[k].default, v) for k, v in fields.items() if k in params and params[k].default != v}


def test_the_optimizers_defaults_are_the_configs():
    signature = inspect.signature(PeriodicRowwiseMuon)
    assert differing_defaults(signature, MuonConfig) == {}
    # AdamW's own: betas, eps (lr, momentum, weight_decay are the Muon group's unless adamw_* are given)
    assert differing_defaults(signature, AdamWConfig, only=("betas", "eps")) == {}
    assert len({f.name for f in dataclasses.fields(MuonConfig)} - set(signature.parameters)) == 0
    assert inspect.signature(DiTModule).parameters["muon"].default == MuonConfig()
    params = [p.replace(default=4) if p.name == "period" else p for p in signature.parameters.values()]
    changed = signature.replace(parameters=params)
    assert differing_defaults(changed, MuonConfig) == {"period": (4, 3)}  # the control


def test_a_checkpoint_written_before_the_change_loads_and_resumes(tmp_path):
    legacy = LEGACY / "dit_0.1.ckpt"  # 3 steps, flat period=2, rownorm_scale=0.3, lr=0.01, weight_decay=0.01, adaptive
    module = DiTModule.load_from_checkpoint(legacy)
    muon = module.hparams.muon
    assert (muon["period"], muon["rownorm_scale"], muon["lr"], muon["schedule"]) == (2, 0.3, 0.01, "adaptive")
    assert muon["weight_decay"] == module.hparams.adamw_weight_decay == 0.01
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, limit_val_batches=0, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(module, DigitsDataModule(batch_size=8), ckpt_path=legacy)
    groups = [g for g in trainer.optimizers[0].param_groups if g["use_muon"]]
    assert trainer.global_step == 4 and {(g["period"], g["schedule"], g["weight_decay"]) for g in groups} == {
        (2, "adaptive", 0.01)
    }
    raw = torch.load(legacy, weights_only=True)["hyper_parameters"]
    assert checked_hparams(raw, DiTModule)["muon"]["period"] == 2  # evaluate's and --ckpt_path's route
    with pytest.raises(TypeError, match="period"):  # the control: the saved keys as they are fit no longer
        DiTModule(**{k: v for k, v in raw.items() if k in ("model_config", "period")})


@pytest.mark.parametrize("name", ["digits_tiny", "dit_xl2_imagenet256", "t2i_base"])
def test_each_shipped_config_written_before_the_change_still_parses(name, capsys):
    from lightning_muon.recipes.cli import main
    from lightning_muon.recipes.shipped import CONFIGS

    def printed(*args: str) -> dict:
        with contextlib.ExitStack() as stack:
            if "_0.1" in args[1]:  # read through a converted copy, with a warning
                stack.enter_context(pytest.warns(FutureWarning, match="converted copy"))
            done = stack.enter_context(pytest.raises(SystemExit))
            main(["fit", *args, "--print_config"])
        assert done.value.code in (0, None)
        return yaml.safe_load(capsys.readouterr().out)

    old, new = printed("--config", str(LEGACY / f"{name}_0.1.yaml")), printed("--config", str(CONFIGS / f"{name}.yaml"))
    assert old["model"]["muon"] == new["model"]["muon"]
    assert old["model"]["adamw_weight_decay"] == new["model"]["adamw_weight_decay"]
    assert old["trainer"]["callbacks"] == new["trainer"]["callbacks"]  # GenerationEvaluation's suite and sampling
    legacy = yaml.safe_load((LEGACY / f"{name}_0.1.yaml").read_text())["model"]
    assert "period" in legacy and "muon" not in legacy  # the control: the old file has the flat keys


def test_an_old_command_line_option_is_read_in_todays_form(capsys):
    from lightning_muon.recipes.cli import main

    with pytest.warns(FutureWarning, match="--model.muon.period"), pytest.raises(SystemExit):
        main(["fit", "--model.period", "2", "--model.refresh_schedule", "adaptive", "--print_config"])
    muon = yaml.safe_load(capsys.readouterr().out)["model"]["muon"]
    assert (muon["period"], muon["schedule"]) == (2, "adaptive")
