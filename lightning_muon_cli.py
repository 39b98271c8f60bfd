"""The ``lightning-muon`` command's entry point, outside the package: ``--version`` and the top-level ``--help`` answer
without importing torch, Lightning or the recipe (``import lightning_muon`` imports Lightning, which takes seconds);
every subcommand goes to :func:`lightning_muon.recipes.cli.main`."""

import sys
from importlib.metadata import PackageNotFoundError, version

#: subcommand -> one line; the recipe's CLI registers the same names (a test ties them)
SUBCOMMANDS = {
    "fit": "Train: the tiny digits default, or --config NAME_OR_FILE (a shipped config such as t2i_1p3b).",
    "validate": "One validation epoch of a checkpoint (--ckpt_path).",
    "test": "One test epoch of a checkpoint (--ckpt_path).",
    "predict": "Predictions from a checkpoint (--ckpt_path).",
    "evaluate": "Generation metrics for every checkpoint of one or several runs.",
    "doctor": "Pre-flight check of a machine: versions, bf16, optimizer, NS5, collectives, one train step.",
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [
        "usage: lightning-muon [-h] [--version] {" + ",".join(SUBCOMMANDS) + "} ...",
        "",
        "Train Diffusion Transformers with Periodic Row-wise Muon.",
        "",
        "subcommands (lightning-muon SUBCOMMAND --help for its options):",
        *(f"  {name:<{width}}  {text}" for name, text in SUBCOMMANDS.items()),
        "",
        "options:",
        "  -h, --help  show this help message and exit",
        "  --version   show the installed version and exit",
    ]
    return "\n".join(lines)


def installed_version() -> str:
    try:
        return version("lightning-muon")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown (not installed)"


def main(args: list[str] | None = None) -> int | None:
    argv = sys.argv[1:] if args is None else list(args)
    if argv in (["--version"], ["-V"]):
        print(f"lightning-muon {installed_version()}")
        return 0
    if argv in ([], ["-h"], ["--help"]):
        print(usage())
        return 0
    try:
        from lightning_muon.recipes.cli import main as recipe_main
    except ModuleNotFoundError as err:
        from lightning_muon.extras import MissingExtraError  # the package's core imported before the recipe failed

        if not isinstance(err, MissingExtraError):
            raise
        sys.stderr.write(f"error: {err}\n")  # one line naming the extra
        return 2
    return recipe_main(argv)


if __name__ == "__main__":
    sys.exit(main())
