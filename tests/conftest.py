"""Shared fixtures."""

import pytest
from helpers import tiny_dit, tiny_pixart


@pytest.fixture
def dit():
    return tiny_dit()


@pytest.fixture
def pixart():
    return tiny_pixart()
