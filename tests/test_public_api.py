"""Each subpackage's ``__all__`` lists its public classes and functions: every name in it imports, and every
user-facing class defined in the subpackage (a torchmetrics ``Metric``, a Lightning ``Callback``, ``LightningModule``,
``LightningDataModule`` or ``Strategy``, a ``torch.optim.Optimizer``, an evaluation network) is in it. Control: a
name left out is caught."""

import importlib
import inspect
import pkgutil

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torchmetrics import Metric

PACKAGES = [
    "lightning_muon",
    "lightning_muon.optim",
    "lightning_muon.metrics",
    "lightning_muon.callbacks",
    "lightning_muon.recipes",
]
USER_FACING = (
    Metric,
    Callback,
    L.LightningModule,
    L.LightningDataModule,
    L.pytorch.strategies.Strategy,
    torch.optim.Optimizer,
)


def user_facing_classes(package: str) -> dict[str, type]:
    """Public classes of the kinds above defined in the package's own library modules (those with an ``__all__``),
    plus every ``torch.nn.Module`` a metric module exports (extractors, judges)."""
    found = {}
    root = importlib.import_module(package)
    for info in pkgutil.iter_modules(root.__path__):
        if info.ispkg:
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        if not hasattr(module, "__all__"):  # a script run as a process (doctor_worker, ...), not a library module
            continue
        for name, obj in vars(module).items():
            if not inspect.isclass(obj) or obj.__module__ != module.__name__ or name.startswith("_"):
                continue
            nn_in_metrics = (
                package.endswith(".metrics")
                and issubclass(obj, torch.nn.Module)
                and name in getattr(module, "__all__", ())
            )
            if issubclass(obj, USER_FACING) or nn_in_metrics:
                found[name] = obj
    return found


def missing_from_all(package: str, exported: list[str]) -> list[str]:
    return sorted(set(user_facing_classes(package)) - set(exported))


@pytest.mark.parametrize("package", PACKAGES)
def test_all_is_complete_and_importable(package):
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name, None) is not None, f"{package}.{name} is in __all__ but does not import"
    assert missing_from_all(package, module.__all__) == []


def test_geneval2_is_exported_and_a_name_left_out_is_caught():
    import lightning_muon.metrics as metrics
    from lightning_muon.metrics import GenEval2, SoftTifaJudge, load_geneval2  # noqa: F401

    without = [n for n in metrics.__all__ if n != "GenEval2"]  # the control
    assert missing_from_all("lightning_muon.metrics", without) == ["GenEval2"]


def test_the_core_import_loads_nothing_lightning_does_not():
    """``import lightning_muon`` (the optimizer, the grouping, ``strategy="muon_fsdp"``) adds no module beyond ``import
    lightning``'s but its own and Lightning's (an alias of one of its plugins): not the recipe's stack (diffusers,
    open_clip, scikit-learn, jsonargparse), not torch.distributed.checkpoint (imported when a Trainer builds the
    strategy). Control: the callbacks package's evaluation brings the metrics."""
    import subprocess
    import sys

    probe = """
import sys, lightning
before = set(sys.modules)
import lightning_muon
import lightning_muon.callbacks.preemption  # what muon_fsdp adds to a run
new = lambda: sorted(m for m in set(sys.modules) - before if not m.startswith(("lightning_muon", "lightning.")))
print(new())
print(sorted(m for m in ("diffusers", "open_clip", "sklearn", "jsonargparse") if m in sys.modules))
lightning_muon.callbacks.GenerationEvaluation  # the control
print(bool(new()))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["[]", "[]", "True"], out.stdout


def test_version_and_top_level_help_import_neither_torch_nor_lightning():
    """``lightning-muon --version`` / ``--help`` answer from the entry module alone (seconds faster than importing
    Lightning); its subcommand list is the recipe CLI's. Control: the probe sees the modules where they are loaded."""
    import subprocess
    import sys

    from lightning.pytorch.cli import LightningCLI

    import lightning_muon
    import lightning_muon_cli

    assert set(lightning_muon_cli.SUBCOMMANDS) == {*LightningCLI.subcommands(), "evaluate", "doctor"}
    loaded = "sorted(m for m in ('torch', 'lightning', 'lightning_muon') if m in sys.modules)"
    probe = "import sys, lightning_muon_cli as c\ntry: c.main({args!r})\nexcept SystemExit: pass\nprint(" + loaded + ")"

    def run(args):
        code = probe.format(args=args)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        return proc.stdout.strip().splitlines()

    assert run(["--version"]) == [f"lightning-muon {lightning_muon.__version__}", "[]"]
    help_lines = run(["--help"])
    assert help_lines[-1] == "[]" and all(
        f"  {name} " in "\n".join(help_lines) for name in lightning_muon_cli.SUBCOMMANDS
    )
    # the control: in this process they are loaded, and the probe's expression sees them
    assert eval(loaded, {"sys": sys}) == ["lightning", "lightning_muon", "torch"]


def test_a_part_without_its_extra_is_one_line_naming_the_extra(monkeypatch):
    """Here every extra is installed; with one of its modules missing (the control) the part's import is refused in
    one line naming the extra and the module. The real core-only install is tested by .ci/run (.ci/core_install.py)."""
    from lightning_muon import extras

    assert extras.missing("metrics") == [] and extras.missing("recipe") == []
    monkeypatch.setitem(extras.EXTRAS, "metrics", (*extras.EXTRAS["metrics"], "no_such_module_here"))
    with pytest.raises(extras.MissingExtraError) as err:
        extras.require("recipe", "the recipe")
    assert str(err.value) == (
        "the recipe needs lightning-muon's 'recipe' extra (missing: no_such_module_here): "
        "pip install 'lightning-muon[recipe]'"
    )
