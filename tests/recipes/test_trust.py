"""Untrusted files run no code: configs, strategy options and checkpoint hyper-parameters are plain data; the
``evaluate`` sweep reports a bad checkpoint and goes on; image folders read only regular files inside them.

Each payload has a control: the same data parsed the way it was before the guard (an ``Any``-typed parameter, which
jsonargparse instantiates from ``class_path``) does create the file, so a test that sees no file means the guard
held, not that the payload was inert."""

import collections.abc
import contextlib
import csv
import dataclasses
import inspect
import os
import signal
import typing
from typing import Any

import lightning as L
import pytest
import torch
import yaml
from helpers import SMALL_DIT, image_folder
from jsonargparse import ArgumentParser

from lightning_muon.metrics.images import ImageFolder
from lightning_muon.recipes.cli import main as cli
from lightning_muon.recipes.evaluate import main as evaluate
from lightning_muon.recipes.module import DiTModule
from lightning_muon.recipes.trust import checked_hparams


def command(path):
    return {"class_path": "os.system", "init_args": {"command": f"touch {path}"}}


@contextlib.contextmanager
def jsonargparse_defaults():
    """jsonargparse's settings before ``lightning-muon`` hardens them (Any values instantiated, no denylist)."""
    from jsonargparse._common import parsing_settings

    saved = dict(parsing_settings)
    parsing_settings.update(instantiate_subclass_spec_in_any=None, import_paths_enforced=False)
    try:
        yield
    finally:
        parsing_settings.clear()
        parsing_settings.update(saved)


def old_style_instantiate(value):
    """The control: a parameter typed ``Any`` (as ``model_config`` / ``mp_policy`` were) parsed and instantiated by
    jsonargparse the way LightningCLI does, from a config or from a checkpoint's hyper-parameters, with
    jsonargparse's default settings."""

    class Module:
        def __init__(self, option: Any = None) -> None:
            self.option = option

    with jsonargparse_defaults():
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(Module, "model")
        parser.instantiate(parser.parse_object({"model": {"option": value}}))


PAYLOADS = {
    "model_config": lambda path: {"model": {"model_config": {"pwn": command(path)}}},
    "param_overrides": lambda path: {"model": {"param_overrides": {"attention": {"pwn": command(path)}}}},
    "mp_policy": lambda path: {
        "trainer": {
            "strategy": {
                "class_path": "lightning_muon.strategy.MuonFSDPStrategy",
                "init_args": {"mp_policy": command(path)},
            }
        }
    },
}


def run_cli(args, cwd):
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli(args)
    finally:
        os.chdir(old)
    return exit_info.value.code


@pytest.mark.parametrize("route", sorted(PAYLOADS))
def test_a_config_that_names_a_command_is_refused_at_parse_time(tmp_path, route, capsys):
    marker = tmp_path / "pwned"
    old_style_instantiate(command(tmp_path / "control"))
    assert (tmp_path / "control").exists()  # control: the payload is live where a parameter is typed Any
    (tmp_path / "evil.yaml").write_text(yaml.safe_dump(PAYLOADS[route](marker)))
    assert run_cli(["fit", "--config", str(tmp_path / "evil.yaml"), "--trainer.max_steps", "1"], tmp_path) != 0
    assert not marker.exists()
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("subcommand", ["validate", "fit"])
def test_a_checkpoint_whose_hyperparameters_name_a_command_runs_nothing(tmp_path, subcommand, capsys):
    marker = tmp_path / "pwned"
    hparams = {"model_config": {"pwn": command(marker)}}
    torch.save({"hyper_parameters": hparams, "state_dict": {}}, tmp_path / "evil.ckpt")
    torch.load(tmp_path / "evil.ckpt", weights_only=True)  # plain data: it passes weights_only loading
    old_style_instantiate(command(tmp_path / "control"))  # control: Lightning's re-parse of an Any-typed value
    assert (tmp_path / "control").exists()
    assert run_cli([subcommand, "--ckpt_path", str(tmp_path / "evil.ckpt")], tmp_path) == 2
    assert not marker.exists()
    err = capsys.readouterr().err
    assert "--ckpt_path" in err and "model_config" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("hparams", "message"),
    [
        ({"_class_path": "os.system", "command": "true"}, "not DiTModule"),
        ({"lr": "0.1; rm -rf /"}, "lr"),
        ({"betas": [0.9, {"class_path": "os.system"}]}, "betas"),
        ([("lr", 0.1)], "mapping"),
    ],
)
def test_hyperparameters_of_the_wrong_type_are_refused(hparams, message):
    with pytest.raises(ValueError, match=message):
        checked_hparams(hparams, DiTModule)


def test_saved_hyperparameters_round_trip_and_unknown_keys_are_dropped():
    module = DiTModule(model_config=SMALL_DIT, param_overrides={"attention": {"period": 2}}, betas=(0.8, 0.9))
    saved = {**dict(module.hparams), "_instantiator": "lightning.pytorch.cli.instantiate_module", "gone": 1}
    checked = checked_hparams(saved, DiTModule)
    assert "gone" not in checked and "_instantiator" not in checked
    assert checked == {k: v for k, v in dict(module.hparams).items()}


#: what a parameter reachable from the CLI may not be annotated with: jsonargparse instantiates any ``class_path``
UNTYPED = (Any, object)


def untyped_parts(annotation) -> list:
    """The ``Any`` / ``object`` / bare callables inside an annotation (recursing into unions and containers)."""
    if annotation in UNTYPED or annotation in (typing.Callable, callable):
        return [annotation]
    if typing.get_origin(annotation) is collections.abc.Callable:
        return [annotation]
    return [part for arg in typing.get_args(annotation) for part in untyped_parts(arg)]


def cli_classes():
    from lightning_muon import callbacks
    from lightning_muon.parallelize import MixedPrecision
    from lightning_muon.recipes import data
    from lightning_muon.strategy import MuonFSDPStrategy

    found = [DiTModule, MuonFSDPStrategy, MixedPrecision]
    for module in (callbacks, data):  # the callbacks package imports its members on first use: ask for each by name
        for obj in (getattr(module, name) for name in getattr(module, "__all__", vars(module))):
            if inspect.isclass(obj) and issubclass(obj, (L.Callback, L.LightningDataModule)):
                found.append(obj)
    return found


def test_no_parameter_reachable_from_the_cli_is_untyped():
    def bad(cls):
        hints = typing.get_type_hints(cls.__init__)
        return {name: hint for name, hint in hints.items() if name != "return" and untyped_parts(hint)}

    classes = cli_classes()
    assert len(classes) >= 10
    assert {cls.__name__: bad(cls) for cls in classes if bad(cls)} == {}

    class Control:  # the audit finds what it looks for
        def __init__(self, a: dict[str, Any], b: int | typing.Callable[[int], int] = 1) -> None: ...

    assert set(bad(Control)) == {"a", "b"}


def plain(annotation) -> bool:
    """Plain data: scalars, literals, and lists / tuples / dicts / unions / dataclasses of plain data (no class is
    named; a dataclass of options is saved as the dict of its fields)."""
    if annotation in (int, float, str, bool, type(None)):
        return True
    if dataclasses.is_dataclass(annotation):
        hints = typing.get_type_hints(annotation)
        return all(plain(hints[f.name]) for f in dataclasses.fields(annotation))
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return True
    if origin in (list, tuple, dict, typing.Union) or str(origin) == "<class 'types.UnionType'>":
        return all(plain(a) for a in typing.get_args(annotation) if a is not Ellipsis)
    return False


def test_every_hyperparameter_a_checkpoint_can_carry_is_plain_data():
    hints = typing.get_type_hints(DiTModule.__init__)
    assert {k: v for k, v in hints.items() if k != "return" and not plain(v)} == {}
    assert not plain(dict[str, Any]) and not plain(int | torch.dtype)  # control

    @dataclasses.dataclass
    class Options:
        lr: float | torch.Tensor = 0.1

    assert not plain(Options)  # control: a dataclass with a tensor field (MuonConfig's lr was typed so)


# ------------------------------------------------------------------------------------------- evaluate's sweep
@pytest.fixture(scope="module")
def cache(digits_cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LIGHTNING_MUON_CACHE", str(digits_cache))  # the session's trained digits classifier
        yield digits_cache


def save_checkpoint(path, step, **hparams):
    module = DiTModule(model_config=SMALL_DIT)
    module.configure_model()
    saved = {**dict(module.hparams), **hparams}
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": saved, "global_step": step}, path)


def test_evaluate_scores_every_good_step_once_and_reports_every_bad_checkpoint(cache, tmp_path):
    runs = tmp_path / "runs"
    for name in ("epoch=0-step=5.ckpt", "best-step=5.ckpt", "last.ckpt"):  # three files, one step
        save_checkpoint(runs / "a" / "checkpoints" / name, 5)
    save_checkpoint(runs / "short" / "checkpoints" / "last.ckpt", 3)  # shorter than its first evaluation
    save_checkpoint(runs / "c" / "checkpoints" / "step=1.ckpt", 1, model_config={**SMALL_DIT, "foo": 1})
    save_checkpoint(runs / "c" / "checkpoints" / "step=2.ckpt", 2, model_config={"pwn": command(tmp_path / "pwned")})
    (runs / "c" / "checkpoints" / "step=4.ckpt").write_bytes(b"not a checkpoint")
    save_checkpoint(runs / "c" / "checkpoints" / "step=7.ckpt", 7)  # after the bad ones: still scored
    out = tmp_path / "eval"
    args = ["--out", str(out), "--num-samples", "32", "--num-inference-steps", "2", "--batch-size", "32"]
    with pytest.raises(SystemExit) as exit_info:
        evaluate([str(runs / r) for r in ("a", "short", "c")] + args)
    assert exit_info.value.code == 1
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert sorted((r["run"], int(r["step"])) for r in rows) == [("a", 5), ("c", 7), ("short", 3)]
    assert next(r for r in rows if r["run"] == "a")["checkpoint"].endswith("best-step=5.ckpt")
    errors = (out / "errors.txt").read_text()
    assert all(f"step={s}.ckpt" in errors for s in (1, 2, 4)) and "foo" in errors
    assert not (tmp_path / "pwned").exists()


# ------------------------------------------------------------------------------------------- image folders
def test_a_fifo_named_like_an_image_is_skipped_not_opened(tmp_path):
    root = image_folder(tmp_path / "images", 4, size=8)
    before = len(ImageFolder(root, 8))
    os.mkfifo(root / "c0" / "b.png")
    signal.alarm(30)  # a regression would block in open(): fail instead of hanging the suite
    try:
        folder = ImageFolder(root, 8)
        assert len(folder) == before and all(f.name != "b.png" for f in folder.files)
        assert folder[0]["images"].shape == (3, 8, 8)
    finally:
        signal.alarm(0)
    (root / "c0" / "b.png").unlink()
    (root / "c0" / "b.png").write_bytes((root / "c0" / "0.png").read_bytes())  # control: a regular file is listed
    assert len(ImageFolder(root, 8)) == before + 1


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"file": "../outside.png", "caption": "x"}', "outside"),
        ('{"file": "/etc/hostname", "caption": "x"}', "outside"),
        ('{"file": 3, "caption": "x"}', "must be"),
        ("not json", "not JSON"),
    ],
)
def test_a_captions_file_names_only_files_inside_its_folder(tmp_path, line, message):
    root = image_folder(tmp_path / "images", 2, size=8, captions=["a"])
    assert len(ImageFolder(root, 8)) == 2  # control
    with (root / "captions.jsonl").open("a") as f:
        f.write("\n" + line)
    with pytest.raises(ValueError, match=message):
        ImageFolder(root, 8)
