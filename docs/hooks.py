"""MkDocs hook: the API reference reads the package as it is installed. ``metrics/``, ``callbacks/`` and ``recipes/``
install as ``lightning_muon.metrics`` / ``.callbacks`` / ``.recipes`` (pyproject's package-dir), which a static
reader of the source tree cannot see; ``.api-src/lightning_muon`` is that installed layout, rebuilt at every build:
the core's files copied (a symlinked ``__init__.py`` would lead the reader back to the source folder), the
subpackages as symlinks."""

import shutil
from pathlib import Path

from mkdocs.plugins import event_priority

ROOT = Path(__file__).parents[1]
SUBPACKAGES = ("metrics", "callbacks", "recipes")


@event_priority(100)  # before mkdocstrings' on_config, which drops search paths that do not exist yet
def on_config(config):
    tree = ROOT / ".api-src" / "lightning_muon"
    shutil.rmtree(tree.parent, ignore_errors=True)
    shutil.copytree(ROOT / "lightning_muon", tree, ignore=shutil.ignore_patterns("__pycache__"))
    for name in SUBPACKAGES:
        (tree / name).symlink_to(ROOT / name)
    return config
