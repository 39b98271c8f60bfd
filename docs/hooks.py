"""MkDocs hook: the API reference reads the package as it is installed, its docstrings' reStructuredText roles become
Markdown, and formulas become MathML (rendered by the browser: no script, nothing fetched).

``metrics/``, ``callbacks/`` and ``recipes/`` install as ``lightning_muon.metrics`` / ``.callbacks`` / ``.recipes``
(pyproject's package-dir), which a static reader of the source tree cannot see; ``.api-src/lightning_muon`` is that
installed layout, rebuilt at every build (``mkdocs serve`` watches the sources, mkdocs.yml ``watch``), each module
copied with its roles rewritten (:func:`markdown_roles`). The docstrings stay reStructuredText in the source, as
``help()`` and torch's own docstrings read.
"""

from __future__ import annotations

import ast
import html
import re
import shutil
from pathlib import Path

from latex2mathml.converter import convert
from mkdocs.plugins import event_priority

ROOT = Path(__file__).parents[1]
SUBPACKAGES = ("metrics", "callbacks", "recipes")
#: ``:role:`~target``` — a cross-reference; ``~`` shows only the last name
ROLE = re.compile(r":(?:py:)?(class|func|meth|attr|mod|data|obj|exc):`(~?)([^`<]+)`")
MATH_ROLE = re.compile(r":math:`([^`]+)`")
MATH_BLOCK = re.compile(r"^(?P<indent>[ \t]*)\.\. math::[ \t]*\n(?P<body>(?:(?P=indent)[ \t]+\S.*\n|[ \t]*\n)+)", re.M)
#: arithmatex's generic output
ARITHMATEX = re.compile(r'<(span|div) class="arithmatex">\s*\\[(\[](.*?)\\[)\]]\s*</\1>', re.S)


@event_priority(100)  # before mkdocstrings' on_config, which drops search paths that do not exist yet
def on_config(config):
    tree = ROOT / ".api-src" / "lightning_muon"
    shutil.rmtree(tree.parent, ignore_errors=True)
    sources = {tree: ROOT / "lightning_muon", **{tree / name: ROOT / name for name in SUBPACKAGES}}
    for target, source in sources.items():
        for path in source.rglob("*.py"):
            module = ".".join((target / path.relative_to(source)).relative_to(tree.parent).with_suffix("").parts)
            module = module.removesuffix(".__init__")
            out = target / path.relative_to(source)
            out.parent.mkdir(parents=True, exist_ok=True)
            text = path.read_text()
            out.write_text(markdown_roles(text, module, imported_names(text, module, path.name == "__init__.py")))
    return config


def imported_names(source: str, module: str, is_package: bool) -> dict[str, str]:
    """``name -> full dotted path`` of every name a module imports or defines at its top level."""
    package = module if is_package else module.rpartition(".")[0]
    names = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}".rstrip(".")
            names.update({a.asname or a.name: f"{base}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            names.update(
                {(a.asname or a.name).split(".")[0]: a.name if a.asname else a.name.split(".")[0] for a in node.names}
            )
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = f"{module}.{node.name}"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names[target.id] = f"{module}.{target.id}"
    return names


def markdown_roles(text: str, module: str, names: dict[str, str]) -> str:
    """Rewrite Sphinx markup as Markdown: ``:class:`~a.B``` → a link to ``a.B`` shown as ``B`` (an optional
    autorefs reference: a link where ``a.B`` is documented, code text elsewhere), ``:math:`x``` → ``$x$``,
    a ``.. math::`` block → ``$$ … $$`` (lines with ``&`` or ``\\\\`` aligned in a ``split``)."""

    def reference(match: re.Match) -> str:
        role, short, target = match.groups()
        path = full_path(target, module, names)
        shown = (target.lstrip(".").rpartition(".")[2] if short else target) + (
            "()" if role in ("func", "meth") else ""
        )
        if not path.startswith("lightning_muon"):
            return f"`{shown}`"
        return f'<autoref identifier="{path}" optional><code>{shown}</code></autoref>'

    def block(match: re.Match) -> str:
        indent, body = match["indent"], match["body"].rstrip("\n").splitlines()
        lines = [line.strip() for line in body if line.strip()]
        if any("&" in line or line.endswith("\\\\") for line in lines):
            lines = [r"\begin{split}", *lines, r"\end{split}"]
        return "\n".join(indent + line for line in ["$$", *lines, "$$"]) + "\n\n"

    text = MATH_BLOCK.sub(block, text)
    text = MATH_ROLE.sub(lambda m: f"${m[1].strip()}$", text)
    return ROLE.sub(reference, text)


def full_path(target: str, module: str, names: dict[str, str]) -> str:
    """The dotted path a role's target names, read as Sphinx does: relative (``.config.X``) to the module's
    package, a name the module imports or defines, or already absolute."""
    if target.startswith("."):
        level = len(target) - len(target.lstrip("."))
        return f"{module.rsplit('.', level)[0]}.{target.lstrip('.')}"
    head, _, rest = target.partition(".")
    if head in names:
        return names[head] + (f".{rest}" if rest else "")
    return target


def on_page_content(html_text: str, **kwargs) -> str:
    """Formulas as MathML: ``\\(…\\)`` inline, ``\\[…\\]`` displayed."""

    def mathml(match: re.Match) -> str:
        display = "block" if match[1] == "div" else "inline"
        return convert(html.unescape(match[2]), display=display)

    return ARITHMATEX.sub(mathml, html_text)


def on_post_build(config, **kwargs) -> None:
    """No ``site_url`` is known (the site is built and served locally): no sitemap of relative addresses."""
    if not config.site_url:
        for name in ("sitemap.xml", "sitemap.xml.gz"):
            (Path(config.site_dir) / name).unlink(missing_ok=True)
