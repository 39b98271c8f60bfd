"""The formatter and the linter own the layout: CI fails on any ``ruff check`` or ``ruff format --check`` finding."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["ruff-check", "ruff-format"])
def test_ruff(command):
    proc = subprocess.run([sys.executable, "-m", "ruff", *command, str(ROOT)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
