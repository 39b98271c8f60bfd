"""One flag style for every command: ``fit``'s options are LightningCLI's snake_case (``--trainer.max_steps``), so
``evaluate``, ``doctor`` and ``encode_latents`` spell theirs the same way and accept the kebab-case form too."""


def option_names(name: str) -> list[str]:
    """``["--num_samples", "--num-samples"]`` for ``num_samples`` (one name when there is no underscore)."""
    return list(dict.fromkeys(["--" + name, "--" + name.replace("_", "-")]))
