"""The shipped configs (``recipes/configs/*.yaml``, installed with the package): each run by name, as the files it
stacks, and those files merged as ``--config a --config b`` merges them. The CLI, ``doctor`` and the memory estimate
read them from here."""

from __future__ import annotations

from pathlib import Path

import yaml

__all__ = ["CONFIGS", "DEFAULT_CONFIG", "SHIPPED_CONFIGS", "load_config", "shipped_config_paths"]

CONFIGS = Path(__file__).parent / "configs"
DEFAULT_CONFIG = CONFIGS / "digits_tiny.yaml"
#: Every shipped run, as the ``--config`` files it stacks (later files override earlier ones).
SHIPPED_CONFIGS = {
    "digits_tiny": [DEFAULT_CONFIG],
    "dit_xl2_imagenet256": [CONFIGS / "dit_xl2_imagenet256.yaml"],
    **{f"t2i_{s}": [CONFIGS / "t2i_base.yaml", CONFIGS / f"t2i_{s}.yaml"] for s in ("1p3b", "4b", "9b", "15b")},
}


def shipped_config_paths(argv: list[str]) -> list[str]:
    """``--config NAME`` (or ``-c NAME``, ``--config=NAME``) with ``NAME`` a shipped run (:data:`SHIPPED_CONFIGS`)
    and no such file here becomes the installed YAML files it stacks (``t2i_1p3b``: ``t2i_base.yaml`` then
    ``t2i_1p3b.yaml``), so the names work from a wheel in any directory; anything else passes unchanged."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-c", "--config") and i + 1 < len(argv):
            flag, value, i = arg, argv[i + 1], i + 2
        elif arg.startswith("--config="):
            flag, value, i = "--config", arg.split("=", 1)[1], i + 1
        else:
            out.append(arg)
            i += 1
            continue
        paths = SHIPPED_CONFIGS.get(value) if not Path(value).exists() else None
        out += [part for path in paths for part in (flag, str(path))] if paths else [flag, value]
    return out


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_config(*paths: str | Path) -> dict:
    """Stacked YAML configs as one dict, the way ``--config a --config b`` merges them (mappings merge, lists and
    values of later files replace)."""
    config: dict = {}
    for path in paths:
        config = _merge(config, yaml.safe_load(Path(path).read_text()) or {})
    return config
