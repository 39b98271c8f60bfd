"""Shared fixtures, and this package's deprecations as errors in every process a test starts."""

import os
from pathlib import Path

import pytest
from helpers import tiny_dit, tiny_pixart


def own_modules() -> list[str]:
    """Every module of the package, by its import name (``lightning_muon.metrics.features``, …), from its files."""
    roots = {"lightning_muon": "lightning_muon", "metrics": "lightning_muon.metrics"}
    roots |= {"callbacks": "lightning_muon.callbacks", "recipes": "lightning_muon.recipes"}
    names = []
    for folder, package in roots.items():
        for path in (Path(__file__).parents[1] / folder).rglob("*.py"):
            parts = path.relative_to(Path(__file__).parents[1] / folder).with_suffix("").parts
            names.append(".".join([package, *parts]).removesuffix(".__init__"))
    return sorted(names)


# pyproject's filterwarnings apply in the pytest process only; the CLI runs, torchrun workers and spawned ranks the
# tests start get the same rule through PYTHONWARNINGS (which matches exact module names, hence the list).
os.environ["PYTHONWARNINGS"] = ",".join(
    [f"error::{category}:{module}" for module in own_modules() for category in ("FutureWarning", "DeprecationWarning")]
    + ["error::FutureWarning:torch.distributed.c10d_logger"]  # torch's deprecated collectives, whoever calls them
)


@pytest.fixture(scope="session")
def digits_cache(tmp_path_factory) -> Path:
    """A feature cache with the digits classifier trained (once per session: about a minute on 2 cores); a test
    points ``LIGHTNING_MUON_CACHE`` at it."""
    from lightning_muon.metrics import DigitsFeatures

    path = tmp_path_factory.mktemp("digits_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LIGHTNING_MUON_CACHE", str(path))
        DigitsFeatures()
    return path


@pytest.fixture
def dit():
    return tiny_dit()


@pytest.fixture
def pixart():
    return tiny_pixart()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip without CUDA."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
