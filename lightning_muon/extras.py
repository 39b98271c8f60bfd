"""The layers of the install: ``pip install lightning-muon`` is the core (the optimizer, the parameter grouping,
``strategy="muon_fsdp"``: torch and Lightning only); the ``metrics`` extra adds the generation metrics and the
evaluation callbacks, ``recipe`` the DiT recipe and the ``lightning-muon`` command, ``all`` both. A part whose extra
is missing says so in one line, when it is imported."""

from importlib.util import find_spec

#: extra -> the modules it brings that its parts import (``pyproject.toml``'s lists, by import name)
EXTRAS = {
    "metrics": ("torchmetrics", "torchvision", "torch_fidelity", "transformers", "open_clip", "sklearn", "PIL"),
    "recipe": ("diffusers", "torchdata", "tensorboard", "jsonargparse", "matplotlib", "yaml"),
}
#: an extra includes these
INCLUDES = {"metrics": ("metrics",), "recipe": ("metrics", "recipe")}


class MissingExtraError(ModuleNotFoundError):
    """A part of lightning-muon imported without the extra that installs its dependencies."""


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` (and the extras it includes) that cannot be imported here."""
    return [name for part in INCLUDES[extra] for name in EXTRAS[part] if find_spec(name) is None]


def require(extra: str, part: str) -> None:
    """Raise :class:`MissingExtraError` naming ``part``, the extra and the missing modules, if any is missing."""
    gone = missing(extra)
    if gone:
        raise MissingExtraError(
            f"{part} needs lightning-muon's '{extra}' extra (missing: {', '.join(gone)}): "
            f"pip install 'lightning-muon[{extra}]'"
        )
