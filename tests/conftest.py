"""Shared fixtures."""

import pytest
from helpers import tiny_dit, tiny_pixart


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
