"""The library's shape: files over 500 lines, the longest class, imports made inside functions, and import circles
(strongly connected modules of the import graph, function-level imports included). Prints a table and writes
``benchmarks/results/code_shape.json`` under ``--label`` (``before`` from an older checkout with ``--root``).

    python benchmarks/code_shape.py --label after
"""

from __future__ import annotations

import argparse
import ast
import json
from pathlib import Path

RESULT = Path(__file__).parent / "results" / "code_shape.json"
#: source folder -> the package it installs as (pyproject's package-dir)
PACKAGES = {"lightning_muon": "lightning_muon", "metrics": "lightning_muon.metrics",
            "callbacks": "lightning_muon.callbacks", "recipes": "lightning_muon.recipes"}  # fmt: skip


def modules(root: Path) -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = path.relative_to(root / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def imports(tree: ast.Module, name: str, is_package: bool) -> tuple[set[str], int]:
    """The library modules ``name`` imports (anywhere), and how many import statements sit inside functions."""
    package = name if is_package else name.rpartition(".")[0]
    targets, inside = set(), 0
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            inside += sum(isinstance(sub, ast.Import | ast.ImportFrom) for sub in ast.walk(node))
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            targets |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
    return targets, inside


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def longest_class(tree: ast.Module) -> tuple[str, int]:
    classes = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    return max(classes, key=lambda c: c[1], default=("", 0))


def shape(root: Path) -> dict[str, object]:
    found = modules(root)
    graph, inside, lines, classes = {}, {}, {}, {}
    for name, path in found.items():
        text = path.read_text()
        tree = ast.parse(text)
        targets, inside[name] = imports(tree, name, path.name == "__init__.py")
        # an import of a package's name counts as importing its __init__ (``from pkg import x``: x may be a module)
        graph[name] = {t for t in targets if t in found and t != name}
        lines[name] = len(text.splitlines())
        classes[name] = longest_class(tree)
    name, size = max(classes.values(), key=lambda c: c[1])
    return {
        "files over 500 lines": {m: n for m, n in sorted(lines.items(), key=lambda x: -x[1]) if n > 500},
        "longest class": f"{name} ({size} lines)",
        "function-level imports": sum(inside.values()),
        "circles": circles(graph),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path(__file__).parents[1])
    parser.add_argument("--label", default="after")
    args = parser.parse_args()
    results = json.loads(RESULT.read_text()) if RESULT.exists() else {}
    results[args.label] = shape(args.root)
    RESULT.write_text(json.dumps(results, indent=1) + "\n")
    print("| measure | " + " | ".join(results) + " |\n|---|" + "---|" * len(results))
    for key in ("files over 500 lines", "longest class", "function-level imports", "circles"):
        cells = []
        for label in results:
            value = results[label][key]
            if isinstance(value, dict):
                value = ", ".join(f"{m.rpartition('.')[2]}.py {n}" for m, n in value.items()) or "none"
            elif isinstance(value, list):
                value = "; ".join(" ↔ ".join(c) for c in value) or "none"
            cells.append(str(value))
        print(f"| {key} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
