"""Run first in .ci/run's lower-bound environment: it really holds the versions .ci/lower-bounds.txt names (a
resolver that quietly took newer ones would make the run test nothing)."""

from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement


def test_the_lower_bounds_are_installed():
    for line in (Path(__file__).parent / "lower-bounds.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            requirement = Requirement(line)
            assert requirement.specifier.contains(version(requirement.name), prereleases=True), (
                f"{requirement.name} {version(requirement.name)} is not {requirement.specifier}"
            )
