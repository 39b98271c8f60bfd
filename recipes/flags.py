"""One flag style for every command: ``fit``'s options are LightningCLI's snake_case (``--trainer.max_steps``), so
``evaluate``, ``doctor`` and ``encode_latents`` spell theirs the same way and accept the kebab-case form too;
their help is plain text."""

import re


def option_names(name: str) -> list[str]:
    """``["--num_samples", "--num-samples"]`` for ``num_samples`` (one name when there is no underscore)."""
    return list(dict.fromkeys(["--" + name, "--" + name.replace("_", "-")]))


ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")


def plain_help(doc: str) -> str:
    """A docstring as a terminal shows it: ``:mod:`~a.b``` → ``b``, ``:func:`a.f``` → ``a.f``, ````x```` → ``x``,
    ``**x**`` → ``x``."""
    doc = ROLE.sub(lambda m: m[2].rpartition(".")[2] if m[1] else m[2], doc)
    return doc.replace("``", "").replace("**", "")
